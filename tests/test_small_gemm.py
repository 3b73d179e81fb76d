"""The small-batch bf16 linear kernel (kernels/csrc/small_gemm.cpp, kernels.linear's ``small_gemm``)
against an fp32 product of the same bf16 values.

Both sum exact bf16 products in fp32 (in different orders) and round once to bf16: within one bf16
ulp of the largest output, 2^-7 relative, plus fp32 summation noise. Shapes cover every row count
the kernel specializes (1-12 in one pass, 13-24 in two, 25-32 in three), N not a multiple of 16
(a partial tile) and of 128 (a partial group of tiles), a row stride wider than K, and two threads.
"""

from __future__ import annotations

import pytest
import torch

from kernels.linear import SMALL_GEMM_MAX_ROWS, DenseLinear, _small_gemm_kernel, pack_small_gemm


@pytest.fixture(scope="module")
def available() -> None:
    if _small_gemm_kernel(torch.zeros(16, 16, dtype=torch.bfloat16)) is None:
        from engine.platform import has_native_bf16

        # Only a CPU without AVX512-BF16 (or without a compiler) has no kernel; never skip on one that has.
        assert not has_native_bf16() or not torch.backends.cpu.get_cpu_capability().startswith("AVX512"), \
            "AVX512-BF16 CPU but the small_gemm kernel did not build"
        pytest.skip("no AVX512-BF16 build of the kernel library on this CPU")


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("n,k", [(200, 96), (16, 32), (1000, 576)])
def test_every_row_count_matches_the_fp32_product(available, n, k):
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=gen).bfloat16()
    kernel = _small_gemm_kernel(w)
    wide = torch.randn(SMALL_GEMM_MAX_ROWS, k + 8, generator=gen).bfloat16()
    for m in range(1, SMALL_GEMM_MAX_ROWS + 1):
        x = wide[:m, :k]                                 # rows of stride k + 8
        want = x.float() @ w.float().T
        got = kernel(x)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert rel(got, want) < 2 ** -7, (m, rel(got, want))


def test_two_threads_give_the_same_result(available):
    w = torch.randn(4096, 64).bfloat16()
    x = torch.randn(5, 64).bfloat16()
    kernel = _small_gemm_kernel(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x)
        torch.set_num_threads(2)
        two = kernel(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_packing_layout_and_dense_linear_candidate(available):
    w = torch.arange(20 * 4, dtype=torch.float32).view(20, 4).bfloat16()
    packed = pack_small_gemm(w)
    assert packed.shape == (2, 2, 16, 2)
    assert torch.equal(packed[1, 1, 3], w[19, 2:4]) and torch.equal(packed[1, 0, 4], torch.zeros(2).bfloat16())
    lin = DenseLinear(torch.randn(48, 32).bfloat16(), None)
    assert "small_gemm" in lin.kernel_choices
    x = torch.randn(SMALL_GEMM_MAX_ROWS + 3, 32).bfloat16()   # beyond the kernel's rows: oneDNN
    assert torch.allclose(lin.run_kernel("small_gemm", x).float(), lin.run_kernel("onednn_packed", x).float(),
                          rtol=2 ** -7, atol=1e-2)
