"""Sampling parameters of one request and their one set of validation rules. Pure Python, no torch.

Shared by the router (front ends), the workers, the engine and the offline CLI: every caller
builds a `SamplingParams`, which validates itself at construction and raises `InvalidRequest`
naming the first bad field (the router maps it to INVALID_ARGUMENT / HTTP 400, the CLI to a
one-line error with exit status 2). `from_wire` / `to_wire` convert to and from the gRPC
`SamplingOptions` message, the one converter both sides use; `check_prompt` is the prompt check
the router and the workers both run before any engine work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from proto.pdserve.v1 import api_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 256
MAX_LOGPROBS = 20
SAMPLING_EPS = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-2, 1e2
DEFAULT_MAX_TOKENS = 16


class InvalidRequest(ValueError):
    """A client error: the message names the field and the allowed values (`field` holds the name)."""

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
    stop: strings that end generation; they are not included in the output text
        (at most MAX_STOP_STRINGS, each non-empty and at most MAX_STOP_STRING_BYTES UTF-8 bytes).
    ignore_eos: keep generating past EOS (benchmarks), until max_tokens.
    logprobs: per generated token, its log-probability (None = none) and those of the top-n
        tokens (0 = the chosen token's only; at most MAX_LOGPROBS), from the model's raw distribution.
    skip_special_tokens: leave special tokens out of the detokenized text.
    min_tokens: EOS (unless ignore_eos) and stop_token_ids cannot be sampled before this many
        output tokens (vLLM's min_tokens), <= max_tokens.
    presence_penalty, frequency_penalty: OpenAI's, in [-2, 2]: logit -= f * count + p * (count > 0)
        over the output tokens so far.
    repetition_penalty: CTRL's (Keskar et al. 2019), > 0, 1 = off: a token already in the prompt or
        the output has its logit divided by r if positive, multiplied by r if not.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        # Tuples keep the params hashable and immutable even when callers pass lists.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        self.validate()

    @property
    def greedy(self) -> bool:
        # A temperature below SAMPLING_EPS is greedy, as in vLLM: dividing fp32 logits by 1e-39
        # gives +-inf, softmax NaN, and every step sampled token 0.
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def validate(self) -> None:
        """Raise InvalidRequest naming the first bad field."""
        # NaN passes every comparison-based range check below ("nan < 0" is False), so the
        # float fields are checked for finiteness first, whichever front end built the params.
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidRequest(name, f"must be a finite number, got {value!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequest("temperature", f"must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            raise InvalidRequest("top_k", f"must be -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(name, f"must be in [-2, 2], got {getattr(self, name)!r}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            # logits are divided or multiplied by it: outside this range fp32 logits overflow to inf
            raise InvalidRequest("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY:g}, "
                                 f"{MAX_REPETITION_PENALTY:g}] (1 = off), got {self.repetition_penalty!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise InvalidRequest("seed", f"must be an integer in [0, 2**64), got {self.seed!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids", "token ids must be >= 0")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s:
                raise InvalidRequest("stop", "stop strings must be non-empty")
            if len(s.encode()) > MAX_STOP_STRING_BYTES:
                raise InvalidRequest("stop", f"each stop string at most {MAX_STOP_STRING_BYTES} bytes, "
                                             f"got {len(s.encode())}")


def check_prompt(prompt_token_ids: Sequence[int], max_tokens: int, max_model_len: int,
                 vocab_size: int | None = None) -> None:
    """The prompt is non-empty, its ids are in [0, vocab_size) and prompt + max_tokens fits the context.

    Raises InvalidRequest("prompt" | "max_tokens", ...)."""
    if not prompt_token_ids:
        raise InvalidRequest("prompt", "must not be empty")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise InvalidRequest("prompt", f"token ids must be in [0, {vocab_size})")
    # The router checks without the model's vocabulary: a negative id must still stop there, before
    # the KV-aware routing hashes the prompt's blocks (uint32 packing) or any worker sees it.
    if any(t < 0 for t in prompt_token_ids):
        raise InvalidRequest("prompt", "token ids must be >= 0")
    if len(prompt_token_ids) + max_tokens > max_model_len:
        raise InvalidRequest("max_tokens", f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({max_tokens}) "
                                           f"exceeds the context length {max_model_len}; shorten the prompt "
                                           f"or lower max_tokens")


def from_wire(wire: api_pb2.SamplingOptions, **override) -> SamplingParams:
    """SamplingParams from the wire message, server defaults for unset optional fields; `override`
    replaces fields (the prefill leg's max_tokens=1). Raises InvalidRequest naming the field."""
    kwargs = dict(temperature=wire.temperature if wire.HasField("temperature") else 1.0,
                  top_p=wire.top_p if wire.HasField("top_p") else 1.0, top_k=wire.top_k,
                  seed=wire.seed if wire.HasField("seed") else None,
                  max_tokens=wire.max_tokens if wire.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
                  stop=tuple(wire.stop), stop_token_ids=tuple(wire.stop_token_ids), ignore_eos=wire.ignore_eos,
                  logprobs=wire.logprobs if wire.HasField("logprobs") else None, min_tokens=wire.min_tokens,
                  presence_penalty=wire.presence_penalty, frequency_penalty=wire.frequency_penalty,
                  repetition_penalty=wire.repetition_penalty if wire.HasField("repetition_penalty") else 1.0)
    return SamplingParams(**(kwargs | override))


def to_wire(params: SamplingParams) -> api_pb2.SamplingOptions:
    """The wire message for validated params, every field explicit (what the router sends the workers)."""
    w = api_pb2.SamplingOptions(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                max_tokens=params.max_tokens, stop=list(params.stop),
                                stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
                                min_tokens=params.min_tokens, presence_penalty=params.presence_penalty,
                                frequency_penalty=params.frequency_penalty,
                                repetition_penalty=params.repetition_penalty)
    if params.seed is not None:
        w.seed = params.seed
    if params.logprobs is not None:
        w.logprobs = params.logprobs
    return w
