"""Serving end to end on real Ray, the real model, real gRPC and HTTP on 127.0.0.1:
the official openai client, bad inputs, overload, cancellation at every stage; every test ends
with the KV blocks of every worker back at their idle value."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from proto.pdserve.v1 import api_pb2, api_pb2_grpc
from tests.conftest import sharegpt_prompts

pytestmark = [pytest.mark.ray, pytest.mark.model]

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def serving(ray_session):
    from deploy.cluster import ClusterSpec
    from deploy.local_cluster import LocalServing
    from router.app import RouterConfig

    from engine.platform import assign_cores

    cores = assign_cores(2, None)  # as `pdserve serve` deals them: each worker its own core(s)
    spec = ClusterSpec(mode="disagg", kv_transport="tcp", num_prefill=1, num_decode=1, num_blocks=256,
                       threads_per_worker=cores.threads, cpu_cores=cores.cores)
    with LocalServing(spec, RouterConfig(port=0, http_port=0, mode="disagg", max_waiting=64)) as s:
        yield s


def assert_idle(serving, timeout_s: float = 30.0) -> None:
    """Every worker: no KV block used or held, no lease, nothing running or waiting."""
    end = time.monotonic() + timeout_s
    while True:
        stats = serving.worker_stats()
        busy = {wid: s for wid, s in stats.items()
                if s.kv_blocks_used or s.kv_blocks_held or s.leases or s.running or s.waiting}
        if not busy and stats:
            return
        if time.monotonic() > end:
            pytest.fail(f"workers not idle after {timeout_s}s: {busy}")
        time.sleep(0.1)


async def _side_router(serving, list_workers=None, **config):
    """(router, endpoints): a second router on the module's cluster with its own RouterConfig
    settings (gRPC on any free port, no HTTP unless given), started; the caller stops it.
    list_workers: the registry's source (default: every worker of the cluster)."""
    from router.app import Router, RouterConfig
    from router.registry import CallableRegistry

    settings = dict(port=0, http_port=None, mode="disagg", internal_secret=serving.controller.internal_secret)
    router = Router(CallableRegistry(list_workers or serving.controller.list_workers),
                    RouterConfig(**(settings | config)))
    return router, await router.start()


def _count_calls(obj, name: str) -> dict[str, int]:
    """Wrap the async method obj.<name> to count its calls; returns the live count {"n": calls}."""
    calls, orig = {"n": 0}, getattr(obj, name)

    async def counting(*args, **kwargs):
        calls["n"] += 1
        return await orig(*args, **kwargs)

    setattr(obj, name, counting)
    return calls


def _stub(serving):
    return api_pb2_grpc.GenerationStub(grpc.insecure_channel(serving.grpc_address))


def _chat_request(text: str, **sampling) -> api_pb2.GenerateRequest:
    req = api_pb2.GenerateRequest(model=MODEL, sampling=api_pb2.SamplingOptions(**sampling))
    req.chat.messages.add(role="user", content=text)
    return req


# -- CPU affinity ---------------------------------------------------------------------------------
def test_each_worker_process_runs_on_its_own_cores(serving):
    """Every thread of each worker process (torch's pool, gRPC's, Ray's) is bound to the cores
    the spec gave that worker, and two workers share none (unless there are fewer cores than workers)."""
    import os

    masks = {}
    for cfg in serving.spec.worker_configs():
        pid = serving.call(serving.controller.worker_pid(cfg.worker_id))
        per_thread = _thread_masks(pid)
        assert per_thread == {frozenset(cfg.cpu_cores)}, (cfg.worker_id, per_thread)
        masks[cfg.worker_id] = set(cfg.cpu_cores)
    if len(os.sched_getaffinity(0)) >= len(masks):
        assert not set.intersection(*masks.values()), masks


def _thread_masks(pid: int) -> set[frozenset[int]]:
    import os

    masks = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            masks.add(frozenset(os.sched_getaffinity(int(tid))))
        except OSError:  # the thread ended meanwhile
            pass
    return masks


