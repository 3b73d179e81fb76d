"""What this machine can run: CPU ISA, the compute dtype (``auto``), cores, threads, affinity.

Everything here is detected at run time, never assumed: the CPUs of the development machines
changed from AVX2-only (bf16 matmuls ~2x slower than fp32) to AVX-512 with AVX512-BF16 (bf16
3-4x faster) between two days. The CPU side reads ``/proc/cpuinfo`` and ``sched_getaffinity``
and imports no torch (the ``pdserve serve`` process validates its flags with it before any
worker starts and stays torch-free); torch is imported only to ask about CUDA or to apply a
thread count.

- ``resolve_dtype_name(name, device)`` / ``resolve_dtype(name, device)``: ``"auto"`` is bf16 on
  CUDA devices with bf16 and on CPUs with native bf16 dot products (AVX512-BF16 or AMX-BF16 on
  x86, the BF16 extension on Arm), float32 elsewhere. A dtype the device cannot run (float16 on
  a CPU without native fp16 matmuls, bf16 on a GPU older than Ampere) raises ``UserError`` naming
  ``--dtype`` and what is allowed.
- ``assign_cores(num_workers, threads_per_worker, cores)``: disjoint core sets, one per worker.
- ``bind_to_cores(cores, num_threads)``: pin every thread of this process to ``cores`` and set
  torch's intra-op threads (called in each worker process before its model loads).
"""

from __future__ import annotations

import os
import platform as _platform
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from engine.errors import UserError

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# Flags (as /proc/cpuinfo spells them) that give native dot products in a dtype: oneDNN's bf16
# GEMM uses AVX512-BF16 (vdpbf16ps) or AMX tiles; without them bf16 is emulated and slower
# than fp32. fp16 GEMMs need AVX512-FP16 or AMX-FP16 (torch.ops.mkldnn._is_mkldnn_fp16_supported
# agrees); without them a float16 matmul ran 7x slower than fp32 here.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")      # "bf16": Arm's FEAT_BF16
NATIVE_FP16_FLAGS = ("amx_fp16", "avx512_fp16", "fphp")      # "fphp": Arm half-precision FP
ISA_LEVELS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")  # best first
_CPUINFO = Path("/proc/cpuinfo")
_MEMINFO = Path("/proc/meminfo")


