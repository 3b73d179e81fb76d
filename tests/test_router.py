"""Router pure logic: selection, validation, incremental detokenization with stop strings,
the no-torch rule. No model, no network."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from router.selection import WorkerLoad, choose_decode, choose_prefill, use_local_prefill
from proto.detokenizer import IncrementalDetokenizer
from proto.sampling import InvalidRequest
from router.validation import validate_model

REPO = Path(__file__).resolve().parents[1]


def test_importing_the_router_does_not_import_torch():
    code = ("import sys; import router.app, router.client, router.http_server, router.grpc_server; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# -- selection ---------------------------------------------------------------------------------
def _w(i, total=100, used=0, running=0, waiting=0, alive=True):
    return WorkerLoad(f"w{i}", total, used, running, waiting, alive)


def test_decode_choice_prefers_free_blocks_then_fewest_running():
    assert choose_decode([_w(0, used=50), _w(1, used=10), _w(2, used=10, running=3)]) == "w1"
    assert choose_decode([_w(0, used=10, running=2), _w(1, used=10, running=1)]) == "w1"


def test_prefill_choice_prefers_shortest_queue():
    assert choose_prefill([_w(0, waiting=3), _w(1, waiting=1, running=1), _w(2, waiting=0, running=4)]) == "w1"


def test_dead_and_excluded_workers_are_never_chosen():
    assert choose_decode([_w(0, alive=False), _w(1, used=90)]) == "w1"
    assert choose_prefill([_w(0), _w(1, waiting=5)], exclude=frozenset({"w0"})) == "w1"
    assert choose_prefill([_w(0)], exclude=frozenset({"w0"})) is None
    assert choose_decode([]) is None


def test_ties_break_on_id_deterministically():
    assert choose_decode([_w(2), _w(1), _w(3)]) == "w1"


def test_local_prefill_below_threshold_only():
    assert use_local_prefill(10, 32) and not use_local_prefill(32, 32) and not use_local_prefill(1, 0)


# -- validation (the sampling and prompt rules are tested in test_protocol_layer.py) ----------------
def test_model_rule():
    with pytest.raises(InvalidRequest, match="^model"):
        validate_model("gpt-4", "smollm2")
    validate_model("", "smollm2")


# -- incremental detokenization (proto/detokenizer.py, the router's and the engine's) --------------------------------------------------------------
# A toy byte-level vocabulary: token i decodes to VOCAB[i]; "é" is split over two byte tokens.
VOCAB = {0: b"Hello", 1: b" wor", 2: b"ld", 3: b"\xc3", 4: b"\xa9", 5: b"!", 6: b"\n", 7: b"EN", 8: b"D"}


class _ToyTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def _run(ids, stop=(), step=1):
    d = IncrementalDetokenizer(_ToyTokenizer(), (), tuple(stop))
    out, stopped = [], False
    for i in range(0, len(ids), step):
        out.append(d.step(ids[i:i + step]))
        if d.stopped:
            stopped = True
            break
    if not stopped:
        out.append(d.finish())
    return out, stopped


def test_deltas_join_to_the_full_text_and_never_split_a_character():
    out, stopped = _run([0, 1, 2, 3, 4, 5])
    assert "".join(out) == "Hello world\u00e9!" and not stopped
    assert all("\ufffd" not in piece for piece in out)


def test_stop_string_is_cut_and_never_streamed():
    out, stopped = _run([0, 1, 2, 6, 7, 8, 5], stop=["\nEND"])
    assert stopped and "".join(out) == "Hello world"
    assert all("\n" not in piece for piece in out)


def test_partial_stop_prefix_is_released_when_it_turns_out_not_to_be_one():
    out, stopped = _run([0, 6, 5], stop=["\nEND"])
    assert not stopped and "".join(out) == "Hello\n!"


def test_stop_string_inside_one_token_batch():
    out, stopped = _run([0, 1, 2, 5, 5], stop=["ld!"], step=5)
    assert stopped and "".join(out) == "Hello wor"


def test_http_request_carries_vllm_sampling_extensions():
    """`ignore_eos` and `top_k` (vLLM's extensions, used by benchmark clients) reach the workers."""
    from router.openai_protocol import CompletionRequest

    s = CompletionRequest(prompt="hi", ignore_eos=True, top_k=5, max_tokens=7).sampling(7, {})
    assert (s.ignore_eos, s.top_k, s.max_tokens) == (True, 5, 7)
    assert CompletionRequest(prompt="hi").sampling(None, {}).ignore_eos is False


def test_generation_config_defaults_fill_only_unset_fields(tmp_path):
    """--generation-config auto: the model's generation_config.json gives the defaults a request leaves unset."""
    import json

    from router.openai_protocol import CompletionRequest
    from router.service import generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 33, "eos_token_id": 2}))
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 33}
    s = CompletionRequest(prompt="hi", temperature=0.0).sampling(None, defaults)
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0.0, 0.9, 20, 33)
    assert generation_defaults(tmp_path / "missing") == {}


