"""The ``"cpu"`` attention backend: paged attention that reads K/V in place (kernels/csrc/paged_attention.cpp).

Every row of the flat batch (see AttentionMetadata) goes through one C++ kernel over the block
tables in place: decode rows, verification runs and prefill chunks at any start position
(chunked prefill, prefix-cache hits), causal inside each chunk, each query over its sequence's
keys up to its own position. Query tiles of up to 48 rows per KV head are the work items (with
split-K for small batches), on torch's intra-op threads, costliest first; a decode or short
verification tile is one item per KV head at every batch size (with K/V cold, 1.24-1.37x faster
than one item over all its heads at b4-b32), a prefill tile one item over all heads when there
are enough tiles. Decode and short rows:
the keys in partitions of 512, with a two-pass softmax inside a partition and online rescaling
between them. Prefill tiles (16-48 rows per KV head, bf16 queries over a bf16 or FP8 cache): QK^T
and PV as two bf16 GEMMs (vdpbf16ps) with the query rows in the vector lanes, K read in place, P
rounded to bf16, online softmax per 64 keys. Decode and short rows with bf16 queries over a bf16
or FP8 cache: QK^T as bf16 dot products (4 keys side by side in the 128-bit lanes, so a key's sum
is over 4 lanes and the K transposes serve every query head of the KV head), PV as bf16 pair dot
products (P split into bf16 hi + lo, so P keeps ~2^-17), K asked into L2 four blocks ahead while
the scores run and V while P V runs, each line once (shuffled block tables defeat the hardware
prefetcher). ``PDSERVE_ATTN_DECODE=fp32`` (read at each call) restores the earlier fp32 PV with
K/V asked for one block ahead, for A/B runs (``pdserve bench attention``) and as a fallback.
fp32 accumulation; AVX-512 / AVX512-BF16 where the CPU has them, a portable path otherwise.
FP8 E4M3 caches are dequantized in the kernel with their per-layer or per-KV-head scales, so
prefill and decode read the same quantized bytes. No reference groups are built
(``metadata_groups = "none"``).

Measured (bf16, SmolLM2-135M's shapes, 2 threads, 2-core EPYC Zen 5, quiet phase at load 1.8,
main's kernel and this one interleaved in one process, best of 5-7): a 512-token prefill chunk
from position 0 2455 -> 1056 us a layer (123 -> 287 GFLOP/s), after 512 cached tokens 7615 ->
2855 us (119 -> 318 GFLOP/s), over an FP8 cache 2669 -> 1195 us; decode unchanged (b16 ctx 160
~70 us a layer, ~28 GB/s of K/V). ``pdserve bench attention`` (median, same run): 0.74 ms wall
(411 GFLOP/s) from 0 against the reference's 8.9 ms of CPU time.
Decode with the bf16 pair PV and the L2 prefetch (2026-12-01, one thread, load 1.8-9 on 2 cores,
A/B against ``PDSERVE_ATTN_DECODE=fp32`` in one process, best of 9, CPU time, shuffled tables,
K/V cold): b16 ctx 256 355 -> 255 us a layer, b16 ctx 1024 1389 -> 964, b32 ctx 256 709 -> 495,
b32 ctx 1024 2721 -> 1932 (1.39-1.44x; 9 -> 13 GB/s of K/V), 4-token verification runs 1.24x;
an FP8 cache 1.07-1.15x, and then 1.16-1.28x more from converting its blocks to bf16 by bit moves
instead of through fp32.

Decode on the 2-core Zen 4 host of 2026-12-06 (bf16, K/V cold, 2 threads; the csrc header has
the A/B figures): DRAM ~190 ns away and ~20 scattered lines in flight a core make decode
attention memory-bound there: b16 ctx 256 (3.1 MB of K/V) takes ~125-145 us a layer (wall) with
shuffled tables, where plain reads of the same bytes in the same order with the same prefetch
take ~106 us, and ~100-115 us with contiguous ones; that day's scores and prefetch changes took
it from ~160-200 and ~125-165 us.

Decode in the real step (2026-12-02, bf16 SmolLM2-135M, b16, shuffled tables, 2 threads, load 2-4,
A/B in one process): with the KV cache on huge pages (engine/huge_pages.py) attention went 3.50 ->
3.05 ms a step at ctx 128. What did not help, measured the same way: the L2 prefetch distance
(``PDSERVE_ATTN_L2_AHEAD`` 2, 4, 8, 16 within 3% of each other at ctx 128 and 256), and asking for
layer l + 1's K/V blocks (prefetcht2) while layer l reads its own (0-5% slower at b16, equal at b1).
Yet every layer reading the same layer's K/V (so it stays in L3) halves the step's attention
(3.39 -> 1.83 ms at ctx 128, 4.90 -> 2.49 at ctx 256): the cold reads cost about half of it, and
neither a longer prefetch nor an earlier one recovers that.

The extension is built once per machine with ``torch.utils.cpp_extension.load`` (``-O3
-march=native -fopenmp``) into a cache directory keyed by the CPU capability, its feature flags and torch version
(``$PDSERVE_KERNEL_CACHE`` or ``~/.cache/pdserve/kernels``); a build takes ~10 s of CPU on these
machines (minutes of wall time when they are busy), a cached load ~20 ms. Each source is its own
build, so a new build removes the oldest ones beside it (``KEEP_BUILDS``, by when each was last
loaded: ~4 MB apiece, 42 of them had piled up on a development machine). ``load_extension``
returns ``None`` with a reason when the build is impossible (no compiler, no ninja, a compile
error), so ``get_attention_backend("auto")`` can fall back to the torch reference and say why.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from kernels.attention import AttentionMetadata
from kernels import torch_ref

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "paged_attention.cpp"
# One library, every source of kernels/csrc in it, each with its own operator namespace:
# pdserve_attn (the attention kernel), pdserve_ops (the decoder's small fused ops,
# kernels/layer_ops.py), pdserve_gemm (the small-batch bf16 linear, kernels/linear.py), ...
# A new *.cpp there is built without being named here; its headers (*.h) are in the build key.
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))
EXTENSION = "pdserve_paged_attention"

_lock = threading.Lock()
_loaded: tuple[Callable | None, str] | None = None   # (the operator, the reason it is None)


FLAGS = ["-O3", "-fopenmp"]


def _flags() -> list[str]:
    return FLAGS + (["-march=native"] if _is_x86() else [])


def _native_target() -> str:
    """What ``-march=native`` compiles for, as far as it matters to a build: the first processor's
    feature flags in /proc/cpuinfo ("" elsewhere). Two CPUs of one torch capability (AVX-512 with
    and without AMX, say) sharing a home directory must not load each other's build."""
    if not _is_x86():
        return ""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("flags"):
            return " ".join(sorted(line.partition(":")[2].split()))
    return ""


