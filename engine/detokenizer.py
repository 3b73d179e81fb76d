"""Incremental detokenization with stop strings, for streaming.

Per request: turns each step's new token ids into a text delta that
- never ends inside a UTF-8 character (a byte-level BPE token may carry part of one: the
  decoder then yields U+FFFD, and we wait for the next token),
- never contains a stop string, nor a prefix of one that a later token could complete: the
  last ``len(longest stop) - 1`` characters are held back until they are safe,
- on a stop string, ends the text just before it (the stop string is not included),
- at the end, flushes what was held back (dropping an unfinished trailing character).

The offsets follow vLLM's ``detokenize_incrementally``: re-decode a short window of ids
(``prefix_offset`` .. end) and emit what it adds over the already-emitted window
(``prefix_offset`` .. ``read_offset``), so each step costs O(window), not O(text).
"""

from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 6  # prompt tokens decoded as left context (merges, leading spaces)


class IncrementalDetokenizer:
    """tokenizer: an HF tokenizer (or a ``tokenizers.Tokenizer``); prompt_token_ids: context only.

    Call ``step(new_ids)`` as tokens arrive and ``finish()`` once; ``stopped`` is set when a stop
    string was found (the caller must end the request with finish reason "stop").
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self._decoder = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # decoded output text so far (complete characters only)
        self.emitted = 0  # characters of self.text already returned
        self.stopped = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self._decoder.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def _advance(self, new_ids: Sequence[int]) -> None:
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now safe to emit ('' if none)."""
        if self.stopped:
            return ""
        if new_token_ids:
            self._advance(new_token_ids)
        if self._find_stop():
            return self._emit(len(self.text))
        return self._emit(max(self.emitted, len(self.text) - self.hold))

    def finish(self) -> str:
        """The request ended: return everything still held back (complete characters only)."""
        if self.stopped:
            return ""
        tail = self._decode(self.ids[self.prefix_offset:])[len(self._decode(self.ids[self.prefix_offset:self.read_offset])):]
        self.text += tail.rstrip(REPLACEMENT)
        self._find_stop()
        return self._emit(len(self.text))

    def _find_stop(self) -> bool:
        """Cut the text at the earliest stop string that starts in the unemitted part."""
        if not self.stop:
            return False
        start = max(0, self.emitted - self.hold)
        hits = [i for s in self.stop if (i := self.text.find(s, start)) != -1]
        if not hits:
            return False
        self.text = self.text[:min(hits)]
        self.stopped = True
        return True

    def _emit(self, upto: int) -> str:
        delta = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return delta
