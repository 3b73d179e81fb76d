"""Workloads for the serving benchmark: ShareGPT prompts, random prompts, shared-prefix prompts,
and an input-grounded one (the answer repeats much of the prompt: speculative decoding's case).

Each loader returns a list of ``SampleRequest``; nothing here does I/O beyond reading the dataset
file. Lengths are in tokens of ``tokenizer`` when one is given; without a tokenizer, random and
prefix prompts are built from common English words (about one token each in BPE vocabularies),
so their lengths are approximate and ``prompt_len`` is left as ``None`` (the target's usage
report then gives the true count).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from engine.errors import UserError

DATASETS = ("sharegpt", "random", "prefix", "grounded")
GROUNDED_TEMPLATE = "Fix the grammar of this text and reply with the corrected text only.\n\nText:\n{}\n\nCorrected text:\n"
DEFAULT_SHAREGPT_OUTPUT_LEN = 128

# Used when no tokenizer is available: short, frequent words that BPE vocabularies keep whole.
_WORDS = (
    "the of and to in is was for that on as with by he at from his an were are which this be or "
    "had it not but first one their its new after who they have her she two been other when there "
    "all during into school time may years more most only over city some world would where later "
    "up such used many can state about national out known university united then made"
).split()


class Tokenizer(Protocol):
    """The subset of a Hugging Face tokenizer the benchmark uses."""

    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    """One prompt to send.

    prompt_len: prompt length in tokens, or None when unknown (no tokenizer).
    expected_output_len: the ``max_tokens`` to request (tokens, >= 1).
    """

    prompt: str
    prompt_len: int | None
    expected_output_len: int


@dataclass(frozen=True)
class DatasetConfig:
    """What to generate; see ``pdserve bench serve --help`` for the meaning of each field."""

    name: str = "sharegpt"
    path: Path | None = None
    num_prompts: int = 100
    max_tokens: int | None = None
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 256
    num_prefixes: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise UserError(f"unknown --dataset {self.name!r}; choose one of {', '.join(DATASETS)}")
        if self.num_prompts < 1:
            raise UserError("--num-prompts must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise UserError("--range-ratio must be in [0, 1)")
        for flag, value, least in (("--input-len", self.input_len, 0), ("--prefix-len", self.prefix_len, 0),
                                   ("--output-len", self.output_len, 1), ("--num-prefixes", self.num_prefixes, 1)):
            if value < least:
                raise UserError(f"{flag} must be >= {least}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UserError("--max-tokens must be >= 1")


def load_requests(cfg: DatasetConfig, tokenizer: Tokenizer | None) -> list[SampleRequest]:
    """The ``cfg.num_prompts`` requests of the configured workload, deterministic in ``cfg.seed``."""
    rng = np.random.default_rng(cfg.seed)
    if cfg.name == "sharegpt":
        return sharegpt_requests(cfg, tokenizer, rng)
    if cfg.name == "random":
        return random_requests(cfg, tokenizer, rng)
    if cfg.name == "grounded":
        return grounded_requests(cfg, tokenizer, rng)
    return prefix_requests(cfg, tokenizer, rng)


# --- ShareGPT ---------------------------------------------------------------------------------

def read_sharegpt(path: Path) -> list[tuple[str, str | None]]:
    """(prompt, reference reply or None) pairs from a ShareGPT file.

    Accepts JSON lines with a ``prompt`` field (the shared ``sharegpt_prompts.jsonl``) or the
    original ShareGPT JSON list (``[{"conversations": [{"from": "human", "value": ...}, ...]}]``),
    whose first human turn is the prompt and the next turn the reference reply.
    Raises UserError if the file is missing or has neither shape.
    """
    if not path.is_file():
        raise UserError(f"dataset file {path} does not exist; pass --dataset-path")
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return _conversations(json.loads(text), path)
    pairs = []
    for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines(): prompts may hold U+2028
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        if "prompt" in row:
            pairs.append((str(row["prompt"]), row.get("completion")))
        elif "conversations" in row:
            pairs.extend(_conversations([row], path))
        else:
            raise UserError(f"{path}:{lineno}: expected a 'prompt' or 'conversations' field")
    return pairs


def _conversations(rows: list[dict[str, Any]], path: Path) -> list[tuple[str, str | None]]:
    pairs = []
    for row in rows:
        turns = row.get("conversations") or row.get("conversation") or []
        if len(turns) >= 1 and turns[0].get("value"):
            reply = turns[1].get("value") if len(turns) >= 2 else None
            pairs.append((str(turns[0]["value"]), reply))
    if not pairs:
        raise UserError(f"{path}: no conversations with a first turn found")
    return pairs


def sharegpt_requests(cfg: DatasetConfig, tokenizer: Tokenizer | None,
                      rng: np.random.Generator) -> list[SampleRequest]:
    """A seeded sample (without replacement while it lasts) of ShareGPT prompts.

    Output length: ``--max-tokens`` if given, else the reference reply's token count when the file
    has replies and a tokenizer is known, else 128.
    """
    pairs = read_sharegpt(cfg.path or default_sharegpt_path())
    order = rng.permutation(len(pairs))
    if cfg.num_prompts > len(pairs):  # cycle through the file again, freshly shuffled
        reps = -(-cfg.num_prompts // len(pairs))
        order = np.concatenate([order] + [rng.permutation(len(pairs)) for _ in range(reps - 1)])
    out = []
    for i in order[: cfg.num_prompts]:
        prompt, reply = pairs[int(i)]
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False)) if tokenizer else None
        out_len = cfg.max_tokens
        if out_len is None and reply and tokenizer:
            out_len = max(1, len(tokenizer.encode(reply, add_special_tokens=False)))
        out.append(SampleRequest(prompt, prompt_len, out_len or DEFAULT_SHAREGPT_OUTPUT_LEN))
    return out


def grounded_requests(cfg: DatasetConfig, tokenizer: Tokenizer | None,
                      rng: np.random.Generator) -> list[SampleRequest]:
    """"Fix the grammar of this text" over ShareGPT prompts (GROUNDED_TEMPLATE): the reply mostly
    copies the text, as in editing, summarising or code-rewriting requests. Each text is cut to
    about ``--input-len`` tokens (4 characters a token when no tokenizer is given); output length
    ``--max-tokens``, else the text's length capped at ``--output-len``."""
    base = sharegpt_requests(replace(cfg, max_tokens=1), None, rng)
    out = []
    for r in base:
        text = r.prompt[: 4 * cfg.input_len]
        if tokenizer is not None:
            ids = tokenizer.encode(text, add_special_tokens=False)[: cfg.input_len]
            text = tokenizer.decode(ids)
        prompt = GROUNDED_TEMPLATE.format(text)
        text_len = _token_len(text, tokenizer) or len(text) // 4
        out.append(SampleRequest(prompt, _token_len(prompt, tokenizer),
                                 cfg.max_tokens or max(1, min(cfg.output_len, text_len))))
    return out


