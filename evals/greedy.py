"""Greedy agreement up to the first near-tie: the rule the bf16 and FP8 tests compare greedy runs by.

Two numerically different runs of one model (bf16 vs fp32, a quantized linear, another batch
shape) may rightly pick different tokens where the reference's top-2 log-probabilities are
within NEAR_TIE_NATS of each other; after such a position the continuations diverge for no
fault of either. So a continuation *agrees* with the reference if it repeats the reference up to
the reference's first near-tie (the whole reference when there is none). Pure Python.
"""

from __future__ import annotations

from typing import Sequence

NEAR_TIE_NATS = 0.5
"""Top-2 log-probability gap (nats) below which a position is a near-tie (measured bf16 vs fp32:
where the argmaxes differed, fp32's top-2 gap was at most 0.23 nats)."""


def first_near_tie(top2_gaps: Sequence[float], near_tie: float = NEAR_TIE_NATS) -> int:
    """Index of the first position whose top-2 gap (nats) is below ``near_tie``; len() if none."""
    for i, gap in enumerate(top2_gaps):
        if gap < near_tie:
            return i
    return len(top2_gaps)


def agrees(reference_text: str, token_offsets: Sequence[int], top2_gaps: Sequence[float], text: str,
           near_tie: float = NEAR_TIE_NATS) -> tuple[bool, int]:
    """(does ``text`` repeat the reference up to its first near-tie, tokens compared).

    reference_text: the reference continuation; token_offsets[i]: the character offset of its
    token i in that text; top2_gaps[i]: the reference's top-1 minus top-2 log-probability there.
    Without a near-tie the whole reference must match, and ``text`` may not go on past it."""
    k = first_near_tie(top2_gaps, near_tie)
    if k == len(top2_gaps):
        return text == reference_text, k
    return text.startswith(reference_text[:token_offsets[k]]), k
