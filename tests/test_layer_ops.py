"""The decoder's C++ layer ops (kernels/layer_ops.py, kernels/csrc/layer_ops.cpp) against the torch
reference ops, and the whole model forward with each.

Tolerances: fp32 1e-5 relative to the largest output (orders of summation differ). RMSNorm rounds
where the reference rounds, so in bf16/fp16 it may differ by one ulp of the output (the sum's order
moves a value across a rounding boundary): 2^-7 / 2^-10 relative. RoPE and SiLU-mul round once
where the reference rounds two or three times: within two ulps of the output, 2^-6 / 2^-9.
Sizes: 576 (the bundled model's hidden, vector path) and 40 (not a multiple of 16: scalar path).
The whole model runs these ops wherever the kernel library builds (ModelRunner's layer_ops
"auto"): test_model_runtime.py checks it against transformers in fp32, test_bf16.py in bf16.
"""

from __future__ import annotations

import pytest
import torch

from kernels.layer_ops import CppLayerOps, TorchLayerOps, get_layer_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ONE_ULP = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


@pytest.fixture(scope="module")
def cpp() -> CppLayerOps:
    ops = get_layer_ops("cpu")
    assert isinstance(ops, CppLayerOps)
    return ops


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 40])
def test_rms_norm_and_add_rms_norm_match_the_reference(cpp, dtype, hidden):
    ref = TorchLayerOps()
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, hidden, generator=gen) * 3).to(dtype)
    res = torch.randn(7, hidden, generator=gen).to(dtype)
    w = (1 + torch.randn(hidden, generator=gen) / 4).to(dtype)
    assert rel(cpp.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5)) <= ONE_ULP[dtype]
    r_cpp, r_ref = res.clone(), res.clone()
    got, want = cpp.add_rms_norm(x, r_cpp, w, 1e-5), ref.add_rms_norm(x, r_ref, w, 1e-5)
    assert torch.equal(r_cpp, r_ref), "the residual add rounds as the reference's"
    assert rel(got, want) <= ONE_ULP[dtype]
    # A strided view (rows of a wider tensor) is read in place.
    wide = torch.randn(7, 2 * hidden, generator=gen).to(dtype)
    assert rel(cpp.rms_norm(wide[:, :hidden], w, 1e-5), ref.rms_norm(wide[:, :hidden], w, 1e-5)) <= ONE_ULP[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 10)])
def test_rope_split_matches_the_reference(cpp, dtype, heads, kv_heads, head_dim):
    ref = TorchLayerOps()
    gen = torch.Generator().manual_seed(1)
    t = 5
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 17, 300, 4000])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    # The reference with fp32 tables: what the C++ op computes, rounded once instead of at every op.
    cos, sin = ref.rope_tables(positions, inv_freq, torch.float32)
    want = ref.rope_split(qkv.float(), cos, sin, heads, kv_heads, head_dim)
    got = cpp.rope_split(qkv, *cpp.rope_tables(positions, inv_freq, dtype), heads, kv_heads, head_dim)
    for g, w, name in zip(got, want, "qkv"):
        assert g.dtype == dtype and g.is_contiguous() and g.shape == w.shape, name
        assert rel(g, w) <= ONE_ULP[dtype], name
    assert torch.equal(got[2], want[2].to(dtype)), "v is copied as it is"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 24])
def test_silu_mul_matches_the_reference(cpp, dtype, inter):
    gen = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(6, 2 * inter, generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])        # the exp's clamp and zero
    want = TorchLayerOps().silu_mul(gate_up.float())
    assert rel(cpp.silu_mul(gate_up), want) <= 2 * ONE_ULP[dtype]


def test_bad_input_is_refused(cpp):
    x = torch.randn(3, 16)
    with pytest.raises(RuntimeError, match="weight must be"):
        cpp.rms_norm(x, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        cpp.rms_norm(x.double(), torch.ones(16, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="qkv must be"):
        cpp.rope_split(torch.randn(3, 10), torch.zeros(3, 2), torch.zeros(3, 2), 1, 1, 4)
    with pytest.raises(ValueError, match="unknown layer ops"):
        get_layer_ops("fast")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [49152, 1000, 7])   # the bundled vocabulary, a vector tail, no vector pass
def test_greedy_argmax_is_torch_argmax(cpp, dtype, vocab):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, vocab, generator=gen) * 4).to(dtype)
    logits[1] = 0.5                                          # a row of ties: the first index
    logits[2] = float("-inf")                                # nothing finite: index 0
    logits[3, [vocab // 3, vocab - 1]] = 1e4                 # a tie for the maximum, far apart
    logits[4, vocab // 2] = float("nan")                     # a NaN wins, as in torch
    logits[5, [vocab - 1, 0]] = float("nan")                 # the first NaN
    logits[6, vocab - 1] = 1e4                               # the maximum in the last (tail) position
    logits[7, :] = -1e4
    logits[7, 0] = float("inf")
    want = logits.argmax(dim=-1)
    got = torch.empty(9, dtype=torch.int64)
    torch.ops.pdserve_ops.argmax_rows(got, logits)
    assert got.tolist() == want.tolist()
    from kernels.layer_ops import greedy_argmax

    assert greedy_argmax(logits).tolist() == want.tolist()
    assert greedy_argmax(logits[:, :-1]).tolist() == logits[:, :-1].argmax(-1).tolist()   # strided rows


def test_argmax_rows_refuses_bad_layouts(cpp):
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.pdserve_ops.argmax_rows(torch.empty(2, dtype=torch.int32), torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.pdserve_ops.argmax_rows(torch.empty(8, dtype=torch.int64), torch.zeros(2, 8).t())
