"""The blocked INT8 kernel (kernels/csrc/int8_gemm_prefill.cpp, Int8Linear's ``w8a8_vnni_large``,
chosen from 16 rows on): the same packed weight and the same operations in the same order as the
decode kernel (kernels/csrc/int8_gemm.cpp's ``w8a8_gemm``), its activations quantized 4 rows at a
time (int8_activations.h quantize_block) to the values w8a8_gemm's quantize_row gives row by row,
so its output equals that kernel's bit for bit, and both are within one bf16 ulp of the largest
output (2^-7 relative) of an fp32 product of the same quantized operands (tests/test_int8_gemm.py's
reference). Shapes: every row count 1-20 (a last block of 1-4 rows) and more, N not a multiple of
its 48-column panels nor of 16 (a partial tile), the activation groups the model uses (32, 64, the
whole row), more than 16 groups (quantize_block's batch of scales), a row stride wider than K,
an outlier channel, an all-zero group, an all-zero row, two threads.
"""

from __future__ import annotations

import pytest
import torch

from kernels.linear import BUCKETS, Int8Linear, quantize_int8_per_channel
from tests.test_int8_gemm import available, reference, rel  # noqa: F401 - the fixture is used by name


@pytest.mark.parametrize("k", [64, 576, 1536])
@pytest.mark.parametrize("n", [48, 960, 40])
def test_equals_the_decode_kernel_bit_for_bit(available, n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)).bfloat16()
    q, scale = quantize_int8_per_channel(w)
    wide = torch.randn(100, k + 8, generator=gen)
    wide[:, 5] *= 300                                     # an outlier channel
    wide[:, 32:64] = 0                                    # an all-zero group
    wide[6] = 0                                           # an all-zero row
    wide[2, 40:] *= 1e-30                                 # tiny values, in groups of their own past the zero group
    wide = wide.bfloat16()
    for group in sorted({32, 64, k}):
        lin = Int8Linear(w, None, group=group)
        for m in [*range(1, 21), 32, 64, 100]:
            x = wide[:m, :k]                              # rows of stride k + 8
            got = lin.run_kernel("w8a8_vnni_large", x)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            assert torch.equal(got, lin.run_kernel("w8a8_vnni", x)), (m, group)
            assert rel(got, reference(x, q, scale, group)) < 2 ** -7, (m, group)