def default_sharegpt_path() -> Path:
    """``../shared/data/sharegpt_prompts.jsonl`` beside the repository root."""
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "sharegpt_prompts.jsonl"


# --- random and shared-prefix -------------------------------------------------------------------

def sample_lengths(mean: int, range_ratio: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n integer lengths uniform in [mean*(1-r), mean*(1+r)] (as ``vllm bench serve --random-range-ratio``)."""
    lo, hi = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return rng.integers(lo, hi + 1, size=n)


def random_text(n_tokens: int, tokenizer: Tokenizer | None, rng: np.random.Generator) -> str:
    """Text of ``n_tokens`` tokens: random token ids decoded (re-encoded and trimmed or padded until
    the round trip keeps the length, a few rounds at most), or ``n_tokens`` random common words."""
    if n_tokens <= 0:
        return ""
    if tokenizer is None:
        return " ".join(rng.choice(_WORDS, size=n_tokens))
    low = min(1000, tokenizer.vocab_size // 2)  # skip the low ids, where special and byte tokens usually sit
    ids = rng.integers(low, tokenizer.vocab_size, size=n_tokens).tolist()
    for _ in range(4):
        text = tokenizer.decode(ids)
        got = tokenizer.encode(text, add_special_tokens=False)
        if len(got) == n_tokens:
            break
        ids = got[:n_tokens] + rng.integers(low, tokenizer.vocab_size, size=max(0, n_tokens - len(got))).tolist()
    return text


def _token_len(text: str, tokenizer: Tokenizer | None) -> int | None:
    return len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer else None


def random_requests(cfg: DatasetConfig, tokenizer: Tokenizer | None,
                    rng: np.random.Generator) -> list[SampleRequest]:
    """Prompts of ``--input-len`` random tokens and ``--output-len`` output tokens, both spread by ``--range-ratio``."""
    in_lens = sample_lengths(cfg.input_len, cfg.range_ratio, cfg.num_prompts, rng)
    out_lens = sample_lengths(cfg.output_len, cfg.range_ratio, cfg.num_prompts, rng)
    reqs = []
    for n_in, n_out in zip(in_lens, out_lens):
        text = random_text(max(1, int(n_in)), tokenizer, rng)
        reqs.append(SampleRequest(text, _token_len(text, tokenizer), cfg.max_tokens or max(1, int(n_out))))
    return reqs


def prefix_requests(cfg: DatasetConfig, tokenizer: Tokenizer | None,
                    rng: np.random.Generator) -> list[SampleRequest]:
    """``--num-prefixes`` shared system prompts of ``--prefix-len`` tokens, each request one of them
    (chosen round-robin, so every prefix is reused) followed by a random ``--input-len`` suffix."""
    prefixes = [random_text(cfg.prefix_len, tokenizer, rng) for _ in range(cfg.num_prefixes)]
    suffix_lens = sample_lengths(cfg.input_len, cfg.range_ratio, cfg.num_prompts, rng)
    out_lens = sample_lengths(cfg.output_len, cfg.range_ratio, cfg.num_prompts, rng)
    reqs = []
    for i in range(cfg.num_prompts):
        suffix = random_text(max(1, int(suffix_lens[i])), tokenizer, rng)
        text = f"{prefixes[i % cfg.num_prefixes]}\n{suffix}" if cfg.prefix_len else suffix
        reqs.append(SampleRequest(text, _token_len(text, tokenizer), cfg.max_tokens or max(1, int(out_lens[i]))))
    return reqs
