"""Linear methods of the decoder: how ``y = x @ W^T + b`` runs, chosen once at load by measurement.

Every method is an ``nn.Module`` taking ``x [..., in_features]`` in the model dtype and returning
``[..., out_features]`` in the same dtype. Each holds its weight in one storage format and one or
more *kernels* (ways to compute the product from that format); at construction it times every
kernel on this machine at three token counts (``BUCKETS``: decode at batch 1, decode at batch 16,
a 512-token prefill chunk) and keeps the fastest for each, so a forward of ``M`` rows runs the
kernel chosen for the bucket ``M`` falls in. The decode buckets are timed on weights pushed out
of cache first, as a decode step finds them. Timings are cached per (method, shape, dtype,
threads), so 30 layers of one shape are measured once; ``kernel_summary`` names the choices.

- ``DenseLinear`` (``--quantization none``): the model dtype. Kernels: ``F.linear``; oneDNN with
  the weight prepacked once (``torch.ops.mkldnn._linear_pointwise``, bf16/fp16/fp32); MKL prepacked
  (``torch.ops.mkl._mkl_linear``, fp32); for bf16 on CPUs with AVX512-BF16, our kernel
  (kernels/csrc/small_gemm.cpp, weight packed into 16-column tiles), which overlaps the stream of
  weights that are not in cache with compute, where oneDNN adds the two (1-64 rows); and on CPUs
  with AMX-BF16 our AMX-tile kernel on the same packed weight (kernels/csrc/small_gemm_amx.cpp,
  5-128 rows). Only the chosen kernels' weight copies are kept.
- ``Int8Linear`` (``int8``): per-output-channel symmetric int8 weights, ``q = round(W / s)``,
  ``s = amax(|W_row|) / 127``, activations quantized dynamically per token and group of
  ``ACT_GROUP`` channels (or a wider group per linear: engine/quantization/apply.py). Kernels:
  ours for bf16 on CPUs with AVX512-VNNI (kernels/csrc/int8_gemm.cpp, vpdpbusd on the int8 weight
  tiles; kernels/csrc/int8_gemm_amx.cpp, AMX tiles on the same weight, where the CPU has AMX-INT8),
  ours for fp32 or bf16 on any AVX2 CPU (kernels/csrc/int8_gemm_avx2.cpp, vpmaddubsw on the same
  tiles), and the dense GEMM on the dequantized operands (elsewhere).
- ``Fp8Linear`` (``fp8``): E4M3 weights with per-output-channel scales ``s = amax(|W_row|) / 448``
  (or a checkpoint's ``weight_scale``), activations quantized dynamically per token to E4M3 (W8A8).
  Kernels: ``torch._scaled_mm`` (fp8 x fp8, per-row/per-column fp32 scales); and an exact emulation
  for CPUs whose ``_scaled_mm`` is slow: the E4M3 values held in bf16 (every E4M3 value is a bf16
  value), a bf16 GEMM with fp32 accumulation, then the scales — the same products and sums as
  ``_scaled_mm``, but the weight takes bf16's two bytes per value instead of one.

References: Micikevicius et al., "FP8 Formats for Deep Learning" (2022) for E4M3.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

BUCKETS = (1, 16, 512)
"""Token counts the kernels are timed at; a forward of M rows uses the choice for bucket_index(M)."""

INT8_MAX = 127.0
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448

Kernel = Callable[[torch.Tensor], torch.Tensor]  # x [M, K] -> y [M, N], no bias
"""A kernel may carry a ``float32`` attribute: the same output written as float32 (its model-dtype
values, widened as they are stored), which ``MeasuredLinear.forward_float32`` runs for the LM
head's logits."""
_choice_cache: dict[tuple, tuple[str, str, str]] = {}


def bucket_index(num_rows: int) -> int:
    """0 for decode-sized batches (<= 4 rows), 1 up to 128 rows, 2 beyond (prefill)."""
    return 0 if num_rows <= 4 else 1 if num_rows <= 128 else 2


def kernel_summary(model: nn.Module) -> str:
    """One line naming the kernels chosen per linear shape of ``model`` (1/16/512 rows), e.g.
    "none 960x576: small_gemm/small_gemm/onednn_packed (x30); ..." (for start-up logs and benchmarks)."""
    seen: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, MeasuredLinear):
            key = (f"{module.method} {module.out_features}x{module.in_features}: "
                   f"{'/'.join(module.kernel_names)}")
            seen[key] = seen.get(key, 0) + 1
    return "; ".join(f"{k} (x{n})" if n > 1 else k for k, n in seen.items())


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``; nothing elsewhere).

    After the linears are built, the weight copies no chosen kernel reads (the plain weights,
    the unchosen packings) are freed, but glibc keeps freed blocks below its mmap threshold
    (which grows to 32 MiB after large frees) in the heap: without this a worker's resident
    memory keeps them (about 230 MB for the bundled model in bf16)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass


