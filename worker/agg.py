"""The aggregated worker: one engine does prefill and decode, with no KV transport.

It serves Generate (WorkerCore.generate) and the shared RPCs only; Reserve, Prefill and Decode
answer FAILED_PRECONDITION (worker/server.py), since an agg worker takes and sends no remote KV.
"""

from __future__ import annotations

from worker.core import WorkerCore


class AggWorker(WorkerCore):
    """WorkerCore as it is: local generation, abort, stats."""
