"""Layer-wise KV streaming from the prefill engine into a decode worker's reserved blocks.

The engine calls `on_layer(layer, chunks)` right after layer `layer` of a forward has written its
K/V, from the engine's forward thread. For every chunk of a request being pushed, the blocks its
new tokens touched are written for that layer at once, so the transfer overlaps the remaining
layers' compute (as in Splitwise / DistServe's layer-wise transmission). Logical block i of the
prompt goes to destination block i; a chunk starting at position p touches logical blocks from
p // block_size on. Blocks the engine did not compute (prefix-cache hits) are sent, all layers at
once, by `finish`, which then waits until the transport confirms every write landed.
The destination's first `skip_blocks` blocks already hold the prompt's KV (the decode worker's
own prefix cache): they are never written, so only the blocks the decode worker lacks travel.

The fence (docs/architecture.md): every write is tagged with the destination's reservation key
and the logical blocks it carries (`landing.write_tag`), so the decode worker admits the request
only once every block of every layer landed and drops writes for a reservation no longer live;
no write is started once the reservation expired (`not_after_unix`). `cancel` returns only once
every write is final (nothing can still land), however many callers ask at once, and then tells
the receiver that nothing more of the reservation will come (`landing.SETTLED_PREFIX`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from kv_transfer.base import TransferState, expired
from kv_transfer.landing import SETTLED_PREFIX, write_tag

log = logging.getLogger(__name__)
CANCEL_WAIT_FACTOR = 4  # a cancel waits up to this many transfer timeouts for every write to be final


class TransferFailed(RuntimeError):
    """A write into the decode worker did not land (peer gone, timeout, cancelled)."""


@dataclass
class _Push:
    peer: str
    dst_blocks: list[int]
    key: str                       # the destination reservation's key: every write's tag names it
    not_after_unix: float | None   # the reservation's expiry: no write starts after it
    skip: int = 0                  # leading logical blocks the destination already caches: not written
    handles: list = field(default_factory=list)
    sent: set[int] = field(default_factory=set)  # logical blocks written for the last layer
    nbytes: int = 0
    error: str | None = None  # a write that could not even start
    started: float = field(default_factory=time.perf_counter)


class KVPusher:
    def __init__(self, transport, block_size: int, num_layers: int, block_bytes_per_layer: int,
                 timeout_s: float) -> None:
        self.transport = transport
        self.block_size = block_size
        self.num_layers = num_layers
        self.block_bytes_per_layer = block_bytes_per_layer
        self.timeout_s = timeout_s
        self._pushes: dict[str, _Push] = {}
        self._cancels: dict[str, asyncio.Future] = {}
        self._lock = threading.Lock()
        self.total_bytes = 0
        self.expired_writes = 0

    def begin(self, request_id: str, peer: str, dst_blocks: list[int], skip_blocks: int = 0, key: str | None = None,
              not_after_unix: float | None = None) -> None:
        """Register a push of ``request_id``'s KV into ``dst_blocks`` (all but the first
        ``skip_blocks``) of reservation ``key`` (default: the request id) at ``peer``, valid until
        ``not_after_unix`` (wall clock). Raises ValueError if skip_blocks is not within 0..len(dst_blocks)."""
        if not 0 <= skip_blocks <= len(dst_blocks):
            raise ValueError(f"num_cached_blocks must be within 0..{len(dst_blocks)}, got {skip_blocks}")
        with self._lock:
            self._pushes[request_id] = _Push(peer, list(dst_blocks), key or request_id, not_after_unix, skip_blocks)

    def on_layer(self, layer: int, chunks) -> None:
        """Engine hook (forward thread): push this layer's touched blocks of every pushed request."""
        with self._lock:
            for c in chunks:
                push = self._pushes.get(c.request_id)
                if push is None or not c.block_ids:
                    continue
                first = c.start_pos // self.block_size
                if first + len(c.block_ids) > len(push.dst_blocks):  # more than reserved: finish reports it
                    continue
                todo = [i for i in range(first, first + len(c.block_ids)) if i >= push.skip]
                if not todo:
                    continue
                src = [c.block_ids[i - first] for i in todo]
                start = max(c.start_pos, push.skip * self.block_size)  # the positions this write carries
                self._write(push, src, [push.dst_blocks[i] for i in todo], [layer], start, c.start_pos + c.num_tokens)
                if layer == self.num_layers - 1:
                    push.sent.update(todo)

    async def finish(self, request_id: str, src_blocks: list[int]) -> tuple[int, float]:
        """Send what the layer hook did not, wait for every write; returns (bytes, seconds waited here:
        the transfer time not hidden behind the prefill compute).

        Raises TransferFailed if any write did not land; the push then stays registered until the
        caller's ``cancel`` (which tells the receiver it is over)."""
        with self._lock:
            push = self._pushes.get(request_id)
            if push is None:
                raise TransferFailed(f"the push of {request_id} was cancelled")
            if len(src_blocks) > len(push.dst_blocks):
                raise TransferFailed(f"{len(src_blocks)} blocks to send, {len(push.dst_blocks)} reserved")
            missing = [i for i in range(push.skip, len(src_blocks)) if i not in push.sent]
            for run in _runs(missing):  # one write per run of logical blocks: its tag names its positions
                self._write(push, [src_blocks[i] for i in run], [push.dst_blocks[i] for i in run],
                            list(range(self.num_layers)), run[0] * self.block_size, (run[-1] + 1) * self.block_size)
            handles = list(push.handles)
        waited_from = time.perf_counter()
        states = await asyncio.gather(*(h.wait_async() for h in handles))
        bad = [h for h, s in zip(handles, states) if s is not TransferState.DONE]
        if push.error:
            raise TransferFailed(f"a KV write could not start: {push.error}")
        if bad:
            raise TransferFailed(f"{len(bad)} of {len(handles)} KV writes did not land: {bad[0].error or bad[0].state.name}")
        with self._lock:
            self._pushes.pop(request_id, None)
        self.total_bytes += push.nbytes
        return push.nbytes, time.perf_counter() - waited_from

    async def cancel(self, request_id: str) -> None:
        """Cancel the request's writes and wait until none can still land. A second caller while
        one is in progress waits for the same cancel (it never returns earlier)."""
        with self._lock:
            push = self._pushes.pop(request_id, None)
            task = self._cancels.get(request_id)
            if push is not None:
                task = self._cancels[request_id] = asyncio.ensure_future(self._stop(request_id, push))
        if task is not None:
            await asyncio.shield(task)

    async def _stop(self, request_id: str, push: _Push) -> None:
        try:
            for h in push.handles:
                h.cancel()
            limit = time.monotonic() + CANCEL_WAIT_FACTOR * self.timeout_s
            for h in push.handles:
                while not h.state.is_final and time.monotonic() < limit:
                    await h.wait_async(max(0.01, limit - time.monotonic()))
            pending = [h for h in push.handles if not h.state.is_final]
            if pending:  # the backend never confirmed: say so loudly, never claim "settled"
                log.error("KV writes of %s still pending %gs after cancel: %s", request_id,
                          CANCEL_WAIT_FACTOR * self.timeout_s, pending[0])
                return
            try:  # every write is final and none will start: the receiver may free at once
                self.transport.send_notification(push.peer, SETTLED_PREFIX + push.key)
            except Exception as e:  # noqa: BLE001  (peer gone: it frees on its own)
                log.info("settled notification for %s not sent: %s", push.key, e)
        finally:
            with self._lock:
                self._cancels.pop(request_id, None)

    def active(self) -> int:
        return len(self._pushes) + len(self._cancels)

    def _write(self, push: _Push, src: list[int], dst: list[int], layers: list[int], start: int, end: int) -> None:
        """One write of prompt positions ``start .. end-1`` of ``layers`` (blocks ``src`` -> ``dst``)."""
        if push.error:
            return
        if expired(push.not_after_unix):  # the reservation is over: nothing more may start
            self.expired_writes += 1
            push.error = "the destination reservation expired"
            return
        notify = write_tag(push.key, layers, start, end)
        try:
            push.handles.append(self.transport.write(push.peer, src, dst, layers, notify, self.timeout_s,
                                                     not_after_unix=push.not_after_unix))
        except Exception as e:  # never raise into the engine's forward
            push.error = push.error or f"{type(e).__name__}: {e}"
            return
        push.nbytes += len(src) * len(layers) * self.block_bytes_per_layer


def _runs(indexes: list[int]) -> list[list[int]]:
    """Sorted ints split into runs of consecutive values."""
    runs: list[list[int]] = []
    for i in indexes:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
