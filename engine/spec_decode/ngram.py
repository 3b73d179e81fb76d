"""n-gram (prompt-lookup) proposer: guess the next tokens by finding the sequence's last n
tokens earlier in its own prompt + output and proposing what followed there (Saxena 2023,
"prompt lookup decoding"; vLLM's ngram speculator). No model, no KV. Pure Python.

Per request an index maps every n-gram (n in ngram_min..ngram_max) to the position right after
its most recent occurrence, updated incrementally as tokens arrive (O(ngram_max) per token),
so a proposal costs O(ngram_max) dictionary look-ups instead of a scan of the context.
"""

from __future__ import annotations

from typing import Sequence


class _NgramIndex:
    """n-gram -> position after its latest occurrence, over tokens[0 .. num_indexed - 1]."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.sizes = range(ngram_min, ngram_max + 1)
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.num_indexed = 0  # n-grams ending before this position are indexed

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Index every n-gram that ends at a position < upto."""
        for end in range(self.num_indexed, upto):
            for n in self.sizes:
                if end + 1 >= n:
                    self.maps[n][tuple(tokens[end + 1 - n:end + 1])] = end + 1
        self.num_indexed = max(self.num_indexed, upto)

    def lookup(self, tokens: Sequence[int]) -> int | None:
        """Position after the latest earlier occurrence of the longest matching suffix, or None."""
        for n in reversed(self.sizes):
            if len(tokens) >= n:
                pos = self.maps[n].get(tuple(tokens[-n:]))
                if pos is not None:
                    return pos
        return None


class NgramProposer:
    """propose(request_id, tokens, k): up to k tokens that followed the latest earlier
    occurrence of the last n tokens (n = ngram_max down to ngram_min); () if none matches.

    tokens: the request's prompt + output so far (a list that only grows, except after a
    preemption, which restarts it: then call forget). Proposals are free, so the caller
    proposes k_max and lets the adaptive controller cut them (``is_free = True``).
    """

    is_free = True

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._index: dict[str, _NgramIndex] = {}

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        if k <= 0 or len(tokens) < self.ngram_min + 1:
            return ()
        index = self._index.get(request_id)
        if index is None or index.num_indexed > len(tokens):
            index = self._index[request_id] = _NgramIndex(self.ngram_min, self.ngram_max)
        index.extend(tokens, len(tokens) - 1)  # the suffix itself (ending at the last token) is not a match
        pos = index.lookup(tokens)
        return () if pos is None else tuple(tokens[pos:pos + k])

    def forget(self, live_request_ids: set[str] | frozenset[str]) -> None:
        """Drop the index of every request not in live_request_ids (finished, aborted)."""
        for rid in [r for r in self._index if r not in live_request_ids]:
            del self._index[rid]

    @property
    def num_tracked(self) -> int:
        return len(self._index)
