"""Batched sampling: one call picks the next token of every sequence in a step.

Per row, in vLLM's order: the penalties on the raw logits (repetition, CTRL / Keskar et al. 2019:
a logit of a token seen in the prompt or the output is divided by r if positive, multiplied by
r if not; frequency and presence, OpenAI: ``logit -= f * count + p * (count > 0)`` over the
output), then min_tokens (EOS and stop token ids masked while fewer tokens were generated), then
greedy (argmax) when ``params.greedy``; otherwise temperature, then top-k, then top-p
(nucleus, Holtzman et al. 2019), then a draw with the exponential-race trick
(``argmax(p / q)``, ``q ~ Exp(1)``, equivalent to sampling from ``p``). A request with a seed
draws its noise from its own ``torch.Generator`` (seeded once, see make_generator), so its
tokens do not depend on what else is in the batch; requests without a seed share torch's
default generator. Top-n logprobs are those of the model's distribution (log-softmax of the
raw logits, before penalties, temperature, top-k and top-p), as vLLM reports them by default.
The vocabulary is never sorted for greedy or top-k rows: top-k takes ``torch.topk`` (already
ordered), and only top-p without a top-k sorts a whole row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kernels.layer_ops import greedy_argmax
from proto.sampling import SamplingParams


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the chosen token and the top-n alternatives (most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class RowHistory:
    """What the penalties and min_tokens need of one row: the prompt and the tokens generated so far."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # None when no row asked for logprobs


def make_generator(params: SamplingParams, device: str | torch.device = "cpu") -> torch.Generator | None:
    """The request's own generator if it has a seed (create once per request, reuse every step)."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32; top_k [N] int64 (V = disabled); top_p [N] float32 (1 = disabled).

    Returns a copy with every token outside the row's top-k and outside its nucleus (smallest
    set whose probability mass reaches top_p) set to -inf; at least one token always survives.
    Top-k alone is a threshold at the k-th largest value (``torch.topk``, no sort; ties at the
    threshold survive). With top-p, only the ``max(top_k)`` best candidates are ordered (topk
    returns them sorted), so the whole vocabulary is sorted only for a row with top-p and no top-k.
    """
    vocab = logits.shape[-1]
    top_k = top_k.clamp(1, vocab)
    k_max = int(top_k.max())
    if bool((top_p >= 1.0).all()):
        kth = logits.topk(k_max, dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))
        return logits.masked_fill(logits < kth, float("-inf"))
    values, order = logits.topk(k_max, dim=-1)  # descending
    values = values.masked_fill(torch.arange(k_max).unsqueeze(0) >= top_k.unsqueeze(1), float("-inf"))
    probs = values.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p.unsqueeze(1)  # the nucleus already reached top_p before this token
    drop[:, 0] = False
    values = values.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, values)


def _has_penalty(p: SamplingParams) -> bool:
    return (getattr(p, "presence_penalty", 0.0) != 0.0 or getattr(p, "frequency_penalty", 0.0) != 0.0
            or getattr(p, "repetition_penalty", 1.0) != 1.0)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[RowHistory]) -> None:
    """In place on logits [N, V] float32: vLLM's repetition, frequency and presence penalties.

    repetition_penalty r (> 0; 1 = off) acts on every token seen in the prompt or the output;
    frequency_penalty f and presence_penalty p (in [-2, 2]; 0 = off) on the output's counts."""
    vocab = logits.shape[-1]
    for i, (p, h) in enumerate(zip(params, histories)):
        if not _has_penalty(p):
            continue
        row = logits[i]
        counts = torch.bincount(torch.as_tensor(list(h.output_token_ids), dtype=torch.int64), minlength=vocab)[:vocab]
        counts = counts.to(row.dtype)
        r = getattr(p, "repetition_penalty", 1.0)
        if r != 1.0:
            seen = counts > 0
            if h.prompt_token_ids:
                seen[torch.as_tensor(list(h.prompt_token_ids), dtype=torch.int64)] = True
            row[seen] = torch.where(row[seen] > 0, row[seen] / r, row[seen] * r)
        row -= getattr(p, "frequency_penalty", 0.0) * counts + getattr(p, "presence_penalty", 0.0) * (counts > 0)


