"""MX activations of the INT8 kernels (kernels.linear.MX_GROUP; kernels/csrc/int8_activations.h
quantize_row_mx): one scale per token, a power-of-two sub-scale per block of 32 channels, carried as
two int8 digit rows (hi, lo) so a product is two per-token products over the same weight.

The kernels' quantizer (its AVX-512 form and the portable one of the AVX2 kernel) equals the torch
reference (quantize_int8_mx) bit for bit, including all-zero, vanishingly small and poisoned rows;
the reference's digits rebuild x to within half a step of each block's scale, that scale being the
finest power of two (down to 2^-7 of the token's) under which the block's values stay within 127;
every kernel that takes MX (w8a8_vnni, w8a8_vnni_large, w8a8_amx, w8a8_avx2) gives the same bf16
outputs bit for bit at every row count it specializes, within one bf16 ulp of the fp32 product of
the reference's digits; a poisoned row is NaN in every kernel and leaves the other rows untouched.
A kernel is skipped, with the reason, only where this CPU cannot run it.
"""

from __future__ import annotations

import pytest
import torch

from engine.platform import cpu_flags
from kernels.linear import MX_GROUP, Int8Linear, quantize_int8_mx

KERNELS = ("w8a8_vnni", "w8a8_vnni_large", "w8a8_amx", "w8a8_avx2")


def activations(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """bf16 [m, k]: channels of very different scales (blocks 2^-9 .. 1 of the largest), an outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(1, k, generator=gen) ** 6 * 4
    x[:, min(7, k - 1)] *= 60
    return x.bfloat16()


@pytest.fixture(scope="module")
def vnni() -> None:
    """The VNNI kernels (and the quantizer op) run here, else skip with the reason; never skip on a
    CPU that has the ISA."""
    if "w8a8_vnni" not in Int8Linear(torch.zeros(16, 32, dtype=torch.bfloat16), None, group=MX_GROUP)._candidates():
        assert not {"avx512_vnni", "avx512_bf16"} <= cpu_flags(), "AVX512-BF16/VNNI CPU but the int8 kernel did not build"
        pytest.skip("no AVX512-BF16 + AVX512-VNNI on this CPU")


@pytest.fixture(scope="module", params=[200, 1000], ids=["n200", "n1000"])
def mx_linear(request, vnni) -> Int8Linear:
    """N = 200: 13 tiles (a 1-tile unit at 1-4 rows on 2 threads); 1000: 63 tiles, the last half
    empty, 4-tile units and a partial last one."""
    gen = torch.Generator().manual_seed(1)
    return Int8Linear((torch.randn(request.param, 1536, generator=gen) * 0.05).bfloat16(), None, group=MX_GROUP)


def special_rows(k: int) -> torch.Tensor:
    """An all-zero row, a vanishingly small one (amax below 127 x FLT_MIN: scale 1, digits 0), one
    whose blocks span more than 2^7 (the shift clamps at 7), exact powers of two (ties), and a row
    at exactly 127 x FLT_MIN (bf16 0x03FE) over a block of the largest subnormal (0x007F), exactly
    2^7 below it (shift 7: the bits' mantissa rule once gave 6 there)."""
    rows = torch.zeros(5, k)
    rows[1] = 1e-38
    rows[2, :32] = 1000.
    rows[2, 32:64] = 1e-3
    rows[2, 64:] = torch.linspace(-1, 1, k - 64)
    rows[3] = 2. ** torch.arange(k).remainder(20).float().sub(10)
    rows = rows.bfloat16()
    edge = torch.zeros(k, dtype=torch.int16)
    edge[0], edge[32] = 0x03FE, 0x007F
    rows[4] = edge.view(torch.bfloat16)
    return rows


@pytest.mark.parametrize("portable", [False, True], ids=["avx512", "portable"])
def test_the_kernels_quantizer_equals_the_torch_reference(vnni, portable):
    x = torch.cat([activations(13, 1536), special_rows(1536)])
    hi, lo, sx = torch.ops.pdserve_int8.quantize_mx(x, portable)
    want_hi, want_lo, want_sx = quantize_int8_mx(x)
    assert torch.equal(hi, want_hi) and torch.equal(lo, want_lo) and torch.equal(sx, want_sx)
    poisoned = x.clone()
    poisoned[0, 100], poisoned[1, 3] = float("nan"), float("inf")
    hi, lo, sx = torch.ops.pdserve_int8.quantize_mx(poisoned, portable)
    assert sx[:2].isnan().all() and not (hi[:2].any() or lo[:2].any())   # a poisoned row: NaN scale, digits 0
    assert torch.equal(sx[2:], want_sx[2:]) and torch.equal(hi[2:], want_hi[2:])


def test_the_digits_rebuild_x_to_half_a_step_of_the_finest_safe_block_scale():
    x = torch.cat([activations(16, 1536, seed=3), special_rows(1536)]).float()
    hi, lo, sx = quantize_int8_mx(x.bfloat16())
    assert int(hi.min()) >= -127 and int(hi.max()) <= 127 and int(lo.min()) >= 0 and int(lo.max()) <= 127
    blocks = x.view(x.shape[0], -1, 32)
    bmax, amax = blocks.abs().amax(2), x.abs().amax(1, keepdim=True)
    v = hi.view_as(blocks).int() * 128 + lo.view_as(blocks).int()      # x / (sx 2^-7), per element
    live = amax[:, 0] >= 127 * torch.finfo(torch.float32).tiny
    # e: the block's shift, read back from the digits' spacing is not possible, so recompute it and
    # check it is the largest safe one: bmax 2^e <= amax < bmax 2^(e+1) unless e is 7
    e = torch.zeros_like(bmax, dtype=torch.int64)
    for j in range(1, 8):
        e += (bmax * 2. ** j <= amax).long()
    assert bool(((bmax * 2. ** (e + 1) > amax) | (e == 7) | (bmax == 0)).all())
    step = (sx[:, None] * 2. ** -e.double())[:, :, None]                  # the block's scale
    err = (v.double() * sx[:, None, None].double() / 128 - blocks.double()).abs()
    assert bool((err[live] <= step[live] / 2 * (1 + 1e-5)).all())   # (ties: x * (1 / sx) rounds in fp32)
    assert bool((v.view(x.shape[0], -1)[~live] == 0).all())            # below the least amax: zeros
    # every value is a multiple of its block's step in units of sx 2^-7: lo's low bits are zero
    assert bool(((v % (2 ** (7 - e)).unsqueeze(-1).int()) == 0).all())


@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 16, 17, 33, 100])
def test_every_kernel_gives_the_same_bits_and_the_product_of_the_digits(mx_linear, m):
    x = activations(m, 1536, seed=m)
    hi, lo, sx = quantize_int8_mx(x)
    xd = sx[:, None].double() * (hi.double() + lo.double() / 128)
    want = (xd @ mx_linear.dequantized_weight().double().T).float()
    ran = {}
    for name in KERNELS:
        if name in mx_linear._candidates():
            ran[name] = mx_linear.run_kernel(name, x)
    assert {"w8a8_vnni", "w8a8_vnni_large"} <= set(ran)
    assert ("w8a8_amx" in ran) == bool({"amx_int8", "amx_tile"} <= cpu_flags())
    for name, y in ran.items():
        assert torch.equal(y, ran["w8a8_vnni"]), name
    y = ran["w8a8_vnni"].float()
    assert float((y - want).abs().max()) <= 2 ** -7 * float(want.abs().max())   # one bf16 ulp of the largest
    assert float((mx_linear.run_kernel("dequant_dense", x).float() - want).abs().max()) <= 2 ** -6 * float(want.abs().max())
    assert torch.equal(mx_linear.forward_float32(x), mx_linear.forward(x).float())


