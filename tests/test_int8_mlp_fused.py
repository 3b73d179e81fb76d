"""The INT8 MLP in one op on AMX (``torch.ops.pdserve_int8_amx.mlp_w8a8_gemm``,
kernels/csrc/int8_gemm_amx.cpp): down_proj(silu(gate) * up) of x gives, bit for bit, what the AMX
INT8 gate/up linear and then ``silu_mul_w8a8_gemm`` give, both where it runs as one parallel region
(M <= 16, gate/up at one scale per token, down_proj's MX activations, I a multiple of 64) and where
it falls back to the two ops; whatever the thread count; a poisoned row stays in its row; bad
arguments are refused with the reason. (The decoder loop that calls it equals the Python loop bit
for bit: test_decoder_loop.py.) Skipped, with the reason, only on a CPU without AMX-INT8."""

from __future__ import annotations

import pytest
import torch

from kernels.linear import MX_GROUP, Int8Linear


def mlp(h: int, inter: int, n: int, seed: int, gu_group: int | None = None, down_group: int = MX_GROUP):
    """(gate_up, down) Int8Linears with the spread of the model's weights; gate_up at one scale
    per token unless gu_group says otherwise."""
    gen = torch.Generator().manual_seed(seed)
    gu = Int8Linear((torch.randn(2 * inter, h, generator=gen) * 0.08).bfloat16(), None, group=gu_group or h)
    down = Int8Linear((torch.randn(n, inter, generator=gen) * 0.05).bfloat16(), None, group=down_group)
    return gu, down


def inputs(m: int, h: int, seed: int) -> torch.Tensor:
    """bf16 [m, h], a few channels 30x the rest (gate and up then take the SiLU's both branches)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=gen)
    x[:, 3] *= 30
    return x.bfloat16()


def apart(gu: Int8Linear, down: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    gate_up = gu.run_kernel("w8a8_amx", x)
    return torch.ops.pdserve_int8_amx.silu_mul_w8a8_gemm(gate_up, down.qweight, down.weight_scale, down.out_features,
                                                          down.group)


def fused(gu: Int8Linear, down: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.pdserve_int8_amx.mlp_w8a8_gemm(x, gu.qweight, gu.weight_scale, gu.out_features, gu.group,
                                                     down.qweight, down.weight_scale, down.out_features, down.group)


@pytest.mark.parametrize("m", [1, 4, 5, 7, 16, 17, 32])
def test_the_mlp_op_equals_gate_up_then_the_fused_down(amx_int8, m):
    """SmolLM2-135M's shapes (576 -> 2 x 1536 -> 576): one region up to 16 rows, the two ops beyond."""
    gu, down = mlp(576, 1536, 576, seed=m)
    x = inputs(m, 576, seed=m)
    want = apart(gu, down, x)
    assert want.abs().max() > 0 and want.isfinite().all()
    assert torch.equal(fused(gu, down, x), want)
    strided = torch.cat([x, x[:, :64]], dim=1)[:, :576]   # rows 640 elements apart
    assert torch.equal(fused(gu, down, strided), want)


@pytest.mark.parametrize("h,inter,n", [(64, 64, 16), (96, 192, 40), (128, 320, 200), (64, 96, 32)],
                         ids=["one-pair", "ragged-down", "odd-pairs", "inter-not-64"])
def test_other_shapes(amx_int8, h, inter, n):
    """One pair of units; n not a multiple of 16 (down_proj's last tile partial); an odd number of
    pairs for two threads (one takes more); I not a multiple of 64 (the two ops)."""
    gu, down = mlp(h, inter, n, seed=h + inter)
    for m in (1, 9, 16):
        x = inputs(m, h, seed=m)
        assert torch.equal(fused(gu, down, x), apart(gu, down, x))


def test_other_activation_groups_take_the_two_ops(amx_int8):
    gu, down = mlp(128, 256, 64, seed=5, gu_group=32, down_group=32)
    x = inputs(16, 128, seed=5)
    assert torch.equal(fused(gu, down, x), apart(gu, down, x))


@pytest.mark.parametrize("threads", [1, 3])
def test_any_thread_count(amx_int8, threads):
    gu, down = mlp(576, 1536, 576, seed=11)
    x = inputs(16, 576, seed=11)
    want = apart(gu, down, x)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(fused(gu, down, x), want)
    finally:
        torch.set_num_threads(before)


def test_a_poisoned_row_stays_in_its_row(amx_int8):
    gu, down = mlp(128, 256, 64, seed=3)
    x = inputs(16, 128, seed=3)
    x[3, 10] = float("inf")   # gate/up of row 3 inf or NaN, so its SiLU product is poisoned
    y, want = fused(gu, down, x), apart(gu, down, x)
    assert y[3].isnan().all()
    rest = [r for r in range(16) if r != 3]
    assert torch.equal(y[rest], want[rest]) and y[rest].isfinite().all()


def test_bad_arguments_are_refused_with_the_reason(amx_int8):
    gu, down = mlp(64, 128, 32, seed=1)
    other_gu, _ = mlp(64, 96, 32, seed=1)
    with pytest.raises(RuntimeError, match=r"x must be bf16 \[M, K\]"):
        fused(gu, down, inputs(4, 64, 0).float())
    with pytest.raises(RuntimeError, match=r"x has 96 columns, the packed weight 64"):
        fused(gu, down, inputs(4, 96, 0))
    with pytest.raises(RuntimeError, match=r"gate_up has 192 outputs; down_proj's packed weight takes I = 128 .* 2I"):
        fused(other_gu, down, inputs(4, 64, 0))


def ops_called(f) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        f()
    return {e.key: e.count for e in prof.key_averages()}


@pytest.mark.parametrize("m,one_region", [(1, True), (16, True), (17, False)])
def test_one_region_where_the_shapes_allow(amx_int8, m, one_region):
    """Up to 16 rows the op runs as one region (no nested linear); beyond, as the two ops (both
    seen by the profiler)."""
    gu, down = mlp(128, 256, 64, seed=m)
    x = inputs(m, 128, seed=m)
    calls = ops_called(lambda: fused(gu, down, x))
    assert calls["pdserve_int8_amx::mlp_w8a8_gemm"] == 1
    for op in ("pdserve_int8_amx::w8a8_gemm", "pdserve_int8_amx::silu_mul_w8a8_gemm"):
        assert calls.get(op, 0) == (0 if one_region else 1), op
