"""The INT8 kernels (kernels/csrc/int8_gemm.cpp, Int8Linear's ``w8a8_vnni``, bf16 on CPUs with
AVX512-VNNI; kernels/csrc/int8_gemm_amx.cpp, ``w8a8_amx``, bf16 on CPUs with AMX-INT8;
kernels/csrc/int8_gemm_avx2.cpp, ``w8a8_avx2``, fp32 or bf16 on any AVX2 CPU) against
an fp32 product of the same quantized activations, int8 weights and scales, and against each other.

The reference quantizes the activations per token and group of 32 channels in torch
(quantize_int8_per_group) and multiplies in fp32; the kernels' int32 group sums are exact, their
fp32 sum over groups another order, and the output is rounded once to the model dtype: for bf16
within one bf16 ulp of the largest output, 2^-7 relative, for fp32 2^-16. (Their activation
quantization multiplies by 1/scale where the reference divides: a value exactly between two levels
may round the other way, one level in a group, far inside that bound.) Shapes cover every row count
the kernels specialize (1-16 in one pass of the VNNI kernel, 1-8 of the AVX2 one, up to 40 in
several), N not a multiple of 16 (a partial tile) nor of 128 (a partial group of tiles), a row
stride wider than K, an outlier input channel, and two threads. The kernels quantize alike and
sum alike, so on a CPU that runs two of them their bf16 outputs are equal bit for bit.

A kernel is skipped, with the reason, only where this CPU cannot run it (no AVX512-VNNI or AMX-INT8;
not x86).
"""

from __future__ import annotations

import pytest
import torch

from kernels.linear import (ACT_GROUP, Int8Linear, pack_int8_gemm, quantize_int8_per_channel, quantize_int8_per_group,
                            unpack_int8_gemm)
from engine.platform import cpu_flags


@pytest.fixture(scope="module", params=[("w8a8_vnni", torch.bfloat16), ("w8a8_amx", torch.bfloat16),
                                        ("w8a8_avx2", torch.bfloat16), ("w8a8_avx2", torch.float32)],
                ids=["vnni-bf16", "amx-bf16", "avx2-bf16", "avx2-fp32"])
def kernel(request) -> tuple[str, torch.dtype]:
    name, dtype = request.param
    flags = cpu_flags()
    if name not in Int8Linear(torch.zeros(16, 32, dtype=dtype), None)._candidates():
        # Only a CPU without the ISA (or without a compiler) has no kernel; never skip on one that has.
        if name == "w8a8_amx":
            assert not {"amx_int8", "amx_tile", "avx512_vnni", "avx512_bf16"} <= flags, \
                "AMX-INT8 CPU but the AMX int8 kernel is not available"
            pytest.skip("no AMX-INT8 on this CPU")
        if name == "w8a8_vnni":
            assert not {"avx512_vnni", "avx512_bf16"} <= flags, "AVX512-BF16/VNNI CPU but the int8 kernel did not build"
            pytest.skip("no AVX512-BF16 + AVX512-VNNI on this CPU")
        assert not {"avx2", "fma"} <= flags, "AVX2 CPU but the AVX2 int8 kernel did not build"
        pytest.skip("no AVX2 + FMA on this CPU")
    return name, dtype


@pytest.fixture(scope="module")
def available() -> None:
    """The VNNI kernels run here (w8a8_vnni, and test_int8_gemm_prefill's w8a8_vnni_large), else skip
    with the reason; never skip on a CPU that has the ISA."""
    if "w8a8_vnni" not in Int8Linear(torch.zeros(16, 32, dtype=torch.bfloat16), None)._candidates():
        assert not {"avx512_vnni", "avx512_bf16"} <= cpu_flags(), "AVX512-BF16/VNNI CPU but the int8 kernel did not build"
        pytest.skip("no AVX512-BF16 + AVX512-VNNI on this CPU: only the AVX2 kernel runs here")


def bound(dtype: torch.dtype) -> float:
    return 2 ** -7 if dtype == torch.bfloat16 else 2 ** -16


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    xq, xs = quantize_int8_per_group(x, group)
    xd = (xq.float().view(x.shape[0], -1, group) * xs[:, :, None]).view(x.shape)
    return (xd @ q.float().T) * scale


@pytest.mark.parametrize("n,k", [(200, 96), (16, 32), (1000, 576)])
def test_every_row_count_matches_the_fp32_product(kernel, n, k):
    name, dtype = kernel
    gen = torch.Generator().manual_seed(n)
    w = (torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)).to(dtype)  # rows of different ranges
    lin = Int8Linear(w, None)
    q, scale = quantize_int8_per_channel(w)
    wide = torch.randn(40, k + 8, generator=gen)
    wide[:, 3] *= 300                                    # an outlier channel (it spoils only its group)
    wide[:, 32:64] = 0 if k >= 64 else wide[:, 32:64]    # an all-zero group
    wide = wide.to(dtype)
    for m in range(1, 41):
        x = wide[:m, :k]                                 # rows of stride k + 8
        want = reference(x, q, scale)
        got = lin.run_kernel(name, x)
        assert got.dtype == dtype and got.shape == (m, n)
        assert rel(got, want) < bound(dtype), (m, rel(got, want))


