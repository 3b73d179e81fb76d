"""One request's state as the scheduler sees it: states, legal transitions, token bookkeeping.

Pure Python. The lifecycle (see also the numbered list at the top of engine/scheduler.py)::

    WAITING ─────────────▶ RUNNING ──▶ FINISHED_STOPPED / FINISHED_LENGTH
       ▲                     │    └──▶ FINISHED_ABORTED / FINISHED_ERROR
       └──── PREEMPTED ◀─────┘
    WAITING_FOR_REMOTE_KV ─▶ RUNNING        (decode worker: KV arrives from a prefill worker)

Every state can move to FINISHED_ABORTED or FINISHED_ERROR. States are ordered: anything at or
past FINISHED_STOPPED is finished.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from proto.sampling import SamplingParams


class RequestState(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestState.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestState.FINISHED_STOPPED: "stop",
    RequestState.FINISHED_LENGTH: "length",
    RequestState.FINISHED_ABORTED: "abort",
    RequestState.FINISHED_ERROR: "error",
}

_S = RequestState
_ENDS = {_S.FINISHED_ABORTED, _S.FINISHED_ERROR}
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    _S.WAITING: frozenset({_S.RUNNING} | _ENDS),
    _S.WAITING_FOR_REMOTE_KV: frozenset({_S.RUNNING} | _ENDS),
    _S.RUNNING: frozenset({_S.PREEMPTED, _S.FINISHED_STOPPED, _S.FINISHED_LENGTH} | _ENDS),
    _S.PREEMPTED: frozenset({_S.RUNNING} | _ENDS),
    _S.FINISHED_STOPPED: frozenset(),
    _S.FINISHED_LENGTH: frozenset(),
    _S.FINISHED_ABORTED: frozenset(),
    _S.FINISHED_ERROR: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A bug: the scheduler tried a move the lifecycle does not allow."""


@dataclass(eq=False)
class Request:
    """A request inside one engine.

    num_computed_tokens: tokens of prompt + output whose K/V are in the cache (the last sampled
        token is not computed until the next step).
    num_cached_tokens: prompt tokens found in the prefix cache at (first) admission.
    block_ids: the block table, owned and mutated by the block manager (read-only here).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    scheduled_time: float | None = None   # first moved to RUNNING (end of the queue time)
    first_token_time: float | None = None
    finish_time: float | None = None
    hold_kv: bool = False
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.state.is_finished

    def move_to(self, new_state: RequestState) -> None:
        """Change state, refusing any move not in TRANSITIONS."""
        if new_state not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"request {self.request_id}: {self.state.name} -> {new_state.name}")
        self.state = new_state
        if new_state == RequestState.RUNNING and self.scheduled_time is None:
            self.scheduled_time = time.monotonic()
        if new_state.is_finished:
            self.finish_time = time.monotonic()
