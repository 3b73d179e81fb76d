"""Linear methods (kernels/linear.py): per-channel scales recover the weight to int8 / E4M3
precision, and every kernel of every method matches the fp32 reference within its bound."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.linear import (DenseLinear, Fp8Linear, Int8Linear, act_group, bucket_index, quantize_fp8_per_channel,
                            quantize_int8_per_channel, quantize_int8_per_group)

torch.manual_seed(0)
N, K = 96, 160


def weight() -> torch.Tensor:
    w = torch.randn(N, K) * 0.05
    w[3] *= 40          # a row with a much larger range: per-channel scales must not let it spoil the others
    w[5] = 0.0          # an all-zero row
    return w


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def dot_err(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> float:
    """RMS over outputs of |y - x w^T - b| / (|x_m| |w_n| + |b_n|): each output's error relative to
    the size of its operands (a plain relative error of one near-cancelling dot product is noise)."""
    scale = x.float().norm(dim=1, keepdim=True) * w.float().norm(dim=1)[None, :] + b.abs()[None, :]
    return float((((y.float() - F.linear(x, w, b)) / scale) ** 2).mean().sqrt())


def test_int8_scales_recover_the_weight_within_half_a_step():
    w = weight()
    q, scale = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (N,) and int(q.abs().max()) <= 127
    err = (q.float() * scale[:, None] - w).abs()
    assert torch.all(err <= scale[:, None] / 2 + 1e-7)
    assert float(err[5].max()) == 0.0


def test_int8_activation_groups_recover_each_group_within_half_a_step():
    x = torch.randn(3, 96)
    x[0, 5] = 500.0          # an outlier: only its group of 32 gets a coarse scale
    x[1, 32:64] = 0.0        # an all-zero group
    q, scale = quantize_int8_per_group(x, 32)
    assert q.dtype == torch.int8 and scale.shape == (3, 3) and int(q.abs().max()) <= 127
    err = (q.float().view(3, 3, 32) * scale[:, :, None] - x.view(3, 3, 32)).abs()
    assert torch.all(err <= scale[:, :, None] / 2 + 1e-6)
    assert abs(float(scale[0, 0]) - 500.0 / 127) < 1e-5 and float(scale[0, 1]) < 0.05 and float(scale[1, 1]) == 1.0
    assert act_group(576) == 32 and act_group(100) == 100      # no group of 32 divides 100: one per token


def test_fp8_scales_recover_the_weight_to_e4m3_precision():
    w = weight()
    q, scale = quantize_fp8_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and float(q.float().abs().max()) <= 448
    v = w / scale[:, None]                                  # in units of the row's scale
    err = (q.float() - v).abs()
    assert torch.all(err <= torch.maximum(v.abs() * 2**-4, torch.full_like(v, 2**-10)) + 1e-6)
    assert torch.allclose(q.float().abs().amax(1)[scale != 1], torch.tensor(448.0))  # the row max maps to 448


# (method, dtype) -> bound on dot_err of every kernel vs the fp32 product, about 3x the worst seen
# over 12 draws (bf16 3e-4, int8 9.6e-4 with the activations quantized per group of 32 too, fp8
# 3.2e-3: E4M3 keeps 3 mantissa bits, int8 about 7).
BOUNDS = {("none", torch.bfloat16): 0.001, ("none", torch.float32): 1e-6,
          ("int8", torch.bfloat16): 0.003, ("int8", torch.float32): 0.003,
          ("fp8", torch.bfloat16): 0.01}


def make(method: str, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype):
    b = None if b is None else b.to(dtype)
    if method == "none":
        return DenseLinear(w.to(dtype), b)
    if method == "int8":
        return Int8Linear(w.to(dtype), b)
    return Fp8Linear(w.to(dtype), b, dtype)


@pytest.mark.parametrize("method,dtype", list(BOUNDS))
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_every_kernel_matches_the_fp32_reference(method, dtype, rows):
    w, b = weight(), torch.randn(N) * 0.1
    lin = make(method, w, b, dtype)
    x = torch.randn(rows, K)
    for name in lin.kernel_choices:
        y = lin.run_kernel(name, x.to(dtype))
        assert y.dtype == dtype and y.shape == (rows, N)
        assert dot_err(y, x, w, b) < BOUNDS[(method, dtype)], (name, dot_err(y, x, w, b))
    y = lin(x.to(dtype).view(rows, 1, K))           # the chosen kernel, through forward, any leading shape
    assert y.shape == (rows, 1, N) and dot_err(y.view(rows, N), x, w, b) < BOUNDS[(method, dtype)]


@pytest.mark.parametrize("method,dtype", list(BOUNDS))
@pytest.mark.parametrize("rows", [1, 16])
def test_forward_float32_is_forward_widened(method, dtype, rows):
    """The LM head's logits (MeasuredLinear.forward_float32): forward(x).float() bit for bit,
    whichever kernel the bucket chose and whether or not it writes fp32 itself, with or without a
    bias, for any leading shape."""
    w, x = weight(), torch.randn(rows, K).to(dtype)
    unbiased = make(method, w, None, dtype)
    for lin in (unbiased, make(method, w, torch.randn(N) * 0.1, dtype)):
        y32 = lin.forward_float32(x)
        assert y32.dtype == torch.float32 and y32.shape == (rows, N)
        assert torch.equal(y32, lin(x).float()), lin.kernel_names
        assert torch.equal(lin.forward_float32(x.view(rows, 1, K)).view(rows, N), y32)
    for name in unbiased.kernel_choices:   # every kernel's float32 variant, chosen or not
        wide = getattr(unbiased._candidates()[name], "float32", None)
        if wide is not None:
            assert torch.equal(wide(x), unbiased.run_kernel(name, x).float()), name


@pytest.mark.parametrize("method,dtype", list(BOUNDS))
def test_no_rows_give_an_empty_output(method, dtype):
    """A batch where no row asks for logits hands the LM head [0, K]; an empty tensor may carry
    any strides (an empty slice of a transposed one): every entry point returns [0, N] in its
    dtype, with or without a bias (the kernels' layout checks once refused some of these); an empty
    x of another width or dtype is refused, as with rows."""
    empties = (torch.empty(0, K), torch.empty(K, 0).t(), torch.empty(K, 5).t()[:0], torch.empty(2, 0, K))
    for lin in (make(method, weight(), torch.randn(N) * 0.1, dtype), make(method, weight(), None, dtype)):
        for x in (e.to(dtype) for e in empties):
            lead = tuple(x.shape[:-1])
            assert lin(x).shape == lead + (N,) and lin(x).dtype == dtype
            y32 = lin.forward_float32(x)
            assert y32.shape == lead + (N,) and y32.dtype == torch.float32
            if x.dim() == 2:
                for name in lin.kernel_choices:
                    assert lin.run_kernel(name, x).shape == (0, N), name
        # what a kernel would refuse with rows is refused without them too (as F.linear refuses it)
        other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
        for bad in (torch.empty(0, K + 1, dtype=dtype), torch.empty(2, 0, 7, dtype=dtype),
                    torch.empty(0, K, dtype=other)):
            for call in (lin, lin.forward_float32):
                with pytest.raises(ValueError, match=f"x must be .*\\[\\.\\.\\., {K}\\], got"):
                    call(bad)


def test_fp8_kernels_compute_the_same_products():
    """_scaled_mm and the bf16 emulation multiply and sum the same E4M3 values."""
    lin = Fp8Linear(weight().bfloat16(), None, torch.bfloat16)
    x = torch.randn(16, K).bfloat16()
    ys = [lin.run_kernel(name, x).float() for name in lin.kernel_choices]
    assert len(ys) == 2 and rel_err(ys[0], ys[1]) < 0.01


def test_fp8_checkpoint_weight_and_scale_are_used_as_given():
    w = weight()
    q, scale = quantize_fp8_per_channel(w)
    from_ckpt = Fp8Linear(q, None, torch.bfloat16, weight_scale=scale[:, None])
    assert torch.equal(from_ckpt.dequantized_weight(), q.float() * scale[:, None])
    with pytest.raises(ValueError, match="weight_scale"):
        Fp8Linear(q, None, torch.bfloat16)


def test_int8_activation_group_per_projection():
    from engine.quantization.apply import int8_act_group

    from engine.quantization.apply import int8_down_group

    layer = "model.layers.7."
    assert [int8_act_group(layer + p, 576) for p in ("self_attn.qkv_proj", "self_attn.q_proj", "self_attn.o_proj",
                                                       "mlp.gate_up_proj", "mlp.up_proj", "mlp.down_proj")] == \
        [576, 576, 576, 576, 576, int8_down_group(576)]                 # down_proj: MX or the default (32)
    assert int8_act_group(layer + "self_attn.qkv_proj", 96) == 96       # one scale per token at any width
    assert int8_act_group(layer + "self_attn.o_proj", 100) == 100


def test_down_proj_takes_mx_activations_where_amx_runs(monkeypatch):
    """int8_down_group: MX where the INT8 kernels run on AMX tiles, groups of 32 elsewhere (the VNNI
    kernels do twice the work on MX); PDSERVE_INT8_DOWN_ACT overrides it, a bad value is named; an
    fp32 model (no AMX kernel for fp32 activations) keeps groups of 32; a width MX cannot take
    (not a multiple of 32) keeps the default."""
    import engine.quantization.apply as apply
    from kernels.linear import MX_GROUP, int8_amx_available

    monkeypatch.delenv(apply.INT8_DOWN_ACT_ENV, raising=False)
    assert apply.int8_down_group(1536) == (MX_GROUP if int8_amx_available() else None)
    assert apply.int8_down_group(1536, torch.float32) is None
    monkeypatch.setenv(apply.INT8_DOWN_ACT_ENV, "mx")
    assert apply.int8_act_group("model.layers.3.mlp.down_proj", 1536) == MX_GROUP
    assert apply.int8_down_group(100) is None
    monkeypatch.setenv(apply.INT8_DOWN_ACT_ENV, "g32")
    assert apply.int8_act_group("model.layers.3.mlp.down_proj", 1536) is None
    monkeypatch.setenv(apply.INT8_DOWN_ACT_ENV, "fp4")
    with pytest.raises(ValueError, match="PDSERVE_INT8_DOWN_ACT='fp4': expected mx or g32"):
        apply.int8_down_group(1536)


def test_every_int8_activation_group_entry_takes_effect(monkeypatch):
    """An INT8_ACT_GROUPS entry for a projection outside the fused ones (down_proj here) is read, not
    ignored (it once was: only the fused projections and o_proj were looked up)."""
    import engine.quantization.apply as apply

    monkeypatch.setitem(apply.INT8_ACT_GROUPS, "mlp.down_proj", 64)
    assert apply.int8_act_group("model.layers.3.mlp.down_proj", 1536) == 64
    assert apply.int8_act_group("model.layers.3.mlp.down_proj", 96) is None   # 64 does not divide 96
    assert apply.int8_act_group("model.layers.3.mlp.gate_proj", 576) == 576


def test_int8_first_rows_compute_the_first_outputs_from_the_same_int8_rows():
    torch.manual_seed(0)
    w = weight().bfloat16()
    x = torch.randn(5, w.shape[1]).bfloat16()
    full = Int8Linear(w, None, decode_only=True, group=w.shape[1])
    cut = full.first_rows(37)
    assert (cut.out_features, cut.group, cut.decode_only) == (37, w.shape[1], True)
    assert torch.equal(cut.forward_float32(x), full.forward_float32(x)[:, :37])
    with pytest.raises(ValueError, match="n must be in"):
        full.first_rows(w.shape[0] + 1)
    with pytest.raises(ValueError, match="quantized must be int8"):
        Int8Linear(w, None, quantized=(torch.zeros(w.shape[0], 3, dtype=torch.int8), torch.ones(w.shape[0])))


def test_bucket_boundaries():
    assert [bucket_index(m) for m in (1, 4, 5, 16, 128, 129, 512)] == [0, 0, 1, 1, 1, 2, 2]


@pytest.mark.model
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_model_predicts_like_the_bf16_model(model_path, tokenizer, shared_data_dir, method):
    from engine.batch import SeqChunk
    from engine.model_runner import ModelRunner
    from kernels.linear import MeasuredLinear

    ids = tokenizer((shared_data_dir / "wikitext-2-raw-test.txt").read_text()[:400])["input_ids"][:64]
    chunk = [SeqChunk(ids, 0, list(range(4)), len(ids))]
    base = ModelRunner(model_path, num_blocks=4, dtype=torch.bfloat16).forward(chunk)
    runner = ModelRunner(model_path, num_blocks=4, dtype=torch.bfloat16, quantization=method)
    linears = [m for m in runner.model.model.layers.modules() if isinstance(m, MeasuredLinear)]
    # qkv_proj, o_proj, gate_up_proj, down_proj (Q/K/V and gate/up are fused at load)
    assert len(linears) == 4 * runner.model_config.num_layers
    assert base.shape and runner.weights_descriptor.startswith(method)
    if method == "fp8":   # down_proj and the last layer stay in the model dtype (apply.FP8_DENSE_*)
        n = runner.model_config.num_layers
        assert sum(m.method == "none" for m in linears) == (n - 1) + 4 and \
            all(m.method in ("fp8", "none") for m in linears)
    else:
        assert all(m.method == method for m in linears)
        groups = {name: m.group for name, m in runner.model.model.layers[0].named_modules() if isinstance(m, MeasuredLinear)}
        from engine.quantization.apply import int8_down_group
        from kernels.linear import MX_GROUP, int8_amx_available

        # apply.INT8_ACT_GROUPS: one scale per token but for down_proj (MX where AMX runs, else 32)
        assert int8_down_group(1536) == (MX_GROUP if int8_amx_available() else None)
        assert groups == {"self_attn.qkv_proj": 576, "self_attn.o_proj": 576, "mlp.gate_up_proj": 576,
                          "mlp.down_proj": MX_GROUP if int8_amx_available() else 32}
        # (the KV compat key's weights field: engine/quantization/apply.py weights_descriptor)
        assert runner.weights_descriptor == ("int8/down:mx" if int8_amx_available() else "int8/down:g32")
        assert runner.model.head_method.group == 576   # (the residual stream rotated: engine/quantization/rotation.py)
        layers = runner.model.model.layers   # rotated (rotation.py): every norm weight folded into the linears
        assert all(bool((n.weight == 1).all()) for l in layers for n in (l.input_layernorm, l.post_attention_layernorm))
        assert runner.model.lm_head is None   # the rotated head lives in head_method alone
    logits = runner.forward(chunk)
    agree = float((logits.argmax(-1) == base.argmax(-1)).float().mean())
    assert agree > 0.85 and rel_err(logits, base) < 0.25, (agree, rel_err(logits, base))
