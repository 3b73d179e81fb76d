"""The decoder's small per-layer ops (RMSNorm with the residual add, RoPE on the fused QKV output,
SiLU-and-multiply), chosen once at load: ``get_layer_ops(device)``; and greedy sampling's argmax
over the logits (``greedy_argmax``).

- ``TorchLayerOps`` (``"torch"``): eager torch, the reference; runs everywhere (CUDA included).
- ``CppLayerOps`` (``"cpu"``): one C++ pass per op (kernels/csrc/layer_ops.cpp, built with the
  attention kernel, see kernels/cpu_attention.py). At decode batch sizes the eager versions cost
  more in dispatch and temporaries than in arithmetic (~200 us a layer of SmolLM2-135M in bf16 on
  one thread, torch.profiler).

Shapes: hidden rows ``x`` [T, H]; the fused QKV output [T, (Hq + 2 Hkv) D]; the fused gate/up
output [T, 2I]. Both implementations compute the norm and SiLU in fp32 and round where the
reference rounds; the C++ RoPE computes in fp32 from fp32 tables and rounds once (the reference
rounds cos/sin and each product to the model dtype), so in bf16 it differs from the reference
by bf16 rounding, not more (and is closer to fp32).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


class TorchLayerOps:
    """Eager torch implementations (the reference)."""

    name = "torch"

    def rope_tables(self, positions: torch.Tensor, inv_freq: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, D] in ``dtype`` (broadcast over heads)."""
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, H] -> weight * rms_norm(x) [T, H] (normalized in fp32, rounded to x's dtype)."""
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual [T, H] += x (in place); return rms_norm(residual) * weight."""
        residual.add_(x)
        return self.rms_norm(residual, weight, eps)

    def rope_split(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D] and k [T, Hkv, D] rotated, v [T, Hkv, D]."""
        t = qkv.shape[0]
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        return (apply_rope(q.view(t, num_heads, head_dim), cos, sin),
                apply_rope(k.view(t, num_kv_heads, head_dim), cos, sin), v.view(t, num_kv_heads, head_dim))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by position (rotate-half: pairs (i, i + D/2))."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class CppLayerOps(TorchLayerOps):
    """The C++ ops (torch.ops.pdserve_ops); construct through ``get_layer_ops``. Tensors whose
    layout the kernels do not take (non-contiguous rows) go through the torch reference."""

    name = "cpu"

    def __init__(self) -> None:
        self._ops = torch.ops.pdserve_ops

    def rope_tables(self, positions: torch.Tensor, inv_freq: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, D/2] float32 (the C++ RoPE reads each half once)."""
        freqs = positions.float()[:, None] * inv_freq[None, :]
        return freqs.cos(), freqs.sin()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or x.stride(-1) != 1:
            return super().rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._ops.rms_norm(out, x, weight, eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or x.stride(-1) != 1 or not residual.is_contiguous():
            return super().add_rms_norm(x, residual, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._ops.add_rms_norm(out, x, residual, weight, eps)
        return out

    def rope_split(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = qkv.shape[0]
        if qkv.stride(-1) != 1:
            qkv = qkv.contiguous()
        # One allocation for the three outputs: q | k | v, each contiguous.
        flat = torch.empty(t * (num_heads + 2 * num_kv_heads) * head_dim, dtype=qkv.dtype)
        q, k, v = flat.split([t * num_heads * head_dim, t * num_kv_heads * head_dim, t * num_kv_heads * head_dim])
        q, k, v = q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)
        self._ops.rope_split(q, k, v, qkv, cos, sin)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.stride(-1) != 1:
            return super().silu_mul(gate_up)
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        self._ops.silu_mul(out, gate_up)
        return out


_argmax_op: object = None   # torch.ops.pdserve_ops.argmax_rows once the library is loaded; False: unavailable


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (float32, bfloat16 or float16) -> [N] int64, ``logits.argmax(-1)``'s answer
    (the first maximum of each row; the first NaN where a row has one).

    On CPU through the C++ op (csrc/layer_ops.cpp: one vector pass a row, rows over torch's
    threads; torch's argmax reads a 49,152-entry fp32 row at ~7 GB/s); elsewhere, for other
    layouts or dtypes, or when the kernel library cannot be built, torch.argmax.
    """
    global _argmax_op
    if logits.device.type != "cpu" or logits.dim() != 2 or logits.stride(-1) != 1 or logits.shape[1] == 0 \
            or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return logits.argmax(dim=-1)
    if _argmax_op is None:
        from kernels.cpu_attention import load_extension

        _argmax_op = torch.ops.pdserve_ops.argmax_rows if load_extension()[0] is not None else False
    if _argmax_op is False:
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _argmax_op(out, logits)
    return out


LAYER_OPS = ("auto", "cpu", "torch")


def get_layer_ops(name: str = "auto", device: torch.device | str = "cpu") -> TorchLayerOps:
    """The layer ops called ``name`` (one of LAYER_OPS) for tensors on ``device``.

    ``"auto"``: the C++ ops on CPU when the kernel library builds (else the reference, with the
    reason logged), the reference elsewhere. Raises ValueError for an unknown name, RuntimeError
    when ``"cpu"`` is asked for and cannot be built.
    """
    if name not in LAYER_OPS:
        raise ValueError(f"unknown layer ops {name!r}: available: {', '.join(LAYER_OPS)}")
    if name == "torch" or (name == "auto" and torch.device(device).type != "cpu"):
        return TorchLayerOps()
    from kernels.cpu_attention import load_extension

    op, reason = load_extension()
    if op is None:
        if name == "cpu":
            raise RuntimeError(f"the cpu layer ops are unavailable: {reason}")
        log.warning("layer ops auto: %s; using the torch reference", reason)
        return TorchLayerOps()
    return CppLayerOps()
