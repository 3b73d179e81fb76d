"""Sampling parameters of one request: pure Python, validated at construction.

Shared by the offline CLI, the engine and the workers; the router validates the same
rules on the wire message without importing this (it must not import torch).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 256


class InvalidRequest(ValueError):
    """A client error: the message names the field and the allowed values."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    temperature: 0 means greedy (argmax); > 0 divides the logits.
    top_k: keep the k most likely tokens; 0 or -1 keeps all.
    top_p: nucleus sampling, keep the smallest set whose probability mass reaches top_p, in (0, 1].
    seed: per-request seed; the same seed gives the same tokens (independent of the batch).
    max_tokens: most tokens to generate, >= 1.
    stop_token_ids: extra token ids that end generation (the model's EOS always does unless ignore_eos).
    stop: strings that end generation; they are not included in the output text.
    ignore_eos: keep generating past EOS (benchmarks), until max_tokens.
    logprobs: return the log-probabilities of the top-n tokens at each step (0 = none).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Tuples keep the params hashable and immutable even when callers pass lists.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Raise InvalidRequest naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequest("temperature", f"must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            raise InvalidRequest("top_k", f"must be -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        if self.logprobs < 0 or self.logprobs > 20:
            raise InvalidRequest("logprobs", f"must be in [0, 20], got {self.logprobs!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s:
                raise InvalidRequest("stop", "stop strings must be non-empty")
            if len(s.encode()) > MAX_STOP_STRING_BYTES:
                raise InvalidRequest("stop", f"each stop string at most {MAX_STOP_STRING_BYTES} bytes, got {len(s.encode())}")
