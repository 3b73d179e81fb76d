"""The machine's floor for a serving workload, measured in the run that measures the servers.

floor seconds = prefill FLOPs / GEMM peak + decode steps x weight bytes / memory bandwidth

- GEMM peak: best-of square ``torch.mm`` FLOP/s in the serving dtype, at the cores available
  (probe_floors, also bench engine's probe); memory bandwidth: its memcpy probe (bytes read +
  written per s).
- prefill FLOPs: every measured prompt once through the model (linear layers, the LM head for the
  last token, causal attention), prefill_flops.
- decode steps: ceil(requests / concurrency) waves of (max_tokens - 1) steps (the first token
  comes from the prefill), each reading every weight once (decoder linears + LM head).

It ignores what a real server cannot avoid (attention reads of the KV cache, per-op overhead,
the client, the router), so it is a bound no server reaches; a server's fraction of it is
floor seconds / its benchmark duration = its output tok/s / the floor's output tok/s.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

GEMM_SIZE = 1536   # M = N = K of the GEMM probe (bench engine's default)
MEMCPY_MIB = 512   # size of the bandwidth probe's tensor
READ_MIB = 512     # size of the read probe's tensor (16x the 32 MiB L3)
GEMM_WARMUP_S = 0.25
"""Untimed GEMM calls of a peak probe until this long has passed. Why: the first calls of a process
run slow (1536^3 on 2 threads of Emerald Rapids, 2026-12-07: bf16 torch.mm ~1,250-1,600 GFLOP/s
for 2 calls, then 2,800-3,150; torch._int_mm ~600-1,700 GOP/s for 3-4 calls, then 3,000-3,800 after
~9): one warm-up call and the best of 4 reported int8 peaks of 1,624-3,477 in one stop."""


@dataclass(frozen=True)
class MachineFloors:
    """dtype: the serving dtype probed; gemm_flops: FLOP/s; memcpy_bytes_per_s: bytes read + written per s."""

    dtype: str
    threads: int
    gemm_flops: float
    memcpy_bytes_per_s: float


@dataclass(frozen=True)
class WorkloadFloor:
    """prefill_s + decode_s = floor_s (seconds); output_tok_s = output tokens / floor_s."""

    prefill_flops: float
    decode_steps: int
    weight_bytes: int
    prefill_s: float
    decode_s: float
    floor_s: float
    output_tok_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def measure_machine(dtype: str = "auto", threads: int | None = None) -> MachineFloors:
    """GEMM peak and copy bandwidth now, with ``threads`` torch threads (default: the cores available).
    dtype "auto" resolves as the servers do (bf16 with native bf16, else fp32)."""
    import torch

    from engine import platform

    name = platform.resolve_dtype_name(dtype, "cpu")
    threads = threads or len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        f = probe_floors([name], GEMM_SIZE, MEMCPY_MIB)
    finally:
        torch.set_num_threads(before)
    return MachineFloors(name, threads, f["gemm_flops"][name], f["memcpy_bytes_per_s"])


def workload_floor(model_cfg, prompt_lens: Sequence[int], output_tokens: int, concurrency: int,
                   machine: MachineFloors) -> WorkloadFloor:
    """The floor of serving ``prompt_lens`` (tokens each) with ``output_tokens`` each at ``concurrency``."""
    layers, head = linear_params(model_cfg)
    elt = 2 if machine.dtype in ("bfloat16", "float16") else 4
    weight_bytes = (layers + head) * elt
    flops = sum(prefill_flops(model_cfg, n) for n in prompt_lens)
    steps = math.ceil(len(prompt_lens) / concurrency) * max(0, output_tokens - 1)
    prefill_s = flops / machine.gemm_flops
    decode_s = steps * weight_bytes / machine.memcpy_bytes_per_s
    floor_s = prefill_s + decode_s
    return WorkloadFloor(flops, steps, weight_bytes, prefill_s, decode_s, floor_s,
                         len(prompt_lens) * output_tokens / floor_s if floor_s > 0 else math.inf)


def measure_read_bandwidth(mib: int = READ_MIB, repeats: int = 10) -> float:
    """Bytes read per second (best of ``repeats``) by a streaming reduction, ``torch.sum`` over
    ``mib`` MiB of fp32 at the current torch threads: the rate at which a decode step can stream
    its weights, which it reads and never writes (the memcpy probe counts bytes read + written).
    On the shared 2-core Zen 4 VM it varies by up to 1.5x from minute to minute (25-35 GB/s on
    2026-12-06), so a bench measures it in the run it compares against, and a kernel timed while
    the memory is less busy than during the probe can read faster than this "floor" (bf16 linears
    at 1 row: 106% of it in one run)."""
    import torch

    src = torch.ones(mib * 2**20 // 4)
    return src.numel() * 4 / best_time(src.sum, repeats)


def measure_int8_gemm_peak(n: int = GEMM_SIZE, repeats: int = 4) -> float | None:
    """int8 multiply-adds x 2 per second (best of ``repeats``) of ``torch._int_mm`` (oneDNN's s8 x s8
    -> s32 GEMM) on n x n x n at the current torch threads: the int8 counterpart of the GEMM probe
    (2-core Zen 4, AVX512-VNNI: 810-866e9, ~0.9x vpdpbusd's one instruction a cycle per core; bf16
    torch.mm ~430e9). None where torch would not run it through oneDNN (mkldnn off, or a CPU without
    AVX512-VNNI): its fallback there is a scalar loop ~100x slower, the peak of nothing."""
    import torch

    from engine.platform import cpu_flags

    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled and "avx512_vnni" in cpu_flags()):
        return None
    a = torch.randint(-127, 128, (n, n), dtype=torch.int8)
    b = torch.randint(-127, 128, (n, n), dtype=torch.int8)
    return 2 * n**3 / best_time(lambda: torch._int_mm(a, b), repeats, GEMM_WARMUP_S)


# ---- the probes and the model's operation counts (bench engine, quant and peers use them) ----

def probe_floors(dtypes: list[str], n: int, memcpy_mib: int, int8: bool = False) -> dict:
    """GEMM peak FLOP/s per dtype (and, with ``int8``, ``torch._int_mm``'s int8 peak under "int8"
    where oneDNN runs it: measure_int8_gemm_peak) and copy bandwidth (bytes read + written per s) at the
    current threads."""
    import torch

    gemm = {}
    for name in dtypes:
        dt = getattr(torch, name)
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        best = best_time(lambda: torch.mm(a, b), 4, GEMM_WARMUP_S)
        gemm[name] = 2 * n**3 / best
    int8_peak = measure_int8_gemm_peak(n) if int8 else None
    if int8_peak is not None:
        gemm["int8"] = int8_peak
    src = torch.ones(memcpy_mib * 2**20 // 4)
    dst = torch.empty_like(src)
    best = best_time(lambda: dst.copy_(src), 5)
    return {"gemm_flops": gemm, "gemm_size": n, "memcpy_bytes_per_s": 2 * src.numel() * 4 / best,
            "memcpy_mib": memcpy_mib}


def best_time(fn: Callable[[], object], repeats: int, warmup_s: float = 0.0) -> float:
    """Seconds of the fastest of ``repeats`` calls of fn, after untimed calls: one, or as many as
    ``warmup_s`` seconds take (at least one)."""
    start = time.perf_counter()
    fn()
    while time.perf_counter() - start < warmup_s:
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def linear_params(cfg) -> tuple[int, int]:
    """Parameters of every matmul a token goes through: the decoder's projections + the LM head."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * per_layer, cfg.vocab_size * cfg.hidden_size


def prefill_flops(cfg, n: int) -> float:
    layers, head = linear_params(cfg)
    attention = cfg.num_layers * 2 * n * n * cfg.num_heads * cfg.head_dim  # QK^T and PV, causal half
    return 2 * layers * n + 2 * head + attention


def decode_flops(cfg, batch: int, context: int) -> float:
    layers, head = linear_params(cfg)
    return 2 * (layers + head) * batch + cfg.num_layers * 4 * batch * context * cfg.num_heads * cfg.head_dim
