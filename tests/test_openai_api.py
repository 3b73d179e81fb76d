"""The OpenAI / vLLM API fields end to end, and the metrics the Grafana dashboard reads, with the official openai client (and gRPC) against a
real cluster: real Ray, the real model, real gRPC and HTTP on 127.0.0.1.

One disaggregated cluster started with the vLLM flags a user types (served model name, max model
len, no prefix caching). "agg" below is the decode worker's own Generate (the local-prefill
path an agg worker runs: one engine does prefill and decode); "disagg" is prefill worker ->
KV transfer -> decode worker. The router chooses between them by --local-prefill-threshold,
which the tests switch per request. Few tokens per request keep the module short.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import grpc
import httpx
import pytest

from proto.pdserve.v1 import api_pb2, api_pb2_grpc

pytestmark = [pytest.mark.ray, pytest.mark.model]

SERVED = "smol"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def serving(ray_session):
    from deploy.cluster import ClusterSpec
    from deploy.local_cluster import LocalServing
    from router.app import RouterConfig

    spec = ClusterSpec(mode="disagg", kv_transport="tcp", num_prefill=1, num_decode=1, num_blocks=256,
                       served_model_name=SERVED, max_model_len=1024, enable_prefix_caching=False,
                       metrics_port=_free_port_run(3))  # workers: +1, +2
    with LocalServing(spec, RouterConfig(port=0, http_port=0, mode="disagg", served_model_name=SERVED)) as s:
        yield s


@pytest.fixture(scope="module")
def client(serving):
    import openai

    return openai.OpenAI(base_url=serving.http_base_url, api_key="none", max_retries=0)


def _free_port_run(n: int) -> int:
    """A port p with p .. p+n-1 free on 127.0.0.1 (the workers' metrics ports are consecutive)."""
    import random
    import socket

    for _ in range(100):
        base = random.randint(20000, 60000)
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def _path(serving, path: str) -> None:
    """Route every request through "agg" (the decode worker alone) or "disagg" (prefill + transfer)."""
    orch = serving.router.orchestrator
    orch.config = replace(orch.config, local_prefill_threshold=10**6 if path == "agg" else 0)


def _stub(serving):
    return api_pb2_grpc.GenerationStub(grpc.insecure_channel(serving.grpc_address))


def test_served_name_max_model_len_and_no_prefix_cache(serving, client):
    assert [(m.id, m.max_model_len) for m in client.models.list().data] == [(SERVED, 1024)]
    for _ in range(2):  # the same prompt twice: nothing comes from a prefix cache
        out = client.completions.create(model=SERVED, prompt=PROMPT * 8, max_tokens=1, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_n2_two_choices_and_seeded_n2_reproducible(client):
    kwargs = dict(model=SERVED, prompt=PROMPT, max_tokens=6, temperature=1.0, n=2, seed=7)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=4, temperature=1.0, seed=3)
    assert len(chat.choices) == 2
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].text
    assert [texts[0], texts[1]] == [c.text for c in first.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_best_of_returns_n_and_cannot_stream(client):
    import openai

    out = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=1, n=1,
                                    best_of=3)
    assert len(out.choices) == 1 and out.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=4, best_of=3, stream=True)


def test_greedy_token_logprob_is_the_max(client):
    chat = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Name a color."}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for tok in content:
        tops = [t.logprob for t in tok.top_logprobs]
        assert len(tops) == 3 and tok.logprob == pytest.approx(max(tops)) and tops == sorted(tops, reverse=True)
        assert tok.logprob <= 0 and sum(math.exp(t) for t in tops) <= 1 + 1e-4
        assert bytes(tok.bytes).decode(errors="replace") == tok.token
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    comp = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen == pytest.approx(max(top.values()))
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == comp.choices[0].text


def test_agg_and_disagg_give_the_same_logprobs_and_seeded_samples(serving, client):
    results = {}
    for path in ("agg", "disagg"):
        _path(serving, path)
        greedy = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
        seeded = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=42)
        results[path] = (greedy.choices[0], seeded.choices[0].text)
    _path(serving, "disagg")
    (agg, agg_seeded), (dis, dis_seeded) = results["agg"], results["disagg"]
    assert agg.text == dis.text and agg_seeded == dis_seeded
    for a, d in zip(agg.logprobs.token_logprobs, dis.logprobs.token_logprobs):
        assert a == pytest.approx(d, abs=1e-3)


def test_penalties_change_repetitive_output(client):
    prompt = "red red red red red red red red red red"
    base = client.completions.create(model=SERVED, prompt=prompt, max_tokens=10, temperature=0).choices[0].text
    assert Counter(base.split()).most_common(1)[0][1] >= 5, base  # the model repeats without penalties
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                    {"extra_body": {"repetition_penalty": 2.0}}):
        text = client.completions.create(model=SERVED, prompt=prompt, max_tokens=10, temperature=0,
                                         **penalty).choices[0].text
        assert text != base and text.split().count("red") < base.split().count("red"), (penalty, text)