def cpu_flags(cpuinfo: Path = _CPUINFO) -> frozenset[str]:
    """The CPU feature flags of the first processor in /proc/cpuinfo (x86 ``flags``, Arm
    ``Features``); empty where the file does not exist (not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_isa(flags: Iterable[str] | None = None) -> str:
    """The best ISA level this CPU offers for GEMMs: ``amx_bf16`` > ``avx512_bf16`` > ``avx512f``
    > ``avx2`` from the flags, else torch's own dispatch level
    (``torch.backends.cpu.get_cpu_capability()``, lower-cased, e.g. ``default``, ``sve256``)."""
    flags = cpu_flags() if flags is None else frozenset(flags)
    for level in ISA_LEVELS:
        if level in flags:
            return level
    if "bf16" in flags:
        return "arm_bf16"
    import torch

    return torch.backends.cpu.get_cpu_capability().lower()


def torch_cpu_capability() -> str:
    """The vector ISA torch's own CPU kernels were dispatched to (``AVX512``, ``AVX2``, ``DEFAULT``...)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def has_native_bf16(flags: Iterable[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else frozenset(flags)
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def has_native_fp16(flags: Iterable[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else frozenset(flags)
    return any(f in flags for f in NATIVE_FP16_FLAGS)


def resolve_dtype_name(name: str, device: str = "cpu", *, flags: Iterable[str] | None = None) -> str:
    """``--dtype`` -> the concrete dtype name ("float32" | "bfloat16" | "float16") for ``device``.

    flags: CPU flags to decide by (default: this machine's; tests pass others). CUDA devices are
    asked through torch. Raises UserError naming --dtype for an unknown name or one the device
    cannot run.
    """
    if name not in DTYPE_CHOICES:
        raise UserError(f"--dtype {name!r}: expected one of {', '.join(DTYPE_CHOICES)}")
    if device.startswith("cuda"):
        return _resolve_cuda(name)
    if name == "auto":
        return "bfloat16" if has_native_bf16(flags) else "float32"
    if name == "float16" and not has_native_fp16(flags):
        raise UserError(f"--dtype float16: this CPU ({cpu_isa(flags)}) has no native fp16 matmuls "
                        "(needs AVX512-FP16 or AMX-FP16); use auto, float32 or bfloat16")
    return name


def _resolve_cuda(name: str) -> str:
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"--dtype {name}: device cuda requested but torch sees no CUDA device")
    bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    if name == "auto":
        return "bfloat16" if bf16 else "float32"
    if name == "bfloat16" and not bf16:
        major, minor = torch.cuda.get_device_capability()
        raise UserError(f"--dtype bfloat16: this GPU (compute capability {major}.{minor}) has no bf16 "
                        "(needs 8.0+); use auto, float32 or float16")
    return name


def resolve_dtype(name: str, device: str = "cpu", *, flags: Iterable[str] | None = None):
    """``--dtype`` -> torch.dtype for ``device`` (see resolve_dtype_name)."""
    import torch

    return getattr(torch, resolve_dtype_name(name, device, flags=flags))


def dtype_reason(name: str, resolved: str, device: str = "cpu", *, flags: Iterable[str] | None = None) -> str:
    """Why ``resolved`` was chosen, for the start-up line ("auto: CPU has avx512_bf16")."""
    if name != "auto":
        return "as asked"
    if device.startswith("cuda"):
        return "auto: GPU has bf16" if resolved == "bfloat16" else "auto: GPU has no bf16"
    isa = cpu_isa(flags)
    if resolved == "bfloat16":
        return f"auto: CPU has native bf16 ({isa})"
    return f"auto: CPU has no native bf16 dot products ({isa})"


# ---- cores and threads -----------------------------------------------------------------------

def available_cores() -> list[int]:
    """The CPU ids this process may run on (its affinity mask, not the machine's core count)."""
    return sorted(os.sched_getaffinity(0))


def format_cores(cores: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the taskset / cgroup cpuset notation)."""
    out: list[str] = []
    cores = sorted(cores)
    i = 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(out)


@dataclass(frozen=True)
class CoreAssignment:
    """threads: intra-op threads of each worker; cores[i]: the CPU ids worker i is bound to
    (disjoint unless ``shared``: more workers than cores, when each gets one thread and the
    cores are dealt round-robin)."""

    threads: int
    cores: tuple[tuple[int, ...], ...]
    shared: bool = False


def assign_cores(num_workers: int, threads_per_worker: int | None, cores: Sequence[int] | None = None) -> CoreAssignment:
    """Deal this host's cores to its workers, each worker its own.

    threads_per_worker None = the cores divided among the workers (at least 1). Raises UserError
    naming --threads-per-worker when the workers would need more cores than are available.
    """
    cores = list(available_cores() if cores is None else cores)
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if threads_per_worker is not None and threads_per_worker < 1:
        raise UserError(f"--threads-per-worker {threads_per_worker}: must be >= 1")
    if threads_per_worker is None:
        if num_workers > len(cores):  # the only way to start them at all: share, one thread each
            return CoreAssignment(1, tuple((cores[i % len(cores)],) for i in range(num_workers)), shared=True)
        threads_per_worker = len(cores) // num_workers
    need = num_workers * threads_per_worker
    if need > len(cores):
        raise UserError(f"--threads-per-worker {threads_per_worker}: {num_workers} worker(s) x {threads_per_worker} "
                        f"threads need {need} cores, {len(cores)} are available (cores {format_cores(cores)}); "
                        f"use at most {max(1, len(cores) // num_workers)}")
    t = threads_per_worker
    return CoreAssignment(t, tuple(tuple(cores[i * t:(i + 1) * t]) for i in range(num_workers)))


def check_threads(threads: int | None, cores: Sequence[int] | None = None, option: str = "--threads") -> int:
    """A thread count for one process: None/0 = every available core; more than available
    raises UserError naming ``option``."""
    n = len(available_cores() if cores is None else cores)
    if not threads:
        return n
    if threads < 0 or threads > n:
        raise UserError(f"{option} {threads}: must be in [1, {n}] (the cores this process may use)")
    return threads


def bind_to_cores(cores: Sequence[int] | None, num_threads: int) -> None:
    """Pin every thread of this process (those running now and, by inheritance, those started
    later: torch's OpenMP pool, gRPC's) to ``cores``, and set torch's intra-op threads.

    sched_setaffinity(0) binds only the calling thread, so each task in /proc/self/task is set.
    cores None: leave the affinity alone (a worker on a remote Ray node, whose cores the driver
    does not know).
    """
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    if cores:
        for tid in _thread_ids():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:  # the thread ended meanwhile
                pass
    import torch

    torch.set_num_threads(num_threads)


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


# ---- memory ----------------------------------------------------------------------------------

def available_memory_bytes(meminfo: Path = _MEMINFO) -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), None if unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 1000**4, "tb": 1000**4}


def parse_bytes(text: str, option: str = "--kv-cache-memory") -> int:
    """"2GiB", "512MiB", "1.5GB", "1073741824" -> bytes. Raises UserError naming ``option``."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise UserError(f"{option} {text!r}: expected a size such as 2GiB, 512MiB or 1.5GB")
    return int(value * _UNITS[unit])


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def machine_summary(flags: Iterable[str] | None = None) -> str:
    """One line for start-up and benchmark logs: CPU model, ISA, cores available."""
    model = ""
    try:
        for line in _CPUINFO.read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        model = _platform.processor()
    return f"{model or 'cpu'} | isa {cpu_isa(flags)} | cores {format_cores(available_cores())}"
