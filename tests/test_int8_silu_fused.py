"""down_proj's SiLU-and-multiply fused into its INT8 quantization on AMX
(``torch.ops.pdserve_int8_amx.silu_mul_w8a8_gemm``, kernels/csrc/int8_gemm_amx.cpp): from the fused
gate/up output [M, 2K] it gives, bit for bit, what ``pdserve_ops.silu_mul`` and then the AMX INT8
linear give, at every row count the kernel specializes (1-4, 5-16, ragged passes, 32-row blocks),
for MX activations and groups of 32, from strided and column-major views; bad arguments are refused with the
reason. (The decoder loop that calls it equals the Python loop bit for bit: test_decoder_loop.py.)
Skipped, with the reason, only on a CPU without AMX-INT8."""

from __future__ import annotations

import pytest
import torch

from kernels.linear import MX_GROUP, Int8Linear


def gate_up(m: int, k: int, seed: int) -> torch.Tensor:
    """bf16 [m, 2k] with the spread of real gate/up outputs (gate in -8..8 with outliers, so the
    SiLU takes both branches and its large-negative tail)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * k, generator=gen) * 2.5
    x[:, 5] = -90.
    x[:, k + 7] *= 40
    return x.bfloat16()


def apart(layer: Int8Linear, gu: torch.Tensor) -> torch.Tensor:
    act = torch.empty(gu.shape[0], gu.shape[1] // 2, dtype=gu.dtype)
    torch.ops.pdserve_ops.silu_mul(act, gu)
    return layer.run_kernel("w8a8_amx", act)


def fused(layer: Int8Linear, gu: torch.Tensor) -> torch.Tensor:
    return torch.ops.pdserve_int8_amx.silu_mul_w8a8_gemm(gu, layer.qweight, layer.weight_scale, layer.out_features,
                                                          layer.group)


@pytest.mark.parametrize("group", [MX_GROUP, 32], ids=["mx", "g32"])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 16, 17, 31, 32, 100])
def test_the_fused_op_equals_silu_mul_then_the_linear(amx_int8, group, m):
    gen = torch.Generator().manual_seed(m)
    layer = Int8Linear((torch.randn(200, 1536, generator=gen) * 0.05).bfloat16(), None, group=group)
    gu = gate_up(m, 1536, seed=m)
    want = apart(layer, gu)
    assert want.abs().max() > 0
    assert torch.equal(fused(layer, gu), want)
    wide = torch.cat([gu, gu[:, :64]], dim=1)[:, :3072]   # rows 3136 elements apart
    assert wide.stride(0) == 3136 and torch.equal(fused(layer, wide), want)
    columns = gu.t().contiguous().t()                      # column-major: copied, as the linear copies x
    assert (columns.stride(1) != 1) == (m > 1) and torch.equal(fused(layer, columns), want)


def test_a_poisoned_row_stays_in_its_row(amx_int8):
    layer = Int8Linear((torch.randn(64, 96) * 0.05).bfloat16(), None, group=MX_GROUP)
    gu = gate_up(16, 96, seed=2)
    gu[3, 10] = float("nan")
    y = fused(layer, gu)
    assert y[3].isnan().all() and torch.equal(torch.cat([y[:3], y[4:]]), torch.cat([apart(layer, gu)[:3], apart(layer, gu)[4:]]))


def test_bad_arguments_are_refused_with_the_reason(amx_int8):
    layer = Int8Linear((torch.randn(64, 96) * 0.05).bfloat16(), None, group=MX_GROUP)
    with pytest.raises(RuntimeError, match=r"gate_up must be bf16 \[M, 2K\]"):
        fused(layer, gate_up(4, 96, 0).float())
    with pytest.raises(RuntimeError, match=r"gate_up has 191 columns; .* K = 96 .* must be \[M, 192\]"):
        fused(layer, gate_up(4, 96, 0)[:, :191])
    with pytest.raises(RuntimeError, match=r"gate_up has 96 columns; .* not silu\(gate\) \* up"):
        fused(layer, gate_up(4, 96, 0)[:, :96])   # the SiLU product passed where gate | up belongs
    with pytest.raises(RuntimeError, match=r"gate_up has 256 columns"):
        fused(layer, gate_up(4, 128, 0))
