"""The SLA planner and the fleet simulator on synthetic profiles: pure, no model, no cluster."""

from __future__ import annotations

import math
import random

import pytest

from planner.profile import DecodePoint, PrefillPoint, WorkerProfile
from planner.simulator import SimConfig, Simulation, diurnal_rates, poisson_requests, size_fleet, trace_requests
from planner.sla import IntervalMetrics, LoadSample, PlannerConfig, Replicas, SlaPlanner


def itl(batch: int, context: int) -> float:
    return 20.0 + 0.5 * batch + 0.002 * batch * context


PROFILE = WorkerProfile(
    prefill=tuple(PrefillPoint(isl, isl / 2000 * 1000, 2000.0) for isl in (64, 256, 1024, 4096)),
    decode=tuple(DecodePoint(b, c, itl(b, c), b / (itl(b, c) / 1000)) for b in (1, 8, 32, 64) for c in (256, 2048)))


def planner(**kw) -> SlaPlanner:
    cfg = dict(ttft_slo_ms=1000, itl_slo_ms=60, min_prefill=1, max_prefill=100, min_decode=1, max_decode=100,
               predictor="constant", cooldown_down_s=0, cooldown_up_s=0, utilization=1.0,
               prefill_sizing="throughput", down_margin=0.2)  # Dynamo exactly (and a fixed dead band)
    return SlaPlanner(PlannerConfig(**(cfg | kw)), PROFILE)


# -- the profile's interpolation ----------------------------------------------------------------
def test_profile_interpolates_and_clamps():
    assert PROFILE.prefill_tokens_per_s(512) == 2000.0
    assert PROFILE.decode_itl_ms(8, 256) == pytest.approx(itl(8, 256))
    assert PROFILE.decode_itl_ms(20, 256) == pytest.approx((itl(8, 256) + itl(32, 256)) / 2)
    mid = (itl(8, 256) + itl(8, 2048)) / 2
    assert PROFILE.decode_itl_ms(8, (256 + 2048) / 2) == pytest.approx(mid)
    assert PROFILE.decode_itl_ms(1000, 10**6) == pytest.approx(itl(64, 2048))  # clamped


def test_best_decode_throughput_is_the_largest_batch_within_the_itl_slo():
    # at context 256, itl(b) = 20 + 1.012 b: ITL 60 ms is reached at b = 39.5
    b = (60 - 20) / (0.5 + 0.002 * 256)
    assert PROFILE.max_decode_batch(60, 256) == pytest.approx(b, rel=0.02)
    assert PROFILE.best_decode_tokens_per_s(60, 256) == pytest.approx(b / 0.060, rel=0.02)
    assert PROFILE.best_decode_tokens_per_s(10, 256) == 0.0   # even batch 1 misses


def test_profile_round_trips_through_json_and_rejects_malformed():
    assert WorkerProfile.from_json(PROFILE.to_json()) == PROFILE
    with pytest.raises(ValueError, match="malformed profile"):
        WorkerProfile.from_json({"prefill": [{"isl": 1}], "decode": []})


# -- the SLA loop: Dynamo's formulas ------------------------------------------------------------
def test_sla_decision_matches_the_formulas():
    p = planner()
    m = IntervalMetrics(duration_s=60, num_requests=600, mean_isl=1000, mean_osl=100)
    d = p.decide_sla(0, m)
    rate = 10.0
    assert d.prefill == math.ceil(rate * 1000 / 2000.0)                      # 5
    per_decode = PROFILE.best_decode_tokens_per_s(60, 1000 + 100 / 2)
    assert d.decode == math.ceil(rate * 100 / per_decode)
    assert d.loop == "sla" and "needs prefill 5" in d.reason


def test_corrections_scale_the_pools():
    p = planner()
    isl, osl = 1000, 100
    slow_decode = 1.5 * PROFILE.decode_itl_ms(10, isl + osl / 2)
    d = p.decide_sla(0, IntervalMetrics(60, 600, isl, osl, ttft_ms=0.5 * PROFILE.prefill_ttft_ms(isl),
                                        itl_ms=slow_decode, decode_batch=10))
    assert d.p_corr == pytest.approx(0.5) and d.d_corr == pytest.approx(1.5)
    assert d.prefill == math.ceil(10 * isl * 0.5 / 2000)                        # min(1, p_corr) shrinks it
    per_decode = PROFILE.best_decode_tokens_per_s(60 / 1.5, isl + osl / 2)      # the corrected ITL SLO
    assert d.decode == math.ceil(10 * osl / per_decode)


