"""AsyncEngine with the real model: streaming (deltas == final text, no U+FFFD, never a stop
string, emoji/CJK, stop strings across token boundaries), abort at any time with nothing
leaked, hold_kv / remote handoff, the event loop never blocked."""

from __future__ import annotations

import asyncio
import io

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from proto.detokenizer import REPLACEMENT
from engine.errors import EngineDeadError
from engine.llm_engine import LLMEngine
from proto.sampling import InvalidRequest, SamplingParams

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]  # a hang fails, not the whole suite

CHAT_PROMPTS = [
    "Reply with five emoji that describe a sunny beach day, nothing else.",
    "Translate into Chinese: Good morning, my dear friend. The weather is nice today.",
    "Write the Japanese words for cat, dog and bird, in Japanese script.",
    "List three colors in French, separated by commas.",
]


@pytest.fixture(scope="module")
def runner(model_path):
    from engine.model_runner import ModelRunner

    torch.set_num_threads(2)
    return ModelRunner(model_path, block_size=16, num_blocks=400)


def make_engine(runner, tokenizer, num_blocks=None) -> AsyncEngine:
    cfg = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
                       cache=CacheConfig(num_blocks=num_blocks))
    return AsyncEngine(LLMEngine(cfg, runner=runner, tokenizer=tokenizer))


def chat(tokenizer, text):
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True)["input_ids"])


async def within(aw, what: str, limit_s: float = 120.0):
    """Await aw; a hang fails naming the step, with every task's stack (CI once hung 600 s in
    test_bad_requests_fail_cleanly with only pytest-timeout's thread dump to show for it)."""
    try:
        return await asyncio.wait_for(aw, limit_s)
    except asyncio.TimeoutError:
        buf = io.StringIO()
        for task in asyncio.all_tasks():
            print(task, file=buf)
            task.print_stack(file=buf)
        raise AssertionError(f"{what}: no answer in {limit_s} s; tasks:\n{buf.getvalue()}") from None


async def collect(eng, prompt, params, rid):
    deltas, tokens, last = [], [], None
    async for out in eng.generate(prompt, params, rid):
        deltas.append(out.text_delta)
        tokens += out.new_token_ids
        last = out
    return deltas, tokens, last


