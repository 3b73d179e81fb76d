"""AsyncEngine: the asyncio face of LLMEngine, used by the workers and the aggregated server.

Every LLMEngine call (add, step, abort, reservations) runs in one dedicated worker thread, so
calls are serialized without locks and the event loop is never blocked by the model. A
background task keeps stepping while there is work and routes each RequestOutput to the
request's queue; ``generate`` / ``generate_remote`` are async generators over those queues.
A consumer that stops iterating (client disconnect, cancellation) aborts its request.

``from_config`` builds the LLMEngine on that same thread, so every torch op of the process (weight
load, linear selection, warm-up, each step) runs on one OS thread. Why: torch's CPU wheel uses GNU
OpenMP, which gives each calling thread its own team; a second team puts more OpenMP threads in the
process than cores, and libgomp then stops spin-waiting between parallel regions (its "throttled"
spin), so every op pays a futex wake-up. Measured (bf16, 2 threads, quiet): decode b1 15 -> 25 ms,
b16 27 -> 36 ms per step once a load thread and a step thread had both run ops.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, Sequence

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.llm_engine import LayerHook, LLMEngine
from engine.outputs import EngineStats, RemoteReservation, RequestOutput, Usage
from proto.sampling import SamplingParams

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.02  # re-check when work exists but nothing could be scheduled (e.g. held KV)
# An idle loop waits for a wakeup (_kick), but never forever: if work ever appears without one, it
# is stepped within this bound (and logged) instead of waiting until the client gives up.
_IDLE_BACKSTOP_S = 1.0

class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, executor: ThreadPoolExecutor | None = None) -> None:
        """executor: the one-thread executor the engine was built on (from_config); None: a new one."""
        self.engine = engine
        self._executor = executor or _engine_executor()
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop_task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._kicked = False  # a _kick since the loop last looked for work
        self._dead: BaseException | None = None
        self._closed = False

    @classmethod
    def from_config(cls, cfg: EngineConfig, **engine_kwargs) -> "AsyncEngine":
        """Load the model and allocate the KV cache now (blocking), on the engine thread that
        will run every step (see the module docstring); the step loop starts with the first request."""
        executor = _engine_executor()
        try:
            engine = executor.submit(LLMEngine, cfg, **engine_kwargs).result()
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(engine, executor=executor)

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                       hold_kv: bool = False, resume_token_ids: Sequence[int] = ()) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last one has finished=True. Raises InvalidRequest,
        CapacityError, KeyError (id in use) or EngineDeadError on the first iteration.
        With hold_kv, the final output's kv_block_ids stay held until release_kv(request_id).
        resume_token_ids: a migrated request's tokens already generated elsewhere (LLMEngine.add_request)."""
        queue = self._open(request_id)
        try:
            await self._call(self.engine.add_request, request_id, prompt, params, hold_kv=hold_kv,
                             resume_token_ids=resume_token_ids)
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        self._kick()
        async with contextlib.aclosing(self._drain(request_id, queue)) as outputs:  # close it with us
            async for out in outputs:
                yield out

    async def reserve_remote(self, request_id: str, prompt_token_ids: list[int],
                             params: SamplingParams) -> RemoteReservation:
        """Decode side: allocate blocks for the prompt's incoming KV (no compute; a cached prefix
        is reused, see RemoteReservation). Raises CapacityError (nothing reserved) if they do not fit, InvalidRequest, KeyError."""
        self._check_alive()
        return await self._call(self.engine.reserve_remote, request_id, prompt_token_ids, params)

    async def generate_remote(self, request_id: str, first_token_id: int) -> AsyncIterator[RequestOutput]:
        """Decode side, once every KV layer landed: decode on from ``first_token_id`` (which is
        not re-emitted) and stream the outputs. Raises KeyError if nothing is reserved."""
        queue = self._open(request_id)
        try:
            early = await self._call(self.engine.start_remote, request_id, first_token_id)
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        for out in early:
            queue.put_nowait(out)
        self._kick()
        async with contextlib.aclosing(self._drain(request_id, queue)) as outputs:
            async for out in outputs:
                yield out

    async def abort(self, request_id: str) -> None:
        """Free everything the request holds, at any state (queued, running, reserved, held).
        Idempotent; a live stream of it ends with finish_reason "abort"."""
        if self._dead is not None or self._closed:
            return
        out = await self._call(self.engine.abort, request_id)
        queue = self._queues.get(request_id)
        if out is not None and queue is not None:
            queue.put_nowait(out)
        self._kick()

    async def release_kv(self, request_id: str) -> None:
        """Free the blocks a finished hold_kv request still holds (full ones may stay cached)."""
        if self._dead is None and not self._closed:
            await self._call(self.engine.release_kv, request_id)
            self._kick()

    def set_layer_hook(self, hook: LayerHook | None) -> None:
        """hook(layer, chunks) is called in the engine thread right after each layer of each
        forward has written its K/V; it must not block for long."""
        self.engine.layer_hook = hook

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def dead(self) -> BaseException | None:
        """Why the step loop died (a model/runtime failure), or None while it can still run."""
        return self._dead

    async def shutdown(self) -> None:
        """Stop the loop (after the step in flight, if any); every open stream ends with
        finish_reason "abort"."""
        self._closed = True
        if self._loop_task is not None:
            self._kick_wakeup()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        for rid in list(self._queues):
            out = await self._call(self.engine.abort, rid)
            if out is not None:
                self._queues[rid].put_nowait(out)
        self._executor.shutdown(wait=True)

    # ---- internals ---------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop stopped: {self._dead!r}")
        if self._closed:
            raise EngineDeadError("engine is shut down")

    def _open(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        self._check_alive()
        if request_id in self._queues:
            raise KeyError(f"request id {request_id!r} is already streaming")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    async def _drain(self, request_id: str, queue: asyncio.Queue[RequestOutput]) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished and self._dead is None and not self._closed:
                # the consumer went away: free the request (shielded from a pending cancel)
                await asyncio.shield(self._call(self.engine.abort, request_id))
                self._kick()

    async def _call(self, fn: Callable, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def _kick(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            if self._dead is None and not self._closed:
                self._wakeup = asyncio.Event()
                self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="pdserve-engine-loop")
        self._kick_wakeup()

    def _kick_wakeup(self) -> None:
        self._kicked = True
        if self._wakeup is not None:
            self._wakeup.set()

    async def _run(self) -> None:
        """The step loop, until shutdown (_closed) or the engine dies. Any exception, from the
        step or from routing its outputs, fails every open request, so no consumer waits on a
        queue nobody will fill.

        shutdown stops it with the _closed flag, not by cancelling it: under Python 3.11 a cancel
        that lands while asyncio.wait_for's inner wait is completing is swallowed (CPython
        gh-86296), and the loop went on idling with shutdown awaiting it forever (the CI hang of
        test_bad_requests_fail_cleanly). The timed waits below use call_later for the same reason."""
        try:
            await self._step_while_work()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a model/runtime failure: fail every request, refuse new ones
            self._dead = e
            log.error("engine loop stopped: %r", e, exc_info=e)
            try:
                failed = await self._call(self.engine.fail_all)
            except BaseException as fail_error:  # noqa: BLE001 - the queues below still get a final output
                log.error("engine fail_all raised %r: failing the open streams directly", fail_error)
                failed = []
            for out in failed:
                self._deliver(out)
            for rid, queue in list(self._queues.items()):
                if not any(out.request_id == rid for out in failed):
                    queue.put_nowait(RequestOutput(rid, [], "", True, "error", Usage(0, 0, 0)))
            if not isinstance(e, Exception):
                raise

    async def _step_while_work(self) -> None:
        while not self._closed:
            self._kicked = False
            if not self.engine.has_unfinished():
                await self._wait_for_kick(_IDLE_BACKSTOP_S)
                if not self._kicked and self.engine.has_unfinished():
                    log.warning("engine loop: work was waiting without a wakeup; stepping it")
                continue
            outputs = await self._call(self.engine.step)
            self._deliver_all(outputs)
            if not self.engine.last_step_ran and not self._kicked:  # work exists, none fits now (held KV)
                await self._wait_for_kick(_IDLE_POLL_S)

    async def _wait_for_kick(self, timeout_s: float) -> None:
        """Until _kick (or shutdown) or timeout_s, whichever is first."""
        assert self._wakeup is not None
        self._wakeup.clear()
        if self._kicked or self._closed:
            return
        timer = asyncio.get_running_loop().call_later(timeout_s, self._wakeup.set)
        try:
            await self._wakeup.wait()
        finally:
            timer.cancel()

    def _deliver_all(self, outputs: Sequence[RequestOutput]) -> None:
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        queue = self._queues.get(out.request_id)
        if queue is not None:
            queue.put_nowait(out)


def _engine_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-engine")


_ids = itertools.count()


def random_request_id(prefix: str = "req") -> str:
    """A process-unique request id (for callers that have none)."""
    return f"{prefix}-{next(_ids)}"