def test_http_usage_carries_recomputed_tokens_summed_over_choices():
    """pdserve's usage extension (as in the gRPC Usage): what was computed again after a lost
    worker, summed over n choices; not in total_tokens. The real-cluster check, streamed and not,
    after a migration: tests/test_serving_failover.py."""
    from proto.pdserve.v1 import api_pb2
    from router.openai_protocol import Shape, usage_dict
    from router.service import Delta

    usages = [api_pb2.Usage(prompt_tokens=40, completion_tokens=8, recomputed_tokens=43),
              api_pb2.Usage(prompt_tokens=40, completion_tokens=8)]
    assert usage_dict(usages) == {"prompt_tokens": 40, "completion_tokens": 16, "total_tokens": 56,
                                  "prompt_tokens_details": {"cached_tokens": 0}, "recomputed_tokens": 43}
    shape = Shape("cmpl-1", "m", False, str)
    full = shape.full([[Delta([5], "a", "length", usages[0])]], want_logprobs=False)
    assert full["usage"]["recomputed_tokens"] == 43
    assert shape.usage_chunk([usages[1]])["usage"]["recomputed_tokens"] == 0


def test_choices_get_unique_worker_ids_and_seeds_that_wrap_at_2_64():
    """n > 1 with seed 2**64 - 1: choice i's seed + i overflowed the wire's uint64 (a 500)."""
    from proto.sampling import SamplingParams
    from router.fanout import choices
    from router.service import Prepared

    req = Prepared("dupe", [1, 2], SamplingParams(seed=2**64 - 1), flow_id="dupe.ab12")
    out = choices(req, 3)
    assert [c.sampling.seed for c in out] == [2**64 - 1, 0, 1]
    assert [c.request_id for c in out] == ["dupe-0", "dupe-1", "dupe-2"]
    assert [c.worker_request_id for c in out] == ["dupe.ab12-0", "dupe.ab12-1", "dupe.ab12-2"]


