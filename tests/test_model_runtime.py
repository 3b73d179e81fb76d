"""The model runtime against transformers on the same weights: logits, paging, chunking, hooks.

Real model (the bundled SmolLM2-135M-Instruct), plus tiny random Mistral/Qwen2 checkpoints for
the architecture variants (untied head, QKV bias, llama3 RoPE scaling).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.batch import SeqChunk
from engine.model_loader import load_tokenizer
from engine.model_runner import ModelRunner

pytestmark = pytest.mark.model
TOL = 1e-3


@pytest.fixture(scope="module")
def runner(model_path) -> ModelRunner:
    torch.set_num_threads(1)  # the test machine's 2 cores are shared: more threads only spin
    return ModelRunner(model_path, block_size=16, num_blocks=128)


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def text_tokens(model_path, shared_data_dir) -> list[int]:
    tok = load_tokenizer(model_path)
    text = (shared_data_dir / "wikitext-2-raw-test.txt").read_text()[:20000]
    return tok(text)["input_ids"]


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        x = torch.tensor([ids])
        return hf_model(x, attention_mask=torch.ones_like(x)).logits[0].float()


def blocks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.parametrize("length", [1, 17, 300])
def test_logits_match_transformers(runner, hf_model, text_tokens, length):
    ids = text_tokens[:length]
    ours = runner.forward([SeqChunk(ids, 0, blocks(0, -(-length // 16)), num_logits=length)])
    assert ours.shape == (length, runner.model_config.vocab_size) and ours.dtype == torch.float32
    assert (ours - hf_logits(hf_model, ids)).abs().max().item() < TOL


def test_mixed_batch_chunked_prefill_and_decode(runner, hf_model, text_tokens):
    """Prefill chunks, a decode token and a 3-token verification run in one forward."""
    a, b = text_tokens[:40], text_tokens[100:125]
    ref_a, ref_b = hf_logits(hf_model, a), hf_logits(hf_model, b)
    # a: 0..29 first (no logits), b: 0..23 first; then a 30..39 + b's 24th token in one forward.
    first = runner.forward([SeqChunk(a[:30], 0, [7, 3, 9], num_logits=0),
                            SeqChunk(b[:24], 0, [20, 11], num_logits=3)])
    assert first.shape[0] == 3
    assert (first - ref_b[21:24]).abs().max().item() < TOL
    second = runner.forward([SeqChunk(a[30:], 30, [7, 3, 9], num_logits=10),
                             SeqChunk(b[24:], 24, [20, 11], num_logits=1)])
    assert (second[:10] - ref_a[30:]).abs().max().item() < TOL
    assert (second[10:] - ref_b[24:]).abs().max().item() < TOL


def test_block_size_1_equals_block_size_16(runner, model_path, text_tokens):
    small = ModelRunner(model_path, block_size=1, num_blocks=400)
    lengths = [5, 33, 70]
    rng = random.Random(0)
    chunks16, chunks1, next16 = [], [], 40
    scattered = list(range(400))
    rng.shuffle(scattered)  # non-contiguous physical blocks
    for i, n in enumerate(lengths):
        ids = text_tokens[i * 100: i * 100 + n]
        chunks16.append(SeqChunk(ids, 0, blocks(next16, -(-n // 16)), num_logits=n))
        next16 += -(-n // 16)
        chunks1.append(SeqChunk(ids, 0, scattered[:n], num_logits=n))
        scattered = scattered[n:]
    out16, out1 = runner.forward(chunks16), small.forward(chunks1)
    assert (out16 - out1).abs().max().item() < TOL


def test_layer_hook_runs_after_each_layer_wrote_kv(runner, text_tokens):
    ids = text_tokens[:20]
    block_table = [60, 61]
    runner.kv_cache.data[:, :, 60:62].zero_()
    seen: list[int] = []

    def hook(layer: int) -> None:
        written = runner.kv_cache.data[layer, :, 60:62].reshape(2, 32, -1)[:, :20]
        assert written.abs().sum(-1).min().item() > 0, "K/V of this layer not written yet"
        if layer + 1 < runner.model_config.num_layers:
            assert runner.kv_cache.data[layer + 1, :, 60:62].abs().sum().item() == 0
        seen.append(layer)

    runner.forward([SeqChunk(ids, 0, block_table)], layer_hook=hook)
    assert seen == list(range(runner.model_config.num_layers))


@pytest.mark.parametrize("chunk, message", [
    (SeqChunk([1, 2, 3], 0, []), "block table"),
    (SeqChunk([1, 2, 3], 0, [10_000]), "outside"),
    (SeqChunk([1, 2], 0, [0], num_logits=3), "num_logits"),
    (SeqChunk([1], 8192, [0] * 513), "max_model_len"),
    (SeqChunk([], 0, [0]), "no tokens"),
])
def test_forward_rejects_bad_chunks(runner, chunk, message):
    with pytest.raises(ValueError, match=message):
        runner.forward([chunk])


def test_model_config_of_bundled_model(runner):
    cfg = runner.model_config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.max_model_len == 8192 and cfg.eos_token_ids == (2,)
    assert cfg.rope.theta == 100000.0 and cfg.tie_word_embeddings
    spec = runner.kv_cache.spec
    assert runner.kv_cache.data.shape == (30, 2, 128, 16, 3, 64) and spec.num_blocks == 128
    # The C++ layer ops live in the attention kernel's library: both or neither (then the references).
    assert runner.layer_ops == ("cpu" if runner.attention_backend == "cpu" else "torch")


# -- architecture variants: tiny random checkpoints written by transformers ----------------------

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _tiny_checkpoint(tmp_path, arch: str, **extra):
    import transformers

    torch.manual_seed(0)
    config_cls = {"MistralForCausalLM": transformers.MistralConfig, "Qwen2ForCausalLM": transformers.Qwen2Config,
                  "LlamaForCausalLM": transformers.LlamaConfig}[arch]
    config = config_cls(**TINY, **extra)
    model = getattr(transformers, arch)(config).eval()
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("arch, extra", [
    ("MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
    ("Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    ("LlamaForCausalLM", dict(tie_word_embeddings=False, attention_bias=True,
                              rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                   low_freq_factor=1.0, high_freq_factor=4.0,
                                                   original_max_position_embeddings=64))),
])
def test_architecture_variants_match_transformers(tmp_path, arch, extra):
    ref = _tiny_checkpoint(tmp_path, arch, **extra)
    ours = ModelRunner(str(tmp_path), block_size=4, num_blocks=64)
    assert ours.model_config.architecture == arch
    ids = list(torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(1)).tolist())
    got = ours.forward([SeqChunk(ids, 0, blocks(0, 50), num_logits=200)])
    assert (got - hf_logits(ref, ids)).abs().max().item() < TOL