@pytest.mark.parametrize("group", [64, 192, 576])   # wider groups (down to one scale per token)
def test_wider_activation_groups_match_the_fp32_product(kernel, group):
    name, dtype = kernel
    gen = torch.Generator().manual_seed(group)
    w = (torch.randn(200, 576, generator=gen) * torch.rand(200, 1, generator=gen)).to(dtype)
    lin = Int8Linear(w, None, group=group)
    q, scale = quantize_int8_per_channel(w)
    x = torch.randn(40, 576, generator=gen)
    x[:, 3] *= 30                                        # a large channel: it sets its group's scale
    x = x.to(dtype)
    for m in (1, 7, 16, 17, 40):                         # one pass, one full pass, two and three passes
        want = reference(x[:m], q, scale, group)
        assert rel(lin.run_kernel(name, x[:m]), want) < bound(dtype), (m, group)
        assert rel(lin.run_kernel("dequant_dense", x[:m]), want) < 2 ** -6, (m, group)


def test_an_activation_group_that_does_not_divide_k_is_refused(kernel):
    w = torch.randn(32, 576).bfloat16()
    with pytest.raises(ValueError, match="activation group 100 must divide in_features 576"):
        Int8Linear(w, None, group=100)
    with pytest.raises(ValueError, match="multiple of 32"):
        Int8Linear(w, None, group=48)
    lin = Int8Linear(w, None)
    op = {"w8a8_vnni": torch.ops.pdserve_int8.w8a8_gemm, "w8a8_amx": torch.ops.pdserve_int8_amx.w8a8_gemm,
          "w8a8_avx2": torch.ops.pdserve_int8_avx2.w8a8_gemm}[kernel[0]]
    with pytest.raises(RuntimeError, match="group must be a multiple of 32 dividing K = 576, got 97"):
        op(torch.randn(1, 576).bfloat16(), lin.qweight, lin.weight_scale, 32, 97)
    with pytest.raises(RuntimeError, match="x must be"):
        op(torch.randn(1, 576).half(), lin.qweight, lin.weight_scale, 32, 32)