# -- request body types (strict) ---------------------------------------------------------------
def _scalar_fields(model) -> list[tuple[str, str]]:
    """(field, JSON type) of every integer, number and boolean field of a request model, nested
    models included (path joined with '.'), read from its own JSON schema."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})

    def kinds(prop: dict) -> set[str]:
        alts = prop.get("anyOf", [prop])
        return {a.get("type") for a in alts if a.get("type") in ("integer", "number", "boolean")} | \
            {f"$ref:{a['$ref'].rsplit('/', 1)[-1]}" for a in alts if "$ref" in a}

    out = []

    def walk(props: dict, prefix: str) -> None:
        for name, prop in props.items():
            for k in kinds(prop):
                if k.startswith("$ref:"):
                    walk(defs[k[5:]].get("properties", {}), f"{prefix}{name}.")
                else:
                    out.append((prefix + name, k))

    walk(schema["properties"], "")
    return out


@pytest.mark.parametrize("model_name", ["CompletionRequest", "ChatCompletionRequest"])
def test_every_numeric_and_boolean_field_refuses_other_json_types(model_name):
    """pydantic's lax mode took "max_tokens": "5" and "stream": "yes" (and true as the integer 1):
    every integer/number/boolean field, nested ones too, is a 400 naming it for a string, and
    integer/number fields for a boolean. A JSON integer stays a valid number."""
    from pydantic import ValidationError

    from router import openai_protocol
    from router.openai_protocol import describe_validation_error

    model = getattr(openai_protocol, model_name)
    base = {"prompt": "hi"} if model_name == "CompletionRequest" else {"messages": [{"role": "user", "content": "hi"}]}
    fields = _scalar_fields(model)
    assert {"max_tokens", "stream", "temperature", "stream_options.include_usage", "n"} <= {f for f, _ in fields}
    for field, kind in fields:
        bad_values = ["5", "yes"] + ([True] if kind != "boolean" else [1])
        for bad in bad_values:
            *parents, leaf = field.split(".")
            body = dict(base)
            target = body
            for p in parents:
                target = target.setdefault(p, {})
            target[leaf] = bad
            with pytest.raises(ValidationError) as e:
                model.model_validate(body)
            named, message = describe_validation_error(e.value.errors())
            assert named == field and "got" in message, (field, bad, named, message)
    assert model.model_validate(base | {"temperature": 1, "top_p": 1}).temperature == 1.0


def test_prompt_of_booleans_is_not_token_ids():
    """prompt [true, false] was taken as token ids [1, 0]: the 400 names prompt and what it may be."""
    from pydantic import ValidationError

    from router.openai_protocol import CompletionRequest, describe_validation_error

    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": [True, False]})
    field, message = describe_validation_error(e.value.errors())
    assert field == "prompt" and message == ("must be a string, a list of strings or a list of token ids (integers), "
                                             "got an array"), message
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompt == [1, 2]
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "hi", "stop_token_ids": [2, True]})
    assert describe_validation_error(e.value.errors()) == ("stop_token_ids.1",
                                                           "Input should be a valid integer, got a boolean")


def test_chat_content_is_required_and_roles_are_the_templates():
    """A user message with content null was an empty turn; role "wizard" a turn the model never saw."""
    from pydantic import ValidationError

    import grpc

    from proto.chat import ChatMessage, check_roles
    from router.errors import ServiceError
    from router.openai_protocol import ChatCompletionRequest, describe_validation_error

    for content in ({"content": None}, {}):
        with pytest.raises(ValidationError) as e:
            ChatCompletionRequest.model_validate({"messages": [{"role": "system", "content": "x"},
                                                               {"role": "user", **content}]})
        assert describe_validation_error(e.value.errors())[0] == "messages.1.content"
    check_roles([ChatMessage(r, "x") for r in ("system", "user", "assistant")])
    for role in ("wizard", "", "tool", "USER"):
        with pytest.raises(InvalidRequest, match=r"messages\.1\.role: must be one of system, user, assistant") as e:
            check_roles([ChatMessage("user", "x"), ChatMessage(role, "x")])
        assert e.value.field == "messages.1.role"
    # a text part without its text names .text (it said "only text parts are supported, got 'text'")
    for part, field in (({"type": "text"}, "messages.0.content.1.text"),
                        ({"type": "text", "text": None}, "messages.0.content.1.text"),
                        ({"type": "image_url", "image_url": {}}, "messages.0.content.1.type")):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, part]}]})
        with pytest.raises(ServiceError, match=rf"^{field}: ") as e:
            req.chat()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_send_json_is_one_complete_json_response():
    """router/asgi.py's answer, shared by the API-key and body-limit middlewares (their real-server
    401 and 413: tests/test_auth.py)."""
    import asyncio
    import json

    from router.asgi import send_json

    sent = []

    async def send(message):
        sent.append(message)

    body = {"error": {"message": "é too big", "code": 413}}
    asyncio.run(send_json(send, 413, body, headers=((b"connection", b"close"),)))
    start, end = sent
    assert start["type"] == "http.response.start" and start["status"] == 413
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"application/json" and headers[b"connection"] == b"close"
    assert int(headers[b"content-length"]) == len(end["body"]) and json.loads(end["body"]) == body
    assert end["type"] == "http.response.body" and not end.get("more_body", False)


def test_a_long_conversation_of_empty_messages_is_tokenized_off_the_event_loop():
    """500k messages with empty contents counted 0 characters, so the router rendered and encoded
    them (~8 s) on its event loop; each message now counts CHAT_MESSAGE_CHARS for that choice."""
    import asyncio
    import threading
    import types

    from proto.chat import ChatMessage
    from router.service import CHAT_MESSAGE_CHARS, INLINE_TOKENIZE_CHARS, RouterService

    threads = []

    def encode_chat(chat, add_generation_prompt):
        threads.append(threading.current_thread())
        return "", [1]

    def service():
        s = types.SimpleNamespace(model_id="m", max_model_len=8192,
                                  tokenizer=types.SimpleNamespace(encode_chat=encode_chat, max_chars_per_token=81))
        s._check_prompt_chars = lambda field, chars: RouterService._check_prompt_chars(s, field, chars)
        return s

    async def tokenize(n):
        return await RouterService.tokenize(service(), "", chat=[ChatMessage("user", "")] * n)

    few = INLINE_TOKENIZE_CHARS // CHAT_MESSAGE_CHARS
    asyncio.run(tokenize(few))
    asyncio.run(tokenize(few + 1))
    assert threads[0] is threading.main_thread() and threads[1] is not threading.main_thread()


def test_lone_surrogates_are_found_with_their_path_and_nothing_else_is():
    """router/openai_protocol.py's body walk (a 400 naming the field), rewritten so that a 16 MiB
    body of token ids or messages costs the event loop ~0.25 s instead of ~1 s."""
    import json

    from router.openai_protocol import _surrogate_path

    assert _surrogate_path({"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "x\ud800"}]},
                           ()) == ("messages", "1", "content")
    assert _surrogate_path({"prompt": [1, 2, None, True, 2.5, "é🙂", ["\udfff"]]}, ("body",)) == ("body", "prompt", "6", "0")
    assert _surrogate_path({"stop": ["a"], "k\udc00": 1}, ()) == ("<key>",)
    assert _surrogate_path("\ud800", ()) == ()
    # an escaped pair is one code point after json.loads, and valid
    assert _surrogate_path(json.loads('{"prompt": "\\ud83d\\ude00 é", "n": [1, {"a": "b"}]}'), ()) is None


def test_a_streaming_client_gone_before_its_first_token_cancels_the_stream():
    """router/http_server.py waits for the first delta before the SSE headers; a client that
    disconnected meanwhile was noticed only at the first token (a whole queue wait and prefill)."""
    import asyncio

    from router.http_server import _GONE, _first_unless_gone

    closed = []

    async def never():
        try:
            await asyncio.sleep(3600)
            yield 0, None
        finally:
            closed.append(True)

    async def one():
        yield 0, "delta"

    class Gone:
        async def is_disconnected(self):
            return True

    class Here:
        async def is_disconnected(self):
            return False

    async def main():
        assert await asyncio.wait_for(_first_unless_gone(never(), Gone()), 5) is _GONE
        assert await _first_unless_gone(one(), Here()) == (0, "delta")

        async def empty():
            return
            yield

        assert await _first_unless_gone(empty(), Here()) is None

    asyncio.run(main())
    assert closed == [True]
