"""The residual-stream rotation folded into the weights before INT8 quantization
(engine/quantization/rotation.py): its Hadamard constructions, and a rotated model computing the
same logits as the model it came from."""

from __future__ import annotations

import pytest
import torch

from engine.quantization.rotation import _hadamard_orders, hadamard, paley_hadamard, rotate_residual, rotation


@pytest.mark.parametrize("n", [2, 4, 12, 20, 72, 576, 1536, 2560])
def test_hadamard_has_entries_of_one_and_orthogonal_rows(n):
    h = hadamard(n)
    assert h is not None and h.shape == (n, n)
    assert torch.equal(h.abs(), torch.ones(n, n, dtype=torch.float64))
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


def test_orders_prefer_one_paley_block_then_sylvester():
    assert _hadamard_orders(576) == [72, 2, 2, 2]            # the bundled model's width: H_72 x H_8
    assert _hadamard_orders(4096) == [2] * 12
    assert _hadamard_orders(28) is None                       # (H_28 exists, but not from these blocks)


@pytest.mark.parametrize("q", [5, 9, 13, 15])
def test_paley_refuses_what_is_not_a_prime_3_mod_4(q):
    with pytest.raises(ValueError, match="prime q = 3 mod 4"):
        paley_hadamard(q)


@pytest.mark.parametrize("n", [576, 1024, 28])   # randomized Hadamards (Paley x Sylvester, Sylvester); the random orthogonal fallback
def test_rotation_is_orthogonal_applied_as_its_matrix_and_the_same_on_every_call(n):
    rot = rotation(n)
    q = rot.matrix()
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-6)
    x = torch.randn(3, n)
    assert torch.allclose(rot.apply(x).double(), x.double() @ q, atol=1e-4)   # block by block = the matrix
    assert torch.equal(q, rotation(n).matrix())                              # every worker folds the same Q
    assert not torch.equal(q, rotation(n, seed=1).matrix())


def _logits(runner, ids: list[int]) -> torch.Tensor:
    from engine.batch import SeqChunk

    return runner.forward([SeqChunk(ids, 0, list(range(runner.num_blocks)), len(ids))])


def _rotated_runner(monkeypatch, *args, **kwargs):
    """A ModelRunner(*args, **kwargs) whose model is rotated (rotate_residual) just before its
    linear method is applied, as --quantization int8 does, here with the method asked for."""
    import engine.model_runner as model_runner

    apply = model_runner.apply_quantization

    def rotated_then_applied(model, method, **kw):
        rotate_residual(model)
        return apply(model, method, **kw)

    monkeypatch.setattr(model_runner, "apply_quantization", rotated_then_applied)
    return model_runner.ModelRunner(*args, **kwargs)


def test_rotated_model_gives_the_same_logits(model_path, monkeypatch):
    """fp32, no quantization: the rotation folded into the weights leaves every logit of a prompt
    as it was, up to the float32 rounding of the folded products."""
    from engine.model_runner import ModelRunner

    ids = [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 2]
    plain = ModelRunner(model_path, block_size=16, num_blocks=2, dtype=torch.float32, decoder_loop=False)
    expected = _logits(plain, ids)
    rot = _rotated_runner(monkeypatch, model_path, block_size=16, num_blocks=2, dtype=torch.float32,
                          decoder_loop=False)
    m = rot.model
    assert m.lm_head is not None and not torch.equal(m.lm_head.weight, m.model.embed_tokens.weight)   # untied
    assert all(bool((norm.weight == 1).all()) for layer in m.model.layers
               for norm in (layer.input_layernorm, layer.post_attention_layernorm))
    assert not torch.equal(m.model.embed_tokens.weight, plain.model.model.embed_tokens.weight)
    got = _logits(rot, ids)
    assert got.shape == expected.shape == (len(ids), m.config.vocab_size)
    assert (got - expected).abs().max() < 2e-3 * expected.abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("arch, extra", [
    ("LlamaForCausalLM", dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),   # o/down biases
    ("Qwen2ForCausalLM", dict(tie_word_embeddings=True)),                                        # qkv bias, tied
])
def test_rotation_keeps_the_logits_of_biased_and_untied_models(tmp_path, monkeypatch, arch, extra):
    """A tiny random checkpoint in fp32, its norm weights random too (they are folded into the
    linears): rotated, the runtime gives the logits it gave before."""
    from engine.model_runner import ModelRunner
    from tests.test_model_runtime import _tiny_checkpoint

    hf = _tiny_checkpoint(tmp_path, arch, **extra)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 2.0)
    hf.save_pretrained(tmp_path)
    ids = list(range(3, 40))
    plain = ModelRunner(str(tmp_path), block_size=4, num_blocks=16)
    expected = _logits(plain, ids)
    got = _logits(_rotated_runner(monkeypatch, str(tmp_path), block_size=4, num_blocks=16), ids)
    assert (got - expected).abs().max() < 1e-4 * max(1.0, float(expected.abs().max()))


def test_rotation_runs_where_the_weights_are():
    """Every tensor the rotation makes is on the weights' device (meta here: shapes only)."""
    import dataclasses

    from engine.model_config import ModelConfig
    from engine.model_loader import resolve_model
    from engine.models.llama import LlamaForCausalLM

    cfg = dataclasses.replace(ModelConfig.from_pretrained(resolve_model("smollm2-135m-instruct")), num_layers=1,
                              vocab_size=64, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                              head_dim=16)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
        model.fuse_projections()
    rotate_residual(model)
    assert model.lm_head.weight.device.type == "meta" and model.lm_head.weight.shape == (64, 64)


def test_rotating_a_quantized_model_is_refused(model_path):
    from engine.model_runner import ModelRunner

    runner = ModelRunner(model_path, block_size=16, num_blocks=2, dtype=torch.float32, decoder_loop=False)
    before = runner.model.model.embed_tokens.weight.clone()
    with pytest.raises(ValueError, match="rotate before apply_quantization"):
        rotate_residual(runner.model)
    assert torch.equal(runner.model.model.embed_tokens.weight, before)   # nothing folded in
