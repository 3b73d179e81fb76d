"""What every worker role shares: the engine, request checks, local generation, abort, stats.

Used by the decode worker (decode_worker/worker.py), the prefill worker (prefill_worker/worker.py)
and the aggregated worker (worker/agg.py). Requests are checked again
here with the same rules (proto/sampling.py; the router checked them first), before any engine work starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import grpc

from engine.errors import EngineDeadError
from engine.scheduler import CapacityError
from engine.spec_decode.config import SpeculativeConfig
from proto.kv_events import encode_record
from proto.tls import TlsFiles
from proto.pdserve.v1 import api_pb2, worker_pb2
from proto.sampling import InvalidRequest, SamplingParams, check_prompt, from_wire
from worker.kv_events import KvEventPublisher
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class WorkerError(Exception):
    """A request failed on this worker with a gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process. role: "prefill" | "decode" | "agg"; kv_transport: "nixl" | "torch" | "tcp"
    (ignored by agg). num_blocks None = derive from kv_cache_memory_bytes (None: the engine's default).
    dtype: "auto" | "float32" | "bfloat16" | "float16" (the CLI passes the one it resolved, so
    every worker of a cluster agrees). num_threads: torch threads; cpu_cores: the CPU ids this
    worker's process is bound to (None: not bound)."""

    worker_id: str
    role: str
    model: str = "smollm2-135m-instruct"
    kv_transport: str = "tcp"
    block_size: int = 16
    num_blocks: int | None = 2048
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    idle_max_num_batched_tokens: int | None = None  # the budget of a step with no decode row (engine/config.py)
    prefill_first_ratio: float | None = None        # ... or with mostly waiting requests (engine/config.py)
    max_waiting: int | None = None
    kv_cache_memory_bytes: int | None = None
    dtype: str = "float32"
    quantization: str = "none"     # --quantization: the decoder's linear method
    kv_cache_dtype: str = "auto"   # --kv-cache-dtype: auto | fp8_e4m3
    num_threads: int = 1
    cpu_cores: tuple[int, ...] | None = None
    device: str = "cpu"            # "cuda" on GPU nodes (the actor declares num_gpus=1)
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None
    transfer_timeout_s: float = 30.0
    max_model_len: int | None = None       # None = the model's context length; never above it
    enable_prefix_caching: bool = True
    batching: str = "continuous"           # --batching: continuous | static (HF generate style, for comparison)
    served_model_name: str | None = None   # the model id reported to the router (None = `model`)
    speculative: SpeculativeConfig | None = None  # decode and agg engines speculate; in the compat key for all
    internal_secret: str | None = field(default=None, repr=False)  # the worker API needs it (proto/internal_auth.py)
    tls: TlsFiles | None = None    # serve the worker API over TLS (proto/tls.py)
    kv_checksum: bool = False      # debug: digest each request's KV on both sides, refuse a mismatch (kv_transfer/checksum.py)
    kv_faults: str = ""            # debug: fault injection on the KV transport (kv_transfer/faults.py FaultSpec.parse)
    engine_wedge_file: str = ""    # test fault: the engine step waits while this file exists (worker/faults.py)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "agg"):
            raise ValueError(f"role must be prefill, decode or agg, got {self.role!r}")


def usage_pb(usage) -> api_pb2.Usage:
    if usage is None:
        return api_pb2.Usage()
    return api_pb2.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                         cached_tokens=usage.cached_tokens)


def logprob_pb(lp) -> api_pb2.TokenLogprob:
    """The sampler's TokenLogprobs on the wire (computed here, on the worker that sampled the token)."""
    return api_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                top=[api_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def token_chunk(out) -> worker_pb2.TokenChunk:
    """A RequestOutput on the wire; an engine-side error becomes UNAVAILABLE (never a success)."""
    if out.finished and out.finish_reason in ("error", "abort"):
        raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"request {out.request_id} ended with {out.finish_reason}")
    chunk = worker_pb2.TokenChunk(token_ids=out.new_token_ids, finish_reason=out.finish_reason or "",
                                  logprobs=[logprob_pb(lp) for lp in out.logprobs or ()])
    if out.finished:
        chunk.usage.CopyFrom(usage_pb(out.usage))
    return chunk


