"""What both front ends (gRPC and OpenAI HTTP) call: tokenize, validate, admit, stream text.

`prepare` turns a request into prompt token ids and validated sampling options, raising
ServiceError(INVALID_ARGUMENT) naming the field before any worker is touched. `stream` admits the
request (RESOURCE_EXHAUSTED past --max-waiting), runs it through the orchestrator under its
deadline, detokenizes incrementally, applies stop strings, and yields `Delta`s; the first carries
the server-side TTFT, the last the finish reason and usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import grpc

from proto.chat import ChatMessage, ChatTemplateError, check_roles
from proto.detokenizer import IncrementalDetokenizer
from proto.pdserve.v1 import api_pb2
from proto.sampling import InvalidRequest, SamplingParams, check_prompt, to_wire
from router.errors import ServiceError
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.pool import WorkerPool
from router.tokenizer import RouterTokenizer
from router.validation import validate_model

DEFAULT_DEADLINE_S = 600.0
# Texts up to this many characters (or lists of as many token ids) are tokenized (detokenized) on the
# event loop itself (~0.8 us per character or id: at most ~2 ms); longer ones on the loop's executor,
# where the thread hop's cost is small beside them.
INLINE_TOKENIZE_CHARS = 2048
# What one chat message adds to the rendered text beside its content, counted for that choice only
# (the model's template writes ~28 characters a turn: "<|im_start|>user\n...<|im_end|>\n"): a
# conversation of 500k empty messages (16 MiB of JSON) had 0 content characters, so it was rendered
# and encoded on the loop itself, 1.6 s per 100k messages.
CHAT_MESSAGE_CHARS = 16


@dataclass(frozen=True)
class Prepared:
    """request_id: the client's id (or one made here), echoed in responses. flow_id: the id the
    workers see, unique per request even when clients reuse an id (two concurrent requests with
    one id made the worker answer ALREADY_EXISTS, which the router read as a lost worker; its
    cleanup Abort then ended the first request too). Empty: the same as request_id."""
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    flow_id: str = ""

    @property
    def worker_request_id(self) -> str:
        return self.flow_id or self.request_id


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: api_pb2.Usage | None = None
    ttft_s: float | None = None
    logprobs: list[api_pb2.TokenLogprob] = field(default_factory=list)  # one per token_ids entry, when asked


@dataclass(frozen=True)
class ServiceConfig:
    """max_waiting: admitted-but-not-started requests before RESOURCE_EXHAUSTED.
    served_model_name: the model id clients use (None = the workers' model id).
    chat_template: path of a Jinja chat template replacing the model's (None = the model's).
    generation_config: "auto" | "vllm" | a directory (see `generation_defaults`).
    request_timeout_s: deadline of a request that names none."""

    max_waiting: int = 256
    served_model_name: str | None = None
    chat_template: str | None = None
    generation_config: str = "auto"
    request_timeout_s: float = DEFAULT_DEADLINE_S


class RouterService:
    def __init__(self, pool: WorkerPool, orchestrator: Orchestrator, metrics: RouterMetrics,
                 config: ServiceConfig = ServiceConfig()) -> None:
        self.pool = pool
        self.orchestrator = orchestrator
        self.metrics = metrics
        self.config = config
        self.max_waiting = config.max_waiting
        self.waiting = 0
        self.running = 0
        self._tokenizer: RouterTokenizer | None = None
        self._chat_template = _read_template(config.chat_template)
        self._defaults: dict | None = None
        self._last_model_id = ""

    # -- model facts, learned from the workers ------------------------------------------------
    def _info(self):
        info = self.pool.any_info()
        if info is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no live worker; retry later")
        return info

    @property
    def model_name(self) -> str:
        """The metrics' model_name: the served id, or "" before any worker was seen."""
        if self.config.served_model_name:
            return self.config.served_model_name
        info = self.pool.any_info()
        if info is not None:
            self._last_model_id = info.model_id
        return self._last_model_id

    @property
    def _m(self):
        return self.metrics.model(self.model_name)

    @property
    def model_id(self) -> str:
        return self.config.served_model_name or self._info().model_id

    @property
    def max_model_len(self) -> int:
        return self._info().max_model_len

    @property
    def tokenizer(self) -> RouterTokenizer:
        if self._tokenizer is None:
            self._tokenizer = RouterTokenizer(self._model_files(), chat_template=self._chat_template)
        return self._tokenizer

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (logprobs name the tokens this way)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @property
    def generation_defaults(self) -> dict:
        """Default sampling values for fields a request leaves unset (vLLM's --generation-config)."""
        if self._defaults is None:
            source = self.config.generation_config
            if source == "vllm":
                self._defaults = {}
            elif source == "auto":  # the model's own file, as the worker sent it
                text = self._model_files().get("generation_config.json")
                self._defaults = _defaults_from_json(text.decode() if text is not None else None)
            else:
                self._defaults = generation_defaults(Path(source))
        return self._defaults

    def _model_files(self) -> dict[str, bytes]:
        """The model's tokenizer files, fetched from a worker by the pool (never read from its disk)."""
        files = self.pool.model_files
        if files is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no live worker; retry later")
        return files

    # -- request preparation ---------------------------------------------------------------------
    async def tokenize(self, model: str, prompt: str | None = None, chat: list[ChatMessage] | None = None,
                       add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """(rendered prompt text, token ids); raises ServiceError(INVALID_ARGUMENT). A text longer
        than INLINE_TOKENIZE_CHARS is encoded on the loop's executor thread, so other requests'
        streams, /health and the workers' polls go on meanwhile (a prompt just under the character
        bound of an 8192-token context takes ~0.4 s)."""
        tok = self.tokenizer
        try:
            validate_model(model, self.model_id)
            if chat is not None:
                if not chat:
                    raise InvalidRequest("messages", "must not be empty")
                check_roles(chat)
                chars = sum(len(m.content) for m in chat)
                self._check_prompt_chars("messages", chars)
                return await _off_loop(chars + CHAT_MESSAGE_CHARS * len(chat), tok.encode_chat, chat,
                                       add_generation_prompt)
            if not prompt:
                raise InvalidRequest("prompt", "must not be empty")
            self._check_prompt_chars("prompt", len(prompt))
            return prompt, await _off_loop(len(prompt), tok.encode, prompt)
        except (InvalidRequest, ChatTemplateError) as e:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    def _check_prompt_chars(self, field: str, chars: int) -> None:
        """InvalidRequest when the text is too long for the context whatever it tokenizes to: no
        token covers more than max_chars_per_token characters. Checked before tokenizing because
        the tokenizer holds the GIL: a 12 MiB prompt stalled the router's event loop (every stream,
        /health, the workers' polls) for 10 s before its 400."""
        limit = self.max_model_len * self.tokenizer.max_chars_per_token
        if chars > limit:
            raise InvalidRequest(field, f"{chars} characters cannot fit the context of {self.max_model_len} tokens "
                                        f"(at most {limit} characters); shorten the prompt")

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        """The text of token ids (special tokens skipped); ServiceError(INVALID_ARGUMENT) naming
        `model` or `tokens`. A list over INLINE_TOKENIZE_CHARS ids is checked and decoded on the
        loop's executor (the body limit lets through millions of ids: ~0.9 us each)."""
        self.check_model(model)
        vocab = self.tokenizer.vocab_size

        def run() -> str:
            if any(not 0 <= t < vocab for t in token_ids):
                raise InvalidRequest("tokens", f"token ids must be in [0, {vocab})")
            return self.tokenizer.decode_releasing_gil(token_ids)

        try:
            return await _off_loop(len(token_ids), run)
        except InvalidRequest as e:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    def check_model(self, model: str) -> None:
        """Raises ServiceError(INVALID_ARGUMENT) unless model is empty or the served model id."""
        try:
            validate_model(model, self.model_id)
        except InvalidRequest as e:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    async def prepare(self, model: str, sampling: SamplingParams, *, prompt: str | None = None,
                chat: list[ChatMessage] | None = None, token_ids: list[int] | None = None,
                request_id: str = "", add_generation_prompt: bool = True) -> Prepared:
        try:
            if token_ids is not None:
                validate_model(model, self.model_id)
                ids = list(token_ids)
            else:
                ids = (await self.tokenize(model, prompt, chat, add_generation_prompt))[1]
            check_prompt(ids, sampling.max_tokens, self.max_model_len)
            self._check_kv_capacity(len(ids), sampling.max_tokens)
        except InvalidRequest as e:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if not request_id:
            return Prepared(f"req-{uuid.uuid4().hex[:16]}", ids, sampling)
        return Prepared(request_id, ids, sampling, flow_id=f"{request_id}.{uuid.uuid4().hex[:8]}")

    def _check_kv_capacity(self, prompt_len: int, max_tokens: int) -> None:
        """InvalidRequest("max_tokens") when prompt + max_tokens needs more KV blocks than the largest
        live decode-capable worker has in all: it could only ever get RESOURCE_EXHAUSTED (429, "retry
        later"), and no retry can succeed. Skipped until the workers' Stats are known."""
        totals = [(w.stats.kv_blocks_total, w.info.block_size) for w in self.pool.workers()
                  if w.alive and w.endpoint.role in ("decode", "agg") and w.stats.kv_blocks_total > 0
                  and w.info.block_size > 0]
        if not totals:
            return
        blocks, block_size = max(totals, key=lambda t: t[0] * t[1])
        need = -(-(prompt_len + max_tokens) // block_size)
        if need > blocks:
            raise InvalidRequest("max_tokens", f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs "
                                               f"{need} KV blocks of {block_size} tokens, but the largest decode "
                                               f"worker's KV cache holds {blocks} blocks ({blocks * block_size} "
                                               f"tokens); shorten the prompt or lower max_tokens")

    # -- streaming -------------------------------------------------------------------------------
    async def stream(self, req: Prepared, timeout_s: float | None = None) -> AsyncIterator[Delta]:
        """Yield the request's deltas; raises ServiceError (the metrics count it either way)."""
        if self.waiting >= self.max_waiting:
            self.metrics.errors(self.model_name, "RESOURCE_EXHAUSTED").inc()
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"more than {self.max_waiting} requests waiting; retry later")
        start = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + (timeout_s or self.config.request_timeout_s)
        self.waiting += 1
        self._m.waiting.inc()
        started = False
        try:
            async with asyncio.timeout_at(deadline):
                async for delta in self._run(req, start, deadline):
                    if not started:
                        started = True
                        self._move_to_running()
                    yield delta
        except TimeoutError:
            self.metrics.errors(self.model_name, "DEADLINE_EXCEEDED").inc()
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None
        except ServiceError as e:
            self.metrics.errors(self.model_name, e.code.name).inc()
            raise
        finally:
            if started:
                self.running -= 1
                self._m.running.dec()
            else:
                self.waiting -= 1
                self._m.waiting.dec()

    def _move_to_running(self) -> None:
        self.waiting -= 1
        self._m.waiting.dec()
        self.running += 1
        self._m.running.inc()

    async def _run(self, req: Prepared, start: float, deadline: float) -> AsyncIterator[Delta]:
        s = req.sampling
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, s.stop, s.skip_special_tokens)
        n_out, cached, recomputed, last_t, first_t = 0, 0, 0, None, start
        flow = self.orchestrator.run(req.worker_request_id, req.prompt_ids, to_wire(s), deadline)
        async with contextlib.aclosing(flow):
            async for tokens in flow:
                now = time.perf_counter()
                ttft = None
                if last_t is None:
                    ttft = now - start
                    first_t = now
                    self._m.ttft.observe(ttft)
                    self._m.kv_bytes.inc(tokens.kv_bytes)
                    if tokens.kv_bytes:
                        self._m.kv_seconds.observe(tokens.transfer_seconds)
                elif tokens.token_ids:
                    self._m.itl.observe((now - last_t) / len(tokens.token_ids))
                last_t = now
                n_out += len(tokens.token_ids)
                if tokens.usage is not None:
                    cached = max(cached, tokens.usage.cached_tokens)
                    recomputed = max(recomputed, tokens.usage.recomputed_tokens)
                text = detok.step(tokens.token_ids)
                finish = "stop" if detok.stopped else tokens.finish_reason
                if finish and not detok.stopped:
                    text += detok.finish()
                delta = Delta(tokens.token_ids, text, finish, ttft_s=ttft, logprobs=tokens.logprobs)
                if finish:
                    delta.usage = api_pb2.Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=n_out,
                                                cached_tokens=cached, recomputed_tokens=recomputed)
                    self._record_finish(finish, start, first_t, n_out, len(req.prompt_ids), cached)
                    yield delta
                    return
                yield delta

    def _record_finish(self, finish: str, start: float, first_t: float, n_out: int, n_prompt: int,
                       cached: int) -> None:
        m = self._m
        now = time.perf_counter()
        m.e2e.observe(now - start)
        if n_out > 1:
            m.tpot.observe((now - first_t) / (n_out - 1))
        self.metrics.finished(self.model_name, finish).inc()
        m.prompt_tokens.inc(n_prompt)
        m.generation_tokens.inc(n_out)
        m.cached_tokens.inc(cached)


