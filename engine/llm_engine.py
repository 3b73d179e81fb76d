"""LLMEngine: the synchronous core of continuous batching. One ``step()`` is

    speculator.drafts(running) -> draft tokens per decode row      (speculative decoding only)
    scheduler.schedule(drafts) -> plan
    ModelRunner.forward(plan's chunks, layer_hook) -> logits
    Sampler.sample(logits, params, per-request generators) -> tokens
        (verification rows: engine/spec_decode/rejection.py:verify_one_hot)
    scheduler.update(plan, result) -> requests with new tokens
    speculator.prefill_drafts(those)   (a draft model: the prompts whose first token was sampled)
    detokenize (stop strings) -> RequestOutput per request

Without speculation, or when every row's k is 0, a step is exactly the plain decode step: the
same plan, one forward, one sampler call.

Not thread-safe: call it from one thread (AsyncEngine runs it in a single worker thread).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from engine.batch import SeqChunk
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import UserError
from engine.outputs import ChunkInfo, EngineStats, RemoteReservation, RequestOutput, RequestTimes, Usage
from engine.plan import SchedulePlan, StepResult
from engine.request import Request, RequestState
from engine.scheduler import Scheduler
from proto.chat import ChatMessage, ChatTemplate
from proto.detokenizer import IncrementalDetokenizer
from proto.sampling import InvalidRequest, SamplingParams

LayerHook = Callable[[int, list[ChunkInfo]], None]
log = logging.getLogger(__name__)


@dataclass
class _Stream:
    """Per-request output state: what was already sent, the detokenizer, the sampler's generator."""

    detokenizer: IncrementalDetokenizer
    generator: object | None
    num_sent: int = 0