class WorkerCore:
    """The engine of one worker and what all roles do with it."""

    def __init__(self, config: WorkerConfig, engine, model_dir: Path, model_config) -> None:
        self.config = config
        self.engine = engine
        self.model_dir = model_dir
        self.model_config = model_config
        self.kv_metadata = b""
        self._background: set[asyncio.Task] = set()
        self.metrics = WorkerMetrics(self)
        # KV events for routers' prefix indexes (worker/kv_events.py); engines without a block
        # manager (test doubles) publish nothing
        self.kv_events = KvEventPublisher(config.worker_id)
        block_manager = getattr(getattr(engine, "engine", None), "block_manager", None)
        if block_manager is not None:
            self.kv_events.attach(block_manager)
        if config.engine_wedge_file:  # test fault only: unset, the engine is not wrapped
            from worker.faults import install_step_wedge, wedge_path

            install_step_wedge(engine, wedge_path(config.engine_wedge_file, config.worker_id))

    # -- checks -----------------------------------------------------------------------------------
    def check(self, prompt_ids: list[int], wire: api_pb2.SamplingOptions, **override) -> SamplingParams:
        """Validate a request; raises WorkerError(INVALID_ARGUMENT) naming the field."""
        try:
            params = from_wire(wire, **override)
            check_prompt(prompt_ids, params.max_tokens, self.max_model_len, self.model_config.vocab_size)
        except InvalidRequest as e:
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return params

    # -- local generation (agg mode, short prompts) -------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], wire: api_pb2.SamplingOptions,
                       resume_token_ids: list[int] | None = None) -> AsyncIterator[worker_pb2.TokenChunk]:
        """Local generation; resume_token_ids: a migrated request's tokens already streamed (not re-sent)."""
        params = self.check(prompt_ids, wire)
        resume = resume_token_ids or []
        if len(resume) >= params.max_tokens:
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"resume_token_ids: {len(resume)} tokens, max_tokens is {params.max_tokens}")
        outputs = self.engine.generate(prompt_ids, params, request_id, resume_token_ids=resume) if resume \
            else self.engine.generate(prompt_ids, params, request_id)
        async for chunk in self.stream(outputs, request_id):
            yield chunk

    async def stream(self, outputs: AsyncIterator, request_id: str) -> AsyncIterator[worker_pb2.TokenChunk]:
        """Relay engine outputs; whatever stops the stream early (cancel, error) aborts the request."""
        finished = False
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    finished = out.finished
                    if finished:
                        self.metrics.observe(out)
                    yield token_chunk(out)
                    if finished:
                        return
        except (InvalidRequest, ValueError) as e:
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except KeyError as e:
            raise WorkerError(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {e}") from None
        except CapacityError as e:
            raise WorkerError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except EngineDeadError as e:
            raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"engine stopped: {e}") from None
        finally:
            if not finished:
                self.spawn(self.engine.abort(request_id))

    async def abort(self, request_id: str, senders_quiesced: bool = False) -> bool:
        """Free everything the request holds. ``senders_quiesced`` matters only to a decode worker."""
        await self.settle(self.engine.abort(request_id))
        return True

    # -- introspection ----------------------------------------------------------------------------------
    def info(self) -> worker_pb2.WorkerInfo:
        mc = self.model_config
        return worker_pb2.WorkerInfo(
            id=self.config.worker_id, role=self.config.role, model_id=self.model_id,
            max_model_len=self.max_model_len, eos_token_ids=list(mc.eos_token_ids), block_size=self.config.block_size,
            kv_transport="" if self.config.role == "agg" else self.config.kv_transport, kv_metadata=self.kv_metadata,
            max_step_tokens=self.max_step_tokens)

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one engine step computes: its token budget, or the idle one when larger
        (a prefill worker keeps its chunks: worker/server.py load_engine)."""
        c = self.config
        idle = c.idle_max_num_batched_tokens if c.role != "prefill" else None
        return max(c.max_num_batched_tokens, idle or 0)

    @property
    def model_id(self) -> str:
        return self.config.served_model_name or self.config.model

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) this worker accepts: --max-model-len, capped by the model."""
        limit = self.model_config.max_model_len
        return min(self.config.max_model_len, limit) if self.config.max_model_len else limit

    def stats(self, held: int = 0, leases: int = 0) -> worker_pb2.WorkerStats:
        s = self.engine.stats()
        return worker_pb2.WorkerStats(kv_blocks_total=s.kv_blocks_total, kv_blocks_used=s.kv_blocks_used,
                                      kv_blocks_held=held, running=s.running, waiting=s.waiting,
                                      prefix_cache_hit_tokens=getattr(s, "prefix_cache_hit_tokens", 0),
                                      leases=leases, spec_draft_tokens=s.spec_num_draft_tokens,
                                      spec_accepted_tokens=s.spec_num_accepted_tokens,
                                      engine_steps=getattr(s, "num_steps", 0))

    def kv_event_batch(self, epoch: str, after_seq: int, snapshot: bool = False) -> worker_pb2.KvEventsResponse:
        """KV events after (epoch, after_seq), or a snapshot when they cannot be replayed."""
        records = None if snapshot else self.kv_events.since(epoch, after_seq)
        if records is not None:
            return worker_pb2.KvEventsResponse(epoch=self.kv_events.epoch, records=[encode_record(r) for r in records],
                                               seq=records[-1].seq if records else after_seq,
                                               block_size=self.config.block_size)
        snap = self.kv_events.snapshot()
        return worker_pb2.KvEventsResponse(epoch=snap.epoch, is_snapshot=True, seq=snap.seq,
                                           block_hashes=sorted(snap.block_hashes), block_size=self.config.block_size)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def settle(self, coro):
        """Run a freeing step (abort, release) to completion even if the RPC that asked for it is
        cancelled (the caller's deadline): the engine call queues behind a long forward, and a
        cancelled executor job would never run, leaking the request's blocks."""
        return await asyncio.shield(self.spawn(coro))

    async def drain_background(self) -> None:
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    # -- lifecycle (roles extend) -----------------------------------------------------------------
    async def start(self) -> None:
        """Start the role's background tasks."""

    async def close(self) -> None:
        await self.drain_background()

    def worker_stats(self) -> worker_pb2.WorkerStats:
        return self.stats()
