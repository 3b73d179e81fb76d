"""Fused RMSNorm (+ residual add) in Triton, fp32 math.

``rms_norm(x, w)``: ``y = x / sqrt(mean(x^2) + eps) * w`` per row. ``fused_add_rms_norm(x, r, w)``:
``r' = x + r`` (stored in r's dtype), ``y = rms_norm(r', w)``, in one pass over the row instead of
three (add, norm, scale), as a decoder layer needs between attention and MLP. The norm is taken
of ``r'`` as stored (rounded to its dtype), so the output is what the unfused
``rms_norm(x + r)`` gives, up to the final rounding. One program per row; the row (the hidden
size) fits one block.

Source: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HIDDEN = 65536


# -- torch reference ---------------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, H], weight [H] -> y [M, H] (x's dtype); with residual [M, H]: (y, x + residual)."""
    out_dtype = x.dtype
    if residual is not None:
        residual = (x.float() + residual.float()).to(residual.dtype)
        x = residual
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()).to(out_dtype)
    return y if residual is None else (y, residual)


# -- kernel ------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, residual_out_ptr, weight_ptr, out_ptr, H, eps,
                     stride_x, stride_r, stride_ro, stride_o,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (row,): normalize one row (after adding its residual)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        stored = (x + r).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, stored, mask=mask)
        x = stored.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


# -- wrappers ----------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, H] (fp16/bf16/fp32, rows contiguous), weight [H] -> [M, H] in x's dtype."""
    _check(x, weight, None)
    out = torch.empty_like(x)
    _launch(x, None, None, weight, out, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [M, H], weight [H] -> (rms_norm(x + residual) [M, H] in x's dtype, x + residual
    [M, H] in residual's dtype). Inputs are not modified."""
    _check(x, weight, residual)
    out = torch.empty_like(x)
    residual_out = torch.empty_like(residual)
    _launch(x, residual, residual_out, weight, out, eps)
    return out, residual_out


def _launch(x, residual, residual_out, weight, out, eps: float) -> None:
    m, h = x.shape
    r = residual if residual is not None else x              # never read when HAS_RESIDUAL is False
    ro = residual_out if residual_out is not None else out
    _rms_norm_kernel[(m,)](x, r, ro, weight, out, h, float(eps),
                           x.stride(0), r.stride(0), ro.stride(0), out.stride(0),
                           HAS_RESIDUAL=residual is not None, BLOCK_H=triton.next_power_of_2(h))


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, hidden], got shape {tuple(x.shape)}")
    if x.shape[1] > MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[1]} exceeds {MAX_HIDDEN} (one row per block)")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [hidden={x.shape[1]}], got shape {tuple(weight.shape)}")
    tensors = [x, weight] + ([residual] if residual is not None else [])
    for t in tensors:
        if t.dtype not in DTYPES:
            raise ValueError(f"dtype {t.dtype} not supported: {DTYPES}")
        if t.stride(-1) != 1:
            raise ValueError("x, residual and weight must be contiguous along hidden (stride 1)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if len({t.device for t in tensors}) != 1:
        raise ValueError("x, residual and weight must be on one device")
