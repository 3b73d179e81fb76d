"""Greedy generation against transformers' generate, batch vs alone, seeded sampling.

Near-tie rule: where the reference's top-2 logit gap at some step is < 1e-4, either token is a
correct greedy choice, so only the tokens before the first such step must match.
"""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from proto.sampling import SamplingParams
from tests.conftest import sharegpt_prompts

pytestmark = pytest.mark.model
NEAR_TIE = 1e-4
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def llm(model_path) -> LLM:
    torch.set_num_threads(1)  # the test machine's 2 cores are shared: more threads only spin
    return LLM(model_path, num_blocks=512)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return sharegpt_prompts(8)


@pytest.fixture(scope="module")
def batched(llm, prompts):
    """The 8 prompts as one batch, greedy."""
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), chat=True)


def first_near_tie(gaps: list[float]) -> int | None:
    return next((i for i, g in enumerate(gaps) if g < NEAR_TIE), None)


def assert_same_greedy(ours: list[int], ref: list[int], ref_gaps: list[float], what: str) -> None:
    tie = first_near_tie(ref_gaps)
    if tie is None:
        assert ours == ref, f"{what}: diverged at {next(i for i, (a, b) in enumerate(zip(ours + [-1], ref)) if a != b)}"
    else:
        assert ours[:tie] == ref[:tie], f"{what}: diverged before the near-tie at step {tie}"


def transformers_greedy(model_path, prompt_ids: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    results = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        with torch.no_grad():  # the attention mask is required: PAD == EOS appears inside chat prompts
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False,
                              pad_token_id=2, output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(ids):].tolist()
        gaps = [float(t.topk(2).values[0, 0] - t.topk(2).values[0, 1]) for t in out.logits]
        results.append((tokens, gaps))
    return results


def test_chat_encoding_is_apply_chat_template(llm):
    messages = [{"role": "user", "content": "Hello there"}]
    ref = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert llm.encode("Hello there", chat=True) == list(ref)


def test_greedy_matches_transformers_generate(model_path, batched):
    """The first 8 ShareGPT prompts (chat template), 48 greedy tokens, batched here, alone in transformers."""
    refs = transformers_greedy(model_path, [o.prompt_token_ids for o in batched])
    for i, (out, (ref_tokens, ref_gaps)) in enumerate(zip(batched, refs)):
        assert_same_greedy(out.token_ids, ref_tokens, ref_gaps, f"prompt {i}")
        assert out.finish_reason == ("stop" if out.token_ids[-1] == 2 else "length")


def test_batch_equals_each_prompt_alone(llm):
    """8 short ShareGPT prompts of different lengths: batched greedy tokens == each run alone."""
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
    by_length: dict[int, str] = {}
    for p in sharegpt_prompts(100):
        if len(p) < 250:
            by_length.setdefault(len(llm.encode(p, chat=True)), p)
    lengths = sorted(by_length)
    chosen = [by_length[lengths[i * (len(lengths) - 1) // 7]] for i in range(8)]
    batch = llm.generate(chosen, params, chat=True)
    assert len({len(o.prompt_token_ids) for o in batch}) == 8, "the 8 prompts should have different lengths"
    for i, prompt in enumerate(chosen):
        alone = llm.generate(prompt, params, chat=True)[0]
        gaps = [lp.top[0][1] - lp.top[1][1] for lp in alone.logprobs]
        assert_same_greedy(batch[i].token_ids, alone.token_ids, gaps, f"prompt {i}")


def test_seeded_sampling_is_reproducible_across_batches(llm, prompts):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=16)
    first = llm.generate([prompts[2], prompts[3]], [seeded, SamplingParams(temperature=1.0, max_tokens=16)],
                         chat=True)[0]
    second = llm.generate([prompts[6], prompts[7], prompts[2]],
                          [SamplingParams(temperature=1.0, max_tokens=5), SamplingParams(temperature=0, max_tokens=16),
                           seeded], chat=True)[2]
    assert first.token_ids == second.token_ids
    other = llm.generate(prompts[2], SamplingParams(temperature=0.8, top_p=0.95, seed=99, max_tokens=16), chat=True)[0]
    assert other.token_ids != first.token_ids


def test_top_k_1_equals_greedy(llm, prompts):
    greedy = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=16), chat=True)
    top1 = llm.generate(prompts[:2], SamplingParams(temperature=1.3, top_k=1, max_tokens=16), chat=True)
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def test_stop_reasons_and_text(llm):
    out = llm.generate("What is the capital of France?", SamplingParams(temperature=0, max_tokens=32), chat=True)[0]
    assert "Paris" in out.text and out.finish_reason == "stop" and out.token_ids[-1] == 2
    assert "<|im_end|>" not in out.text
    short = llm.generate("What is the capital of France?", SamplingParams(temperature=0, max_tokens=3), chat=True)[0]
    assert short.finish_reason == "length" and short.token_ids == out.token_ids[:3]
    stopped = llm.generate("What is the capital of France?",
                           SamplingParams(temperature=0, max_tokens=32, stop=("France",)), chat=True)[0]
    assert stopped.finish_reason == "stop" and stopped.text == out.text[:out.text.index("France")]


def test_prompt_errors(llm):
    from proto.sampling import InvalidRequest

    with pytest.raises(InvalidRequest, match="prompt"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(InvalidRequest, match="context is 8192"):
        llm.generate([[5] * 8192], SamplingParams())
