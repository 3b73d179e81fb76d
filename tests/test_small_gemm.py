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
    for m in (1, 5, 16, 40):
        x = torch.randn(m, 64).bfloat16()
        one, two = _on_one_and_two_threads(kernel, x)
        assert torch.equal(one, two), m
        assert rel(one, x.float() @ w.float().T) < 2 ** -7, m


def _on_one_and_two_threads(kernel, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x)
        torch.set_num_threads(2)
        return one, kernel(x)
    finally:
        torch.set_num_threads(threads)


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


# -- the AMX-BF16 kernel (kernels/csrc/small_gemm_amx.cpp) on the same packed weight ----------------
@pytest.fixture(scope="module")
def amx(available) -> None:
    from engine.platform import cpu_flags

    if not torch.ops.pdserve_amx.available():
        # Only a CPU (or an OS) without AMX-BF16 has no kernel; never skip on one that has it.
        assert not {"amx_bf16", "amx_tile"} <= cpu_flags(), "AMX-BF16 CPU but the AMX kernel is not available"
        pytest.skip("no AMX-BF16 on this CPU")


def _amx(w: torch.Tensor):
    from kernels.linear import _amx_gemm_kernel

    return _amx_gemm_kernel(pack_small_gemm(w), w.shape)


@pytest.mark.parametrize("n,k", [(200, 96), (16, 32), (1000, 576), (72, 1536)])
def test_amx_every_row_count_matches_the_fp32_product(amx, n, k):
    """1-16 rows: one pass; 17-130: passes of equal size, ragged counts through the zero-padded copy;
    N 200 and 72: a partial 16-column tile and a partial 4-tile unit."""
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=gen).bfloat16()
    kernel = _amx(w)
    wide = torch.randn(130, k + 32, generator=gen).bfloat16()
    for m in [*range(1, 34), 47, 64, 100, 128, 130]:
        x = wide[:m, :k]                                 # rows of stride k + 32
        got = kernel(x)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert rel(got, x.float() @ w.float().T) < 2 ** -7, (m, rel(got, x.float() @ w.float().T))


def test_amx_two_threads_give_the_same_result(amx):
    w = torch.randn(3072, 576).bfloat16()
    kernel = _amx(w)
    for m in (5, 16, 40):
        one, two = _on_one_and_two_threads(kernel, torch.randn(m, 576).bfloat16())
        assert torch.equal(one, two), m


def test_amx_float32_out_is_the_bf16_output_widened(amx):
    """The AMX kernel's float32 variant (the LM head's logits at 5-128 rows): its bf16 output's
    values widened as they are stored, bit for bit, partial tiles and ragged passes included."""
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(1000, 576, generator=gen).bfloat16()
    kernel = _amx(w)
    for m in (1, 5, 16, 17, 40, 130):
        x = torch.randn(m, 576, generator=gen).bfloat16()
        got = kernel.float32(x)
        assert got.dtype == torch.float32 and got.shape == (m, 1000)
        assert torch.equal(got, kernel(x).float()), m


def test_amx_applies_only_to_a_k_of_whole_tiles(amx):
    """K must be a multiple of 32 (one tile's k depth): the kernel is not offered otherwise, and the
    op refuses such a weight with a message saying so."""
    w = torch.randn(64, 48).bfloat16()
    assert _amx(w) is None
    out = torch.empty(4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.pdserve_amx.small_gemm_bf16_amx(out, torch.randn(4, 48).bfloat16(), pack_small_gemm(w), 64)


def test_dense_linear_shares_one_packed_copy_between_small_gemm_and_amx(amx):
    w = torch.randn(96, 64).bfloat16()
    lin = DenseLinear(w, None)
    assert "amx_gemm" in lin.kernel_choices
    x = torch.randn(16, 64).bfloat16()
    assert rel(lin.run_kernel("amx_gemm", x), x.float() @ w.float().T) < 2 ** -7
    lin._candidates(w)   # records every kernel's weight copy in lin._packed, whatever the timing chose
    assert lin._packed["small_gemm"] is lin._packed["amx_gemm"]
    plain = 0 if lin.weight is None else w.numel() * 2
    assert lin.resident_bytes() == plain + sum(t.numel() * t.element_size() for name, t in lin._packed.items()
                                               if name != "amx_gemm")   # the shared copy counted once


def test_float32_out_is_the_bf16_output_widened(available):
    """out float32 (the LM head's logits, MeasuredLinear.forward_float32): the bf16 output's values,
    widened as they are stored, bit for bit; an out of another dtype, or whose rows overlap, is
    refused naming what is wrong."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(1000, 576, generator=gen).bfloat16()
    kernel = _small_gemm_kernel(w)
    for m in (1, 5, 16, 17, 40):
        x = torch.randn(m, 576, generator=gen).bfloat16()
        got = kernel.float32(x)
        assert got.dtype == torch.float32 and got.shape == (m, 1000)
        assert torch.equal(got, kernel(x).float()), m
    op = torch.ops.pdserve_gemm.small_gemm_bf16
    with pytest.raises(RuntimeError, match="out must be bf16 or float32"):
        op(torch.empty(1, 1000, dtype=torch.float16), x[:1], kernel.packed, 1000)
    with pytest.raises(RuntimeError, match="out's rows must not overlap"):
        op(torch.zeros(1, 1000).expand(4, 1000), x[:4], kernel.packed, 1000)
