"""Request validation at the router, before any worker work starts. Pure Python, no torch.

The same rules as engine/sampling_params.py (the workers check again with that class); the router
cannot import it, so they are restated here over plain values. Every failure names the field.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 256
DEFAULT_MAX_TOKENS = 16


class InvalidArgument(ValueError):
    """A client error (gRPC INVALID_ARGUMENT, HTTP 400); the message names the field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class Sampling:
    """Validated sampling options, as sent on to the workers."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


def validate_sampling(s: Sampling) -> Sampling:
    """Return s unchanged or raise InvalidArgument naming the first bad field."""
    if not isinstance(s.max_tokens, int) or s.max_tokens < 1:
        raise InvalidArgument("max_tokens", f"must be an integer >= 1, got {s.max_tokens!r}")
    if s.temperature < 0:
        raise InvalidArgument("temperature", f"must be >= 0 (0 = greedy), got {s.temperature!r}")
    if not 0.0 < s.top_p <= 1.0:
        raise InvalidArgument("top_p", f"must be in (0, 1], got {s.top_p!r}")
    if s.top_k < -1:
        raise InvalidArgument("top_k", f"must be -1 or 0 (off) or >= 1, got {s.top_k!r}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}")
    for stop in s.stop:
        if not stop:
            raise InvalidArgument("stop", "stop strings must be non-empty")
        if len(stop.encode()) > MAX_STOP_STRING_BYTES:
            raise InvalidArgument("stop", f"each stop string at most {MAX_STOP_STRING_BYTES} bytes, "
                                          f"got {len(stop.encode())}")
    return s


def validate_prompt(prompt_token_ids: list[int], max_tokens: int, max_model_len: int, vocab_size: int | None = None) -> None:
    """The prompt is non-empty and prompt + max_tokens fits the context."""
    if not prompt_token_ids:
        raise InvalidArgument("prompt", "must not be empty")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise InvalidArgument("prompt", f"token ids must be in [0, {vocab_size})")
    if len(prompt_token_ids) + max_tokens > max_model_len:
        raise InvalidArgument("max_tokens", f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({max_tokens}) "
                                            f"exceeds the context length {max_model_len}; shorten the prompt "
                                            f"or lower max_tokens")


def validate_model(requested: str, served: str) -> None:
    if requested and requested != served:
        raise InvalidArgument("model", f"unknown model {requested!r}; this server serves {served!r}")
