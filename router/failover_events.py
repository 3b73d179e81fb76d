"""What the router's failover machinery reports as it happens, with the reason.

The orchestrator (router/orchestrator.py) reports each request moved to another decode-capable
worker (a migration) and each prefill leg given up on its worker (a prefill failover); the pool
(router/pool.py) and the orchestrator report each worker that becomes suspect (no new requests
until its next answered Stats poll). router/metrics.py counts them as Prometheus counters
(pdserve:request_migrations_total, pdserve:prefill_failovers_total, pdserve:worker_suspect_total).
This base ignores them (tests, a pool or orchestrator built without metrics). No I/O.
"""

from __future__ import annotations

# Why a decode-side leg's worker was left (migration) or a prefill leg given up (failover):
WORKER_ERROR = "worker_error"   # the RPC or stream failed UNAVAILABLE: the worker died, its connection broke
STREAM_ENDED = "stream_ended"   # the stream ended without a finish reason
LEG_TIMEOUT = "leg_timeout"     # nothing came within the leg's timeout (router/leg_timeouts.py)
NO_PROGRESS = "no_progress"     # busy, answering its polls, but its engine completed no step within the stall bound
MIGRATION_REASONS = (WORKER_ERROR, STREAM_ENDED, LEG_TIMEOUT, NO_PROGRESS)
NO_PREFILL_WORKER = "no_prefill_worker"  # the failed prefill is done by the decode worker itself (none left)
PREFILL_FAILOVER_REASONS = (WORKER_ERROR, LEG_TIMEOUT, NO_PREFILL_WORKER)
# Why a worker became suspect:
MISSED_POLL = "missed_poll"     # a Stats poll failed or missed its deadline
SUSPECT_REASONS = (MISSED_POLL, WORKER_ERROR, LEG_TIMEOUT, NO_PROGRESS)


class FailoverEvents:
    """Hooks called as failover happens; every reason is one of the constants above."""

    def migration(self, reason: str) -> None:
        """A request left its decode-capable worker for another (its tokens so far recomputed there)."""

    def prefill_failover(self, reason: str) -> None:
        """A prefill leg was given up on its worker: retried on another prefill worker, or (reason
        NO_PREFILL_WORKER) prefilled on the decode worker."""

    def worker_suspect(self, role: str, reason: str) -> None:
        """A live worker became suspect (not once per missed poll: once per fall)."""