# -- the OpenAI API ------------------------------------------------------------------------------
def test_openai_client_streaming_and_not_agree_with_right_usage(serving):
    import openai

    client = openai.OpenAI(base_url=serving.http_base_url, api_key="none")
    msgs = [{"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content == streamed and streamed
    usage = chunks[-1].usage
    assert usage.prompt_tokens == full.usage.prompt_tokens and usage.completion_tokens == full.usage.completion_tokens
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    # prompt_tokens is what the router's tokenizer makes of the chat template
    tok = _stub(serving).Tokenize(api_pb2.TokenizeRequest(model=MODEL, chat=api_pb2.ChatMessages(
        messages=[api_pb2.ChatMessage(role="user", content="Name three colors.")])))
    assert full.usage.prompt_tokens == len(tok.token_ids)
    assert full.usage.completion_tokens <= 20 and full.choices[0].finish_reason in ("stop", "length")

    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    plain_stream = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True))
    assert plain.choices[0].text == plain_stream and plain.usage.completion_tokens == 8
    assert plain.choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list().data] == [MODEL]
    # the gRPC API gives the same text
    grpc_text = "".join(m.text for m in _stub(serving).Generate(api_pb2.GenerateRequest(
        model=MODEL, prompt="The capital of France is", sampling=api_pb2.SamplingOptions(temperature=0, max_tokens=8))))
    assert grpc_text == plain.choices[0].text
    assert_idle(serving)


def test_stop_string_never_appears_in_the_stream(serving):
    import openai

    client = openai.OpenAI(base_url=serving.http_base_url, api_key="none")
    prompt = "Count from 1 to 20, separated by commas: 1, 2, 3,"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    assert " 7" in free, free  # the stop string below really occurs in the unconstrained text
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[" 7"], stream=True)]
    text = "".join(pieces)
    assert text == free[:free.index(" 7")] and " 7" not in text
    assert all(" 7" not in p for p in pieces)
    assert_idle(serving)


