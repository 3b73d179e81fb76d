"""The OpenAI / vLLM request bodies pdserve accepts, and the response objects it returns. No torch.

Every accepted field is declared; any other field is refused with a 400 naming it (pydantic
``extra="forbid"``), and a declared field whose value pdserve cannot honour (``suffix``,
a non-empty ``logit_bias``, ``echo`` with ``logprobs``, a non-text content part) is a 400 naming
it too: never a 200 that ignored something. Types are strict (pydantic ``strict=True``): a value of
the wrong JSON type is a 400 naming the field and what was sent, never coerced ("5" is no integer,
"yes" no boolean, ``true`` no token id); a JSON integer is a valid number. vLLM extensions accepted: ``top_k``, ``min_tokens``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``; pdserve's: ``timeout`` (seconds).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Callable

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from proto.chat import ChatMessage
from proto.pdserve.v1 import api_pb2
from proto.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from router.errors import ServiceError
from router.service import Delta


def invalid(field: str, message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")


# Integers as the wire carries them (proto/pdserve/v1/api.proto: int32, seed uint64): a larger
# value is a 400 naming the field, not a protobuf error (500) after validation.
Int32 = Annotated[int, Field(ge=-2**31, le=2**31 - 1)]
Seed = Annotated[int, Field(ge=0, le=2**64 - 1)]


class _Strict(BaseModel):
    # allow_inf_nan=False: NaN and ±Infinity (which Python's json accepts) are a 400, never a sampling value.
    # strict=True: a JSON value of the wrong type is a 400 naming the field, never coerced (pydantic's lax
    # mode took "max_tokens": "5", "stream": "yes" and prompt [true, false] as token ids [1, 0]); an
    # integer where a number is expected stays accepted (strict floats take ints).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer, protobuf string or
        # UTF-8 response can carry: refuse them here with the field's path (a 400)
        where = _surrogate_path(data, ())
        if where is not None:
            raise ValueError(f"{'.'.join(where) or 'body'}: invalid Unicode (a lone surrogate)")
        return data


def _surrogate_path(value: Any, path: tuple[str, ...]) -> tuple[str, ...] | None:
    """The path of the first string (key or value) in a decoded JSON value holding a lone surrogate."""
    found = _surrogate_at(value)
    return None if found is None else path + tuple(reversed(found))


def _has_surrogate(s: str) -> bool:
    # UTF-8 encoding fails exactly on surrogates (json.loads joins an escaped pair into one code
    # point); both calls run in C, a per-character generator cost ~1 us a string
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _surrogate_at(value: Any) -> list[str] | None:
    # The path comes back reversed and is built only on a hit, and numbers, booleans and null are
    # skipped without a call: a 16 MiB body of ~3M token ids or ~500k messages took 0.76 s / 1.2 s
    # of the event loop when every element got a call and a new path tuple.
    if isinstance(value, str):
        return [] if _has_surrogate(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and _has_surrogate(k):
                return ["<key>"]
            if isinstance(v, (str, dict, list)):
                found = _surrogate_at(v)
                if found is not None:
                    found.append(str(k))
                    return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, (str, dict, list)):
                found = _surrogate_at(v)
                if found is not None:
                    found.append(str(i))
                    return found
    return None


# How pydantic names a union's members in an error's location ("prompt", "list[constrained-int]", 0):
# the readable form of each alternative a field accepts.
_UNION_MEMBERS = {"str": "a string", "list[str]": "a list of strings", "list[int]": "a list of token ids (integers)",
                  "list[constrained-int]": "a list of token ids (integers)",
                  "list[ContentPart]": 'a list of content parts ({"type": "text", "text": "..."})'}


def _is_union_member(part: object) -> bool:
    # our field names are snake_case identifiers; pydantic's member labels are type names
    return isinstance(part, str) and (part in _UNION_MEMBERS or "[" in part or "-" in part or part[:1].isupper()
                                      or part in ("int", "float", "bool"))


def describe_validation_error(errors: list[dict]) -> tuple[str, str]:
    """(field, message) for the first of pydantic's errors of a request body, e.g. ("prompt",
    "must be a string, a list of strings or a list of token ids (integers)"). A value that fits no
    member of a union names the union's field and its alternatives, not pydantic's member labels."""
    if not errors:
        return "body", "invalid"
    loc = [x for x in errors[0].get("loc", ()) if x != "body"]
    cut = next((i for i, x in enumerate(loc) if _is_union_member(x)), None)
    if cut is None:
        kind = errors[0].get("type", "")
        msg = "not supported by pdserve" if kind == "extra_forbidden" else errors[0].get("msg", "invalid")
        if kind.endswith("_type") and "input" in errors[0]:  # strict types: say what was sent instead
            msg += f", got {_json_type(errors[0]['input'])}"
        return ".".join(map(str, loc)) or "body", msg
    members: list[str] = []
    for e in errors:
        here = [x for x in e.get("loc", ()) if x != "body"]
        if here[:cut] == loc[:cut] and len(here) > cut and here[cut] not in members:
            members.append(here[cut])
    alternatives = [_UNION_MEMBERS.get(str(m), str(m)) for m in members]
    listed = alternatives[0] if len(alternatives) == 1 else ", ".join(alternatives[:-1]) + " or " + alternatives[-1]
    got = f", got {_json_type(errors[0]['input'])}" if "input" in errors[0] else ""
    return ".".join(map(str, loc[:cut])) or "body", f"must be {listed}{got}"


def _json_type(value: object) -> str:
    """The JSON type of a decoded JSON value, as a client wrote it ("a string", "a boolean")."""
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM; refused when true (see check)


class _SamplingFields(_Strict):
    model: str = ""
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int32] | None = Field(default=None, description="vLLM: token ids that end the output")
    top_k: Int32 | None = Field(default=None, description="vLLM: keep the k most likely tokens (0 = all)")
    min_tokens: Int32 = Field(default=0, description="vLLM: EOS and stop token ids cannot end the output before")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = Field(default=1.0, description="vLLM: > 1 discourages tokens already seen")
    ignore_eos: bool = Field(default=False, description="vLLM: generate past EOS until max_tokens")
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int32 = 1
    user: str | None = None
    timeout: float | None = Field(default=None, gt=0, le=86400,
                                   description="pdserve: deadline in seconds (0 < timeout <= 86400)")

    def sampling(self, max_tokens: int | None, defaults: dict, logprobs: int | None = None) -> SamplingParams:
        """Validated params; raises InvalidRequest naming the field (answered as a 400).
        defaults: values for unset fields (--generation-config), else the OpenAI defaults."""
        if self.logit_bias:
            raise invalid("logit_bias", "not supported by pdserve")
        if self.stream_options and self.stream_options.continuous_usage_stats:
            raise invalid("stream_options.continuous_usage_stats", "not supported by pdserve")
        if self.stream_options and not self.stream:
            raise invalid("stream_options", "only allowed with stream=true")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

        def pick(name: str, value, fallback):
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(temperature=pick("temperature", self.temperature, 1.0),
                              top_p=pick("top_p", self.top_p, 1.0), top_k=pick("top_k", self.top_k, 0), seed=self.seed,
                              max_tokens=pick("max_tokens", max_tokens, DEFAULT_MAX_TOKENS), stop=stop,
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              logprobs=logprobs, min_tokens=self.min_tokens, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[Int32]
    logprobs: Int32 | None = None   # top-n per token, 0..20
    echo: bool = False
    best_of: Int32 | None = None
    suffix: str | None = None

    def engine_logprobs(self) -> int | None:
        if self.suffix is not None:
            raise invalid("suffix", "not supported by pdserve")
        if self.echo and self.logprobs is not None:
            raise invalid("echo", "with logprobs needs the prompt's logprobs, which pdserve does not compute")
        return self.logprobs


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # image_url etc. are refused by type, with their name
    type: str
    text: str | None = None


class ChatMessageIn(_Strict):
    """role: checked against proto/chat.py's CHAT_ROLES where both APIs meet (RouterService.tokenize).
    content: required, never null (OpenAI allows null only beside tool_calls, which pdserve does not accept)."""
    role: str
    content: str | list[ContentPart]
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageIn]
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    add_generation_prompt: bool = True

    def engine_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[ChatMessage]:
        """The conversation with every content as one string (a list of text parts is joined)."""
        if not self.messages:
            raise invalid("messages", "must not be empty")
        return [ChatMessage(m.role, _content_text(m, i)) for i, m in enumerate(self.messages)]


def _content_text(m: ChatMessageIn, i: int) -> str:
    if m.name is not None:
        raise invalid(f"messages.{i}.name", "not supported by pdserve")
    if isinstance(m.content, str):
        return m.content
    texts = []
    for j, part in enumerate(m.content):
        if part.type != "text":
            raise invalid(f"messages.{i}.content.{j}.type", f"only text parts are supported, got {part.type!r}")
        if part.text is None:  # was "only text parts are supported, got 'text'": name the missing field
            raise invalid(f"messages.{i}.content.{j}.text", "a text part needs a string text")
        texts.append(part.text)
    return "".join(texts)


class TokenizeRequest(_Strict):
    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_generation_prompt: bool = True


class DecodeTokensRequest(_Strict):
    model: str = ""
    tokens: list[int]


# ---- responses -----------------------------------------------------------------------------------

def usage_dict(usages: list[api_pb2.Usage]) -> dict | None:
    """One usage for n completions of one prompt: the prompt once, the completions summed.

    ``recomputed_tokens`` (pdserve's extension, as in the gRPC Usage): tokens computed again after
    a worker was lost — a migrated request's prompt and already streamed tokens, a prefill retried
    elsewhere — summed over the completions; 0 when nothing failed. They are not in
    ``total_tokens``, which counts what the client sent and received, as OpenAI's does."""
    if not usages:
        return None
    prompt = usages[0].prompt_tokens
    completion = sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": max(u.cached_tokens for u in usages)},
            "recomputed_tokens": sum(u.recomputed_tokens for u in usages)}


