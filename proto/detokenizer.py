"""Incremental detokenization with stop strings, for streaming: the one detokenizer of the engine
and the router. Pure Python, no torch.

Per request it turns each step's new token ids into a text delta that
- never ends inside a UTF-8 character (a byte-level BPE token may carry part of one: the
  decoder then yields U+FFFD, and we wait for the next token),
- never contains a stop string, nor the beginning of one that a later token could complete:
  the longest suffix of the unsent text that is a proper prefix of a stop string is held back
  until it is known not to be one (proto/stop.py),
- on a stop string, ends the text just before it (the stop string is not included; tokens after
  the one that completed it are ignored),
- at the end, flushes what was held back (dropping an unfinished trailing character).

The offsets follow vLLM's ``detokenize_incrementally`` (vllm/transformers_utils/detokenizer_utils.py):
re-decode a short window of ids (``prefix_offset`` .. end) and emit what it adds over the
already-emitted window (``prefix_offset`` .. ``read_offset``), so each token costs O(window), not
O(text). The last few prompt tokens seed the window, so the first output token decodes with its
left context (merges, leading spaces) as it would inside the full text.
"""

from __future__ import annotations

from typing import Any, Sequence

from proto.stop import find_stop_string, partial_stop_len

REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 6  # prompt tokens decoded as left context (merges, leading spaces)


class IncrementalDetokenizer:
    """One request's stream of text.

    tokenizer: anything with ``decode(ids, skip_special_tokens=...) -> str``: an HF tokenizer
    (its fast ``backend_tokenizer`` is used), a ``tokenizers.Tokenizer``, the router's tokenizer.
    prompt_token_ids: context only (never emitted). Call ``step(new_ids)`` as tokens arrive and
    ``finish()`` once; ``stopped`` is set when a stop string was found (the caller must end the
    request with finish reason "stop").
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self._decoder = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # decoded output text so far (complete characters only, cut at a stop string)
        self.emitted = 0  # characters of self.text already returned
        self.stopped = False

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now safe to emit ('' if none)."""
        if self.stopped:
            return ""
        for t in new_token_ids:
            self._advance(t)
            if self._cut_at_stop():
                return self._emit(len(self.text))
        return self._emit(len(self.text) - partial_stop_len(self.text[self.emitted:], self.stop))

    def finish(self) -> str:
        """The request ended: return everything still held back (complete characters only)."""
        if self.stopped:
            return ""
        self.text += self._new_text().rstrip(REPLACEMENT)
        self._cut_at_stop()
        return self._emit(len(self.text))

    def _decode(self, ids: Sequence[int]) -> str:
        return self._decoder.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def _new_text(self) -> str:
        """What the ids past read_offset add to the window's text."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        return full[len(prefix):] if len(full) > len(prefix) else ""

    def _advance(self, token_id: int) -> None:
        self.ids.append(token_id)
        new = self._new_text()
        if new and not new.endswith(REPLACEMENT):  # else: an incomplete character, wait for more
            self.text += new
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _cut_at_stop(self) -> bool:
        """Cut the text at the earliest stop string in the unsent part (none can start earlier:
        a sent suffix was never the beginning of a stop string)."""
        i = find_stop_string(self.text, self.stop, self.emitted) if self.stop else None
        if i is None:
            return False
        self.text = self.text[:i]
        self.stopped = True
        return True

    def _emit(self, upto: int) -> str:
        delta = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return delta
