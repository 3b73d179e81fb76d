"""Layer-wise streaming of one request's KV from inside the forward pass.

The model runner calls ``layer_done(l)`` from its per-layer hook right after layer ``l`` wrote its
K/V. That call only appends to a queue: a shared submitter thread issues the transport ``write``
for the layer (tag ``layers_tag(request_id, [l])``), so neither validation, descriptor building nor
the copy itself sits on the forward's critical path. The receiver's ``LandingTracker`` sees the
request complete once every layer's notification arrived.

    stream = LayerStream(transport, peer, src_blocks, dst_blocks, request_id, num_layers, timeout_s=10)
    runner.forward(chunks, layer_hook=stream.layer_done)
    state = stream.wait()          # DONE only if every layer is DONE

The owner ends every stream with ``wait`` or ``cancel`` (an open stream is polled every 0.2 ms).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Sequence

from kv_transfer.base import KVTransport, TransferHandle, TransferState
from kv_transfer.landing import layers_tag


class LayerStream:
    """One request's layer-by-layer push to one peer. ``layer_done`` is safe from any thread."""

    def __init__(self, transport: KVTransport, peer: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                 request_id: str, num_layers: int, timeout_s: float, tagged: bool = True) -> None:
        """``tagged=False`` for the non-final chunks of a chunked prefill: their layers land without
        notifications (the receiver would otherwise count a layer landed after its first chunk).
        Start the final chunk's (tagged) stream once the earlier streams' ``wait`` returned DONE."""
        self.transport, self.peer = transport, peer
        self.tagged = tagged
        self.src_blocks, self.dst_blocks = list(src_blocks), list(dst_blocks)
        self.request_id, self.num_layers, self.timeout_s = request_id, num_layers, timeout_s
        self.handles: list[TransferHandle] = []
        self.error: str | None = None
        self._pending: collections.deque[int] = collections.deque()
        self._issued = 0
        _SUBMITTER.open(self)

    def layer_done(self, layer: int) -> None:
        """Layer ``layer`` has been written locally: send it (asynchronously)."""
        self._pending.append(layer)

    def _submit_pending(self) -> bool:
        """Issue queued layers (submitter thread). Returns True once every layer was issued."""
        while self._pending:
            layer = self._pending.popleft()
            try:
                notify = layers_tag(self.request_id, [layer]) if self.tagged else ""
                self.handles.append(self.transport.write(self.peer, self.src_blocks, self.dst_blocks, [layer], notify,
                                                         self.timeout_s))
            except Exception as e:  # bad blocks / unknown peer: the stream fails, nothing is sent
                self.error = f"layer {layer}: {e}"
                failed = TransferHandle(self.peer, layers_tag(self.request_id, [layer]), self.timeout_s, 0)
                failed._finish(TransferState.FAILED, self.error)
                self.handles.append(failed)
            self._issued += 1
        return self._issued >= self.num_layers

    @property
    def issued(self) -> int:
        return self._issued

    def wait(self, timeout_s: float | None = None) -> TransferState:
        """Wait until every layer was issued and is final. DONE if all are DONE, else the first
        non-DONE final state (FAILED when the deadline passes first)."""
        end = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s + 1.0)
        while self._issued < self.num_layers and time.monotonic() < end:
            time.sleep(0.0005)
        if self._issued < self.num_layers:
            _SUBMITTER.close(self)  # the forward never finished: stop polling this stream
            return TransferState.FAILED
        for handle in list(self.handles):
            state = handle.wait(max(0.0, end - time.monotonic()))
            if state is not TransferState.DONE:
                return state if state.is_final else TransferState.FAILED
        return TransferState.DONE

    def cancel(self) -> None:
        """Stop issuing layers and cancel the ones in flight (each reaches a final state only when
        its backend confirms)."""
        _SUBMITTER.close(self)
        self._pending.clear()
        for handle in list(self.handles):
            handle.cancel()


class _Submitter:
    """One daemon thread for all open streams: polls their queues every ``interval_s`` while any is
    open (the hook never pays for waking a thread), sleeps on an event when none is."""

    interval_s = 0.0002

    def __init__(self) -> None:
        self._streams: set[LayerStream] = set()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def open(self, stream: LayerStream) -> None:
        with self._lock:
            self._streams.add(stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-layer-stream", daemon=True)
                self._thread.start()
        self._wake.set()

    def close(self, stream: LayerStream) -> None:
        with self._lock:
            self._streams.discard(stream)

    def _run(self) -> None:
        while True:
            self._wake.clear()
            with self._lock:
                streams = list(self._streams)
            if not streams:
                self._wake.wait(1.0)
                continue
            for stream in streams:
                if stream._submit_pending():
                    self.close(stream)
            time.sleep(self.interval_s)


_SUBMITTER = _Submitter()