def test_a_poisoned_row_is_nan_in_every_kernel_and_the_others_untouched(mx_linear):
    x = activations(16, 1536, seed=9)
    bad = x.clone()
    bad[5, 1000] = float("nan")
    for name in KERNELS:
        if name not in mx_linear._candidates():
            continue
        clean, y = mx_linear.run_kernel(name, x), mx_linear.run_kernel(name, bad)
        assert y[5].isnan().all(), name
        assert torch.equal(torch.cat([y[:5], y[6:]]), torch.cat([clean[:5], clean[6:]])), name


def test_mx_needs_k_a_multiple_of_32():
    with pytest.raises(ValueError, match="MX activations .* multiple of 32"):
        Int8Linear(torch.zeros(16, 48).bfloat16(), None, group=MX_GROUP)


@pytest.mark.parametrize("k", [96, 608])
def test_widths_not_a_multiple_of_64_give_the_same_bits_in_every_kernel(vnni, k):
    """K = 96 and 608: each digit row a whole number of 32-channel blocks but not of AMX's 64-byte
    tile depth (its tiles then take 32 bytes of k a product); N = 70, a partial tile."""
    gen = torch.Generator().manual_seed(k)
    lin = Int8Linear((torch.randn(70, k, generator=gen) * 0.05).bfloat16(), None, group=MX_GROUP)
    for m in (1, 5, 16, 40):
        x = activations(m, k, seed=m)
        ran = {name: lin.run_kernel(name, x) for name in KERNELS if name in lin._candidates()}
        assert len(ran) >= 2 and all(torch.equal(y, ran["w8a8_vnni"]) for y in ran.values()), (k, m)


def test_special_rows_give_the_same_bits_in_every_kernel(mx_linear):
    """The quantizer's edge rows (special_rows) through every kernel: the VNNI and AMX kernels
    quantize with the AVX-512 quantizer, the AVX2 one with the portable one. Outputs below FLT_MIN
    (the edge row's, ~1e-38): the AVX-512 kernels' fp32 -> bf16 rounding (VCVTNEPS2BF16) flushes
    them to zero, where the AVX2 kernel keeps the subnormal."""
    x = special_rows(1536)
    ran = {name: mx_linear.run_kernel(name, x) for name in KERNELS if name in mx_linear._candidates()}
    ref = ran["w8a8_vnni"]
    for name, y in ran.items():
        if name == "w8a8_avx2":
            tiny = y.float().abs() < torch.finfo(torch.float32).tiny
            assert torch.equal(y[~tiny], ref[~tiny]) and not ref[tiny].float().any(), name
        else:
            assert torch.equal(y, ref), name
