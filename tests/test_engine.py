"""LLMEngine with the real SmolLM2 model: continuous batching gives the same greedy tokens as
the offline runtime run one prompt at a time, also under preemption; prefix caching; static
batching; remote-KV handoff and hold_kv; the layer hook."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from proto.sampling import SamplingParams
from engine_helpers import NEAR_TIE, first_near_tie, run_to_completion

pytestmark = pytest.mark.model

NUM_PROMPTS, MAX_TOKENS = 32, 8
PROMPT_CHARS = 320
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def runner(model_path):
    from engine.model_runner import ModelRunner

    torch.set_num_threads(2)
    return ModelRunner(model_path, block_size=16, num_blocks=800)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """The first 32 ShareGPT prompts in the chat template, each cut to its first PROMPT_CHARS
    characters so the one-at-a-time reference stays affordable on 2 cores."""
    from conftest import sharegpt_prompts

    return [list(tokenizer.apply_chat_template([{"role": "user", "content": p[:PROMPT_CHARS]}],
                                               add_generation_prompt=True, tokenize=True)["input_ids"])
            for p in sharegpt_prompts(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def reference(model_path, prompts):
    """The offline runtime, one prompt at a time: tokens and the top-2 logprob gaps."""
    from engine.llm import LLM

    llm = LLM(model_path, num_blocks=128)
    ref = []
    for p in prompts:
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2))[0]
        ref.append((out.token_ids, [lp.top[0][1] - lp.top[1][1] for lp in out.logprobs]))
    return ref


def engine(runner, tokenizer, **sched) -> LLMEngine:
    num_blocks = sched.pop("num_blocks", None)
    cfg = EngineConfig(scheduler=SchedulerConfig(**sched), cache=CacheConfig(num_blocks=num_blocks))
    return LLMEngine(cfg, runner=runner, tokenizer=tokenizer, track_kv_waste=True)


def assert_equal_with_near_ties(got: list[list[int]], reference) -> None:
    for i, (tokens, (ref_tokens, gaps)) in enumerate(zip(got, reference)):
        cut = first_near_tie(gaps)
        assert tokens[:cut] == ref_tokens[:cut], f"prompt {i}: {tokens} != {ref_tokens} (first near tie at {cut})"
        if cut == len(ref_tokens):
            assert tokens == ref_tokens


def test_continuous_batching_matches_one_at_a_time(runner, tokenizer, prompts, reference):
    eng = engine(runner, tokenizer, max_num_seqs=32, max_num_batched_tokens=512)
    outs = run_to_completion(eng, prompts, GREEDY)
    assert_equal_with_near_ties([o.token_ids for o in outs], reference)
    st = eng.stats()
    assert st.num_steps < NUM_PROMPTS * MAX_TOKENS / 4  # requests really were batched
    assert st.kv_blocks_used == 0 and st.running == 0 and st.waiting == 0
    eng.block_manager.check_invariants()


def test_small_cache_preempts_and_outputs_stay_equal(runner, tokenizer, prompts, reference):
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    num_blocks = 2 * (-(-longest // 16)) + 4  # room for 2-3 requests, far less than all 32 need
    eng = engine(runner, tokenizer, max_num_seqs=32, max_num_batched_tokens=512, num_blocks=num_blocks)
    outs = run_to_completion(eng, prompts, GREEDY)
    assert eng.stats().num_preemptions > 0
    assert_equal_with_near_ties([o.token_ids for o in outs], reference)
    assert eng.stats().kv_blocks_used == 0
    eng.block_manager.check_invariants()


def test_static_batching_gives_the_same_tokens(runner, tokenizer, prompts, reference):
    eng = engine(runner, tokenizer, max_num_seqs=4, max_num_batched_tokens=2048, batching="static")
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (4, 8, 2, 8, 1, 8)]
    outs = run_to_completion(eng, prompts[:6], params)
    for o, (ref_tokens, gaps), p in zip(outs, reference, params):
        cut = min(first_near_tie(gaps), p.max_tokens)
        assert o.token_ids[:cut] == ref_tokens[:cut]
    assert eng.stats().kv_blocks_used == 0
    assert max(eng.kv_waste_samples) > 0.1  # padding and up-front reservation waste slots


def test_shared_64_token_prefix_is_served_from_the_cache(runner, tokenizer, prompts):
    eng = engine(runner, tokenizer)
    shared = prompts[0][:64]
    assert len(prompts[0]) > 64
    short = SamplingParams(temperature=0, max_tokens=2)
    first = run_to_completion(eng, [shared + tokenizer.encode(" Answer briefly.")], short)[0]
    assert first.cached_tokens == 0
    second = run_to_completion(eng, [shared + tokenizer.encode(" Summarize in French please.")], short)[0]
    assert second.cached_tokens >= 48
    assert eng.stats().prefix_cache_hit_tokens >= 48


def test_prefix_cache_hit_gives_the_same_tokens_as_a_cold_run(runner, tokenizer, prompts, reference):
    eng = engine(runner, tokenizer)
    run_to_completion(eng, prompts[:1], GREEDY)
    again = run_to_completion(eng, prompts[:1], GREEDY)[0]
    assert again.cached_tokens >= len(prompts[0]) - 16
    assert_equal_with_near_ties([again.token_ids], reference[:1])


def test_hold_kv_then_remote_decode_continues_the_sequence(runner, tokenizer, prompts, reference):
    """Prefill with hold_kv, copy the held blocks into a remote reservation (as a KV transfer
    would), release the hold, decode from the first token: the tokens continue the reference."""
    eng = engine(runner, tokenizer)
    prompt = prompts[2]
    eng.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1), hold_kv=True)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    final = outs[-1]
    assert final.finished and final.finish_reason == "length" and final.kv_block_ids
    assert eng.stats().held_kv == 1
    dst = eng.reserve_remote("d", prompt, GREEDY).block_ids
    assert len(dst) == len(final.kv_block_ids)
    cache = runner.kv_cache.data
    cache[:, :, dst] = cache[:, :, final.kv_block_ids]
    eng.release_kv("p")
    first = final.new_token_ids[0]
    tokens = [first]
    for o in eng.start_remote("d", first):
        tokens += o.new_token_ids
    while eng.has_unfinished():
        for o in eng.step():
            tokens += o.new_token_ids
    ref_tokens, gaps = reference[2]
    cut = first_near_tie(gaps)
    assert tokens[:cut] == ref_tokens[:cut]
    assert eng.stats().kv_blocks_used == 0


def test_reservation_that_does_not_fit_leaves_nothing(runner, tokenizer, prompts):
    from engine.scheduler import CapacityError

    need = -(-len(prompts[0]) // 16)
    eng = engine(runner, tokenizer, num_blocks=need + need // 2)  # room for one reservation, not two
    eng.reserve_remote("a", prompts[0], GREEDY)
    used = eng.stats().kv_blocks_used
    with pytest.raises(CapacityError):
        eng.reserve_remote("b", prompts[0], GREEDY)
    assert eng.stats().kv_blocks_used == used
    eng.abort("a")
    assert eng.stats().kv_blocks_used == 0


def test_layer_hook_sees_every_layer_and_the_chunks(runner, tokenizer, prompts):
    eng = engine(runner, tokenizer, max_num_batched_tokens=64)
    calls = []
    eng.layer_hook = lambda layer, chunks: calls.append((layer, chunks))
    n = len(prompts[3])
    eng.add_request("a", prompts[3], SamplingParams(temperature=0, max_tokens=2))
    eng.step()
    num_layers = runner.model_config.num_layers
    assert [c[0] for c in calls] == list(range(num_layers))
    (info,) = calls[0][1]
    assert (info.request_id, info.start_pos, info.num_tokens, info.is_last_chunk) == ("a", 0, min(n, 64), n <= 64)
    assert info.block_ids == tuple(eng.block_manager.block_table("a")[:-(-min(n, 64) // 16)])


def test_seeded_remote_decode_draws_what_one_engine_draws(runner, tokenizer, prompts):
    """A seeded, penalised sampled request split as prefill (first token, hold_kv) + remote decode
    gives the same tokens as one engine: the decode side skips the first token's draw and the
    penalties see the first token in the output."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=6, frequency_penalty=0.5,
                            repetition_penalty=1.2)
    prompt = prompts[3]
    whole = engine(runner, tokenizer)
    whole.add_request("w", prompt, params)
    want = []
    while whole.has_unfinished():
        for o in whole.step():
            want += o.new_token_ids
    eng = engine(runner, tokenizer)
    eng.add_request("p", prompt, SamplingParams(**{**params.__dict__, "max_tokens": 1}), hold_kv=True)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    held = outs[-1].kv_block_ids
    dst = eng.reserve_remote("d", prompt, params).block_ids
    cache = runner.kv_cache.data
    cache[:, :, dst] = cache[:, :, held]
    eng.release_kv("p")
    got = [outs[-1].new_token_ids[0]]
    for o in eng.start_remote("d", got[0]):
        got += o.new_token_ids
    while eng.has_unfinished():
        for o in eng.step():
            got += o.new_token_ids
    assert got == want and len(want) == 6


def test_resumed_request_continues_as_one_engine_would(runner, tokenizer, prompts):
    """Migration's engine half: a request re-added with the tokens another engine already produced
    (resume_token_ids) emits exactly the rest of the uninterrupted run, seeded and penalised
    sampling included (the generator skips the resumed draws, the penalties see them as output),
    and its usage counts every output token."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=77, max_tokens=7, frequency_penalty=0.5,
                            repetition_penalty=1.2)
    for p in (params, GREEDY):
        whole = engine(runner, tokenizer)
        want = run_to_completion(whole, [prompts[5]], p)[0].token_ids
        eng = engine(runner, tokenizer)
        eng.add_request("m", prompts[5], p, resume_token_ids=want[:3])
        got, usage = [], None
        while eng.has_unfinished():
            for o in eng.step():
                got += o.new_token_ids
                usage = o.usage if o.finished else usage
        assert got == want[3:] and len(want) == p.max_tokens
        assert usage.completion_tokens == p.max_tokens and usage.prompt_tokens == len(prompts[5])
        assert eng.block_manager.num_used_blocks == 0 or eng.stats().running == 0