class Shape:
    """OpenAI response objects for one request (chat or completion, n choices).

    token_text: a token id's text (logprobs name tokens); echo: text put before each choice's output.
    """

    def __init__(self, rid: str, model: str, chat: bool, token_text: Callable[[int], str], echo: str = "") -> None:
        self.id, self.model, self.chat, self.created = rid, model, chat, int(time.time())
        self.token_text, self.echo = token_text, echo
        self._offsets: dict[int, int] = {}  # completions logprobs: text_offset per choice

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, per_choice: list[list[Delta]], want_logprobs: bool) -> dict:
        choices, usages = [], []
        for i, deltas in enumerate(per_choice):
            text = "".join(d.text for d in deltas)
            last = deltas[-1] if deltas else None
            lps = [lp for d in deltas for lp in d.logprobs] if want_logprobs else None
            if last is not None and last.usage is not None:
                usages.append(last.usage)
            choices.append(self._choice(i, text, last.finish_reason if last else None, lps, first=True, full=True))
        obj = self._base("chat.completion" if self.chat else "text_completion")
        return obj | {"choices": choices, "usage": usage_dict(usages)}

    def chunk(self, index: int, d: Delta, first: bool, want_logprobs: bool) -> dict:
        obj = self._base("chat.completion.chunk" if self.chat else "text_completion")
        return obj | {"choices": [self._choice(index, d.text, d.finish_reason, d.logprobs if want_logprobs else None,
                                               first=first, full=False)]}

    def usage_chunk(self, usages: list[api_pb2.Usage]) -> dict:
        return self._base("chat.completion.chunk" if self.chat else "text_completion") | {
            "choices": [], "usage": usage_dict(usages)}

    def _choice(self, index: int, text: str, finish: str | None, lps: list | None, first: bool, full: bool) -> dict:
        if self.chat:
            body: dict[str, Any] = {"role": "assistant", "content": text} if full else (
                {"role": "assistant", "content": text} if first else {"content": text})
            key = "message" if full else "delta"
            return {"index": index, key: body, "logprobs": self._chat_logprobs(lps), "finish_reason": finish}
        if first and self.echo:
            text = self.echo + text
        return {"index": index, "text": text, "logprobs": self._completion_logprobs(index, lps, first),
                "finish_reason": finish}

    def _chat_logprobs(self, lps: list | None) -> dict | None:
        if lps is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            s = self.token_text(token_id)
            return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

        return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t.token_id, t.logprob)
                                                                               for t in lp.top]}
                            for lp in lps]}

    def _completion_logprobs(self, index: int, lps: list | None, first: bool) -> dict | None:
        if lps is None:
            return None
        if first:
            self._offsets[index] = len(self.echo)
        tokens, offsets = [], []
        for lp in lps:
            s = self.token_text(lp.token_id)
            offsets.append(self._offsets[index])
            self._offsets[index] += len(s)
            tokens.append(s)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self.token_text(t.token_id): t.logprob for t in lp.top} for lp in lps],
                "text_offset": offsets}