def test_bounds_and_an_unreachable_itl_slo():
    p = planner(itl_slo_ms=5, max_decode=7, max_prefill=3)
    d = p.decide_sla(0, IntervalMetrics(60, 6000, 1000, 100))
    assert d.decode == 7 and d.prefill == 3 and "below the profile's batch-1 ITL" in d.reason


def test_hysteresis_prevents_flapping_on_a_noisy_constant_load():
    p = planner(predictor="moving-average", patience=3)
    rng = random.Random(0)
    sizes = []
    for i in range(40):
        n = int(600 * (1 + rng.uniform(-0.15, 0.15)))
        d = p.decide_sla(60.0 * i, IntervalMetrics(60, n, 1000, 100))
        sizes.append((d.prefill, d.decode))
    changes = sum(1 for a, b in zip(sizes, sizes[1:]) if a != b)
    assert changes <= 3, sizes


@pytest.mark.parametrize("predictor", ["moving-average", "linear"])
def test_default_planner_does_not_flap_on_a_noisy_constant_load(predictor):
    """The defaults (queueing sizing, the measured dead band) on a load +-15% around 10 req/s."""
    p = SlaPlanner(PlannerConfig(ttft_slo_ms=1000, itl_slo_ms=60, max_prefill=100, max_decode=100,
                                 predictor=predictor, patience=3, cooldown_down_s=0, cooldown_up_s=0), PROFILE)
    rng = random.Random(0)
    sizes = [(d.prefill, d.decode) for d in (p.decide_sla(60.0 * i, IntervalMetrics(
        60, int(600 * (1 + rng.uniform(-0.15, 0.15))), 1000, 100)) for i in range(40))]
    assert sum(1 for a, b in zip(sizes, sizes[1:]) if a != b) <= 3, sizes


def test_scale_down_waits_for_patience_and_cooldown():
    p = planner(patience=2, cooldown_down_s=300)
    assert p.decide_sla(0, IntervalMetrics(60, 1200, 1000, 100)).prefill == 10
    low = IntervalMetrics(60, 120, 1000, 100)
    assert p.decide_sla(60, low).prefill == 10     # one interval below: patience
    assert p.decide_sla(120, low).prefill == 10    # patience met, cooldown (since the scale-up) not
    assert p.decide_sla(360, low).prefill == math.ceil(2 * 1000 * 1.2 / 2000)   # 2: the down margin (20%)


def test_erlang_c_and_the_fewest_servers_for_a_wait_budget():
    from planner.queueing import erlang_c, servers_for_wait, wait_tail

    assert erlang_c(1, 0.5) == pytest.approx(0.5)          # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)        # M/M/2 at rho 0.5: 2 rho^2 / (1 + rho)
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(3, 0.0) == 0.0
    n = servers_for_wait(a=5.0, service_s=0.5, budget_s=0.5, tail=0.01)
    assert wait_tail(n, 5.0, 0.5, 0.5) <= 0.01 < wait_tail(n - 1, 5.0, 0.5, 0.5)
    assert servers_for_wait(a=5.0, service_s=0.5, budget_s=600, tail=0.01) == 6   # a long budget: just a > n - 1
    with pytest.raises(ValueError):
        servers_for_wait(1.0, 0.0, 1.0, 0.01)


def test_queueing_sizing_uses_the_wait_the_ttft_slo_allows():
    """10 req/s of 1000-token prompts on 2000 tok/s workers: 5 workers of work. A TTFT SLO with
    one service time of slack needs a few more; a generous one runs the pool near full."""
    from planner.queueing import servers_for_wait

    m = IntervalMetrics(duration_s=60, num_requests=600, mean_isl=1000, mean_osl=100)
    tight = planner(prefill_sizing="queueing", ttft_slo_ms=1000).decide_sla(0, m)
    assert tight.prefill == servers_for_wait(5.0, 0.5, 0.5, 0.01) == 8
    assert planner(prefill_sizing="queueing", ttft_slo_ms=20_000).decide_sla(0, m).prefill == 6
    assert planner(prefill_sizing="queueing", ttft_slo_ms=400).decide_sla(0, m).prefill == 5  # no slack: the formula


