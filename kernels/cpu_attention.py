"""The ``"cpu"`` attention backend: paged attention that reads K/V in place (kernels/csrc/paged_attention.cpp).

What runs where, per sequence of the flat batch (see AttentionMetadata):

- decode rows and short chunks (at most ``MAX_PADDED_QUERY_LEN`` new tokens: speculative
  verification, short prefill tails): the C++ kernel, over the block table in place, one work
  item per sequence (or per sequence and KV head for small batches) on torch's intra-op threads,
  fp32 accumulation, online softmax;
- a long prefill chunk that starts at position 0: causal SDPA on the K/V the layer has just
  computed (``key``/``value``), no cache read;
- a long chunk that continues a sequence (chunked prefill, a prefix-cache hit): that one
  sequence's context is gathered and attended with the reference's masked SDPA. Its cost is
  the chunk's matmuls, which SDPA runs as GEMMs; the gather of one context is small beside them.

The extension is built once per machine with ``torch.utils.cpp_extension.load`` (``-O3
-march=native -fopenmp``) into a cache directory keyed by the CPU capability and torch version
(``$PDSERVE_KERNEL_CACHE`` or ``~/.cache/pdserve/kernels``); a build takes ~10 s of CPU on these
machines (minutes of wall time when they are busy), a cached load ~20 ms. ``load_extension``
returns ``None`` with a reason when the build is impossible (no compiler, no ninja, a compile
error), so ``get_attention_backend("auto")`` can fall back to the torch reference and say why.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kernels.attention import MAX_PADDED_QUERY_LEN, AttentionMetadata
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


def _stamp() -> str:
    """The build key: every source and header (name and bytes) and the flags. A header edit must
    change it too, or a checkout would load the build of an older header."""
    digest = hashlib.sha256(" ".join(_flags()).encode())
    for path in SOURCES + HEADERS:
        digest.update(f"\0{path.name}\0{path.stat().st_size}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_dir() -> Path:
    """Where the built extension lives: one directory per CPU capability, torch version and
    source (checkouts with different sources, sharing one home directory, never overwrite
    each other's build)."""
    root = Path(os.environ.get("PDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pdserve" / "kernels")
    tag = f"{torch.backends.cpu.get_cpu_capability().lower()}-torch{torch.__version__.replace('+', '_')}"
    return root / f"paged_attention-{tag}-{_stamp()[:12]}"


def load_extension() -> tuple[Callable | None, str]:
    """The compiled kernel (the torch operator ``torch.ops.pdserve_attn.paged_attention_short``,
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
        return torch.ops.pdserve_attn.paged_attention_short, ""
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
        op = torch.ops.pdserve_attn.paged_attention_short
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the reference", with the reason
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"building {' + '.join(s.name for s in SOURCES)} failed: {first_line} (build dir {build_dir})"
    (build_dir / "source.sha256").write_text(stamp + "\n")
    print(f"pdserve: built the CPU kernels in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return op, ""


def _load_cached(library: Path, stamp_file: Path, stamp: str) -> bool:
    """Load the library built earlier from this very source and flags, without cpp_extension
    (whose import and ninja check cost each worker process seconds); False if there is none."""
    try:
        if not library.exists() or stamp_file.read_text().strip() != stamp:
            return False
        torch.ops.load_library(str(library))
        return True
    except (OSError, RuntimeError):
        return False


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
    # The reference's padded groups are needed only for long chunks (see AttentionMetadata.build).
    metadata_groups = "long"
    reads_new_kv = True
    write_kv_cache = staticmethod(torch_ref.write_kv_cache)

    def __init__(self) -> None:
        op, reason = load_extension()
        if op is None:
            raise RuntimeError(f"the cpu attention kernel is unavailable: {reason}")
        self._op = op

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | float | None = None,
                        v_scale: torch.Tensor | float | None = None, *, key: torch.Tensor | None = None,
                        value: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, Hq, D] -> [T, Hq, D] in query's dtype (see AttentionBackend.paged_attention).

        key/value [T, Hkv, D]: this layer's new K/V (already in the cache); used for long chunks
        that start at position 0. k_scale/v_scale: only None (a cache in the compute dtype).
        """
        if k_scale is not None or v_scale is not None:
            raise NotImplementedError("the cpu attention kernel has no FP8 KV cache scales yet")
        if query.device.type != "cpu":
            raise ValueError(f"the cpu attention backend needs CPU tensors, got {query.device}")
        query = query if query.stride(-1) == 1 else query.contiguous()
        out = torch.empty_like(query)
        self._op(out, query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                        meta.query_start_loc, float(scale), MAX_PADDED_QUERY_LEN)
        for group in meta.groups:   # long chunks, one sequence each
            rows = group.token_index
            q = query if rows is None else query.index_select(0, rows)
            if group.is_causal_prefill and key is not None and value is not None:
                k = key if rows is None else key.index_select(0, rows)
                v = value if rows is None else value.index_select(0, rows)
                got = _causal_fresh(q, k.to(query.dtype), v.to(query.dtype), scale)
            else:
                got = torch_ref._attend_group(q, key_cache, value_cache, group, scale)
            if rows is None:
                return got
            out.index_copy_(0, rows, got)
        return out


def _causal_fresh(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """[Q, Hq, D] x [Q, Hkv, D] -> [Q, Hq, D]: causal attention of a chunk over its own keys.

    K/V are repeated to Hq heads and passed as 4-D [1, H, Q, D]: with ``enable_gqa`` or 3-D inputs
    torch 2.13 runs SDPA's math path on CPU (softmax and bmm over the whole [H, Q, Q] scores),
    4-D without GQA its flash kernel, 3-5x faster for a 512-token bf16 chunk; the copy is a few
    hundred KiB.
    """
    group = query.shape[1] // key.shape[1]
    k, v = (x.transpose(0, 1).repeat_interleave(group, dim=0)[None] for x in (key, value))
    out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], k, v, is_causal=True, scale=scale)
    return out[0].transpose(0, 1)
