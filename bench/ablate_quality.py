"""Quality of an ablation configuration against the baseline's.

- Greedy agreement, through the configuration's own server (the path users get: speculative
  decoding, disaggregation, quantized kernels): the same prompts at temperature 0; the
  baseline's server answers with its top-2 log-probabilities too (``logprobs=2``), which locate
  its near-ties (evals/greedy.py). A configuration's requests ask for no log-probabilities, so
  nothing it would skip for them (e.g. drafting) is skipped.
- Perplexity on a held text, with the ``pdserve eval ppl`` machinery (evals/perplexity.py:
  sliding windows through our ModelRunner and paged cache), once per quality key (dtype,
  weight quantization, KV-cache dtype, debug hooks), in this process.
"""

from __future__ import annotations

import asyncio
import os
from contextlib import contextmanager
from typing import Any, Sequence

from evals.greedy import agrees


async def served_model(url: str) -> str:
    """The first model id the server lists."""
    import httpx

    async with httpx.AsyncClient(timeout=30.0) as client:
        return (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]


async def greedy_completions(url: str, prompts: Sequence[str], max_tokens: int, *, with_logprobs: bool,
                             concurrency: int = 8, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """One temperature-0 completion per prompt: {"text"} (+ "offsets", "gaps" with_logprobs:
    each token's character offset and the top-1 minus top-2 log-probability there, nats).
    A failed request is {"error"}."""
    import httpx

    model = await served_model(url)
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        async def one(prompt: str) -> dict[str, Any]:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
            if with_logprobs:
                body["logprobs"] = 2
            async with limit:
                resp = await client.post(f"{url}/v1/completions", json=body)
            if resp.status_code != 200:
                return {"error": f"HTTP {resp.status_code}: {resp.text[:200]}"}
            choice = resp.json()["choices"][0]
            out: dict[str, Any] = {"text": choice["text"]}
            if with_logprobs:
                lp = choice["logprobs"]
                out["offsets"] = lp["text_offset"]
                out["gaps"] = [_top2_gap(top) for top in lp["top_logprobs"]]
            return out

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def _top2_gap(top: dict[str, float]) -> float:
    """Top-1 minus top-2 log-probability; 0 (a tie) when two top tokens share one text."""
    values = sorted(top.values(), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else 0.0


def greedy_agreement(reference: Sequence[dict[str, Any]], outputs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Share of prompts whose output repeats the reference up to its first near-tie, and the
    tokens compared per prompt on average. A failed request (either side) counts as disagreeing."""
    agreed, compared = 0, []
    for ref, out in zip(reference, outputs):
        if "error" in ref or "error" in out:
            continue
        ok, k = agrees(ref["text"], ref["offsets"], ref["gaps"], out["text"])
        agreed += ok
        compared.append(k)
    n = len(reference)
    return {"greedy_agreement": agreed / n if n else None, "greedy_prompts": n,
            "greedy_tokens_compared_mean": sum(compared) / len(compared) if compared else 0.0}


@contextmanager
def _environ(env: Sequence[tuple[str, str]]):
    """Set env for the duration (the debug hooks are read at model load)."""
    old = {k: os.environ.get(k) for k, _ in env}
    os.environ.update(dict(env))
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def perplexity(model: str, dtype: str, quantization: str, kv_cache_dtype: str, env: Sequence[tuple[str, str]],
               token_ids: Sequence[int], context: int, stride: int) -> dict[str, Any]:
    """``pdserve eval ppl``'s run of one configuration (dtype resolved: "auto" as serve resolves it)."""
    from engine import platform
    from evals.perplexity import EvalConfig, run_config

    concrete = platform.resolve_dtype_name(dtype, "cpu")
    with _environ(env):
        return run_config(model, EvalConfig(concrete, quantization, kv_cache_dtype), token_ids, context, stride,
                          decode_tokens=min(8, max(0, stride - 1)))


def held_text_tokens(model: str, path, max_tokens: int) -> list[int]:
    """The first max_tokens tokens of the held text (evals/perplexity.py's reader)."""
    from evals.perplexity import text_tokens

    return text_tokens(model, path, max_tokens)
