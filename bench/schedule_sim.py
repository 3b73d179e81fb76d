"""The scheduler alone on a closed-loop workload, with a step-time model instead of a model.

Why: on a shared 2-core host a served A/B of two scheduler settings swings 2x with the load, but
the plans the scheduler makes do not depend on it. With EOS ignored and a fixed output length every
request's token count is known in advance, so the real ``Scheduler`` and ``BlockManager``
(engine/scheduler.py, engine/block_manager.py; no torch) can be stepped with dummy sampled
tokens, and each step's duration taken from a linear model of the forward::

    t_step = step_s + prefill_token_s * (prefill tokens) + decode_row_s * (decode rows)   [seconds]

The defaults (15 ms + 0.45 ms a prefill token + 0.8 ms a decode row) fit the bundled model in bf16
on two Zen 5 cores: a batch-16 decode step ~28 ms, a 2048-token prefill step ~0.94 s. The step
count is exact; the times are as good as the model. Closed loop as bench/closed_loop.py: at most
``max_concurrency`` in flight, the next added when one finishes; no prefix caching (as
``bench peers`` runs the servers).

Run as ``python -m bench.schedule_sim --prefill-first-ratio 1.0,0.5 ...`` (ShareGPT prompt lengths
of bench serve's sample, tokenized as the router does): one JSON object per setting on stdout.
"""

from __future__ import annotations

import argparse
import json
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Sequence

from bench.metrics import RequestRecord, summarize
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.plan import SchedulePlan, StepResult
from engine.request import Request
from engine.scheduler import Scheduler
from proto.sampling import SamplingParams


@dataclass(frozen=True)
class StepTimeModel:
    """A forward's duration in seconds: step_s + prefill_token_s x prefill tokens + decode_row_s x decode rows."""

    step_s: float = 0.015
    prefill_token_s: float = 0.00045
    decode_row_s: float = 0.0008

    def seconds(self, plan: SchedulePlan) -> float:
        rows = sum(1 for c in plan.chunks if c.is_last_chunk and c.num_tokens == 1)
        tokens = sum(c.num_tokens for c in plan.chunks)
        return self.step_s + self.prefill_token_s * (tokens - rows) + self.decode_row_s * rows


def simulate(config: SchedulerConfig, prompt_lens: Sequence[int], max_concurrency: int, max_tokens: int,
             model: StepTimeModel = StepTimeModel(), num_blocks: int = 8192, block_size: int = 16) -> dict[str, Any]:
    """Closed loop of ``prompt_lens`` (tokens per prompt) through a Scheduler with ``config``,
    ``max_tokens`` output tokens each (EOS ignored). Returns bench/metrics.py ``summarize``'s doc
    (ms, tok/s, on the model's clock) plus ``num_steps``. Raises ValueError (InvalidRequest) if a
    prompt cannot fit the cache."""
    sched = Scheduler(config, BlockManager(num_blocks, block_size, enable_prefix_caching=False), max_model_len=1 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    pending = deque(enumerate(prompt_lens))
    records: dict[str, RequestRecord] = {}
    added: dict[str, float] = {}
    last: dict[str, float] = {}
    now, steps = 0.0, 0

    def admit() -> None:
        i, n = pending.popleft()
        rid = f"sim-{i}"
        sched.add(Request(rid, [i * 100_003 + k for k in range(n)], params))  # distinct ids: no accidental sharing
        added[rid] = now
        records[rid] = RequestRecord(i, False, start_s=now, prompt_len=n)

    for _ in range(min(max_concurrency, len(pending))):
        admit()
    while sched.has_work():
        plan = sched.schedule()
        steps += 1
        now += model.seconds(plan)
        sampled = {c.request_id: 0 for c in plan.chunks if c.num_logits}
        for req in sched.update(plan, StepResult(sampled=sampled)):
            rid, rec = req.request_id, records[req.request_id]
            if rec.ttft_s is None:
                rec.ttft_s = now - added[rid]
            else:
                rec.itl_s.append(now - last[rid])
            last[rid] = now
            rec.output_tokens += 1
            if req.is_finished:
                rec.success, rec.e2el_s = True, now - added[rid]
                if pending:
                    admit()
    return {**summarize(list(records.values()), now), "num_steps": steps}


def main(argv: Sequence[str] | None = None) -> None:
    from bench.closed_loop import load_prompts
    from engine import config as defaults
    from engine.model_loader import resolve_model

    ap = argparse.ArgumentParser(prog="python -m bench.schedule_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="its tokenizer counts the prompts' tokens")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", default=str(defaults.DEFAULT_MAX_NUM_BATCHED_TOKENS),
                    help="comma list: one run per value")
    ap.add_argument("--prefill-first-ratio", default=str(defaults.DEFAULT_PREFILL_FIRST_RATIO), help="comma list")
    ap.add_argument("--idle-max-num-batched-tokens", type=int, default=defaults.DEFAULT_IDLE_MAX_NUM_BATCHED_TOKENS)
    a = ap.parse_args(argv)
    lens = [len(p) for p in load_prompts(resolve_model(a.model), a.num_prompts, a.max_tokens, None)]
    for budget in (int(v) for v in a.max_num_batched_tokens.split(",")):
        for ratio in (float(v) for v in a.prefill_first_ratio.split(",")):
            cfg = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=budget,
                                  idle_max_num_batched_tokens=a.idle_max_num_batched_tokens, prefill_first_ratio=ratio)
            out = simulate(cfg, lens, a.max_concurrency, a.max_tokens)
            print(json.dumps({"max_num_batched_tokens": budget, "prefill_first_ratio": ratio, **out}), flush=True)


if __name__ == "__main__":
    main()