class LLMEngine:
    """runner / tokenizer: pass them to share a loaded model (tests, benchmarks); by default
    they are loaded from ``config.model``. With a shared runner, ``config.cache.num_blocks`` (if
    set) limits the engine to that many of the runner's blocks. track_kv_waste: sample allocated-vs-filled KV slots
    every step (benchmarks). draft_runner: the draft model's runner for speculative method "draft"
    (its own cache; by default loaded from ``config.speculative.model``)."""

    def __init__(self, config: EngineConfig, *, runner=None, tokenizer=None, track_kv_waste: bool = False,
                 draft_runner=None) -> None:
        import torch

        from engine.model_loader import load_tokenizer
        from engine.model_runner import ModelRunner
        from engine.sampler import Sampler, make_generator

        from engine import platform

        if config.num_threads or config.cpu_cores:
            platform.bind_to_cores(config.cpu_cores, config.num_threads or len(config.cpu_cores or ()))
        cache = config.cache
        self.config = config
        if runner is None:
            dtype = platform.resolve_dtype_name(config.dtype, config.device)
            log.info("engine: dtype %s (%s), %d threads%s", dtype,
                     platform.dtype_reason(config.dtype, dtype, config.device), torch.get_num_threads(),
                     f" on cores {platform.format_cores(config.cpu_cores)}" if config.cpu_cores else "")
        self.runner = runner or ModelRunner(config.model, block_size=cache.block_size, num_blocks=cache.num_blocks,
                                            kv_cache_memory_bytes=cache.resolved_memory_bytes(),
                                            dtype=getattr(torch, dtype), device=config.device,
                                            quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype)
        self.model_config = self.runner.model_config
        self.tokenizer = tokenizer or load_tokenizer(self.model_config.path)
        num_blocks = self.runner.num_blocks
        if runner is not None and cache.num_blocks is not None:
            num_blocks = min(num_blocks, cache.num_blocks)  # manage a part of a shared runner's cache
        self.block_manager = BlockManager(num_blocks, self.runner.block_size, watermark=cache.watermark,
                                          enable_prefix_caching=cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, max_model_len=self.model_config.max_model_len,
                                   eos_token_ids=self.model_config.eos_token_ids)
        self.sampler = Sampler(self.model_config.eos_token_ids)
        self.speculator = self._make_speculator(config, draft_runner)
        self._make_generator = make_generator
        self._streams: dict[str, _Stream] = {}
        self.layer_hook: LayerHook | None = None
        self.num_steps = 0
        self.last_step_ran = False
        self.track_kv_waste = track_kv_waste
        self.kv_waste_samples: list[float] = []
        self.kv_usage_peak = 0.0
        self._template: ChatTemplate | None = None

    def _make_speculator(self, config: EngineConfig, draft_runner=None):
        spec = config.speculative
        if spec is None:
            return None
        if config.scheduler.batching != "continuous":
            raise ValueError("speculative decoding needs continuous batching")
        from engine.spec_decode.speculator import Speculator

        proposer = None
        if spec.method == "draft":
            from engine.model_runner import ModelRunner
            from engine.spec_decode.draft import DraftModelProposer

            draft_runner = draft_runner or ModelRunner(spec.model, block_size=self.runner.block_size,
                                                       num_blocks=self.runner.num_blocks,
                                                       # the target's dtype (config.dtype may be "auto")
                                                       dtype=self.runner.dtype, device=config.device,
                                                       quantization=spec.quantization)
            proposer = DraftModelProposer(draft_runner, self.model_config.vocab_size, spec.draft_vocab_size)
        return Speculator(spec, self.scheduler.max_model_len, proposer)

    def _release_spec(self, request_id: str) -> None:
        if self.speculator is not None:
            self.speculator.release(request_id)

    # ---- requests ----------------------------------------------------------------------------
    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        """Token ids of a prompt; with chat=True as one user message plus the generation prompt,
        rendered by the same chat-template code as the router's (proto/chat.py). Raises UserError
        if the model has no chat template."""
        if chat:
            text = self._chat_template().render([ChatMessage("user", prompt)], add_generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(prompt)["input_ids"])

    def _chat_template(self) -> ChatTemplate:
        if self._template is None:
            self._template = ChatTemplate.from_model_dir(self.model_config.path)
            if self._template is None:
                raise UserError(f"--chat: the model at {self.model_config.path} has no chat template")
        return self._template

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, *,
                    hold_kv: bool = False, resume_token_ids: Sequence[int] = ()) -> Request:
        """Queue a request. Raises InvalidRequest (empty/too long, does not fit the cache),
        CapacityError (queue full) or KeyError (request id in use).

        resume_token_ids: output tokens another engine already generated (a migrated request).
        The request starts as a preempted one would be recomputed: prompt + those tokens are
        prefilled, they count as output (max_tokens, min_tokens, penalties) and are not emitted
        again, and a seeded generator is moved past their draws, so the continuation is what one
        uninterrupted engine would have produced."""
        req = Request(request_id, self._prompt_ids(prompt), params, hold_kv=hold_kv)
        resumed = self._prompt_ids(resume_token_ids) if resume_token_ids else []
        req.output_token_ids = resumed
        self.scheduler.add(req)
        self._open_stream(req, req.prompt_token_ids + resumed, num_sent=len(resumed))
        if resumed:
            self.sampler.advance(self._streams[request_id].generator, self.model_config.vocab_size, req.params,
                                 len(resumed))
        return req

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise InvalidRequest("prompt", "is empty: give at least one token")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequest("prompt", f"token ids must be in [0, {vocab})")
        return ids

    def _open_stream(self, req: Request, context: list[int], num_sent: int = 0) -> None:
        p = req.params
        detok = IncrementalDetokenizer(self.tokenizer, context, p.stop, p.skip_special_tokens)
        self._streams[req.request_id] = _Stream(detok, self._make_generator(p), num_sent)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Free everything the request holds at any state (idempotent). Returns its final output
        (finish_reason "abort") if it was still streaming, else None."""
        req = self.scheduler.abort(request_id)
        self._release_spec(request_id)
        if req is None or request_id not in self._streams:
            return None
        self._streams.pop(request_id)
        return RequestOutput(request_id, [], "", True, "abort", self._usage(req))

    def release_kv(self, request_id: str) -> None:
        self.scheduler.release_kv(request_id)

    def reserve_remote(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams) -> RemoteReservation:
        """Decode side: blocks for the prompt's KV (written from outside, except the blocks of its
        cached prefix); state WAITING_FOR_REMOTE_KV.
        Raises CapacityError / InvalidRequest / KeyError with nothing changed."""
        req = Request(request_id, self._prompt_ids(prompt_token_ids), params)
        blocks = self.scheduler.add_remote(req)
        return RemoteReservation(blocks, req.num_cached_tokens // self.block_manager.block_size)

    def start_remote(self, request_id: str, first_token_id: int) -> list[RequestOutput]:
        """The prompt's KV landed: decode on from ``first_token_id`` (not re-emitted). Returns a
        final output at once if the request already ends there (max_tokens == 1, EOS)."""
        req = self.scheduler.remote_kv_ready(request_id, first_token_id)
        self._open_stream(req, req.prompt_token_ids + [first_token_id], num_sent=1)
        # the first token was drawn on the prefill worker: skip its draw so seeded samples match one engine
        self.sampler.advance(self._streams[request_id].generator, self.model_config.vocab_size, req.params)
        return [self._output(req)] if req.is_finished else []

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, apply. Returns one output per request that advanced."""
        spec = self.speculator
        start = time.perf_counter()  # the step-time model counts drafting too (a draft model's forwards)
        plan = self.scheduler.schedule(spec.drafts(self.scheduler.running) if spec is not None else None)
        self.last_step_ran = not plan.is_empty
        if plan.is_empty:
            return []
        self.kv_usage_peak = max(self.kv_usage_peak, self.block_manager.usage)
        result = self._execute(plan)
        if spec is not None:
            spec.observe(plan, result, time.perf_counter() - start)
        updated = self.scheduler.update(plan, result)
        if spec is not None:  # a draft model's prompt KV, before the first token goes out (as the target's)
            spec.prefill_drafts(updated)
        self.num_steps += 1
        self._sample_kv_metrics()
        return [self._output(req, result.logprobs.get(req.request_id)) for req in updated]

    def _execute(self, plan: SchedulePlan) -> StepResult:
        chunks = [SeqChunk(c.token_ids, c.start_pos, c.block_ids, c.num_logits) for c in plan.chunks]
        logits = self.runner.forward(chunks, self._layer_hook_for(plan), pad_to_longest=plan.pad_to_longest)
        if any(c.draft_token_ids for c in plan.chunks):
            return self._verify(plan, logits)
        sampling = [c.request_id for c in plan.chunks if c.num_logits]
        if not sampling:
            return StepResult()
        return self._sample(sampling, logits)

    def _sample(self, sampling: list[str], logits) -> StepResult:
        from engine.sampler import RowHistory

        reqs = [self.scheduler.requests[rid] for rid in sampling]
        out = self.sampler.sample(logits, [r.params for r in reqs], [self._streams[rid].generator for rid in sampling],
                                  [RowHistory(r.prompt_token_ids, r.output_token_ids) for r in reqs])
        logprobs = {rid: lp for rid, lp in zip(sampling, out.logprobs) if lp is not None} if out.logprobs else {}
        return StepResult(dict(zip(sampling, out.token_ids)), logprobs)

    def _verify(self, plan: SchedulePlan, logits) -> StepResult:
        """A step with verification rows: plain rows sampled as usual, each verification row's
        k + 1 logits rows verified against its drafts."""
        import torch

        from engine.spec_decode.rejection import verify_one_hot

        plain, plain_rows, spec, offsets, row = [], [], [], [], 0
        for c in plan.chunks:
            if c.draft_token_ids:
                spec.append(c)
                offsets.append(row)
            elif c.num_logits:
                plain.append(c.request_id)
                plain_rows.append(row)
            row += c.num_logits
        result = self._sample(plain, logits[torch.tensor(plain_rows)]) if plain else StepResult()
        reqs = [self.scheduler.requests[c.request_id] for c in spec]
        emitted = verify_one_hot(self.sampler, logits, offsets, [c.draft_token_ids for c in spec],
                                 [r.params for r in reqs], [self._streams[c.request_id].generator for c in spec],
                                 [(r.prompt_token_ids, r.output_token_ids) for r in reqs])
        return StepResult(result.sampled, result.logprobs, {c.request_id: t for c, t in zip(spec, emitted)})

    def _layer_hook_for(self, plan: SchedulePlan) -> Callable[[int], None] | None:
        hook = self.layer_hook
        if hook is None:
            return None
        bs = self.block_manager.block_size
        infos = [ChunkInfo(c.request_id, tuple(c.new_block_ids(bs)), c.start_pos, c.num_tokens, c.is_last_chunk)
                 for c in plan.chunks if not c.is_padding]
        return lambda layer: hook(layer, infos)

    def _output(self, req: Request, logprobs: object | None = None) -> RequestOutput:
        stream = self._streams[req.request_id]
        new_ids = req.output_token_ids[stream.num_sent:]
        delta = self._detokenize(req, stream, new_ids)
        new_ids = req.output_token_ids[stream.num_sent:]
        stream.num_sent = len(req.output_token_ids)
        reason = None
        if req.is_finished:
            delta += stream.detokenizer.finish()
            reason = "stop" if stream.detokenizer.stopped else req.state.finish_reason
            self._streams.pop(req.request_id)
            self._release_spec(req.request_id)
        held = list(self.block_manager.block_table(req.request_id)) if req.is_finished and req.hold_kv else None
        return RequestOutput(req.request_id, new_ids, delta, req.is_finished, reason, self._usage(req), held,
                             [logprobs] if logprobs is not None else None,
                             _times(req) if req.is_finished else None)

    def _detokenize(self, req: Request, stream: _Stream, new_ids: list[int]) -> str:
        """Text delta of new_ids. Several new tokens (a verification row) with stop strings go
        one at a time: at a stop string the request ends there and the later tokens are dropped."""
        detok = stream.detokenizer
        if len(new_ids) <= 1 or not detok.stop:
            delta = detok.step(new_ids)
            n = len(new_ids)
        else:
            delta, n = "", 0
            while n < len(new_ids) and not detok.stopped:
                delta += detok.step(new_ids[n:n + 1])
                n += 1
        if detok.stopped:
            del req.output_token_ids[stream.num_sent + n:]
            if not req.is_finished:
                self.scheduler.finish(req.request_id, RequestState.FINISHED_STOPPED)
        return delta

    @staticmethod
    def _usage(req: Request) -> Usage:
        return Usage(req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_tokens)

    # ---- failure -----------------------------------------------------------------------------
    def fail_all(self) -> list[RequestOutput]:
        """End every request with finish_reason "error" and free its blocks (after a failed step)."""
        outputs = []
        for rid in list(self.scheduler.requests):
            req = self.scheduler.requests[rid]
            if not req.is_finished:
                self.scheduler.finish(rid, RequestState.FINISHED_ERROR)
            self.scheduler.abort(rid)
            self._release_spec(rid)
            if self._streams.pop(rid, None) is not None:
                outputs.append(RequestOutput(rid, [], "", True, "error", self._usage(req)))
        return outputs

    # ---- metrics -----------------------------------------------------------------------------
    def _sample_kv_metrics(self) -> None:
        if self.track_kv_waste:
            allocated, filled = self.scheduler.kv_slots()
            if allocated:
                self.kv_waste_samples.append((allocated - filled) / allocated)

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        return EngineStats(
            kv_blocks_total=bm.num_blocks, kv_blocks_used=bm.num_used_blocks, kv_usage=bm.usage,
            running=len(s.running), waiting=len(s.waiting), waiting_for_remote_kv=len(s.remote), held_kv=len(s.held),
            num_preemptions=s.num_preemptions, prefix_cache_hit_tokens=bm.prefix_hit_tokens,
            prefix_cache_query_tokens=bm.prefix_query_tokens, num_evictions=bm.num_evictions,
            num_steps=self.num_steps, block_size=bm.block_size, **self._spec_stats())

    def _spec_stats(self) -> dict:
        if self.speculator is None:
            return {}
        c = self.speculator.counters
        return dict(spec_num_drafts=c.num_drafts, spec_num_draft_tokens=c.num_draft_tokens,
                    spec_num_accepted_tokens=c.num_accepted_tokens, spec_num_verify_steps=c.num_verify_steps,
                    spec_k_histogram=tuple(c.k_histogram))


def _times(req: Request) -> RequestTimes:
    def span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else max(0.0, b - a)

    return RequestTimes(span(req.arrival_time, req.scheduled_time), span(req.scheduled_time, req.first_token_time),
                        span(req.first_token_time, req.finish_time))
