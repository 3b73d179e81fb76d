"""Incremental detokenization and stop strings for one request's stream. Pure Python.

Two rules the client can rely on:
- text is emitted only when it is UTF-8 complete (a byte-level token that splits a character
  waits for the next one), using the prefix/read offsets of vLLM's incremental detokenizer
  (vllm/transformers_utils/detokenizer_utils.py): decode the last emitted tokens with and
  without the new ones and emit the difference;
- a stop string never appears: text that could be the start of a stop string is held back until
  it is known not to be one, and on a match the text is cut before the stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

@dataclass
class StreamDelta:
    text: str
    stopped: bool  # a stop string matched: the request is finished with reason "stop"


@dataclass
class IncrementalDetokenizer:
    """Feed token ids as they arrive; get the text to send (see module docstring)."""

    decode: Callable[[list[int]], str]
    stop: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0
    _pending: str = ""     # decoded but not yet sent (may be a stop string's beginning)
    _stopped: bool = False

    def add(self, new_ids: list[int]) -> StreamDelta:
        if self._stopped:
            return StreamDelta("", True)
        for t in new_ids:
            self.token_ids.append(t)
            self._pending += self._next_text()
            if self._cut_at_stop():
                return StreamDelta(self._flush(), True)
        return StreamDelta(self._release(), False)

    def finish(self) -> str:
        """The held-back text once the stream has ended without a stop string."""
        return "" if self._stopped else self._flush()

    def _next_text(self) -> str:
        ids = self.token_ids
        prefix = self.decode(ids[self._prefix_offset:self._read_offset])
        full = self.decode(ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # incomplete UTF-8 sequence: wait for more tokens
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return full[len(prefix):]

    def _cut_at_stop(self) -> bool:
        hits = [i for i in (self._pending.find(s) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self._pending = self._pending[:min(hits)]
        self._stopped = True
        return True

    def _release(self) -> str:
        # Keep back only a suffix that could still grow into a stop string.
        keep = _longest_stop_prefix_suffix(self._pending, self.stop)
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def _flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


def _longest_stop_prefix_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