async def _off_loop(chars: int, fn, *args):
    """fn(*args), on the running loop's default executor when the text has more than
    INLINE_TOKENIZE_CHARS characters (or ids); fn must release the GIL for most of its work for that
    to help (RouterTokenizer's encode, encode_chat and decode_releasing_gil do)."""
    if chars <= INLINE_TOKENIZE_CHARS:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


# generation_config.json key -> our sampling field (transformers' names; vLLM reads the same keys)
_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                    "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: Path) -> dict:
    """The sampling defaults in model_dir/generation_config.json (missing file: none).

    Only the keys in _GENERATION_KEYS are used; a key the file does not set keeps the server default."""
    path = model_dir / "generation_config.json"
    try:
        return _defaults_from_json(path.read_text() if path.exists() else None)
    except OSError:
        return {}


def _defaults_from_json(text: str | None) -> dict:
    """The sampling defaults in the text of a generation_config.json (None or unparsable: none)."""
    if text is None:
        return {}
    try:
        config = json.loads(text)
    except ValueError:
        return {}
    return {ours: config[theirs] for theirs, ours in _GENERATION_KEYS.items() if config.get(theirs) is not None}


def _read_template(path: str | None) -> str | None:
    """The text of a --chat-template file (checked readable by the CLI before anything starts)."""
    return None if path is None else Path(path).read_text()


def with_defaults(wire: api_pb2.SamplingOptions, defaults: dict) -> api_pb2.SamplingOptions:
    """A copy of a client's wire options with `defaults` (--generation-config) in the fields it left unset."""
    out = api_pb2.SamplingOptions()
    out.CopyFrom(wire)
    for name in ("temperature", "top_p", "max_tokens"):
        if not out.HasField(name) and name in defaults:
            setattr(out, name, defaults[name])
    if not out.top_k and "top_k" in defaults:
        out.top_k = defaults["top_k"]
    return out