def test_min_tokens_suppresses_eos_until_reached(client):
    msgs = [{"role": "user", "content": "Reply with one word: yes or no?"}]
    free = client.chat.completions.create(model=SERVED, messages=msgs, max_tokens=40, temperature=0)
    assert free.choices[0].finish_reason == "stop"  # EOS came early
    k = free.usage.completion_tokens
    held = client.chat.completions.create(model=SERVED, messages=msgs, max_tokens=40, temperature=0,
                                          extra_body={"min_tokens": k + 3})
    assert held.usage.completion_tokens >= k + 3


def test_echo_returns_the_prompt(client):
    out = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.choices[0].text == PROMPT + plain.choices[0].text


def test_stop_token_ids_stop(serving, client):
    ids = [i for m in _stub(serving).Generate(api_pb2.GenerateRequest(
        model=SERVED, prompt=PROMPT, sampling=api_pb2.SamplingOptions(temperature=0, max_tokens=6))) for i in m.token_ids]
    assert len(ids) == 6 and ids[2] not in ids[:2]
    out = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"stop_token_ids": [ids[2]]})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 3


def test_content_as_text_parts_and_user(client):
    as_string = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hello there"}],
                                               max_tokens=4, temperature=0, user="u-1")
    as_parts = client.chat.completions.create(
        model=SERVED, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}])
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content


@pytest.mark.parametrize("kwargs, field", [
    ({"extra_body": {"logit_bias": {"5": 1.0}}}, "logit_bias"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"extra_body": {"suffix": "x"}}, "suffix"),
    ({"extra_body": {"echo": True, "logprobs": 1}}, "echo"),
    ({"extra_body": {"presence_penalty": 3.0}}, "presence_penalty"),
    ({"extra_body": {"min_tokens": 9}}, "min_tokens"),
])
def test_unsupported_or_bad_field_is_a_400_naming_it(client, kwargs, field):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=4, **kwargs)
    assert e.value.status_code == 400 and field in str(e.value) and e.value.body["param"].startswith(field)


def test_non_text_content_part_is_a_400(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="messages.0.content.0.type"):
        client.chat.completions.create(model=SERVED, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])


def test_a_form_body_is_a_400_that_says_send_json(serving):
    """curl -d without -H 'Content-Type: application/json' posts a form: the 400 says what to send."""
    r = httpx.post(f"{serving.http_base_url}/chat/completions", content=b'{"messages":[]}',
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]
    r = httpx.post(f"{serving.http_base_url}/completions", json=[1, 2])
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]