def test_two_threads_and_one_give_the_same_bits(available):
    w = torch.randn(960, 576).bfloat16()
    lin = Int8Linear(w, None, group=64)
    x = torch.randn(130, 576).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin.run_kernel("w8a8_vnni_large", x)
        torch.set_num_threads(2)
        two = lin.run_kernel("w8a8_vnni_large", x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_offered_from_the_16_row_bucket_on(available):
    """1-4 rows never take the blocked kernel, whatever a noisy timing says (its 48-column panels
    make a weight load per vpdpbusd at one row); from 16 rows it is timed (and preferred), the LM
    head's (decode_only) too; wrong operands are refused naming the field."""
    for decode_only in (False, True):
        lin = Int8Linear(torch.randn(200, 96).bfloat16(), None, decode_only=decode_only)
        assert "w8a8_vnni_large" in lin.kernel_choices and len(lin.kernel_names) == len(BUCKETS)
        assert lin.kernel_names[0] != "w8a8_vnni_large"
    with pytest.raises(RuntimeError, match="group"):
        torch.ops.pdserve_int8p.w8a8_gemm_large(torch.randn(4, 96).bfloat16(), lin.qweight, lin.weight_scale, 200, 48)


def test_a_vanishing_group_quantizes_to_zeros_in_every_kernel(available):
    """A group whose amax is below 127 x FLT_MIN (its scale would be subnormal and 1 / scale
    infinite) quantizes to zeros, as an all-zero group: both kernels, every row position (the
    decode kernel quantizes 4 rows at a time and the rest row by row), the Python reference too;
    K = 0 is refused, not divided by."""
    from kernels.linear import quantize_int8_per_group

    gen = torch.Generator().manual_seed(3)
    lin = Int8Linear(torch.randn(16, 64, generator=gen).bfloat16(), None, group=64)
    for amax in (1e-37, 3e-38):   # (1 / (amax / 127) overflows float32 below ~3.7e-37)
        row = torch.randn(64, generator=gen)
        row = (row / row.abs().max() * amax).bfloat16()
        x = row[None].expand(5, 64).contiguous()          # 4 rows quantized as a block, 1 alone
        small = torch.ops.pdserve_int8.w8a8_gemm(x, lin.qweight, lin.weight_scale, 16, 64)
        assert torch.equal(small, torch.ops.pdserve_int8p.w8a8_gemm_large(x, lin.qweight, lin.weight_scale, 16, 64))
        if "w8a8_avx2" in lin.kernel_choices:   # (its own row quantizer, the same rule)
            assert torch.equal(small, lin.run_kernel("w8a8_avx2", x)), amax
        assert all(torch.equal(small[0], small[i]) for i in range(5)), amax
        assert float(small.float().abs().max()) < 1e-30, amax
        q, scale = quantize_int8_per_group(x, 64)
        assert bool((q.abs() <= 127).all()) and bool(torch.isfinite(scale).all())
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.pdserve_int8.w8a8_gemm(torch.empty(3, 0).bfloat16(), torch.empty(1, 0, 16, 4, dtype=torch.uint8),
                                         torch.zeros(16), 16, 32)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_an_inf_or_nan_input_poisons_its_row_alone_in_every_kernel(available, bad):
    """A row holding an inf or a NaN gives NaN outputs (its group's scale is NaN), in every kernel
    and at every row position (the decode kernel quantizes 4 rows at a time and the rest row by
    row; the blocked kernel 4 at a time; the AVX2 kernel and the Python reference their own way),
    and every other row of the call is what it is without that row. Before, the kernels gave
    finite values that differed between them (a NaN was dropped from the amax or turned into
    -128 by the conversion)."""
    gen = torch.Generator().manual_seed(4)
    for group, rows in ((32, 9), (96, 9), (96, 40)):   # 40 rows, one scale per token: AMX's 32-row blocks
        lin = Int8Linear(torch.randn(40, 96, generator=gen).bfloat16(), None, group=group)
        clean = torch.randn(rows, 96, generator=gen).bfloat16()
        # a 4-row block's first and last row, the next block's first, row 8 (alone in its block at 9
        # rows), row 35 (AMX's second 32-row block)
        for row in (0, 3, 4, 8, 35)[:4 if rows == 9 else 5]:
            x = clean.clone()
            x[row, 40] = bad
            for name in lin.kernel_choices:
                out = lin.run_kernel(name, x)
                assert bool(out[row].isnan().all()), (name, group, row)
                others = [r for r in range(rows) if r != row]
                assert torch.equal(out[others], lin.run_kernel(name, clean)[others]), (name, group, row)
                if name != "dequant_dense":   # (the reference multiplies in another order)
                    assert torch.equal(out[others], lin.run_kernel("w8a8_vnni", clean)[others]), (name, group, row)


def test_16_rows_prefer_the_decode_kernel_with_one_scale_per_token(available, monkeypatch):
    """The quiet-machine preference at the 16-row bucket (what a load keeps unless another kernel
    times 1.25x faster): the decode kernel where the activations take one scale per token (group =
    in_features: its fp32 sums touched once a call), the blocked kernel where they take groups; on
    a CPU with AMX-INT8, the AMX kernel with one scale per token (at 512 rows too) and the decode
    kernel with groups."""
    import kernels.linear as linear

    seen = {}

    def fastest(kernels, in_features, dtype, device, rows, preferred=None, *args, **kw):
        seen[rows] = preferred
        return preferred if preferred in kernels else next(iter(kernels))

    monkeypatch.setattr(linear, "_choice_cache", {})
    monkeypatch.setattr(linear, "_fastest", fastest)
    w = torch.randn(200, 96).bfloat16()
    amx = "w8a8_amx" in Int8Linear(w, None)._candidates()
    linear._choice_cache.clear()   # (that linear's choices, made through `fastest`, must not answer below)
    for group, middle in ((96, "w8a8_vnni"), (32, "w8a8_vnni_large")):
        middle = ("w8a8_amx" if group == 96 else "w8a8_vnni") if amx else middle
        large = "w8a8_amx" if amx and group == 96 else "w8a8_vnni_large"
        lin = Int8Linear(w, None, group=group)
        assert lin.kernel_names == ("w8a8_vnni", middle, large), group
        assert seen[BUCKETS[1]] == middle
        x = torch.randn(16, 96).bfloat16()
        assert torch.equal(lin(x), lin.run_kernel("w8a8_vnni_large", x))   # either way the same bits


def test_float32_out_is_the_bf16_output_widened(available):
    """out_dtype=float32 (the LM head's logits at 16 rows): the bf16 output's values widened, bit for
    bit, as the decode kernel's."""
    gen = torch.Generator().manual_seed(5)
    lin = Int8Linear(torch.randn(1000, 576, generator=gen).bfloat16(), None)
    large, small = torch.ops.pdserve_int8p.w8a8_gemm_large, torch.ops.pdserve_int8.w8a8_gemm
    for m in (1, 5, 16, 40):
        x = torch.randn(m, 576, generator=gen).bfloat16()
        got = large(x, lin.qweight, lin.weight_scale, 1000, 32, out_dtype=torch.float32)
        assert got.dtype == torch.float32 and got.shape == (m, 1000)
        assert torch.equal(got, large(x, lin.qweight, lin.weight_scale, 1000, 32).float()), m
        assert torch.equal(got, small(x, lin.qweight, lin.weight_scale, 1000, 32, out_dtype=torch.float32)), m
    with pytest.raises(RuntimeError, match="out_dtype must be bfloat16 or float32"):
        large(x, lin.qweight, lin.weight_scale, 1000, 32, out_dtype=torch.float16)