# -- bad input and overload ------------------------------------------------------------------------
BAD = [
    ({"prompt": "", "max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 8200}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "model": "gpt-4"}, "model"),
    ({"prompt": "hi", "stop": [str(i) for i in range(17)]}, "stop"),
    ({"prompt": "hi", "stop": ["x" * 257]}, "stop"),
]


@pytest.mark.parametrize("fields, name", BAD)
def test_bad_input_gets_invalid_argument_naming_the_field(serving, fields, name):
    import httpx

    body = {"model": MODEL, **fields}
    r = httpx.post(f"{serving.http_base_url}/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(name)
    sampling = {k: v for k, v in fields.items() if k in ("max_tokens", "temperature", "top_p", "stop")}
    req = api_pb2.GenerateRequest(model=fields.get("model", MODEL), prompt=fields["prompt"],
                                  sampling=api_pb2.SamplingOptions(**sampling))
    with pytest.raises(grpc.RpcError) as e:
        list(_stub(serving).Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(name)
    assert_idle(serving)


def test_workers_check_again_and_refuse_bad_requests(serving):
    """A request that skips the router's checks is refused by the worker itself, before any work."""
    from proto.internal_auth import call_metadata
    from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc

    for w in serving.router.pool.workers():
        stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(w.endpoint.address))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(worker_pb2.WorkerGenerateRequest(
                request_id="bad-1", prompt_token_ids=[1, 2], sampling=api_pb2.SamplingOptions(top_p=2.0)), timeout=10,
                metadata=call_metadata(serving.controller.internal_secret)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.value.details()
    assert_idle(serving)


def test_too_many_waiting_gets_resource_exhausted(serving):
    async def run() -> list:
        router, ep = await _side_router(serving, max_waiting=2)
        try:
            async with grpc.aio.insecure_channel(ep.grpc) as ch:
                stub = api_pb2_grpc.GenerationStub(ch)

                async def one(i: int):
                    req = api_pb2.GenerateRequest(model=MODEL, prompt=f"Tell me about the number {i}.",
                                                  sampling=api_pb2.SamplingOptions(temperature=0, max_tokens=4))
                    try:
                        return "".join([m.text async for m in stub.Generate(req, timeout=60)])
                    except grpc.RpcError as e:
                        return e.code()

                return await asyncio.gather(*(one(i) for i in range(8)))
        finally:
            await router.stop()

    results = serving.call(run(), 120)
    exhausted = [r for r in results if r == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert exhausted and len(exhausted) <= 6, results
    assert all(isinstance(r, str) for r in results if r not in exhausted), results
    assert_idle(serving)


def test_no_prefill_worker_alive_prefills_on_the_decode_worker(serving):
    """Prefill failover's last resort: with no live prefill worker the decode worker prefills the
    prompt itself (no reservation is made), over gRPC and HTTP."""
    async def decode_only():
        return [w for w in await serving.controller.list_workers() if w.role == "decode"]

    async def run():
        router, ep = await _side_router(serving, decode_only, http_port=0)
        try:
            async with grpc.aio.insecure_channel(ep.grpc) as ch:
                req = api_pb2.GenerateRequest(model=MODEL, prompt="Hello there",
                                              sampling=api_pb2.SamplingOptions(max_tokens=4, ignore_eos=True))
                msgs = [m async for m in api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60)]
            import httpx

            async with httpx.AsyncClient() as c:
                r = await c.post(f"http://{ep.http}/v1/completions", json={"model": MODEL, "prompt": "Hi"},
                                 timeout=60)
            return sum(len(m.token_ids) for m in msgs), r.status_code
        finally:
            await router.stop()

    assert serving.call(run(), 120) == (4, 200)
    assert_idle(serving)


def test_deadline_exceeded(serving):
    import httpx

    prompt = sharegpt_prompts(1)[0]
    r = httpx.post(f"{serving.http_base_url}/completions",
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 200, "timeout": 0.3}, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "DEADLINE_EXCEEDED"
    with pytest.raises(grpc.RpcError) as e:
        list(_stub(serving).Generate(_chat_request(prompt, max_tokens=200), timeout=0.3))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_idle(serving)


# -- cancellation at every stage -----------------------------------------------------------------
def _cancel_round(serving, stage: str, n: int, concurrency: int = 5) -> dict[str, int]:
    """n requests cancelled by the client at `stage`; returns how each ended."""
    prompts = [p[:800] for p in sharegpt_prompts(40)]  # about 200 tokens: prefill takes ~0.1-0.3 s here
    rng = random.Random(stage)

    async def one(stub, i: int) -> str:
        prompt = prompts[i % len(prompts)]
        req = _chat_request(prompt, temperature=0, max_tokens=64, ignore_eos=True)
        call = stub.Generate(req, timeout=120)
        if stage == "queued":  # sent behind others on a busy prefill worker: cancel before any work
            await asyncio.sleep(rng.uniform(0, 0.005))
        elif stage == "prefill":  # somewhere inside the prefill (and its layer-wise transfer)
            await asyncio.sleep(rng.uniform(0.01, 0.25))
        received = 0
        if stage in ("transfer", "decode"):
            async for m in call:  # transfer: right after the first token (KV handoff); decode: later
                received += len(m.token_ids)
                if received >= (1 if stage == "transfer" else rng.randint(2, 10)):
                    break
        call.cancel()
        return "cancelled"

    async def run():
        async with grpc.aio.insecure_channel(serving.grpc_address) as ch:
            stub = api_pb2_grpc.GenerationStub(ch)
            outcomes: dict[str, int] = {}
            for start in range(0, n, concurrency):
                results = await asyncio.gather(*(one(stub, i) for i in range(start, min(n, start + concurrency))),
                                               return_exceptions=True)
                for r in results:
                    key = r if isinstance(r, str) else type(r).__name__
                    outcomes[key] = outcomes.get(key, 0) + 1
            await serving.router.orchestrator.drain()
            return outcomes

    return serving.call(run(), 600)


@pytest.mark.parametrize("stage", ["queued", "prefill", "transfer", "decode"])
def test_cancellation_at_every_stage_leaks_nothing(serving, stage):
    outcomes = _cancel_round(serving, stage, n=50)
    assert outcomes == {"cancelled": 50}, outcomes
    assert_idle(serving)
    # and the cluster still serves
    text = "".join(m.text for m in _stub(serving).Generate(_chat_request("Say hi.", temperature=0, max_tokens=4)))
    assert text
    assert_idle(serving)


def test_http_client_disconnect_mid_stream_leaks_nothing(serving):
    import httpx

    body = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 200, "temperature": 0,
            "stream": True}
    for _ in range(5):
        with httpx.stream("POST", f"{serving.http_base_url}/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # one chunk, then hang up
    assert_idle(serving)


def test_short_prompts_are_prefilled_on_the_decode_worker(serving):
    """Conditional disaggregation: below --local-prefill-threshold the decode worker does it all,
    with the same greedy text as the disaggregated path."""
    prompt = "The three primary colors are"

    async def run() -> tuple[str, int]:
        router, ep = await _side_router(serving, local_prefill_threshold=64)
        calls = _count_calls(router.orchestrator, "_prefill_with_retry")
        try:
            async with grpc.aio.insecure_channel(ep.grpc) as ch:
                req = api_pb2.GenerateRequest(model=MODEL, prompt=prompt,
                                              sampling=api_pb2.SamplingOptions(temperature=0, max_tokens=12))
                text = "".join([m.text async for m in api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60)])
            return text, calls["n"]
        finally:
            await router.stop()

    local_text, prefill_calls = serving.call(run(), 120)
    disagg_text = "".join(m.text for m in _stub(serving).Generate(api_pb2.GenerateRequest(
        model=MODEL, prompt=prompt, sampling=api_pb2.SamplingOptions(temperature=0, max_tokens=12))))
    assert prefill_calls == 0 and local_text == disagg_text and local_text
    assert_idle(serving)



def test_decode_worker_that_caches_the_prefix_receives_only_the_uncached_blocks(serving):
    """Disaggregated, the decode worker's own prefix cache supplies the blocks it already has:
    Reserve says how many, the prefill worker writes only the rest (bytes exactly those blocks'),
    and the greedy text is the one the full transfer gave."""
    # ignore_eos: a first token that ends the request frees the decode side's reservation unused
    stem = "Background: " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(40))  # new to the workers
    bs = 16  # ClusterSpec's block size

    async def run() -> list[tuple[str, int, int, int]]:
        router, ep = await _side_router(serving)
        seen: list[tuple[int, int, int]] = []
        orig = router.orchestrator._prefill

        async def capture(p, legs, dest):  # one prefill leg: its destination and what it moved
            first = await orig(p, legs, dest)
            seen.append((len(legs.prompt_ids), dest.num_cached_blocks, first.kv_bytes))
            return first

        router.orchestrator._prefill = capture
        out = []
        try:
            async with grpc.aio.insecure_channel(ep.grpc) as ch:
                stub = api_pb2_grpc.GenerationStub(ch)
                for question in ("Which item is 5?", "Which item is 3?", "Which item is 5?"):
                    req = api_pb2.GenerateRequest(model=MODEL, prompt=f"{stem}\n{question}",
                                                  sampling=api_pb2.SamplingOptions(temperature=0, max_tokens=6,
                                                                                   ignore_eos=True))
                    text = "".join([m.text async for m in stub.Generate(req, timeout=60)])
                    out.append((text, *seen[-1]))
            return out
        finally:
            await router.stop()

    (t1, n1, c1, b1), (_, n2, c2, b2), (t3, n3, c3, b3) = serving.call(run(), 180)
    per_block = b1 // -(-n1 // bs)
    assert c1 == 0 and b1 == -(-n1 // bs) * per_block  # the stem was new: every block travelled
    assert 0 < c2 <= (n2 - 1) // bs and b2 == (-(-n2 // bs) - c2) * per_block  # the stem's blocks did not
    assert c3 == (n3 - 1) // bs and b3 == (-(-n3 // bs) - c3) * per_block  # only the last token's block
    assert t3 == t1 and t1
    assert_idle(serving)


def test_conditional_disaggregation_decides_on_the_uncached_length(serving):
    """--local-prefill-threshold 64 against a 300-token prompt: disaggregated while the decode
    worker lacks it; once D caches its stem, the same stem with a new question (its uncached
    part a few tokens) is prefilled on D itself, although the prompt is far above the threshold."""
    from router.prefix_index import prompt_block_hashes

    stem = "Inventory: " + " ".join(f"box {i} holds {i * 5 % 11} pens." for i in range(36))

    async def run() -> list[tuple[int, int]]:
        router, ep = await _side_router(serving, local_prefill_threshold=64)
        calls = _count_calls(router.orchestrator, "_prefill_with_retry")
        out = []
        try:
            async with grpc.aio.insecure_channel(ep.grpc) as ch:
                stub = api_pb2_grpc.GenerationStub(ch)
                for question in ("Which box holds 3?", "Which box holds 7?"):
                    prompt = f"{stem}\n{question}"
                    ids = router.service.tokenizer.encode(prompt)
                    before = calls["n"]
                    req = api_pb2.GenerateRequest(model=MODEL, prompt=prompt, sampling=api_pb2.SamplingOptions(
                        temperature=0, max_tokens=4, ignore_eos=True))
                    assert "".join([m.text async for m in stub.Generate(req, timeout=60)])
                    out.append((len(ids), calls["n"] - before))
                    # D's KV events reach the router's index with its Stats polls: wait for the stem's blocks
                    hashes = prompt_block_hashes(router.service.tokenizer.encode(stem), 16)
                    for _ in range(200):
                        if any(router.index.overlap_blocks(w.id, hashes) >= len(hashes) - 1
                               for w in router.pool.workers("decode")):
                            break
                        await asyncio.sleep(0.05)
            return out
        finally:
            await router.stop()

    (n1, disagg1), (n2, disagg2) = serving.call(run(), 180)
    assert n1 > 200 and n2 > 200
    assert disagg1 == 1 and disagg2 == 0  # the second one's uncached part (< 64 tokens) stayed on D
    assert_idle(serving)
