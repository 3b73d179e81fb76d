"""The INT8 kernel (kernels/csrc/int8_gemm.cpp, Int8Linear's ``w8a8_vnni``) against an fp32
product of the same quantized activations, int8 weights and scales.

The reference quantizes the activations per token and group of 32 channels in torch
(quantize_int8_per_group) and multiplies in fp32; the kernel's int32 group sums are exact, its
fp32 sum over groups another order, and the output is rounded once to bf16: within one bf16 ulp
of the largest output, 2^-7 relative. (Its activation quantization multiplies by 1/scale where
the reference divides: a value exactly between two levels may round the other way, one level in
a group, far inside that bound.) Shapes cover every row count the kernel specializes (1-16 in one
pass, 17-40 in two or three), N not a multiple of 16 (a partial tile) nor of 128 (a partial group
of tiles), a row stride wider than K, an outlier input channel, and two threads.
"""

from __future__ import annotations

import pytest
import torch

from kernels.linear import (ACT_GROUP, Int8Linear, pack_int8_gemm, quantize_int8_per_channel, quantize_int8_per_group,
                            unpack_int8_gemm)


@pytest.fixture(scope="module")
def available() -> None:
    if not Int8Linear(torch.zeros(16, 32, dtype=torch.bfloat16), None).tiled:
        from engine.platform import has_native_bf16

        # Only a CPU without AVX512-BF16 (or without a compiler) has no kernel; never skip on one that has.
        assert not has_native_bf16() or not torch.backends.cpu.get_cpu_capability().startswith("AVX512"), \
            "AVX512-BF16 CPU but the int8 kernel did not build"
        pytest.skip("no AVX512-BF16 + AVX512-VNNI build of the kernel library on this CPU")


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    xq, xs = quantize_int8_per_group(x, group)
    xd = (xq.float().view(x.shape[0], -1, group) * xs[:, :, None]).view(x.shape)
    return (xd @ q.float().T) * scale


@pytest.mark.parametrize("n,k", [(200, 96), (16, 32), (1000, 576)])
def test_every_row_count_matches_the_fp32_product(available, n, k):
    gen = torch.Generator().manual_seed(n)
    w = (torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)).bfloat16()  # rows of different ranges
    lin = Int8Linear(w, None)
    q, scale = quantize_int8_per_channel(w)
    wide = torch.randn(40, k + 8, generator=gen)
    wide[:, 3] *= 300                                    # an outlier channel (it spoils only its group)
    wide[:, 32:64] = 0 if k >= 64 else wide[:, 32:64]    # an all-zero group
    wide = wide.bfloat16()
    for m in range(1, 41):
        x = wide[:m, :k]                                 # rows of stride k + 8
        want = reference(x, q, scale)
        got = lin.run_kernel("w8a8_vnni", x)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert rel(got, want) < 2 ** -7, (m, rel(got, want))


@pytest.mark.parametrize("group", [64, 192, 576])   # wider groups (down to one scale per token)
def test_wider_activation_groups_match_the_fp32_product(available, group):
    gen = torch.Generator().manual_seed(group)
    w = (torch.randn(200, 576, generator=gen) * torch.rand(200, 1, generator=gen)).bfloat16()
    lin = Int8Linear(w, None, group=group)
    q, scale = quantize_int8_per_channel(w)
    x = torch.randn(40, 576, generator=gen)
    x[:, 3] *= 30                                        # a large channel: it sets its group's scale
    x = x.bfloat16()
    for m in (1, 7, 16, 17, 40):                         # one pass, one full pass, two and three passes
        want = reference(x[:m], q, scale, group)
        assert rel(lin.run_kernel("w8a8_vnni", x[:m]), want) < 2 ** -7, (m, group)
        assert rel(lin.run_kernel("dequant_dense", x[:m]), want) < 2 ** -6, (m, group)


def test_an_activation_group_that_does_not_divide_k_is_refused(available):
    w = torch.randn(32, 576).bfloat16()
    with pytest.raises(ValueError, match="activation group 100 must divide in_features 576"):
        Int8Linear(w, None, group=100)
    with pytest.raises(ValueError, match="multiple of 32"):
        Int8Linear(w, None, group=48)
    lin = Int8Linear(w, None)
    with pytest.raises(RuntimeError, match="group must be a multiple of 32 dividing K = 576, got 97"):
        torch.ops.pdserve_int8.w8a8_gemm(torch.randn(1, 576).bfloat16(), lin.qweight, lin.weight_scale, 32, 97)


@pytest.mark.parametrize("n,k,m", [(4096, 64, 5), (256, 576, 40)])   # the second: three passes of rows
def test_two_threads_give_the_same_result(available, n, k, m):
    lin = Int8Linear(torch.randn(n, k).bfloat16(), None)
    x = torch.randn(m, k).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin.run_kernel("w8a8_vnni", x)
        torch.set_num_threads(2)
        two = lin.run_kernel("w8a8_vnni", x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_packing_layout_round_trip_and_one_copy_of_the_weight(available):
    q = (torch.arange(20 * 8) - 80).to(torch.int8).view(20, 8)
    packed = pack_int8_gemm(q)
    assert packed.shape == (2, 2, 16, 4) and packed.dtype == torch.uint8        # q + 128
    assert torch.equal(packed[1, 1, 3].int(), q[19, 4:8].int() + 128)
    assert torch.equal(packed[1, 0, 4], torch.full((4,), 128, dtype=torch.uint8))   # a padding row: weight 0
    assert torch.equal(unpack_int8_gemm(packed, 20), q)
    lin = Int8Linear(torch.randn(48, 64).bfloat16(), None)
    assert set(lin.kernel_choices) == {"w8a8_vnni", "w8a8_vnni_large", "dequant_dense"}
    assert [b.dtype for b in lin.buffers()] == [torch.uint8, torch.float32]   # the tiles and scales: no [N, K] copy
    x = torch.randn(20, 64).bfloat16()
    a, b = lin.run_kernel("w8a8_vnni", x).float(), lin.run_kernel("dequant_dense", x).float()
    assert float((a - b).abs().max() / b.abs().max()) < 2 ** -6