def test_tokenize_detokenize_version_health_metrics(serving):
    base = serving.http_base_url.removesuffix("/v1")
    tok = httpx.post(f"{base}/tokenize", json={"model": SERVED, "prompt": PROMPT}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 1024
    assert httpx.post(f"{base}/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": PROMPT}
    chat = httpx.post(f"{base}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3
    assert httpx.get(f"{base}/version").json()["version"]
    assert httpx.get(f"{base}/health").status_code == 200
    assert "pdserve" in httpx.get(f"{base}/metrics").text
    bad = httpx.post(f"{base}/detokenize", json={"model": "other", "tokens": [1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"


def test_grpc_carries_n_logprobs_echo_and_penalties(serving):
    sampling = api_pb2.SamplingOptions(temperature=0, max_tokens=4, logprobs=2, frequency_penalty=0.5,
                                       repetition_penalty=1.1, min_tokens=1)
    msgs = list(_stub(serving).Generate(api_pb2.GenerateRequest(model=SERVED, prompt=PROMPT, n=2, echo=True,
                                                                sampling=sampling)))
    by_choice = {0: [], 1: []}
    for m in msgs:
        by_choice[m.index].append(m)
        assert len(m.logprobs) == len(m.token_ids)
        for lp, t in zip(m.logprobs, m.token_ids):
            # penalties move the choice, the logprobs stay the model's: the chosen one is at most the top one
            assert lp.token_id == t and len(lp.top) == 2 and lp.logprob <= lp.top[0].logprob + 1e-6
    texts = ["".join(m.text for m in by_choice[i]) for i in (0, 1)]
    assert texts[0] == texts[1] and texts[0].startswith(PROMPT)  # greedy: both choices the same
    with pytest.raises(grpc.RpcError) as e:
        next(iter(_stub(serving).Generate(api_pb2.GenerateRequest(
            model=SERVED, prompt=PROMPT, sampling=api_pb2.SamplingOptions(presence_penalty=5)))))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "presence_penalty" in e.value.details()


def test_concurrent_requests_that_share_a_client_id_each_complete(serving):
    """Three gRPC calls with request_id 'dupe' at once: each gets its own prompt's greedy text
    (the worker saw one id three times, answered ALREADY_EXISTS, and the router's cleanup ended them all)."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["The capital of France is", "One, two, three,", "The sky is"]

    def run(prompt: str, request_id: str) -> str:
        sampling = api_pb2.SamplingOptions(temperature=0, max_tokens=6, ignore_eos=True)
        return "".join(m.text for m in _stub(serving).Generate(api_pb2.GenerateRequest(
            model=SERVED, prompt=prompt, request_id=request_id, sampling=sampling)))

    alone = [run(p, "") for p in prompts]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(run, prompts, ["dupe"] * 3))
    assert together == alone
    ids = {m.request_id for m in _stub(serving).Generate(api_pb2.GenerateRequest(
        model=SERVED, prompt=prompts[0], request_id="dupe", sampling=api_pb2.SamplingOptions(max_tokens=2)))}
    assert ids == {"dupe"}  # the client's id is what it gets back


def test_detokenize_refuses_ids_outside_the_vocabulary(serving):
    base = serving.http_base_url.removesuffix("/v1")
    for tokens in ([-1], [10**12], [49152], [1] * 3000 + [49152]):  # OverflowError (500), "" (200) before; the
        # last one is checked off the event loop (router/service.py INLINE_TOKENIZE_CHARS)
        r = httpx.post(f"{base}/detokenize", json={"tokens": tokens})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", (tokens, r.text)


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(serving, client):
    """No token covers more than max_chars_per_token characters, so a longer text cannot fit: 400
    without tokenizing it (the tokenizer holds the GIL; 12 MiB stalled the router for 10 s)."""
    limit = serving.router.service.max_model_len * serving.router.service.tokenizer.max_chars_per_token
    r = httpx.post(f"{serving.http_base_url}/completions", json={"prompt": "a" * (limit + 1), "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 400 and "cannot fit the context" in r.json()["error"]["message"]


@pytest.mark.parametrize("kind", ["prompt", "chat", "detokenize"])
def test_a_long_tokenization_leaves_the_router_loop_running(serving, monkeypatch, kind):
    """A prompt just under the character bound (or /detokenize of a long id list) took the event
    loop for its whole (de)tokenization (tokenizers' encode/decode hold the GIL): nothing else ran
    meanwhile. Order of events: the real tokenizer's call is bracketed by 'start'/'end' (from the
    thread it runs on) and a task on the router's loop logs 'tick' at every turn: some tick must
    land between start and end."""
    import asyncio

    from proto.chat import ChatMessage

    svc = serving.router.service
    tok = svc.tokenizer
    limit = svc.max_model_len * tok.max_chars_per_token
    text = ("The quick brown fox jumps over the lazy dog. " * (limit // 45 + 1))[:limit - 200]
    many_ids = [i % 40000 + 100 for i in range(200_000)]
    events: list[str] = []
    name = {"prompt": "encode", "chat": "encode_chat", "detokenize": "decode_releasing_gil"}[kind]
    real = getattr(tok, name)

    def traced(*args):
        events.append("start")
        out = real(*args)
        events.append("end")
        return out

    monkeypatch.setattr(tok, name, traced)

    async def run():
        done = False

        async def ticker():
            while not done:
                events.append("tick")
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        try:
            if kind == "prompt":
                return await svc.tokenize(SERVED, text)
            if kind == "detokenize":
                return await svc.detokenize(SERVED, many_ids)
            return await svc.tokenize(SERVED, chat=[ChatMessage("user", text)])
        finally:
            done = True
            await task

    out = serving.call(run())
    if kind == "detokenize":
        assert len(out) > len(many_ids)  # real work: the text of 200k ids
    else:
        assert len(out[1]) > svc.max_model_len  # real work: longer than any context this server takes
    start, end = events.index("start"), events.index("end")
    assert "tick" in events[start:end], f"no loop turn during {end - start - 1} events of tokenization"


def _metric_names(scrape: str) -> set[str]:
    return {line.split("{", 1)[0].split(" ", 1)[0] for line in scrape.splitlines() if line and line[0] != "#"}


def test_every_dashboard_metric_exists_in_a_live_scrape(serving, client):
    """deploy/grafana/pdserve-dashboard.json uses exactly the names the router and the workers export."""
    import json
    import re
    from pathlib import Path

    client.completions.create(model=SERVED, prompt=PROMPT * 4, max_tokens=3, temperature=0)  # a disagg request
    with pytest.raises(Exception):
        client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=50, extra_body={"timeout": 0.001})
    base = serving.spec.metrics_port
    router = httpx.get(serving.http_base_url.removesuffix("/v1") + "/metrics").text
    workers = [httpx.get(f"http://127.0.0.1:{base + i}/metrics").text for i in (1, 2)]
    names = _metric_names(router) | set().union(*map(_metric_names, workers))
    dashboard = json.loads((Path(__file__).parents[1] / "deploy/grafana/pdserve-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"pdserve:[A-Za-z0-9_:]+", e)}
    assert len(used) >= 20 and not used - names, sorted(used - names)
    # the labels operators query: model_name everywhere, finished_reason (vLLM's spelling)
    assert re.search(r'pdserve:request_success_total\{[^}]*finished_reason="length"', router)
    assert f'model_name="{SERVED}"' in router and all(f'model_name="{SERVED}"' in w for w in workers)
    assert "finish_reason=" not in router
    # router and workers never export the same name (a sum over one name would double count)
    assert not (_metric_names(router) - {"pdserve:registry_connected"}) & set().union(*map(_metric_names, workers))
    assert "pdserve:num_requests_running" not in _metric_names(router)
