"""The bf16 linear kernel (kernels/csrc/small_gemm.cpp, kernels.linear's ``small_gemm``) against an
fp32 product of the same bf16 values, and DenseLinear keeping only the chosen kernels' copies.

Both sum exact bf16 products in fp32 (in different orders) and round once to bf16: within one bf16
ulp of the largest output, 2^-7 relative, plus fp32 summation noise. Shapes cover every row count
the kernel specializes (1-16 in one pass, each with its own register blocking; 17-64 in 2-4 passes
of equal size), N not a multiple of 16 (a partial tile) and of the tiles a unit takes (a partial
unit), a row stride wider than K, and two threads.
"""

from __future__ import annotations

import pytest
import torch

from kernels.linear import DenseLinear, _small_gemm_kernel, pack_small_gemm, unpack_small_gemm

MAX_ROWS = 64   # the decode rows the kernel is written for (more rows: more passes of the same code)


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
    wide = torch.randn(MAX_ROWS + 3, k + 8, generator=gen).bfloat16()
    for m in [*range(1, MAX_ROWS + 1), MAX_ROWS + 3]:   # (25 = 13 + 12: a last pass of fewer rows)
        x = wide[:m, :k]                                 # rows of stride k + 8
        want = x.float() @ w.float().T
        got = kernel(x)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert rel(got, want) < 2 ** -7, (m, rel(got, want))


def test_prefill_sized_inputs_match_too(available):
    """Hundreds of rows (a prefill chunk, teacher-forced logits): 19 passes, the last one shorter."""
    w = torch.randn(1000, 96).bfloat16()
    x = torch.randn(300, 96).bfloat16()
    assert rel(_small_gemm_kernel(w)(x), x.float() @ w.float().T) < 2 ** -7


@pytest.mark.parametrize("n", [4096, 576])   # 576: few wide units, split narrower over two threads
def test_two_threads_give_the_same_result(available, n):
    w = torch.randn(n, 64).bfloat16()
    kernel = _small_gemm_kernel(w)
    threads = torch.get_num_threads()
    for m in (1, 5, 16, 40):
        x = torch.randn(m, 64).bfloat16()
        try:
            torch.set_num_threads(1)
            one = kernel(x)
            torch.set_num_threads(2)
            two = kernel(x)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, two), m
        assert rel(one, x.float() @ w.float().T) < 2 ** -7, m


def test_packing_layout_round_trips(available):
    w = torch.arange(20 * 4, dtype=torch.float32).view(20, 4).bfloat16()
    packed = pack_small_gemm(w)
    assert packed.shape == (2, 2, 16, 2)
    assert torch.equal(packed[1, 1, 3], w[19, 2:4]) and torch.equal(packed[1, 0, 4], torch.zeros(2).bfloat16())
    assert torch.equal(unpack_small_gemm(packed, 20), w)


def test_dense_linear_keeps_only_the_chosen_copies(available):
    w = torch.randn(48, 32).bfloat16()
    lin = DenseLinear(w, None)
    assert {"small_gemm", "onednn_packed", "F.linear"} <= set(lin.kernel_choices)
    assert set(lin._packed) | ({"F.linear"} if lin.weight is not None else set()) == set(lin.kernel_names)
    assert torch.equal(lin.dense_weight(), w)
    kept = lin.resident_bytes()
    assert kept <= 2 * (16 * 3) * 32 * 2 + (w.numel() * 2 if lin.weight is not None else 0)
    x = torch.randn(40, 32).bfloat16()
    for name in lin.kernel_choices:   # an unchosen kernel is rebuilt for the call, and not kept
        assert torch.allclose(lin.run_kernel(name, x).float(), x.float() @ w.float().T, rtol=2 ** -7, atol=1e-2)
    assert lin.resident_bytes() == kept