def test_a_rising_load_is_sized_for_when_new_replicas_are_ready():
    """Linear predictor on 6, 8, 10 req/s: the next interval is 12, but a replica asked for now is
    ready two intervals later (startup 120 s), so the pool is sized for 16."""
    def run(startup_s: float) -> int:
        p = planner(predictor="linear", startup_s=startup_s)
        for i, n in enumerate((360, 480, 600)):
            d = p.decide_sla(60.0 * i, IntervalMetrics(60, n, 1000, 100))
        return d.prefill
    assert run(0) == math.ceil(12 * 1000 / 2000) and run(120) == math.ceil(16 * 1000 / 2000)


def test_measured_margin_follows_the_predictors_error():
    """A steady load that drops: with the measured margin (down_margin None) the pool shrinks to
    what the new load needs, not 20% above it; a persistently noisy load keeps a wide margin."""
    p = planner(down_margin=None, patience=1)
    for i in range(6):
        p.decide_sla(60.0 * i, IntervalMetrics(60, 1200, 1000, 100))      # 20 req/s: 10 workers
    assert p.margin() == pytest.approx(0.0)
    d = p.decide_sla(360, IntervalMetrics(60, 600, 1000, 100))            # 10 req/s
    assert d.prefill == 5  # not ceil(5 x 1.2) = 6: no fixed 20% band, and one surprise does not widen it
    noisy = planner(down_margin=None)
    rng = random.Random(1)
    for i in range(10):
        noisy.decide_sla(60.0 * i, IntervalMetrics(60, int(600 * (1 + rng.uniform(-0.3, 0.3))), 1000, 100))
    assert noisy.margin() > 0.2


def test_pending_replicas_count_toward_the_target():
    assert SlaPlanner.to_add(5, Replicas(ready=2, starting=3)) == 0
    assert SlaPlanner.to_add(5, Replicas(ready=2, starting=1)) == 2
    assert SlaPlanner.to_add(1, Replicas(ready=3)) == -2


def test_load_loop_steps_up_with_patience_and_cooldown():
    p = planner(patience=2, cooldown_up_s=30, cooldown_down_s=100, kv_high=0.8, kv_low=0.2)
    hot = LoadSample(decode_kv_usage=0.95, prefill_queue=0.0)
    assert p.decide_load(0, hot) is None                 # one sample: patience
    d = p.decide_load(1, hot)
    assert d.decode == 2 and d.loop == "load" and "decode +1" in d.reason
    assert p.decide_load(2, hot) is None and p.decide_load(3, hot) is None   # cooldown 30 s
    assert p.decide_load(40, hot).decode == 3
    cold = LoadSample(decode_kv_usage=0.05, prefill_queue=0.0)
    assert p.decide_load(200, cold) is None and p.decide_load(201, cold) is None   # never shrinks: the SLA loop does


def test_manual_change_is_adopted_not_fought():
    p = planner(cooldown_down_s=600, patience=1)
    p.decide_sla(0, IntervalMetrics(60, 60, 1000, 100))
    d = p.adopt(100, prefill=6, decode=6)
    assert (d.prefill, d.decode, d.loop) == (6, 6, "manual")
    low = p.decide_sla(160, IntervalMetrics(60, 60, 1000, 100))
    assert (low.prefill, low.decode) == (6, 6)         # held for the cooldown
    assert p.decide_sla(800, IntervalMetrics(60, 60, 1000, 100)).prefill == 1


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="bounds"):
        PlannerConfig(ttft_slo_ms=100, itl_slo_ms=10, min_decode=3, max_decode=2)
    with pytest.raises(ValueError, match="predictor"):
        planner(predictor="oracle")


# -- the simulator --------------------------------------------------------------------------------
def test_simulator_single_request_matches_the_profile():
    reqs = poisson_requests(0.01, 150, 1024, 33, seed=1)[:1]
    r = Simulation(PROFILE, SimConfig(1, 1, transfer_s=0.01)).run(reqs)
    assert r.ttft_ms[0] == pytest.approx(1024 / 2000 * 1000 + 10)
    # one request alone: batch 1, context growing from 1025 to 1057 (mean ~1041)
    assert r.itl_ms[0] == pytest.approx(itl(1, 1041), rel=0.01)


def test_simulator_queues_when_overloaded_and_loses_no_request():
    reqs = poisson_requests(8, 120, 512, 32, seed=2)
    small = Simulation(PROFILE, SimConfig(1, 1)).run(reqs)
    big = Simulation(PROFILE, SimConfig(4, 2)).run(reqs)
    assert len(small.ttft_ms) == len(big.ttft_ms) == len(reqs)
    assert small.percentile(small.ttft_ms, 50) > 5 * big.percentile(big.ttft_ms, 50)


