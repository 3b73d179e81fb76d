"""bench/schedule_sim.py: the real scheduler stepped on a step-time model (pure: no model, no torch)."""

from __future__ import annotations

import pytest

from bench.schedule_sim import StepTimeModel, simulate
from engine.config import SchedulerConfig

MODEL = StepTimeModel(step_s=1.0, prefill_token_s=0.1, decode_row_s=0.01)


def test_times_follow_the_model_step_by_step():
    # step 1: both 10-token prompts (1 + 20 x 0.1 = 3 s), step 2: two decode rows (1 + 2 x 0.01 s)
    out = simulate(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), [10, 10], 2, 2, MODEL)
    assert out["num_steps"] == 2
    assert out["median_ttft_ms"] == pytest.approx(3000.0)
    assert out["median_itl_ms"] == pytest.approx(1020.0)
    assert out["duration"] == pytest.approx(4.02)
    assert out["output_throughput"] == pytest.approx(4 / 4.02)


def test_prefill_first_ratio_takes_the_rest_of_a_burst_in_one_step():
    # 4 prompts of 30 tokens at once, idle budget 100: step 1 prefills 3 and 10 tokens of the 4th.
    # Then 3 rows decode while 1 prompt waits for 20 tokens. Ratio 1.0 (1 < 3): 5 prefill tokens a
    # step beside the decode rows until the 3 finish (max_tokens 3), then the rest alone: 6 steps.
    # Ratio 0.25 (1 >= 0.75): the 20 tokens go in step 2: 4 steps, the 4th first token 3 steps sooner.
    def run(ratio: float):
        cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, idle_max_num_batched_tokens=100,
                              prefill_first_ratio=ratio)
        return simulate(cfg, [30] * 4, 4, 3, MODEL)

    slow, fast = run(1.0), run(0.25)
    assert (slow["num_steps"], fast["num_steps"]) == (6, 4)
    assert fast["p99_ttft_ms"] < slow["p99_ttft_ms"]
    assert fast["completed"] == slow["completed"] == 4


def test_closed_loop_adds_the_next_prompt_when_one_finishes():
    # concurrency 1: each request runs alone (a prefill step, then max_tokens - 1 decode steps)
    out = simulate(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), [5, 7, 9], 1, 3, MODEL)
    assert out["num_steps"] == 9 and out["completed"] == 3
    assert out["total_output_tokens"] == 9