@pytest.mark.parametrize("n,k,m", [(4096, 64, 5), (256, 576, 40)])   # the second: three passes of rows
def test_two_threads_give_the_same_result(kernel, n, k, m):
    name, dtype = kernel
    lin = Int8Linear(torch.randn(n, k).to(dtype), None)
    x = torch.randn(m, k).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin.run_kernel(name, x)
        torch.set_num_threads(2)
        two = lin.run_kernel(name, x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_packing_layout_round_trip_and_one_copy_of_the_weight(kernel):
    name, dtype = kernel
    q = (torch.arange(20 * 8) - 80).to(torch.int8).view(20, 8)
    packed = pack_int8_gemm(q)
    assert packed.shape == (2, 2, 16, 4) and packed.dtype == torch.uint8        # q + 128
    assert torch.equal(packed[1, 1, 3].int(), q[19, 4:8].int() + 128)
    assert torch.equal(packed[1, 0, 4], torch.full((4,), 128, dtype=torch.uint8))   # a padding row: weight 0
    assert torch.equal(unpack_int8_gemm(packed, 20), q)
    lin = Int8Linear(torch.randn(48, 64).to(dtype), None)
    assert {name, "dequant_dense"} <= set(lin.kernel_choices)
    assert [b.dtype for b in lin.buffers()] == [torch.uint8, torch.float32]   # the tiles and scales: no [N, K] copy
    x = torch.randn(20, 64).to(dtype)
    a, b = lin.run_kernel(name, x).float(), lin.run_kernel("dequant_dense", x).float()
    assert float((a - b).abs().max() / b.abs().max()) < 2 ** -6


def test_the_avx2_kernel_equals_the_vnni_kernel_bit_for_bit(available):
    gen = torch.Generator().manual_seed(7)
    for n, k, group in [(1000, 576, 32), (200, 1536, 32), (49, 576, 576)]:
        lin = Int8Linear(torch.randn(n, k, generator=gen).bfloat16(), None, group=group)
        x = torch.randn(40, k, generator=gen)
        x[:, 5] *= 100
        for m in (1, 3, 8, 16, 17, 40):
            xm = x[:m].bfloat16()
            assert torch.equal(lin.run_kernel("w8a8_vnni", xm), lin.run_kernel("w8a8_avx2", xm)), (n, k, group, m)


def test_the_amx_kernel_equals_the_vnni_kernel_bit_for_bit(available):
    """The same quantize_row, exact int32 group sums (TDPBSUD: signed activations by the stored q + 128,
    the offset cancelled by the same correction) and the same fp32 fma per group: the same bits.
    Groups of 32 take tiles 32 deep, of 64 and more 64; 17-130 rows take passes (ragged ones padded);
    from 32 rows one scale per token takes the blocked path (32-row blocks, panels of two column
    tiles, an odd tile count's last panel of one; K = 96 in tiles 32 deep)."""
    if "w8a8_amx" not in Int8Linear(torch.zeros(16, 32, dtype=torch.bfloat16), None)._candidates():
        assert not {"amx_int8", "amx_tile"} <= cpu_flags(), "AMX-INT8 CPU but the AMX int8 kernel is not available"
        pytest.skip("no AMX-INT8 on this CPU")
    gen = torch.Generator().manual_seed(11)
    for n, k, group in [(1000, 576, 32), (200, 1536, 32), (3072, 576, 64), (72, 576, 192), (49, 576, 576),
                        (1000, 576, 576), (40, 96, 96), (200, 1536, 1536)]:
        lin = Int8Linear(torch.randn(n, k, generator=gen).bfloat16(), None, group=group)
        x = torch.randn(300, k, generator=gen)
        x[:, 5] *= 100
        for m in (1, 4, 5, 16, 17, 20, 31, 32, 33, 64, 100, 130, 300):
            xm = x[:m].bfloat16()
            vnni, amx = lin.run_kernel("w8a8_vnni", xm), lin.run_kernel("w8a8_amx", xm)
            assert torch.equal(vnni.view(torch.int16), amx.view(torch.int16)), (n, k, group, m)   # (signed zeros too)


def test_amx_float32_out_is_the_bf16_output_widened(available):
    """The AMX kernel's out_dtype=float32: its bf16 output widened, bit for bit, through the passes
    (5-31 rows, and groups) and the 32-row blocks (one scale per token from 32 rows)."""
    if "w8a8_amx" not in Int8Linear(torch.zeros(16, 32, dtype=torch.bfloat16), None)._candidates():
        assert not {"amx_int8", "amx_tile"} <= cpu_flags(), "AMX-INT8 CPU but the AMX int8 kernel is not available"
        pytest.skip("no AMX-INT8 on this CPU")
    gen = torch.Generator().manual_seed(13)
    op = torch.ops.pdserve_int8_amx.w8a8_gemm
    for group in (576, ACT_GROUP):
        lin = Int8Linear(torch.randn(1000, 576, generator=gen).bfloat16(), None, group=group)
        for m in (5, 16, 17, 40, 130):
            x = torch.randn(m, 576, generator=gen).bfloat16()
            got = op(x, lin.qweight, lin.weight_scale, 1000, group, out_dtype=torch.float32)
            assert got.dtype == torch.float32 and got.shape == (m, 1000)
            assert torch.equal(got, op(x, lin.qweight, lin.weight_scale, 1000, group).float()), (group, m)
    with pytest.raises(RuntimeError, match="out_dtype must be bfloat16 or float32"):
        op(x, lin.qweight, lin.weight_scale, 1000, group, out_dtype=torch.float16)


def test_float32_out_is_the_bf16_output_widened(available):
    """out_dtype=float32 (the LM head's logits): the bf16 output's values widened, bit for bit, tiny
    outputs included (flushed alike); another out_dtype is refused naming the ones allowed."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(1000, 576, generator=gen).bfloat16()
    lin = Int8Linear(w, None)
    op = torch.ops.pdserve_int8.w8a8_gemm
    for m in (1, 3, 16, 17):
        x = torch.randn(m, 576, generator=gen).bfloat16()
        got = op(x, lin.qweight, lin.weight_scale, 1000, ACT_GROUP, out_dtype=torch.float32)
        assert got.dtype == torch.float32 and got.shape == (m, 1000)
        assert torch.equal(got, op(x, lin.qweight, lin.weight_scale, 1000, ACT_GROUP).float()), m
    tiny = Int8Linear((torch.randn(40, 64, generator=gen) * 1e-27).bfloat16(), None)   # outputs ~1e-39: subnormal
    xt = (torch.randn(5, 64, generator=gen) * 1e-12).bfloat16()
    got = op(xt, tiny.qweight, tiny.weight_scale, 40, ACT_GROUP, out_dtype=torch.float32)
    assert torch.equal(got, op(xt, tiny.qweight, tiny.weight_scale, 40, ACT_GROUP).float())
    with pytest.raises(RuntimeError, match="out_dtype must be bfloat16 or float32"):
        op(x, lin.qweight, lin.weight_scale, 1000, ACT_GROUP, out_dtype=torch.float16)