def test_size_fleet_meets_the_slo_with_the_fewest_workers():
    out = size_fleet(PROFILE, rate=20, isl=512, osl=64, ttft_slo_ms=1000, itl_slo_ms=60, duration_s=200)
    assert out["attainment"] >= 0.95
    assert out["prefill"] >= math.ceil(20 * 512 / 2000)
    fewer = size_fleet(PROFILE, rate=5, isl=512, osl=64, ttft_slo_ms=1000, itl_slo_ms=60, duration_s=200)
    assert fewer["prefill"] < out["prefill"]


def test_planner_follows_a_diurnal_trace_with_fewer_worker_hours_than_a_peak_fleet():
    rates = diurnal_rates(peak=10, trough=1, hours=2, step_s=300)
    reqs = trace_requests(rates, 512, 64, seed=3)
    peak = size_fleet(PROFILE, 10, 512, 64, 1000, 60, duration_s=200)
    fixed = Simulation(PROFILE, SimConfig(peak["prefill"], peak["decode"])).run(reqs)
    pl = planner(predictor="linear", cooldown_down_s=240, cooldown_up_s=30, patience=2, utilization=0.85)
    planned = Simulation(PROFILE, SimConfig(1, 1, startup_s=60, interval_s=120), pl).run(reqs)
    assert len(planned.ttft_ms) == len(reqs)                                   # nothing dropped by drains
    assert planned.summary()["worker_hours"] < 0.95 * fixed.summary()["worker_hours"]
    sizes = [t["prefill"] + t["decode"] for t in planned.timeline]
    peak_at = sizes.index(max(sizes))
    assert sizes[0] < max(sizes) and sizes[-1] < max(sizes) and 0 < peak_at < len(sizes) - 1   # grew, then shrank
    assert planned.attainment(1000, 60) > 0.75


# -- pdserve plan ---------------------------------------------------------------------------------
def _plan(*args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "deploy.cli", "plan", *args], capture_output=True, text=True,
                          timeout=120)


def test_plan_sizes_a_fleet_from_a_profile_file(tmp_path):
    prof = tmp_path / "profile.json"
    PROFILE.save(prof)
    out = tmp_path / "plan.json"
    r = _plan("--profile", str(prof), "--rate", "5", "--isl", "512", "--osl", "32", "--slo", "ttft:1000,itl:60",
              "--duration", "120", "--json", str(out))
    assert r.returncode == 0, r.stderr
    import json

    doc = json.loads(out.read_text())
    assert doc["prefill"] >= 2 and doc["decode"] >= 1 and doc["attainment"] >= 0.95
    assert f"prefill {doc['prefill']}, decode {doc['decode']} workers" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--profile", "nope.json", "--rate", "1"], "--profile 'nope.json': no such file"),
    (["--profile", "roofline:h200-llama3-8b", "--rate", "1", "--slo", "ttft:fast"], "--slo"),
    (["--profile", "roofline:h200-llama3-8b"], "exactly one of --rate, --trace, --diurnal"),
    (["--profile", "roofline:h200-llama3-8b", "--diurnal", "1:2"], "--diurnal"),
])
def test_plan_bad_input_is_one_line_and_status_2(args, message):
    r = _plan(*args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_validate_sim_compares_the_simulator_fed_the_real_requests():
    """deploy/validate_sim.py's comparison, on a run whose 'real' figures are what the profile
    says plus a fixed handoff: the handoff is measured from the lone requests and the errors are 0."""
    from deploy.validate_sim import compare, handoff_cost_ms

    isl, osl, handoff = 512, 16, 0.040
    ttft = PROFILE.prefill_ttft_ms(isl) / 1000 + handoff
    tpot = PROFILE.decode_itl_ms(1, isl + osl / 2) / 1000
    rec = lambda t: {"success": True, "start_s": t, "prompt_len": isl, "output_tokens": osl,  # noqa: E731
                     "ttft_s": ttft, "tpot_s": tpot}
    lone = {"requests": [rec(0.0) for _ in range(3)]}
    assert handoff_cost_ms(lone, PROFILE) == pytest.approx(1000 * handoff)
    row = compare(0.1, {"requests": [rec(10.0 * i) for i in range(5)]}, PROFILE, 1000 * handoff)
    assert row["completed"] == 5 and row["ttft_error"] == pytest.approx(0, abs=1e-9)
    assert abs(row["itl_error"]) < 0.02  # the context grows by OSL over the request: ITL at its mean context
