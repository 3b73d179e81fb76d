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
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from kv_transfer.base import TransferState
from kv_transfer.landing import layers_tag


class TransferFailed(RuntimeError):
    """A write into the decode worker did not land (peer gone, timeout, cancelled)."""


@dataclass
class _Push:
    peer: str
    dst_blocks: list[int]
    skip: int = 0  # leading logical blocks the destination already caches: not written
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
        self._lock = threading.Lock()
        self.total_bytes = 0

    def begin(self, request_id: str, peer: str, dst_blocks: list[int], skip_blocks: int = 0) -> None:
        """Start pushing a request into ``dst_blocks``, all but the first ``skip_blocks``.
        Raises ValueError if skip_blocks is not within 0..len(dst_blocks)."""
        if not 0 <= skip_blocks <= len(dst_blocks):
            raise ValueError(f"num_cached_blocks must be within 0..{len(dst_blocks)}, got {skip_blocks}")
        with self._lock:
            self._pushes[request_id] = _Push(peer, list(dst_blocks), skip_blocks)

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
                self._write(push, c.request_id, src, [push.dst_blocks[i] for i in todo], [layer])
                if layer == self.num_layers - 1:
                    push.sent.update(todo)

    async def finish(self, request_id: str, src_blocks: list[int]) -> tuple[int, float]:
        """Send what the layer hook did not, wait for every write; returns (bytes, seconds waited here:
        the transfer time not hidden behind the prefill compute).

        Raises TransferFailed if any write did not land (the caller aborts the request)."""
        with self._lock:
            push = self._pushes[request_id]
            if len(src_blocks) > len(push.dst_blocks):
                raise TransferFailed(f"{len(src_blocks)} blocks to send, {len(push.dst_blocks)} reserved")
            missing = [i for i in range(push.skip, len(src_blocks)) if i not in push.sent]
            if missing:
                self._write(push, request_id, [src_blocks[i] for i in missing], [push.dst_blocks[i] for i in missing],
                            list(range(self.num_layers)))
            handles = list(push.handles)
        waited_from = time.perf_counter()
        states = await asyncio.gather(*(h.wait_async() for h in handles))
        with self._lock:
            self._pushes.pop(request_id, None)
        bad = [h for h, s in zip(handles, states) if s is not TransferState.DONE]
        if push.error:
            raise TransferFailed(f"a KV write could not start: {push.error}")
        if bad:
            raise TransferFailed(f"{len(bad)} of {len(handles)} KV writes did not land: {bad[0].error or bad[0].state.name}")
        self.total_bytes += push.nbytes
        return push.nbytes, time.perf_counter() - waited_from

    async def cancel(self, request_id: str) -> None:
        """Cancel the request's writes and wait until none can still land."""
        with self._lock:
            push = self._pushes.pop(request_id, None)
        if push is None:
            return
        for h in push.handles:
            h.cancel()
        await asyncio.gather(*(h.wait_async() for h in push.handles))

    def active(self) -> int:
        return len(self._pushes)

    def _write(self, push: _Push, request_id: str, src: list[int], dst: list[int], layers: list[int]) -> None:
        notify = layers_tag(request_id, layers)
        try:
            push.handles.append(self.transport.write(push.peer, src, dst, layers, notify, self.timeout_s))
        except Exception as e:  # never raise into the engine's forward
            push.error = push.error or f"{type(e).__name__}: {e}"
            return
        push.nbytes += len(src) * len(layers) * self.block_bytes_per_layer
