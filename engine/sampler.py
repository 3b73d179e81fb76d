"""Batched sampling: one call picks the next token of every sequence in a step.

Per row: greedy (argmax) when ``params.greedy``; otherwise temperature, then top-k, then top-p
(nucleus, Holtzman et al. 2019), then a draw with the exponential-race trick
(``argmax(p / q)``, ``q ~ Exp(1)``, equivalent to sampling from ``p``). A request with a seed
draws its noise from its own ``torch.Generator`` (seeded once, see make_generator), so its
tokens do not depend on what else is in the batch; requests without a seed share torch's
default generator. Top-n logprobs are those of the model's distribution (log-softmax of the
raw logits, before temperature/top-k/top-p), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from proto.sampling import SamplingParams


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the chosen token and the top-n alternatives (most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # None when no row asked for logprobs


def make_generator(params: SamplingParams, device: str | torch.device = "cpu") -> torch.Generator | None:
    """The request's own generator if it has a seed (create once per request, reuse every step)."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def check_stop(token_id: int, num_output_tokens: int, params: SamplingParams,
               eos_token_ids: Sequence[int]) -> str | None:
    """Finish reason after appending ``token_id`` as output token number ``num_output_tokens``:
    "stop" (EOS unless ignore_eos, or a stop token id), "length" (max_tokens reached), or None."""
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return "stop"
    if num_output_tokens >= params.max_tokens:
        return "length"
    return None


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32; top_k [N] int64 (V = disabled); top_p [N] float32 (1 = disabled).

    Returns a copy with every token outside the row's top-k and outside its nucleus (smallest
    set whose probability mass reaches top_p) set to -inf; at least one token always survives.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - top_p).unsqueeze(1)  # the low tail holding at most 1 - top_p of the mass
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    """Stateless; the per-request generators are owned by the caller (one per request)."""

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None] | None = None) -> SamplerOutput:
        """logits [N, V] float32 -> one token id per row (row i uses params[i], generators[i]).

        Raises ValueError if the number of params (or generators) differs from N.
        """
        num_rows, vocab = logits.shape
        generators = list(generators) if generators is not None else [None] * num_rows
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(f"{num_rows} logits rows but {len(params)} params and {len(generators)} generators")
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            tokens[rows] = self._draw(logits[rows], [params[i] for i in rows], [generators[i] for i in rows])
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, self._logprobs(logits, token_ids, params))

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
        wanted = [p.logprobs for p in params]
        if not any(wanted):
            return None
        logp = logits.log_softmax(dim=-1)
        top_vals, top_ids = logp.topk(max(wanted), dim=-1)
        chosen = logp.gather(1, torch.tensor(token_ids).unsqueeze(1)).squeeze(1).tolist()
        out: list[TokenLogprobs | None] = []
        for i, n in enumerate(wanted):
            if n == 0:
                out.append(None)
                continue
            top = tuple(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist()))
            out.append(TokenLogprobs(token_ids[i], chosen[i], top))
        return out
