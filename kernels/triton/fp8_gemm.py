"""FP8 E4M3 GEMM in Triton with per-token activation scales and per-output-channel weight scales.

``out[m, n] = (sum_k a[m, k] * b[n, k]) * a_scale[m] * b_scale[n] (+ bias[n])``, the W8A8 linear
``x @ W^T`` with ``a`` the dynamically quantized activations (one scale per token) and ``b`` the
weight as ``nn.Linear`` stores it (``[out_features, in_features]``, one scale per output channel).
The products are taken on the FP8 inputs (native FP8 tensor-core MMA on Hopper/Ada) and
accumulated in fp32; both scales are applied once per output tile, after the K loop, since
they are constant along K. For where ``torch._scaled_mm`` cannot take this scale layout (its
row-wise scaling needs a recent GPU and torch build, and bf16 output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_E4M3_MAX = float(torch.finfo(FP8).max)  # 448
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# -- torch reference ---------------------------------------------------------------------------
def fp8_gemm_ref(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a [M, K], b [N, K] E4M3; a_scale [M] (or [M, 1]), b_scale [N] (or [N, 1]) fp32 -> [M, N] out_dtype."""
    out = (a.float() @ b.float().T) * a_scale.float().view(-1, 1) * b_scale.float().view(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (E4M3 [M, K], fp32 scale [M]): each row scaled so its largest |x| maps to 448."""
    scale = x.float().abs().amax(dim=1).clamp(min=1e-12) / FP8_E4M3_MAX
    return (x.float() / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8), scale


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (E4M3 [N, K], fp32 scale [N]): one scale per output channel (row)."""
    return quantize_per_token(w)


# -- kernel ------------------------------------------------------------------------------------
@triton.jit
def _fp8_gemm_kernel(
    a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_am, stride_bn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (i, j): the [BLOCK_M, BLOCK_N] output tile at rows i * BLOCK_M, columns j * BLOCK_N."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * stride_am + (k0 + offs_k)[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + (k0 + offs_k)[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)                  # FP8 x FP8 -> fp32 accumulator
    a_scale = tl.load(a_scale_ptr + offs_m, mask=m_mask, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n, mask=n_mask, other=0.0)
    out = acc * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# -- wrapper -----------------------------------------------------------------------------------
def fp8_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, *,
             block_m: int | None = None, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """a [M, K] E4M3 (activations), b [N, K] E4M3 (weight), a_scale [M] / [M, 1] and b_scale [N] /
    [N, 1] fp32, bias [N] or None -> [M, N] in out_dtype (fp16, bf16 or fp32).

    Rows of a and b must be contiguous along K. block_m defaults to 16 for M <= 16 (decode) and
    64 otherwise; block sizes must be powers of two >= 16 (tl.dot). Raises ValueError naming the
    offending argument.
    """
    _check(a, b, a_scale, b_scale, bias, out_dtype)
    (m, k), n = a.shape, b.shape[0]
    bm = block_m or (16 if m <= 16 else 64)
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    bias_arg = bias if bias is not None else b_scale          # never read when HAS_BIAS is False
    _fp8_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, block_n))](
        a, b, a_scale.reshape(-1).float(), b_scale.reshape(-1).float(), bias_arg, out,
        m, n, k, a.stride(0), b.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32) through an E4M3 weight [N, K] with per-channel scales [N] -> [..., N]
    in x's dtype; x is quantized per token on the fly (torch ops)."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_per_token(x2)
    return fp8_gemm(xq, weight, x_scale, weight_scale, bias, x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _check(a, b, a_scale, b_scale, bias, out_dtype) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a must be [M, K] and b [N, K] with the same K, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != FP8 or b.dtype != FP8:
        raise ValueError(f"a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("a and b must be contiguous along K (stride 1)")
    if a_scale.numel() != a.shape[0] or b_scale.numel() != b.shape[0]:
        raise ValueError(f"a_scale must have M={a.shape[0]} entries (per token) and b_scale N={b.shape[0]} "
                         f"(per output channel), got {tuple(a_scale.shape)} and {tuple(b_scale.shape)}")
    if bias is not None and bias.shape != (b.shape[0],):
        raise ValueError(f"bias must be [N={b.shape[0]}], got {tuple(bias.shape)}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    tensors = [a, b, a_scale, b_scale] + ([bias] if bias is not None else [])
    if len({t.device for t in tensors}) != 1:
        raise ValueError("a, b, scales and bias must be on one device")