def boundary_stop(tokenizer, tokens) -> tuple[str, int] | None:
    """A 3-4 character stop string that starts in one token and ends in a later one."""
    texts = [tokenizer.decode(tokens[:j], skip_special_tokens=True) for j in range(len(tokens) + 1)]
    full = texts[-1]
    for j in range(len(tokens) // 2, len(tokens)):
        cut = len(texts[j])
        if REPLACEMENT in texts[j] or not 2 <= cut <= len(full) - 2 or texts[j] != full[:cut]:
            continue
        stop = full[cut - 2:cut + 2]
        if stop.strip() and full.find(stop) == cut - 2:
            return stop, cut - 2
    return None


def test_streamed_text_is_whole_and_stop_strings_never_leak(runner, tokenizer):
    async def main():
        eng = make_engine(runner, tokenizer)
        prompts = [chat(tokenizer, p) for p in CHAT_PROMPTS]
        params = SamplingParams(temperature=0, max_tokens=20)
        runs = await asyncio.gather(*(collect(eng, p, params, f"free-{i}") for i, p in enumerate(prompts)))
        non_ascii = 0
        stops = []
        for i, (deltas, tokens, last) in enumerate(runs):
            text = "".join(deltas)
            assert not any(REPLACEMENT in d for d in deltas)
            assert last.finished and last.usage.completion_tokens == len(tokens)
            if last.finish_reason == "length":
                assert text == tokenizer.decode(tokens, skip_special_tokens=True).rstrip(REPLACEMENT)
            non_ascii += any(ord(ch) > 0x2000 for ch in text)
            found = boundary_stop(tokenizer, tokens)
            if found:
                stops.append((i, found, text))
        assert non_ascii >= 2, "the prompts should make the model write emoji / CJK"
        assert len(stops) >= 2
        for i, (stop, at), text in stops:
            sp = SamplingParams(temperature=0, max_tokens=20, stop=(stop, "@@@@@@"))
            deltas, tokens, last = await collect(eng, prompts[i], sp, f"stop-{i}")
            out = "".join(deltas)
            assert last.finish_reason == "stop"
            assert out == text[:at]
            assert all(stop not in d for d in deltas) and stop not in out
            assert not any(REPLACEMENT in d for d in deltas)
        assert eng.stats().kv_blocks_used == 0
        await eng.shutdown()

    asyncio.run(main())


def test_abort_half_mid_stream_leaves_no_blocks(runner, tokenizer):
    async def main():
        eng = make_engine(runner, tokenizer)
        prompts = [chat(tokenizer, p) for p in CHAT_PROMPTS * 2]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

        async def consume(i):
            reasons = []
            async for out in eng.generate(prompts[i], params, f"r{i}"):
                if i % 2 and out.new_token_ids and not reasons:
                    await eng.abort(f"r{i}")  # mid-stream: the request is running
                reasons.append(out.finish_reason)
            return reasons[-1]

        async def disconnect():  # a client that goes away: stop iterating, generator closed
            gen = eng.generate(prompts[0], params, "gone")
            async for out in gen:
                if out.new_token_ids:
                    break
            await gen.aclose()

        results = await asyncio.gather(*(consume(i) for i in range(len(prompts))), disconnect())
        assert results[:-1] == ["length", "abort"] * (len(prompts) // 2)
        st = eng.stats()
        assert st.kv_blocks_used == 0 and st.running == 0 and st.waiting == 0
        eng.engine.block_manager.check_invariants()
        await eng.abort("r1")  # idempotent
        await eng.abort("never-existed")
        await eng.shutdown()

    asyncio.run(main())


def test_abort_while_waiting_and_while_reserved(runner, tokenizer):
    async def main():
        eng = make_engine(runner, tokenizer)
        p = chat(tokenizer, CHAT_PROMPTS[0])
        await eng.reserve_remote("remote", p, SamplingParams(temperature=0, max_tokens=8))
        assert eng.stats().waiting_for_remote_kv == 1 and eng.stats().kv_blocks_used > 0
        await eng.abort("remote")
        assert eng.stats().kv_blocks_used == 0
        gen = eng.generate(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), "queued")
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        await eng.abort("queued")
        first = await task
        outs = [first] + [o async for o in gen]
        assert outs[-1].finish_reason == "abort"
        assert eng.stats().kv_blocks_used == 0
        await eng.shutdown()

    asyncio.run(main())


def test_hold_kv_and_remote_generation_async(runner, tokenizer):
    async def main():
        eng = make_engine(runner, tokenizer)
        p = chat(tokenizer, CHAT_PROMPTS[3])
        params = SamplingParams(temperature=0, max_tokens=6)
        _, ref_tokens, _ = await collect(eng, p, params, "ref")
        outs = [o async for o in eng.generate(p, SamplingParams(temperature=0, max_tokens=1), "pre", hold_kv=True)]
        held = outs[-1].kv_block_ids
        assert held and eng.stats().held_kv == 1 and eng.stats().kv_blocks_used >= len(held)
        dst = (await eng.reserve_remote("dec", p, params)).block_ids
        cache = runner.kv_cache.data
        cache[:, :, dst] = cache[:, :, held]
        await eng.release_kv("pre")
        first = outs[-1].new_token_ids[0]
        tokens = [first]
        async for o in eng.generate_remote("dec", first):
            tokens += o.new_token_ids
        assert tokens == ref_tokens
        # max_tokens == 1 on the decode side: finished at once, nothing re-emitted
        await eng.reserve_remote("one", p, SamplingParams(temperature=0, max_tokens=1))
        (only,) = [o async for o in eng.generate_remote("one", first)]
        assert only.finished and only.new_token_ids == [] and only.finish_reason == "length"
        assert eng.stats().kv_blocks_used == 0 and eng.stats().held_kv == 0
        await eng.shutdown()

    asyncio.run(main())


def test_event_loop_stays_responsive_while_the_model_runs(runner, tokenizer):
    """The model runs off the event loop. An order of events, not a wall-time bound: each engine
    step is bracketed by 'start'/'end' (from the thread it runs on) and a task on the loop logs
    'tick' every 5 ms; some tick must land inside a step. A step run on the loop could let no tick
    in however fast the host; a loaded host only makes fewer ticks."""
    async def main():
        eng = make_engine(runner, tokenizer)
        events, stop = [], asyncio.Event()
        real_step = eng.engine.step

        def traced_step():
            events.append("start")
            try:
                return real_step()
            finally:
                events.append("end")

        eng.engine.step = traced_step

        async def ticker():
            while not stop.is_set():
                events.append("tick")
                await asyncio.sleep(0.005)

        tick = asyncio.create_task(ticker())
        prompts = [chat(tokenizer, p) for p in CHAT_PROMPTS]
        await asyncio.gather(*(collect(eng, p, SamplingParams(temperature=0, max_tokens=8), f"t{i}")
                               for i, p in enumerate(prompts)))
        stop.set()
        await tick
        await eng.shutdown()
        return events

    events = asyncio.run(main())
    steps, inside, in_step = 0, 0, False
    for e in events:
        steps += e == "start"
        inside += in_step and e == "tick"
        in_step = e == "start" or (in_step and e != "end")
    assert steps >= 8, steps  # a prefill and 7 decode steps at least
    assert inside >= 1, f"no loop turn inside any of {steps} engine steps"


def test_bad_requests_fail_cleanly(runner, tokenizer):
    async def main():
        eng = make_engine(runner, tokenizer, num_blocks=16)
        with pytest.raises(InvalidRequest):
            await within(collect(eng, [], SamplingParams(), "empty"), "empty prompt")
        with pytest.raises(InvalidRequest, match="max_tokens"):
            await within(collect(eng, [1, 2, 3], SamplingParams(max_tokens=1000), "huge"), "huge max_tokens")
        with pytest.raises(KeyError):
            await within(eng.generate_remote("nothing-reserved", 5).__anext__(), "generate_remote unreserved")
        gen = eng.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4), "dup")
        await within(gen.__anext__(), "first output of 'dup'")
        with pytest.raises(KeyError):
            await within(collect(eng, [1, 2, 3], SamplingParams(), "dup"), "second 'dup'")
        await within(gen.aclose(), "closing 'dup'")
        assert eng.stats().kv_blocks_used == 0
        await within(eng.shutdown(), "shutdown")
        with pytest.raises(EngineDeadError):
            await within(collect(eng, [1, 2, 3], SamplingParams(), "late"), "request after shutdown")

    asyncio.run(main())


def test_from_config_builds_the_engine_on_the_thread_that_steps_it(monkeypatch):
    """Every torch op of a worker runs on one thread (a second OpenMP team slows every op down:
    engine/async_engine.py); a failing build raises to the caller."""
    import threading

    import engine.async_engine as async_engine

    built = {}

    class Recorder:
        def __init__(self, cfg, **kwargs) -> None:
            if kwargs.get("fail"):
                raise RuntimeError("no weights")
            built["thread"] = threading.get_ident()

    monkeypatch.setattr(async_engine, "LLMEngine", Recorder)
    eng = AsyncEngine.from_config(EngineConfig())
    step_thread = eng._executor.submit(threading.get_ident).result()
    assert built["thread"] == step_thread != threading.get_ident()
    with pytest.raises(RuntimeError, match="no weights"):
        AsyncEngine.from_config(EngineConfig(), fail=True)