def apply_min_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[RowHistory],
                     eos_token_ids: Sequence[int]) -> None:
    """In place: while a row has fewer than min_tokens outputs, EOS (unless ignore_eos, as in vLLM)
    and its stop token ids cannot be sampled."""
    for i, (p, h) in enumerate(zip(params, histories)):
        if len(h.output_token_ids) >= getattr(p, "min_tokens", 0):
            continue
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        banned = [t for t in banned if 0 <= t < logits.shape[-1]]
        if banned:
            logits[i, banned] = float("-inf")


def _wanted_logprobs(p: SamplingParams) -> int | None:
    """None: no logprobs; 0: the chosen token's only; n: also the top n."""
    n = getattr(p, "logprobs", None)
    return None if n is None else int(n)


class Sampler:
    """Stateless; the per-request generators are owned by the caller (one per request).

    eos_token_ids: the model's EOS ids (masked under min_tokens)."""

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None] | None = None,
               histories: Sequence[RowHistory] | None = None) -> SamplerOutput:
        """logits [N, V] float32 -> one token id per row (row i uses params[i], generators[i]).

        histories[i]: row i's prompt and output so far; needed when a row has a penalty or
        min_tokens (None: every row is taken to have an empty history).
        Raises ValueError if the number of params (or generators, histories) differs from N.
        """
        num_rows, vocab = logits.shape
        generators = list(generators) if generators is not None else [None] * num_rows
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(f"{num_rows} logits rows but {len(params)} params and {len(generators)} generators")
        if histories is not None and len(histories) != num_rows:
            raise ValueError(f"{num_rows} logits rows but {len(histories)} histories")
        raw = logits.float()
        logits = self._processed(raw, params, histories)
        tokens = greedy_argmax(logits)   # (the C++ argmax on CPU: torch's reads 49K logits at ~7 GB/s)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            tokens[rows] = self._draw(logits[rows], [params[i] for i in rows], [generators[i] for i in rows])
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, self._logprobs(raw, token_ids, params))

    def _processed(self, raw: torch.Tensor, params: Sequence[SamplingParams],
                   histories: Sequence[RowHistory] | None) -> torch.Tensor:
        """The logits after penalties and min_tokens (raw itself when no row has either)."""
        penalties = any(_has_penalty(p) for p in params)
        min_tokens = any(getattr(p, "min_tokens", 0) > 0 for p in params)
        if not (penalties or min_tokens):
            return raw
        histories = histories if histories is not None else [RowHistory((), ())] * len(params)
        logits = raw.clone()
        if penalties:
            apply_penalties(logits, params, histories)
        if min_tokens:
            apply_min_tokens(logits, params, histories, self.eos_token_ids)
        return logits

    @staticmethod
    def advance(generator: torch.Generator | None, vocab: int, params: SamplingParams, steps: int = 1) -> None:
        """Move a request's generator past `steps` draws made elsewhere (the first token, sampled on
        the prefill worker), so a disaggregated seeded request draws what it would in one engine."""
        if generator is not None and not params.greedy:
            for _ in range(steps):
                torch.empty(vocab).exponential_(generator=generator)

    @staticmethod
    def _draw(logits: torch.Tensor, params: list[SamplingParams],
              generators: list[torch.Generator | None]) -> torch.Tensor:
        vocab = logits.shape[-1]
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        scaled = logits / temps.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], dtype=torch.int64)
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.stack([torch.empty(vocab).exponential_(generator=g) for g in generators])
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _logprobs(logits: torch.Tensor, token_ids: list[int],
                  params: Sequence[SamplingParams]) -> list[TokenLogprobs | None] | None:
        wanted = [_wanted_logprobs(p) for p in params]
        if all(n is None for n in wanted):
            return None
        logp = logits.log_softmax(dim=-1)
        k = max(n for n in wanted if n is not None)
        top_vals, top_ids = logp.topk(k, dim=-1) if k else (None, None)
        chosen = logp.gather(1, torch.tensor(token_ids).unsqueeze(1)).squeeze(1).tolist()
        out: list[TokenLogprobs | None] = []
        for i, n in enumerate(wanted):
            if n is None:
                out.append(None)
                continue
            top = tuple(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist())) if n else ()
            out.append(TokenLogprobs(token_ids[i], chosen[i], top))
        return out
