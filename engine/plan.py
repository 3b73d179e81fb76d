"""What the scheduler decides for one step (the plan) and what comes back (the result).

Two separate types: the plan is read-only for whoever executes it; only the scheduler applies a
result to request state. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScheduledChunk:
    """The tokens of one request computed in this step.

    token_ids: tokens at positions start_pos .. start_pos + len - 1.
    block_ids: the request's block table (covers every position of the chunk).
    num_logits: 1 when the chunk ends at the request's last token (a token is sampled), else 0;
        1 + len(draft_token_ids) for a verification row.
    is_last_chunk: the chunk reaches the end of the request's known tokens (prefill done).
    is_padding: static batching only; computed like a real token, result discarded.
    draft_token_ids: speculative decoding: the drafts appended after the request's last token
        (token_ids = (last token, *drafts)); their KV goes to lookahead slots reserved at schedule
        time, and only the accepted ones count as computed afterwards.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]
    num_logits: int
    is_last_chunk: bool
    is_padding: bool = False
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def new_block_ids(self, block_size: int) -> list[int]:
        """Block ids that the chunk's new tokens are written to."""
        first, last = self.start_pos // block_size, (self.start_pos + self.num_tokens - 1) // block_size
        return list(self.block_ids[first:last + 1])


@dataclass(frozen=True)
class SchedulePlan:
    """chunks: in execution order. preempted: request ids preempted (by recompute) this step.
    freed_block_ids: blocks released by those preemptions (nothing to copy: no copy-on-write).
    pad_to_longest: attend every decode row as one batch padded to the longest context, as a
        contiguous-cache engine does (static batching's rectangle), not grouped by length."""

    chunks: tuple[ScheduledChunk, ...] = ()
    preempted: tuple[str, ...] = ()
    freed_block_ids: tuple[int, ...] = ()
    pad_to_longest: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True)
class StepResult:
    """sampled: request id -> the token sampled from its chunk's logits (chunks with num_logits).
    logprobs: optional, request id -> whatever the sampler returned for it.
    verified: verification rows: request id -> the tokens they emit (accepted drafts, then the
        target's own token; 1 .. k + 1 tokens). Such a request has no entry in sampled."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, object] = field(default_factory=dict)
    verified: dict[str, tuple[int, ...]] = field(default_factory=dict)
