"""Helpers shared by the engine tests (not a test module)."""

from __future__ import annotations

from dataclasses import dataclass, field

NEAR_TIE = 1e-4  # the runtime issue's rule: a top-2 logit gap below this is a near tie


def first_near_tie(gaps: list[float]) -> int:
    """Index of the first position whose reference top-2 gap is a near tie (len if none)."""
    return next((i for i, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    deltas: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0


def run_to_completion(eng, prompts, params) -> list[Collected]:
    """Add every prompt, step until idle, collect each request's outputs in prompt order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    base = eng.num_steps
    ids = [f"r{base}-{i}" for i in range(len(prompts))]
    got = {rid: Collected() for rid in ids}
    for rid, p, sp in zip(ids, prompts, params):
        eng.add_request(rid, p, sp)
    while eng.has_unfinished():
        for o in eng.step():
            c = got[o.request_id]
            c.token_ids += o.new_token_ids
            c.text += o.text_delta
            c.deltas.append(o.text_delta)
            if o.finished:
                c.finish_reason, c.cached_tokens = o.finish_reason, o.usage.cached_tokens
    return [got[rid] for rid in ids]