def _stamp() -> str:
    """The build key: every source and header (name and bytes), the flags and the CPU that
    ``-march=native`` targets. A header edit must change it too, or a checkout would load the
    build of an older header."""
    digest = hashlib.sha256(" ".join(_flags()).encode())
    digest.update(f"\0{_native_target()}\0".encode())
    for path in SOURCES + HEADERS:
        digest.update(f"\0{path.name}\0{path.stat().st_size}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


KEEP_BUILDS = 8
"""Builds of other sources (other checkouts, earlier commits) kept beside a new one: the ones
loaded most recently; the rest are removed after each build (``prune_builds``)."""


def cache_dir() -> Path:
    """Where the built extension lives: one directory per CPU capability, torch version and
    source (checkouts with different sources, sharing one home directory, never overwrite
    each other's build)."""
    root = Path(os.environ.get("PDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pdserve" / "kernels")
    tag = f"{torch.backends.cpu.get_cpu_capability().lower()}-torch{torch.__version__.replace('+', '_')}"
    return root / f"paged_attention-{tag}-{_stamp()[:12]}"


def load_extension() -> tuple[Callable | None, str]:
    """The compiled kernel (the torch operator ``torch.ops.pdserve_attn.paged_attention``,
    built on first use, then cached), or (None, why not).

    Never raises: a missing compiler or ninja, or a failed compile, is returned as the reason.
    """
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build()
        return _loaded


def _build() -> tuple[Callable | None, str]:
    build_dir = cache_dir()
    flags, stamp = _flags(), _stamp()
    library = build_dir / f"{EXTENSION}.so"
    if _load_cached(library, build_dir / "source.sha256", stamp):
        return torch.ops.pdserve_attn.paged_attention, ""
    # No loadable build here: a stamp left from an earlier build of this source would mark the
    # directory finished, and another process's prune_builds could remove it under this build.
    try:
        (build_dir / "source.sha256").unlink(missing_ok=True)
    except OSError:   # (not a file, not ours: the build below says what is wrong, if anything)
        pass
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return None, f"no C++ compiler ({compiler!r} not on PATH)"
    _put_ninja_on_path()
    if shutil.which("ninja") is None:
        return None, "ninja is not installed (pip install ninja)"
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"pdserve: building the CPU kernels (paged attention, layer ops) into {build_dir} (once per machine; about 20 s)...",
          file=sys.stderr, flush=True)
    try:
        cpp_extension.load(name=EXTENSION, sources=[str(s) for s in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           build_directory=str(build_dir), is_python_module=False, verbose=False)
        op = torch.ops.pdserve_attn.paged_attention
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the reference", with the reason
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"building {' + '.join(s.name for s in SOURCES)} failed: {first_line} (build dir {build_dir})"
    (build_dir / "source.sha256").write_text(stamp + "\n")
    print(f"pdserve: built the CPU kernels in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    removed = prune_builds(build_dir)
    if removed:
        log.info("removed %d older kernel builds from %s", len(removed), build_dir.parent)
    return op, ""


def prune_builds(current: Path, keep: int = KEEP_BUILDS) -> list[Path]:
    """Remove the finished builds beside ``current`` (its siblings with a ``source.sha256``) but the
    ``keep`` loaded most recently (the stamp file's mtime: ``_load_cached`` touches it); returns the
    directories removed. A build without a stamp file may be under way in another process and is
    left alone; so is anything that cannot be removed (another user's, a read-only cache). A
    process that loaded a removed build keeps its mapped library; another checkout of that source
    builds it again on its next start. The pool spans CPU capabilities and torch versions (a
    home directory shared by several hosts, a torch upgraded): each host's loads keep its own
    builds recent. A scan races with a rebuild that starts after it in a listed directory (the
    rebuild then fails and says why); a build that cannot be removed entirely may be left half."""
    builds = []
    for path in current.parent.glob(current.name.split("-", 1)[0] + "-*"):
        try:
            stamp = (path / "source.sha256").stat(follow_symlinks=False)
            if path != current and path.is_dir() and not path.is_symlink() and stat.S_ISREG(stamp.st_mode):
                builds.append((stamp.st_mtime, path))
        except OSError:   # no stamp file: not finished (or not a build)
            continue
    builds.sort(reverse=True)
    removed = []
    for _, path in builds[keep:]:
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed


def _load_cached(library: Path, stamp_file: Path, stamp: str) -> bool:
    """Load the library built earlier from this very source and flags, without cpp_extension
    (whose import and ninja check cost each worker process seconds); False if there is none."""
    try:
        if not library.exists() or stamp_file.read_text().strip() != stamp:
            return False
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError):
        return False
    try:
        os.utime(stamp_file)   # last loaded now: prune_builds keeps the builds in use
    except OSError:            # (a read-only cache still loads)
        pass
    return True


def _put_ninja_on_path() -> None:
    """pip's ninja lives beside the interpreter; the venv's bin is not on PATH when it is not activated."""
    if shutil.which("ninja") is not None:
        return
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # type: ignore[import-not-found]

        dirs.append(ninja.BIN_DIR)
    except ImportError:
        pass
    os.environ["PATH"] = os.pathsep.join(dirs + [os.environ.get("PATH", "")])


def _is_x86() -> bool:
    import platform

    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


class CpuAttention:
    """The in-place CPU backend; construct through ``get_attention_backend("cpu")``.

    Raises RuntimeError naming the reason when the extension cannot be built.
    """

    name = "cpu"
    # Every row is attended by the kernel, in place: no reference groups are needed.
    metadata_groups = "none"
    supports_kv_scales = True    # FP8 E4M3 caches with k_scale/v_scale (read by engine.model_runner)

    def __init__(self) -> None:
        op, reason = load_extension()
        if op is None:
            raise RuntimeError(f"the cpu attention kernel is unavailable: {reason}")
        self._op = op
        self._write = torch.ops.pdserve_attn.write_kv_cache

    def write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | float | None = None,
                       v_scale: torch.Tensor | float | None = None) -> None:
        """key/value [T, Hkv, D] -> the caches at slot_mapping [T], in one C++ pass (csrc/kv_cache_write.cpp);
        the same bytes as torch_ref.write_kv_cache, FP8 E4M3 included. Layouts the op does not take
        (a token's [Hkv, D] not contiguous) go through the reference. Raises ValueError as the reference does."""
        k_scale, v_scale = _scales(key_cache, k_scale, v_scale)
        if not (_rows_contiguous(key) and _rows_contiguous(value)):
            return torch_ref.write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        self._write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | float | None = None,
                        v_scale: torch.Tensor | float | None = None) -> torch.Tensor:
        """query [T, Hq, D] -> [T, Hq, D] in query's dtype (see AttentionBackend.paged_attention).

        k_scale/v_scale: the dequantization scales of an FP8 E4M3 cache (fp32 scalars or [Hkv]);
        None for a cache in a float dtype. Raises ValueError for a non-CPU tensor, an FP8 cache
        without scales, or scales for another cache.
        """
        if query.device.type != "cpu":
            raise ValueError(f"the cpu attention backend needs CPU tensors, got {query.device}")
        k_scale, v_scale = _scales(key_cache, k_scale, v_scale)
        query = query if query.stride(-1) == 1 else query.contiguous()
        out = torch.empty_like(query)
        self._op(out, query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                 float(scale), k_scale, v_scale, 0)
        return out


def _scales(cache: torch.Tensor, k_scale, v_scale) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The kernel's fp32 [1] or [Hkv] scales for an FP8 cache (None, None for a float cache)."""
    if cache.dtype != torch.float8_e4m3fn:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"KV scales given for a {cache.dtype} cache (scales are for an FP8 cache)")
        return None, None
    if k_scale is None or v_scale is None:
        raise ValueError("an FP8 E4M3 KV cache needs k_scale and v_scale")
    return _fp32_vector(k_scale), _fp32_vector(v_scale)


def _rows_contiguous(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _fp32_vector(scale: torch.Tensor | float) -> torch.Tensor:
    if isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.dim() == 1 and scale.is_contiguous():
        return scale
    return torch.as_tensor(scale, dtype=torch.float32).reshape(-1).contiguous()
