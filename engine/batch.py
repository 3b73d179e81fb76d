"""What one model forward computes: a flat batch of per-sequence chunks.

The contract between whoever schedules (the offline runtime, the scheduler, speculative
verification) and the model runner. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class SeqChunk:
    """The new tokens of one sequence in one forward.

    token_ids: the tokens to compute now (a prefill chunk, one decode token, or k+1 tokens
        for speculative verification); at least one.
    start_pos: how many of the sequence's tokens are already in the KV cache (their K/V are
        read from the cache, not recomputed); the new tokens take positions
        start_pos .. start_pos + len(token_ids) - 1.
    block_table: block ids covering at least start_pos + len(token_ids) tokens.
    num_logits: how many trailing positions of this chunk need logits: 1 for the last token
        of a prompt or a decode step, k+1 for verification, 0 for a non-final prefill chunk.
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    num_logits: int = 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this forward."""
        return self.start_pos + len(self.token_ids)
