"""Exact verification of draft tokens: the output is distributed as the target model's.

Two forms of the same rule (Leviathan et al. 2023, Chen et al. 2023, "speculative sampling"):

- ``rejection_sample`` (any draft distribution q, e.g. a draft model): accept draft x_j with
  probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection emit a token drawn from the
  normalised residual max(0, p_j - q_j) and stop; if all k drafts are accepted, emit a bonus
  token drawn from p_k. p and q are fp32 probabilities *after* the request's temperature /
  top-k / top-p were applied to both.
- ``verify_one_hot`` (a deterministic proposer such as n-gram: q_j is one-hot on x_j): the rule
  then reads "accept with probability p_j(x_j), else draw from p_j with x_j removed". Drawing
  y_j ~ p_j and accepting iff y_j == x_j is the same joint law (P(accept) = p_j(x_j); given a
  rejection, y_j is p_j restricted to y != x_j, renormalised), so each position is sampled by
  the engine's ordinary Sampler and compared. Because a request's generator is advanced once
  per *emitted* token, in order, a seeded request draws exactly the noise it would draw without
  speculation: its tokens are the same with any k (up to logits rounding).
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine.sampler import RowHistory
from proto.sampling import SamplingParams


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify k drafts for each of B rows at once.

    target_probs [B, k+1, V] float32: p at each draft position plus the bonus position.
    draft_probs [B, k, V] float32: q that the drafts were drawn from. draft_ids [B, k] int64.
    Returns (num_accepted [B] int64 in 0..k, tokens [B, k+1] int64): row b emits
    tokens[b, :num_accepted[b] + 1] (the accepted drafts, then the residual or bonus token);
    later entries are -1. Raises ValueError on inconsistent shapes.
    """
    num_rows, k = draft_ids.shape
    if target_probs.shape[:2] != (num_rows, k + 1) or draft_probs.shape[:2] != (num_rows, k):
        raise ValueError(f"shapes: target {tuple(target_probs.shape)}, draft {tuple(draft_probs.shape)}, "
                         f"ids {tuple(draft_ids.shape)}")
    p_x = target_probs[:, :k].gather(2, draft_ids.unsqueeze(2)).squeeze(2)
    q_x = draft_probs.gather(2, draft_ids.unsqueeze(2)).squeeze(2)
    u = torch.rand(num_rows, k, generator=generator)
    accept = u * q_x < p_x  # u < p/q without dividing by a zero q
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    rows = torch.arange(num_rows)
    if k:
        j = num_accepted.clamp(max=k - 1)
        residual = (target_probs[rows, j] - draft_probs[rows, j]).clamp(min=0)
        empty = residual.sum(dim=1, keepdim=True) <= 0  # p == q: a rejection has probability 0 there
        residual = torch.where(empty, target_probs[rows, j], residual)
        last = torch.where((num_accepted < k).unsqueeze(1), residual, target_probs[:, k])
    else:
        last = target_probs[:, 0]
    final = torch.multinomial(last, 1, generator=generator).squeeze(1)
    tokens = torch.full((num_rows, k + 1), -1, dtype=torch.int64)
    keep = torch.arange(k + 1).unsqueeze(0) < num_accepted.unsqueeze(1)
    tokens[:, :k] = torch.where(keep[:, :k], draft_ids, tokens[:, :k])
    tokens[rows, num_accepted] = final
    return num_accepted, tokens


def verify_one_hot(sampler, logits: torch.Tensor, offsets: Sequence[int], drafts: Sequence[Sequence[int]],
                   params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                   histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None) -> list[tuple[int, ...]]:
    """Verify deterministic drafts for several requests (see the module docstring).

    logits [R, V] float32: request i's k_i + 1 rows start at offsets[i] (rows for positions
    0..k_i; row j scores the token after draft j - 1). sampler: engine.sampler.Sampler.
    Returns per request the emitted tokens: the accepted drafts, then the target's own token
    (1..k_i + 1 tokens). Greedy rows (params.greedy) reduce to "accept while draft == argmax".
    histories[i]: request i's (prompt, output so far); position j is sampled with the output
    extended by drafts 0..j-1, so penalties and min_tokens see exactly what they would without
    speculation. Position j is sampled for every request still accepting, in one sampler call.
    """
    out: list[list[int]] = [[] for _ in drafts]
    alive = list(range(len(drafts)))
    j = 0
    while alive:
        rows = torch.tensor([offsets[i] + j for i in alive], dtype=torch.int64)
        rows_history = None if histories is None else [
            RowHistory(histories[i][0], list(histories[i][1]) + list(drafts[i][:j])) for i in alive]
        got = sampler.sample(logits.index_select(0, rows), [params[i] for i in alive],
                             [generators[i] for i in alive], rows_history).token_ids
        still = []
        for i, token in zip(alive, got):
            out[i].append(token)
            if j < len(drafts[i]) and token == drafts[i][j]:
                still.append(i)
        alive, j = still, j + 1
    return [tuple(t) for t in out]
