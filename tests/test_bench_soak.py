"""deploy/bench_soak.py's analysis (pure, synthetic runs) and its flag checks; the soak itself is a
benchmark (`pdserve bench soak`), not a test."""

from __future__ import annotations

import pytest

from deploy.bench_soak import RequestRecord, Sample, SoakConfig, SoakRun, goals, goals_table
from engine.errors import UserError


def _run() -> SoakRun:
    c = SoakConfig(duration_s=100, warmup_s=10, kill_interval_s=50)
    run = SoakRun(c, kills=[(50.0, "decode-1", 123)])
    for t in range(0, 100, 2):
        during = 50 <= t < 80
        run.requests.append(RequestRecord(float(t), "ok", 0.9 if during else 0.4, 16, 2.0))
    run.requests += [RequestRecord(5.0, "cancelled", None, 0, 1.0), RequestRecord(60.0, "UNAVAILABLE", None, 3, 1.0)]
    for t in range(0, 101, 10):
        rss = {"router:1": 500.0, "decode-0:7": 1000.0 + t}
        if t < 50:
            rss["decode-1:123"] = 1000.0
        if t >= 20:  # a worker Ray restarted at t=20 loads its model first: start-up, not drift
            rss["prefill-0:9"] = 300.0 if t == 20 else 1000.0
        run.samples.append(Sample(float(t), rss, {"decode-0": 0}, {}))
    run.idle_after_s, run.leaked = 0.5, {"decode-0": 0, "decode-1": 0}
    return run


def test_goals_from_a_synthetic_run():
    g = goals(_run())
    assert g["lost"] == {"value": 1, "by_code": {"UNAVAILABLE": 1}, "met": False}
    assert g["leaked_blocks"]["met"] and g["leaked_blocks"]["value"] == 0
    # decode-0 grew 1010 -> 1100 MiB (+8.9 %); decode-1 lived too short after warm-up to count;
    # the restarted prefill-0's warm-up starts at t=20: 1000 -> 1000 MiB from t=30, not 300 -> 1000
    assert g["rss_drift_pct"]["per_process"]["prefill-0:9"] == 0.0
    assert set(g["rss_drift_pct"]["per_process"]) == {"router:1", "decode-0:7", "prefill-0:9"}
    assert g["rss_drift_pct"]["value"] == pytest.approx(100 * 90 / 1010) and g["rss_drift_pct"]["met"]
    t = g["p99_ttft_kill_vs_steady"]
    assert t["kill_s"] == 0.9 and t["steady_s"] == 0.4 and t["ratio"] == pytest.approx(2.25) and t["met"]
    table = goals_table(g)
    assert "lost requests" in table and "NO" in table


@pytest.mark.parametrize("kw", [{"duration_s": 0}, {"warmup_s": 2000}, {"cancel_fraction": 1.5},
                                {"mode": "x"}, {"num_prefill": 0}])
def test_bad_soak_flags_are_a_usage_error(kw):
    with pytest.raises(UserError):
        SoakConfig(**kw)


def test_embedded_ray_has_a_cpu_for_every_worker():
    """The soak's 1P+2D cluster on a 2-core host: an embedded Ray sized by the host alone (2 CPUs)
    never placed the third worker, and the soak timed out starting its cluster."""
    from deploy.cluster import ClusterSpec

    assert ClusterSpec(mode="disagg", num_prefill=1, num_decode=2).ray_num_cpus() == 3
    assert ClusterSpec(mode="agg", num_decode=1).ray_num_cpus() == 2
    assert ClusterSpec(mode="disagg", num_prefill=1, num_decode=1).ray_num_cpus(max_workers=5) == 5
    assert ClusterSpec(mode="agg", num_decode=3, num_cpus_per_worker=0.5).ray_num_cpus() == 2


def test_rss_drift_judges_instances_that_lived_one_kill_interval():
    """Kills in turn every 30 s: an instance seen from t=50 lives 40 s after its warm-up, less than
    half the run (45 s) but more than one kill interval, so it is judged."""
    from deploy.bench_soak import rss_drift

    run = SoakRun(SoakConfig(duration_s=100, warmup_s=10, kill_interval_s=30), kills=[(50.0, "decode-0", 7)])
    for t in range(0, 101, 10):
        run.samples.append(Sample(float(t), {"decode-0:7": 1000.0} if t < 50 else {"decode-0:8": 1000.0 + t}, {}, {}))
    assert rss_drift(run) == {"decode-0:7": 0.0, "decode-0:8": pytest.approx(100 * 40 / 1060)}


def test_plots_of_a_synthetic_run(tmp_path):
    """The four figures, one line per process (RSS) and per worker (KV blocks), kills marked."""
    from deploy.bench_soak import plots

    paths = plots(_run(), tmp_path)
    assert [p.name for p in paths] == ["rss.png", "kv_blocks.png", "outcomes.png", "ttft.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
