"""Speculative-decoding configuration: a frozen dataclass, validated at construction. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Method = Literal["ngram", "draft"]
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "ngram" (prompt lookup, no model) or "draft" (a draft model, engine/spec_decode/draft.py).
    num_speculative_tokens: the most draft tokens verified per request and step (k_max, 1..16);
        with ``adaptive`` each request's k is chosen in 0..k_max every step.
    ngram_max / ngram_min: n-gram lengths tried, longest first (``--spec-ngram-max/min``).
    model / quantization: the draft model and its linear method (method "draft").
    adaptive: choose k per request from its acceptance rate and the measured step-time model
        (engine/spec_decode/adaptive.py); False = always propose up to k_max.
    draft_vocab_size: method "draft": the draft's LM head covers token ids < N only
        (engine/spec_decode/draft_vocab.py); None = the whole vocabulary.
    """

    method: Method = "ngram"
    num_speculative_tokens: int = 4
    ngram_max: int = 4
    ngram_min: int = 2
    model: str | None = None
    quantization: str = "none"
    adaptive: bool = True
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative method must be ngram or draft, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= spec ngram min <= spec ngram max, got {self.ngram_min}, {self.ngram_max}")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative method draft needs a speculative model")
        if self.draft_vocab_size is not None and (self.method != "draft" or self.draft_vocab_size < 1):
            raise ValueError(f"draft_vocab_size is for method draft and must be >= 1, got {self.draft_vocab_size}")

    def compat_descriptor(self) -> str:
        """What a prefill/decode pair must agree on (method, draft identity, k), as one string.
        Used in the KV-transfer compatibility key (kv_transfer/base.py)."""
        if self.method == "ngram":
            return f"ngram:k={self.num_speculative_tokens}:n={self.ngram_min}-{self.ngram_max}"
        vocab = "" if self.draft_vocab_size is None else f":vocab={self.draft_vocab_size}"
        return f"draft:{self.model}:{self.quantization}{vocab}:k={self.num_speculative_tokens}"


def compat_descriptor(config: SpeculativeConfig | None) -> str:
    """The descriptor of an optional config ("none" without speculation)."""
    return "none" if config is None else config.compat_descriptor()


def from_flags(method: str | None, num_speculative_tokens: int | None, model: str | None, ngram_max: int | None,
               ngram_min: int | None, quantization: str = "none",
               draft_vocab_size: int | None = None) -> SpeculativeConfig | None:
    """The config of the vLLM-style CLI flags (None = speculation off: no --speculative-method).
    ngram_max / ngram_min: None = not given (4 / 2). Raises engine.errors.UserError naming the flag
    (the CLI prints one line, exit status 2), also for a speculation flag given without a method
    (it would be ignored without a word)."""
    from engine.errors import UserError

    if not method:
        given = [flag for flag, value in (("--num-speculative-tokens", num_speculative_tokens is not None),
                                          ("--speculative-model", bool(model)),
                                          ("--speculative-draft-vocab-size", draft_vocab_size is not None),
                                          ("--speculative-quantization", quantization not in (None, "none")),
                                          ("--spec-ngram-max", ngram_max is not None),
                                          ("--spec-ngram-min", ngram_min is not None)) if value]
        if given:
            raise UserError(f"{' / '.join(given)} need{'s' if len(given) == 1 else ''} --speculative-method "
                            "ngram|draft (without it speculation is off)")
        return None
    ngram_max = 4 if ngram_max is None else ngram_max
    ngram_min = 2 if ngram_min is None else ngram_min
    if method not in ("ngram", "draft"):
        raise UserError(f"--speculative-method must be ngram or draft, got {method!r}")
    k = 4 if num_speculative_tokens is None else num_speculative_tokens
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise UserError(f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
    if not 1 <= ngram_min <= ngram_max:
        raise UserError(f"--spec-ngram-min ({ngram_min}) must be in [1, --spec-ngram-max ({ngram_max})]")
    if method == "draft" and not model:
        raise UserError("--speculative-method draft needs --speculative-model NAME|PATH")
    if method == "ngram" and model:
        raise UserError("--speculative-model is for --speculative-method draft; ngram uses no model (drop it)")
    if quantization not in ("none", "int8", "fp8"):
        raise UserError(f"--speculative-quantization must be none, int8 or fp8, got {quantization!r}")
    if draft_vocab_size is not None and (method != "draft" or draft_vocab_size < 1):
        raise UserError(f"--speculative-draft-vocab-size needs --speculative-method draft and must be >= 1, "
                        f"got {draft_vocab_size}")
    return SpeculativeConfig(method, k, ngram_max, ngram_min, model, quantization, draft_vocab_size=draft_vocab_size)
