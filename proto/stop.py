"""The stop rules of a request, in one place for the engine, the workers and the detokenizer. Pure Python.

A request ends, after a token is appended, with finish reason
- "stop": the token is one of ``params.stop_token_ids``, or one of the model's EOS ids unless
  ``params.ignore_eos`` (neither before ``params.min_tokens`` output tokens);
- "length": ``max_tokens`` output tokens were generated, or the sequence fills the context;
- "stop" too when the text contains a stop string (``params.stop``): the text ends just before
  the earliest one and the stop string is never emitted (the incremental detokenizer,
  proto/detokenizer.py, applies this with the two string helpers below).
Token rules are checked before length rules, so an EOS that is also the last allowed token is "stop".
"""

from __future__ import annotations

from typing import Collection, Sequence

from proto.sampling import SamplingParams


def token_stop_reason(token_id: int, num_output_tokens: int, params: SamplingParams,
                      eos_token_ids: Collection[int], num_tokens: int = 0,
                      max_model_len: int | None = None) -> str | None:
    """Finish reason after appending ``token_id`` as output token number ``num_output_tokens`` (1-based).

    num_tokens / max_model_len: the sequence's length (prompt + output) and the context length;
    a full context ends the request with "length". Before ``params.min_tokens`` output tokens only
    the length rules apply (the sampler also masks EOS and the stop token ids there; this matters
    for a token that was not sampled here, e.g. the prefill worker's first token).
    Returns "stop", "length" or None."""
    if num_output_tokens < params.min_tokens:
        return _length_reason(num_output_tokens, params, num_tokens, max_model_len)
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return "stop"
    return _length_reason(num_output_tokens, params, num_tokens, max_model_len)


def _length_reason(num_output_tokens: int, params: SamplingParams, num_tokens: int,
                   max_model_len: int | None) -> str | None:
    if num_output_tokens >= params.max_tokens:
        return "length"
    if max_model_len is not None and num_tokens >= max_model_len:
        return "length"
    return None


def find_stop_string(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Index in ``text`` of the earliest stop string that begins at or after ``start``, or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string: the text
    a later token could still turn into a stop string, so it must be held back."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