class MeasuredLinear(nn.Module):
    """Base of the linear methods: candidate kernels, timed once, the fastest per bucket kept.

    Subclasses set ``self.in_features``, ``self.out_features``, ``self.bias`` and the weight
    buffers, then call ``self._choose(kernels, dtype)``.
    """

    method = ""

    def _choose(self, kernels: dict[str, Kernel], dtype: torch.dtype, device: torch.device,
                preferred: tuple[str, str, str] | None = None, decode_only: bool = False,
                first_bucket: dict[str, int] | None = None) -> None:
        """Time ``kernels`` per bucket; ``preferred``: the kernel per bucket that wins on a quiet
        machine of this kind, kept unless another measures clearly (1.25x) faster. decode_only:
        the linear sees prefill-sized row counts rarely if ever (the LM head: one row per
        sequence), so the last bucket takes the middle bucket's kernel, untimed. first_bucket:
        kernel name -> the first bucket (index into BUCKETS) it is timed and chosen at (0 where
        absent): kernels built for more rows, never the right choice below that bucket, so a noisy
        timing on a busy host must not pick one there.

        Only the chosen kernels are kept (with the weight copies they read); ``run_kernel``
        rebuilds any other from ``_candidates()`` when asked (tests, bench quant)."""
        # the activation group (int8) changes a kernel's work, as the shape does
        key = (self.method, self.out_features, self.in_features, getattr(self, "group", None), dtype, device.type,
               torch.get_num_threads(), tuple(kernels), decode_only, tuple(sorted((first_bucket or {}).items())))
        if key not in _choice_cache:
            evict = _cache_evictor(device)
            first = first_bucket or {}
            names = [_fastest({name: k for name, k in kernels.items() if first.get(name, 0) <= i}, self.in_features, dtype,
                              device, m, None if preferred is None else preferred[i],
                              evict=evict if m <= COLD_MAX_ROWS else None)
                     for i, m in enumerate(BUCKETS[:-1] if decode_only else BUCKETS)]
            _choice_cache[key] = tuple(names + names[-1:] if decode_only else names)
        self.kernel_names: tuple[str, str, str] = _choice_cache[key]
        self._kernel_choices = tuple(kernels)
        self._kernels = {name: kernels[name] for name in self.kernel_names}
        self._chosen = tuple(self._kernels[name] for name in self.kernel_names)

    def _candidates(self) -> dict[str, Kernel]:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0]:   # the decoder's [tokens, features]: no reshape or view
            y = self._chosen[bucket_index(x.shape[0])](x)   # (~2 us of 121 calls a step)
        elif not x.numel():   # no rows (a batch where no row asks for logits): see _no_rows
            y = self._no_rows(x)
        else:
            x2 = x.reshape(-1, self.in_features)
            y = self._chosen[bucket_index(x2.shape[0])](x2).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias   # (bias [N] broadcasts over the leading dims)

    def _no_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[..., out_features] in the output dtype (``self.dtype``) for an x [..., in_features] of
        no rows, without calling a kernel: an empty tensor may carry any strides (an empty slice of
        a transposed one, or what a quantization of one returns), which the kernels' layout checks
        rightly refuse for real rows. ValueError for an x the kernels would refuse with rows (a
        last dimension other than in_features, another dtype), as F.linear refuses it."""
        if x.dim() == 0 or x.shape[-1] != self.in_features or x.dtype != self.dtype:
            raise ValueError(f"x must be {self.dtype} [..., {self.in_features}], got {x.dtype} {list(x.shape)}")
        return torch.empty(*x.shape[:-1], self.out_features, dtype=self.dtype, device=x.device)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] float32 (the LM head's logits):
        ``forward(x).float()`` bit for bit, whichever kernel a bucket chose (so a row's logits never
        depend on the batch it ran in), written as float32 by the chosen kernel where it can (its
        ``float32`` variant widens as it stores: no second pass over [M, vocab], 0.2 ms of a 16-row
        decode step; without a bias only, as forward rounds after adding it)."""
        # (the head's case; anything else widens forward's output)
        if x.dim() == 2 and self.bias is None and x.shape[0]:
            wide = getattr(self._chosen[bucket_index(x.shape[0])], "float32", None)
            if wide is not None:
                return wide(x)
        return self.forward(x).float()

    def run_kernel(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """One named kernel of ``kernel_choices`` on x [M, K] (tests compare every kernel, not only
        the chosen ones; an unchosen one is rebuilt for the call, with its weight copy)."""
        kernel = self._kernels.get(name) or self._candidates()[name]
        y = kernel(x) if x.shape[0] else self._no_rows(x)
        return y if self.bias is None else y + self.bias

    @property
    def kernel_choices(self) -> tuple[str, ...]:
        """Every kernel that was timed (the chosen ones are ``kernel_names``)."""
        return self._kernel_choices

    def weight_bytes(self) -> int:
        """Bytes of weight one forward reads (its buffers: the stored format's values and scales)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kernels(1/16/512 rows)={'/'.join(self.kernel_names)}")


COLD_MAX_ROWS = 128
"""Buckets up to these rows are timed on weights out of cache (a decode step streams every weight
from DRAM: the model's 270 MB pass through a 32 MB L3 each step); prefill reuses each weight
across its rows, so its bucket is timed hot."""


def _fastest(kernels: dict[str, Kernel], in_features: int, dtype: torch.dtype, device: torch.device,
             rows: int, preferred: str | None = None, rounds: int = 3, budget_s: float = 0.002,
             evict: Callable[[], None] | None = None) -> str:
    """The kernel with the least best-of-``rounds`` time on a random [rows, in_features] input.

    One warm-up call each, in cache (which also checks the kernel runs here: one that raises is
    never chosen); kernels over 3x slower than the fastest warm-up are dropped, the preferred one never (CPU ``_scaled_mm`` is
    ~30x slower than bf16); the rest are timed round-robin, each round about ``budget_s`` per
    kernel, and each keeps its minimum, which other processes on a busy machine inflate least.
    evict: called before every timed call (one call per round then): the time of a kernel on a
    weight that is not in cache. On a machine loaded several times over its cores even minima
    flip, so ``preferred`` (if it runs here) is kept unless another kernel is 1.25x faster.
    """
    if len(kernels) == 1:
        return next(iter(kernels))
    x = torch.randn(rows, in_features, device=device).to(dtype)
    best: dict[str, float] = {}
    with torch.inference_mode():
        for name, kernel in kernels.items():
            try:
                best[name] = _time(kernel, x, 1, device)
            except (RuntimeError, NotImplementedError):
                continue
        if not best:
            raise RuntimeError(f"no linear kernel runs here for {dtype} on {device}: tried {list(kernels)}")
        fastest = min(best.values())
        # (the preferred kernel is never dropped on its warm-up: one call a busy host slowed 3x dropped it)
        best = {name: (t if evict is None else float("inf")) for name, t in best.items()
                if t <= 3 * fastest or name == preferred}
        reps = 1 if evict is not None else max(1, min(10, int(budget_s / max(fastest, 1e-6))))
        for _ in range(rounds if evict is None else rounds + 1):   # one call a round: one more
            for name in best:
                best[name] = min(best[name], _time(kernels[name], x, reps, device, evict))
    winner = min(best, key=best.__getitem__)
    if preferred in best and best[winner] * 1.25 > best[preferred]:
        return preferred
    return winner


def _time(kernel: Kernel, x: torch.Tensor, reps: int, device: torch.device,
          evict: Callable[[], None] | None = None) -> float:
    if evict is not None:
        evict()
    t0 = time.perf_counter()
    for _ in range(reps):
        kernel(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / reps


def _cache_evictor(device: torch.device) -> Callable[[], None] | None:
    """A function that pushes every weight out of this CPU's caches (it reads a buffer 1.5x the
    last-level cache, written once so its pages are real; read, not written, so the timed call
    finds clean lines, as a decode step does, instead of paying their write-back), or None off
    CPU. The buffer lives as long as the function."""
    if device.type != "cpu":
        return None
    scratch = torch.ones(int(1.5 * _last_level_cache_bytes()) // 4)
    return lambda: scratch.amax()


def _last_level_cache_bytes(default: int = 32 * 2**20) -> int:
    """The largest CPU cache (sysfs ``.../cpu0/cache/index*/size``, e.g. "32768K"), or ``default``."""
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip().upper()
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]] if text[-1] in "KM" else int(text))
        except (OSError, ValueError):
            continue
    return max(sizes, default=default)


# -- the model dtype ------------------------------------------------------------------------------
class DenseLinear(MeasuredLinear):
    """The unquantized linear: weight [N, K] in the model dtype, the fastest kernel measured.

    Only the chosen kernels' weight copies are kept: the plain weight (``self.weight``) only where
    ``F.linear`` was chosen for some bucket, else None; ``dense_weight()`` gives it back from a
    packed copy.
    """

    method = "none"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, decode_only: bool = False) -> None:
        """decode_only: see MeasuredLinear._choose (the LM head: one kernel, one weight copy, fewer)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.bias = None if bias is None else bias.detach()
        self._packed: dict[str, torch.Tensor] = {}   # kernel name -> the weight copy it reads (kept ones)
        kernels = self._candidates(weight.detach())
        # Quiet-machine winners (Zen 5, AVX512-BF16): our small_gemm at 1-64 rows on weights out of
        # cache (1.3-1.7x oneDNN at 1-16 rows), oneDNN prepacked for prefill (1.4-1.6x F.linear).
        # fp32 (Zen 1, AVX2, 2 threads, weights cold): oneDNN prepacked at 16 rows 1.7x MKL's
        # prepacked kernel on gate_up (1.07 vs 1.84 ms) and 2.6x on the LM head (13.8 vs 36.0), and
        # 1.1x at 512 rows; at 1 row within 1.25x of the best (F.linear or MKL) on the decoder's
        # shapes, and preferring it there too keeps one copy of each weight, not two.
        # AMX-BF16 (Sapphire Rapids, 2 threads, weights cold): our AMX kernel at 16 rows 1.4-2.3x
        # oneDNN's and 1.3-3x small_gemm's (gate_up 117-141 us against 196 and 318; LM head 1.65-1.94 ms
        # against 2.41 and 4.45); at 1 row small_gemm stays fastest, at 512 rows oneDNN (749 against 1126 us).
        preferred = None
        if "onednn_packed" in kernels:
            small = "small_gemm" if "small_gemm" in kernels else "onednn_packed"
            preferred = (small, "amx_gemm" if "amx_gemm" in kernels else small, "onednn_packed")
        self._choose(kernels, weight.dtype, weight.device, preferred, decode_only)
        self._packed = {name: t for name, t in self._packed.items() if name in self.kernel_names}
        reads_plain = {"F.linear", "mkl_packed"} & set(self.kernel_names)   # (MKL's fp32 kernel takes both)
        self.register_buffer("weight", weight.detach() if reads_plain else None, persistent=False)

    def _candidates(self, w: torch.Tensor | None = None) -> dict[str, Kernel]:
        """Every kernel for weight w [N, K]; with w given (at construction) the packed copies each
        reads are recorded in ``self._packed``; without, they are built from ``dense_weight()``
        for one call of ``run_kernel`` and not kept."""
        record, w = w is not None, self.dense_weight() if w is None else w
        packed_copies: dict[str, torch.Tensor] = {}
        kernels: dict[str, Kernel] = {"F.linear": lambda x: F.linear(x, w)}
        if w.device.type != "cpu":
            return kernels
        if w.dtype in (torch.bfloat16, torch.float16, torch.float32) and torch.backends.mkldnn.is_available():
            try:  # oneDNN's blocked weight layout, packed once; the batch-size hint tunes the packing: for
                # fp32 (Zen 1, 2 threads, weights cold) a hint of 16 runs 16 rows 1.3-1.35x faster than a
                # hint of 1 (gate_up 1.73 -> 1.29 ms, LM head 23.6 -> 17.4) and 1 and 512 rows as fast;
                # bf16/fp16 keep the hint of 1 they were measured with (Zen 5)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, 16 if w.dtype == torch.float32 else 1)
                kernels["onednn_packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
                packed_copies["onednn_packed"] = packed
            except (RuntimeError, AttributeError):
                pass
        small = _small_gemm_kernel(w)
        if small is not None:
            kernels["small_gemm"] = small
            packed_copies["small_gemm"] = small.packed
            amx = _amx_gemm_kernel(small.packed, w.shape)
            if amx is not None:   # (the same packed tensor: one copy for both kernels)
                kernels["amx_gemm"] = amx
                packed_copies["amx_gemm"] = small.packed
        if w.dtype == torch.float32 and torch.backends.mkl.is_available():
            try:
                packed32 = torch.ops.mkl._mkl_reorder_linear_weight(w, 1)
                kernels["mkl_packed"] = lambda x: torch.ops.mkl._mkl_linear(x, packed32, w, None, x.shape[0])
                packed_copies["mkl_packed"] = packed32
            except (RuntimeError, AttributeError):
                pass
        if record:
            self._packed = packed_copies
        return kernels

    def dense_weight(self) -> torch.Tensor:
        """[N, K] in the model dtype: the plain weight, or one unpacked from a kept copy."""
        if self.weight is not None:
            return self.weight
        for name in ("small_gemm", "amx_gemm"):
            if name in self._packed:
                return unpack_small_gemm(self._packed[name], self.out_features)
        if "onednn_packed" in self._packed:
            return self._packed["onednn_packed"].to_dense()
        raise RuntimeError("DenseLinear keeps no copy of its weight")   # unreachable: some kernel was chosen

    def weight_bytes(self) -> int:
        """Bytes of weight one forward reads: N x K values in the model dtype (and the bias)."""
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.out_features * self.in_features * self.dtype.itemsize + bias

    def resident_bytes(self) -> int:
        """Bytes this linear's kept weight copies occupy (the plain weight and packed copies)."""
        plain = 0 if self.weight is None else self.weight.numel() * self.weight.element_size()
        # (small_gemm and amx_gemm share one tensor; by identity: oneDNN's opaque tensor has no data_ptr)
        copies = {id(t): t for t in self._packed.values()}
        return plain + sum(t.numel() * t.element_size() for t in copies.values())


def pack_small_gemm(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 (K even) -> [ceil(N/16), K/2, 16, 2]: tiles of 16 output columns, each
    k pair of a column adjacent (the layout kernels/csrc/small_gemm.cpp reads); zero rows pad N."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // 16) * 16, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_small_gemm(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_small_gemm: [ceil(N/16), K/2, 16, 2] -> [n, K]."""
    tiles, k2 = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(tiles * 16, 2 * k2)[:n].contiguous()


def _small_gemm_kernel(w: torch.Tensor) -> Kernel | None:
    """The bf16 kernel of kernels/csrc/small_gemm.cpp for weight w [N, K] (any number of rows;
    written for 1-64, where it overlaps the weight stream with compute), or None where it does not
    apply (not a bf16 CPU weight, K odd, no AVX512-BF16 build of the kernel library). The
    returned function's ``packed`` attribute is the packed weight it reads."""
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.shape[1] % 2:
        return None
    from kernels.cpu_attention import load_extension

    if load_extension()[0] is None or not torch.ops.pdserve_gemm.available():
        return None
    packed = pack_small_gemm(w)
    small = _packed_bf16_kernel(torch.ops.pdserve_gemm.small_gemm_bf16, packed, w.shape[0], float32=True)
    small.packed = packed  # type: ignore[attr-defined]
    return small


def _with_float32(kernel: Kernel, float32: Kernel) -> Kernel:
    """``kernel`` with ``float32`` (its output written as float32) as its ``float32`` attribute."""
    kernel.float32 = float32  # type: ignore[attr-defined]
    return kernel


def _packed_bf16_kernel(op, packed: torch.Tensor, n: int, float32: bool = False) -> Kernel:
    """x [M, K] bf16 -> op(out [M, n], x, packed, n): the call of both kernels on the packed weight,
    out bf16; float32: with the ``float32`` variant (out float32, the same values: small_gemm
    and its AMX kernel write either)."""
    def run(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x = x if x.stride(-1) == 1 else x.contiguous()
        out = torch.empty(x.shape[0], n, dtype=dtype)
        op(out, x, packed, n)
        return out

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return run(x, torch.bfloat16)

    return _with_float32(kernel, lambda x: run(x, torch.float32)) if float32 else kernel


def _amx_gemm_kernel(packed: torch.Tensor, shape: torch.Size) -> Kernel | None:
    """The AMX-BF16 kernel of kernels/csrc/small_gemm_amx.cpp reading ``packed`` (pack_small_gemm's
    layout, which is AMX's B layout) for a weight of ``shape`` [N, K]; written for 5-128 rows. None
    where it does not apply: K not a multiple of 32 (one tile's k depth), a kernel library built
    without AMX-BF16, or an OS that does not grant this process AMX state."""
    n, k = shape
    if k % 32 or not torch.ops.pdserve_amx.available():
        return None
    return _packed_bf16_kernel(torch.ops.pdserve_amx.small_gemm_bf16_amx, packed, n, float32=True)


# -- int8 -----------------------------------------------------------------------------------------
def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q int8 [N, K], scale float32 [N]) with ``weight ~= q * scale[:, None]``.

    Symmetric, per output channel: scale = amax(|row|) / 127 (an all-zero row gets scale 1), so
    ``|weight - q * scale| <= scale / 2`` elementwise.
    """
    w = weight.float()
    scale = w.abs().amax(dim=1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


ACT_GROUP = 32
"""Input channels per activation scale of the INT8 linears: each token's activations are quantized
in groups of 32 consecutive channels (one scale each), so an outlier channel coarsens only its own
group (engine/quantization/apply.py has the measurements)."""


def act_group(in_features: int) -> int:
    """The activation group of a linear with ``in_features`` inputs: ACT_GROUP where it divides
    them, else the whole row (one scale per token)."""
    return ACT_GROUP if in_features % ACT_GROUP == 0 else in_features


MIN_ACT_AMAX = 127 * torch.finfo(torch.float32).tiny
"""The least activation-group amax given its own scale: amax / 127 stays a normal float and its
inverse finite (the C++ kernels' kMinAmax, kernels/csrc/int8_activations.h)."""


def quantize_int8_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], scale float32 [M, K / group]): dynamic, symmetric, per token
    and per group of ``group`` channels, ``scale = amax(|x_group|) / 127`` (a group whose amax is
    below MIN_ACT_AMAX, all-zero included, gets 1 and quantizes to zeros; one holding an inf or a
    NaN gets NaN, with q 0 there, so its row's products are NaN, as in the C++ kernels' group_scale),
    ``q = round(x / scale)`` (half to even), so ``|x - q * scale| <= scale / 2`` elsewhere."""
    m, k = x.shape
    xg = x.float().view(m, k // group, group)
    finite = torch.isfinite(xg).all(dim=2)
    xg = torch.where(finite[:, :, None], xg, torch.zeros(()))   # (a poisoned group: q 0)
    amax = xg.abs().amax(dim=2)
    scale = torch.where(amax >= MIN_ACT_AMAX, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(xg / scale[:, :, None]).to(torch.int8).view(m, k)
    return q, torch.where(finite, scale, torch.full((), float("nan")))


MX_GROUP = -32
"""The activation ``group`` of MX activations (quantize_int8_mx): one scale per token, a
power-of-two sub-scale per block of 32 channels (kernels/csrc/int8_activations.h kMxGroup)."""


def quantize_int8_mx(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (hi int8 [M, K], lo int8 [M, K], sx float32 [M]): MX activations, the torch
    reference of kernels/csrc/int8_activations.h quantize_row_mx (the same values):
    ``x ~ sx * (hi + lo / 128)``, sx = amax(|x|) / 127 per token, each block of 32 channels at
    ``sx * 2**-e`` with e the largest of 0..7 where ``amax_block * 2**e <= amax`` (bf16 inputs: the
    comparison is exact on their bits)."""
    m, k = x.shape
    xf = x.float()
    finite = torch.isfinite(xf).all(dim=1)
    xf = torch.where(finite[:, None], xf, torch.zeros(()))
    bmax = xf.view(m, k // 32, 32).abs().amax(dim=2)
    amax = bmax.amax(dim=1)
    sx = torch.where(amax >= MIN_ACT_AMAX, amax / INT8_MAX, torch.ones_like(amax))
    # e from exponents and mantissas, as the kernel takes it from the bits
    rman, rexp = torch.frexp(amax)
    bman, bexp = torch.frexp(bmax)
    e = (rexp[:, None] - bexp - (bman > rman[:, None]).int()).clamp(0, 7)
    e = torch.where(bmax == 0, torch.full_like(e, 7), e)
    scale = torch.exp2(e.float()).repeat_interleave(32, dim=1)
    v = torch.round(xf * (1 / sx)[:, None] * scale).to(torch.int32)
    ei = e.repeat_interleave(32, dim=1)
    hi = v >> ei
    lo = (v & ((1 << ei) - 1)) << (7 - ei)
    sx = torch.where(finite, sx, torch.full((), float("nan")))
    return hi.to(torch.int8), lo.to(torch.int8), sx


def pack_int8_gemm(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8 (K a multiple of 4) -> q + 128 as uint8 [ceil(N/16), K/4, 16, 4]: the tiles of
    kernels/csrc/int8_gemm.cpp (vpdpbusd multiplies unsigned by signed bytes), 16 output columns
    each, a column's 4 consecutive k adjacent (vpdpbusd's quad layout); zero-weight rows pad N."""
    n, k = q.shape
    padded = torch.zeros(-(-n // 16) * 16, k, dtype=torch.int16, device=q.device)
    padded[:n] = q
    return (padded + 128).to(torch.uint8).view(-1, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def unpack_int8_gemm(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_int8_gemm: q [N, K] int8 (a copy)."""
    tiles, k4 = packed.shape[:2]
    return (packed.permute(0, 2, 1, 3).reshape(tiles * 16, 4 * k4)[:n].to(torch.int16) - 128).to(torch.int8)


# The INT8 kernel libraries and the activation dtypes each takes: kernels/csrc/int8_gemm.cpp (and
# int8_gemm_prefill.cpp), built where the CPU has AVX512-BF16 and AVX512-VNNI; int8_gemm_amx.cpp,
# where it has AMX-INT8 too (and the OS grants AMX state); int8_gemm_avx2.cpp, built on any x86 CPU
# with AVX2 and FMA (every AVX-512 CPU too).
_INT8_LIBRARIES = {"vnni": ("pdserve_int8", (torch.bfloat16,)),
                   "amx": ("pdserve_int8_amx", (torch.bfloat16,)),
                   "avx2": ("pdserve_int8_avx2", (torch.float32, torch.bfloat16))}


def _int8_kernel_available(isa: str, dtype: torch.dtype, device: torch.device, in_features: int) -> bool:
    """Whether the INT8 kernel library ``isa`` ("vnni", "amx" or "avx2") runs here for ``dtype``
    activations on ``device``: a CPU, the library built with its ISA, K a multiple of ACT_GROUP."""
    library, dtypes = _INT8_LIBRARIES[isa]
    if dtype not in dtypes or device.type != "cpu" or in_features % ACT_GROUP:
        return False
    from kernels.cpu_attention import load_extension

    return load_extension()[0] is not None and getattr(torch.ops, library).available()


def int8_amx_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the INT8 kernels run here on AMX tiles (AMX-INT8, with AVX512-VNNI) for ``dtype``
    activations: what engine/quantization/apply.py's choice of MX activations asks."""
    return _int8_kernel_available("vnni", dtype, torch.device("cpu"), ACT_GROUP) and \
        _int8_kernel_available("amx", dtype, torch.device("cpu"), ACT_GROUP)


class Int8Linear(MeasuredLinear):
    """W8A8 INT8: per-output-channel symmetric int8 weights, activations quantized dynamically per
    token and per group of ACT_GROUP channels:
    ``y[m, n] = s_w[n] * sum_g s_x[m, g] * sum_{k in g} q_x[m, k] q_w[n, k]``,
    or MX activations (``group=MX_GROUP``, quantize_int8_mx: per token, a power-of-two sub-scale per
    block of 32) as two such products over the same weight, the hi digits at s_x and the lo at s_x / 128.

    Kernels: ``w8a8_vnni`` (kernels/csrc/int8_gemm.cpp, bf16 on CPUs with AVX512-BF16 and
    AVX512-VNNI: the activations quantized in the call, the int8 weight streamed once through
    vpdpbusd, int32 sums per group, fp32 across groups; preferred at 1 row, and at 16 with one
    activation scale per token), ``w8a8_vnni_large`` (from the 16-row
    bucket on: kernels/csrc/int8_gemm_prefill.cpp, the same tiles and the same result bit for bit,
    blocked 4 rows x 48 columns in registers, the activations quantized 4 rows at a time),
    ``w8a8_amx`` (kernels/csrc/int8_gemm_amx.cpp,
    CPUs with AMX-INT8: the same tiles through TDPBSUD, the same result bit for bit, from 5 rows;
    with one scale per token, 32-row blocks from 32 rows), ``w8a8_avx2``
    (kernels/csrc/int8_gemm_avx2.cpp, fp32 or bf16 on any AVX2 CPU: the same
    tiles and, for bf16, the same result bit for bit; on Zen 1, fp32 model, 2 threads: the decode
    step 2.8x faster than fp32 at batch 1, 1.47x at 16, 1.1x at 32, fp32 through oneDNN) and ``dequant_dense`` (the reference and the path elsewhere:
    the activations quantized and dequantized, the weight widened to the model dtype, the dense
    GEMM, the weight scales). They compute the same quantized products; the
    dense one rounds the dequantized activations to the model dtype. The weight is held once: in
    the C++ kernel's tiles where it runs, else as [N, K].

    Measured and not kept (2026-12-02, Zen 5, 2 threads, decode steps alternating in one process):
    asking the next linear's weight (qkv -> o -> gate_up -> down -> next layer) into L2 or L3
    while a call computes, up to 64 KiB-1 MiB per thread, made decode 0-9% slower at batch 1 and
    1-7% at 16, more prefetch worse (it competes with the call's own stream); a small linear's
    batch-1 call still reads its weight at only 18-46 GB/s (o_proj 331 KB in 18 us). Weight tiles
    on huge pages: no gain either (branch old/int8-hugepages-s13).

    Also measured and not kept (2026-12-02, the model's 121 linears in sequence on random weights,
    each read once a step, 2 threads, min per call over 10 interleaved steps, host load 3.5-7; the
    kernel: 16 rows 4.6-5.2 ms a step, 1 row 3.0-3.1 = 43-44 GB/s; bf16 small_gemm 7.2-7.5 and 5.1-5.3
    ms): L1 prefetch 16 or 32 lines ahead instead of 8 (1 row 3.33 -> 3.32 / 3.48 ms, 16 rows 5.39 ->
    5.60 / 5.40); the next unit into L2 at 1 row too (3.33 -> 3.79); 16 rows as two passes of 8 over
    2-tile units (hot, one thread, 12% faster; cold 5.25 -> 5.87); 12 + 4 or 8 + 8 rows over each tile
    with the fp32 sums in registers (hot 3-5% faster, cold 5.00 -> 5.03 / 5.22); rows over the threads
    instead of columns at 16 rows, each thread quantizing its own rows and streaming every weight (4.63
    -> 4.86); narrower units where 9 split 5 + 4 over 2 threads (o, down; 1 row 3.12 -> 3.13); the
    prologue's rows in a second parallel region (a 1-tile call at 16 rows 5 -> 22 us) or inside the one
    region, each thread quantizing a share of the rows and waiting at a spin barrier for the rest (16
    rows 5.17 -> 8.37 ms); the two threads taking units from the two ends of the range until they meet,
    one or `grain` units a claim, in case the second thread starts late (5.23 -> 6.21, 5.36 -> 5.99);
    OMP_WAIT_POLICY=ACTIVE (noise). A numerics change: cancelling the weight's +128 offset once per row
    in fp32 instead of exactly in each group's int32 sum was 3.5% faster at 16 rows but cost perplexity
    18.8275 -> 18.8415 (pdserve eval ppl, bf16, 16,384 WikiText-2 tokens): on rows with a large
    activation sum (the massive activations) the offset term dwarfs the output and fp32 loses the
    difference. Where 16 rows go: one thread runs ~5 G vpdpbusd/s hot (~2 a cycle at the 2.6 GHz
    /proc/cpuinfo gives; compute-bound: cold = hot); two threads reach 1.55-1.7x one on the decoder's
    shapes (2x on the LM head): the serial prologue (16 rows quantized: ~2.5 us at K = 576, ~8 us at K =
    1536, ~0.47 ms a step; ~6 ns per row and group: computing 16 groups' scales in one vector division
    saved 4% of it) and ~5-10 us a call more, not from a late second thread (taking units from both ends
    did not recover it).
    """

    method = "int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, decode_only: bool = False,
                 group: int | None = None, *, quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """decode_only: see MeasuredLinear._choose (the LM head). group: input channels per
        activation scale (a multiple of ACT_GROUP dividing in_features; default act_group()), or
        MX_GROUP for MX activations (quantize_int8_mx).
        quantized: the int8 weight [N, K] and its per-channel scales float32 [N], taken as they are
        (``weight`` then gives only the shape and dtype: a meta tensor does)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype, self.decode_only = weight.dtype, decode_only
        self.group = act_group(self.in_features) if group is None else group
        if self.group == MX_GROUP and self.in_features % ACT_GROUP:
            raise ValueError(f"MX activations (group {MX_GROUP}) need in_features {self.in_features} a multiple of 32")
        if self.group != MX_GROUP and (self.group <= 0 or self.in_features % self.group
                                       or (self.group != self.in_features and self.group % ACT_GROUP)):
            raise ValueError(f"activation group {self.group} must divide in_features {self.in_features} "
                             f"and be a multiple of {ACT_GROUP} (or in_features itself)")
        q, scale = quantize_int8_per_channel(weight) if quantized is None else quantized
        if q.shape != weight.shape or q.dtype != torch.int8 or scale.shape != (q.shape[0],):
            raise ValueError(f"quantized must be int8 {list(weight.shape)} and its scales [{weight.shape[0]}], "
                             f"got {q.dtype} {list(q.shape)} and {list(scale.shape)}")
        self._vnni = _int8_kernel_available("vnni", self.dtype, q.device, self.in_features)
        self._amx = self._vnni and _int8_kernel_available("amx", self.dtype, q.device, self.in_features)
        self._avx2 = _int8_kernel_available("avx2", self.dtype, q.device, self.in_features)
        self.tiled = self._vnni or self._avx2   # both kernels read the same packed tiles
        if self.tiled:
            packed = pack_int8_gemm(q)
            padded = torch.zeros(packed.shape[0] * 16, dtype=torch.float32, device=q.device)
            padded[:self.out_features] = scale
            self.register_buffer("qweight", packed, persistent=False)
            self.register_buffer("weight_scale", padded, persistent=False)
        else:
            self.register_buffer("qweight", q, persistent=False)
            self.register_buffer("weight_scale", scale, persistent=False)
        self.bias = None if bias is None else bias.detach()
        # Quiet-machine winners (Zen 4/5, 2 threads): the decode kernel at 1 row, the blocked kernel
        # (w8a8_vnni_large) at 16 rows (Zen 4, the model's 121 linears cold: 1.07x at 16 rows, 1.1x at
        # 32) and at 512 (1.2-1.5x the decode kernel there); it is not offered at 1 row, where its
        # 48-column panels make 3 loads per 3 vpdpbusd. Where the VNNI kernels run, dequant_dense is
        # offered at 512 rows only: it never won a decode bucket on a quiet machine, but a timing on
        # a loaded host picked it for 16 rows (~2 ms a step lost, and that bucket off the fused loop).
        # Where only AVX2 runs (Zen 1), w8a8_avx2 at every bucket, dequant_dense timed at 512 only.
        # With AMX-INT8 (Sapphire Rapids), w8a8_amx at 16 rows (with groups: below). With one
        # activation scale per token (group = in_features: qkv, o, gate/up and the LM head after
        # the rotation), the decode kernel at 16 rows too: its fp32 sums are then touched once a
        # call, not once a group, and its one pass over each weight line ran the 16-row decode step
        # 2.4-4.5% faster than the blocked kernel (Zen 4, 2 threads, A/B in one process, both build
        # orders; the 121 linears alone, cold: 1.05x at 16 rows, 1.02x at 32, equal at 64, 0.97x at 128).
        # With AMX-INT8 and one scale per token, w8a8_amx at 512 rows too (its blocked path: 2.5-3.6x
        # w8a8_vnni_large on the decoder's shapes at 512 rows, Emerald Rapids, 2 threads); with
        # groups the blocked VNNI kernel stays (a group's int32 sums leave the tiles 48 times at K =
        # 1536: AMX 865 us against 725 for down_proj at 512 rows).
        # With AMX and groups (down_proj) the decode kernel at 16 rows: in the 16-row step (weights
        # from L3, Emerald Rapids, 2 threads, A/B in one process, both orders) down_proj on
        # w8a8_vnni ran the step 9.66 / 10.14 ms against 10.35 / 10.63 on w8a8_amx (whose per-group
        # tile stores stall) and 10.02 / 10.27 on w8a8_vnni_large.
        # With MX activations (MX_GROUP: two per-token products, the hi and the lo digits, over
        # the same weight) the AMX kernel from 16 rows as with one scale per token; the VNNI
        # kernels do twice the vpdpbusd of one scale per token there (engine/quantization/apply.py
        # takes MX only where AMX-INT8 runs).
        per_token = self.group in (self.in_features, MX_GROUP)
        if self._amx:
            middle = "w8a8_amx" if per_token else "w8a8_vnni"
        else:
            middle = "w8a8_vnni" if per_token else "w8a8_vnni_large"
        large = "w8a8_amx" if self._amx and per_token else "w8a8_vnni_large"
        preferred = (("w8a8_vnni", middle, large) if self._vnni
                     else ("w8a8_avx2",) * 3 if self._avx2 else None)
        self._choose(self._candidates(), self.dtype, q.device, preferred, decode_only,
                     first_bucket={"w8a8_vnni_large": 1, **({"dequant_dense": 2} if self.tiled else {})})

    def first_rows(self, n: int) -> "Int8Linear":
        """A linear computing this one's first ``n`` outputs, from the same int8 rows and scales
        (per-channel quantization: a row's values do not depend on the others), with the same
        activation group; its kernels chosen anew (the LM head cut to a draft vocabulary)."""
        if not 1 <= n <= self.out_features:
            raise ValueError(f"n must be in [1, {self.out_features}], got {n}")
        shape = torch.empty(n, self.in_features, dtype=self.dtype, device="meta")
        bias = None if self.bias is None else self.bias[:n]
        return Int8Linear(shape, bias, self.decode_only, self.group,
                          quantized=(self._int8_nk()[:n].contiguous(), self.weight_scale[:n].contiguous()))

    def _int8_nk(self) -> torch.Tensor:
        """The int8 weight [N, K] (unpacked from the tiles when they hold it: a copy)."""
        return unpack_int8_gemm(self.qweight, self.out_features) if self.tiled else self.qweight

    def _candidates(self) -> dict[str, Kernel]:
        n, dtype, group = self.out_features, self.dtype, self.group
        s_w = self.weight_scale[:n].to(dtype)

        def dequant_dense(x: torch.Tensor) -> torch.Tensor:
            if group == MX_GROUP:
                hi, lo, xs = quantize_int8_mx(x)
                xd = (xs[:, None] * (hi.float() + lo.float() / 128)).to(dtype)
            else:
                xq, xs = quantize_int8_per_group(x, group)
                xd = (xq.float().view(x.shape[0], -1, group) * xs[:, :, None]).view(x.shape).to(dtype)
            return F.linear(xd, self._int8_nk().to(dtype)).mul_(s_w)

        kernels: dict[str, Kernel] = {"dequant_dense": dequant_dense}
        q, scale = self.qweight, self.weight_scale
        if self._vnni:
            op, large = torch.ops.pdserve_int8.w8a8_gemm, torch.ops.pdserve_int8p.w8a8_gemm_large
            kernels["w8a8_vnni"] = _with_float32(lambda x: op(x, q, scale, n, group),
                                                 lambda x: op(x, q, scale, n, group, out_dtype=torch.float32))
            kernels["w8a8_vnni_large"] = _with_float32(lambda x: large(x, q, scale, n, group),
                                                       lambda x: large(x, q, scale, n, group, out_dtype=torch.float32))
        if self._amx:
            amx = torch.ops.pdserve_int8_amx.w8a8_gemm
            kernels["w8a8_amx"] = _with_float32(lambda x: amx(x, q, scale, n, group),
                                                lambda x: amx(x, q, scale, n, group, out_dtype=torch.float32))
        if self._avx2:
            avx2 = torch.ops.pdserve_int8_avx2.w8a8_gemm
            kernels["w8a8_avx2"] = lambda x: avx2(x, q, scale, n, group)
        return kernels

    def dequantized_weight(self) -> torch.Tensor:
        """[N, K] float32: the weight the int8 values and scales represent."""
        return self._int8_nk().float() * self.weight_scale[:self.out_features, None]


# -- fp8 ------------------------------------------------------------------------------------------
def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q float8_e4m3fn [N, K], scale float32 [N]), scale = amax(|row|) / 448.

    Each value is rounded to the nearest E4M3 value (3 mantissa bits): in units of the row's
    scale the error is at most ``max(|v| * 2**-4, 2**-10)`` (half an ulp; 2**-10 below the
    smallest normal, 2**-6).
    """
    w = weight.float()
    scale = w.abs().amax(dim=1) / FP8_E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return quantize_fp8(w, scale[:, None]), scale


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to E4M3, saturated at +-448 (scale broadcasts against x)."""
    return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def _triton_fp8_gemm():
    """kernels.triton.fp8_gemm.fp8_gemm, or None where triton is not installed."""
    try:
        from kernels.triton.fp8_gemm import fp8_gemm
    except ImportError:
        return None
    return fp8_gemm


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scale float32 [M, 1]): dynamic, per row."""
    scale = x.float().abs().amax(dim=1, keepdim=True).clamp_(min=1e-12) / FP8_E4M3_MAX
    return quantize_fp8(x, scale), scale


class Fp8Linear(MeasuredLinear):
    """W8A8 FP8: E4M3 weights with per-output-channel scales, per-token dynamic E4M3 activations.

    weight_scale: a checkpoint's scales ([N], [N, 1] or a scalar) when ``weight`` is already
    float8_e4m3fn; else computed here from the full-precision weight.
    """

    method = "fp8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 weight_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        if weight.dtype == torch.float8_e4m3fn:
            if weight_scale is None:
                raise ValueError("an float8_e4m3fn weight needs its weight_scale")
            q, scale = weight, weight_scale.float().reshape(-1).expand(self.out_features).contiguous()
        else:
            q, scale = quantize_fp8_per_channel(weight)
        self.register_buffer("qweight", q, persistent=False)
        self.register_buffer("weight_scale", scale, persistent=False)
        self.bias = None if bias is None else bias.detach().to(dtype)
        emulated = "emulated_bf16" if q.device.type == "cpu" else None
        self._choose(self._candidates(), dtype, q.device, None if emulated is None else (emulated,) * 3)

    def _candidates(self) -> dict[str, Kernel]:
        q, s, dtype = self.qweight, self.weight_scale, self.dtype
        s_row = s[None, :]
        kernels: dict[str, Kernel] = {}

        def scaled_mm(x: torch.Tensor) -> torch.Tensor:
            xq, xs = quantize_fp8_per_token(x)
            return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s_row, out_dtype=dtype)

        kernels["scaled_mm"] = scaled_mm
        if q.device.type == "cuda" and _triton_fp8_gemm() is not None:
            fp8_gemm = _triton_fp8_gemm()

            def triton_fp8(x: torch.Tensor) -> torch.Tensor:
                # kernels/triton/fp8_gemm.py: for GPUs whose _scaled_mm cannot take these scales.
                xq, xs = quantize_fp8_per_token(x)
                return fp8_gemm(xq, q, xs, s, out_dtype=dtype)

            kernels["triton"] = triton_fp8
        if q.device.type == "cpu":
            # E4M3 values are exact in bf16; the GEMM then multiplies and sums what _scaled_mm would.
            emulated = DenseLinear(q.to(torch.bfloat16), None)

            def emulated_bf16(x: torch.Tensor) -> torch.Tensor:
                xq, xs = quantize_fp8_per_token(x)
                return (emulated(xq.to(torch.bfloat16)).float() * (xs * s_row)).to(dtype)

            kernels["emulated_bf16"] = emulated_bf16
        return kernels

    def dequantized_weight(self) -> torch.Tensor:
        """[N, K] float32: what the E4M3 values and scales represent."""
        return self.qweight.float() * self.weight_scale[:, None]
