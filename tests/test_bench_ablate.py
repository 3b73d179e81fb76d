"""pdserve bench ablate: the plan, the analysis and the quality rules (pure), and a small
ablation end to end through real `pdserve serve` processes (joined to the session's Ray).

The end-to-end run: the ladder continuous -> fp8-broken (FP8 weights served with every scale
x4, the debug hook of engine/quantization/apply.py), fp8-broken alone, and the full stack minus
each: 4 servers, 2 concurrency tiers, 3 prompts of 3 tokens. It checks the JSON's fields, that
the plots are PNGs, that the report's rows are the JSON's, and that the quality gate fails the
broken configurations and passes the lossless one.
"""

from __future__ import annotations

import json

import pytest

from bench import ablate_plan as P
from bench.ablate_analysis import Gates, interactions, ladder_steps, quality_verdict, role_names
from engine.errors import UserError
from evals.greedy import agrees, first_near_tie


def test_default_plan_runs_each_configuration_once_with_its_roles():
    known = P.catalog()
    plans = P.build_plan(P.DEFAULT_LADDER, P.DEFAULT_ISOLATION, P.DEFAULT_LEAVE_ONE_OUT, known)
    names = [p.name for p in plans]
    assert len(names) == len(set(names)) == 13
    by = {p.name: p for p in plans}
    assert by["baseline"].settings.args()[:2] == ["--batching", "static"]
    assert "isolation-reference:int8" in by["baseline"].roles
    # spec needs continuous batching: alone, it is measured against continuous batching alone
    assert by["continuous+spec"].roles == ("isolation:spec",) and "isolation-reference:spec" in by["continuous"].roles
    full = by["continuous+prefix-caching+chunked-prefill+int8+spec+disagg"]
    assert full.settings.mode == "disagg" and full.settings.quantization == "int8"
    assert "--speculative-method" in full.settings.args()
    ladder, per = role_names(plans)
    assert ladder[0] == "baseline" and ladder[-1] == full.name and per["int8"]["full"] == full.name


def test_plan_refuses_a_technique_before_what_it_needs_and_exclusive_weights():
    known = P.catalog()
    with pytest.raises(UserError, match="spec needs continuous"):
        P.build_plan(("spec", "continuous"), (), (), known)
    with pytest.raises(UserError, match="int8 and fp8 cannot be combined"):
        P.build_plan(("continuous", "int8", "fp8"), (), (), known)
    with pytest.raises(UserError, match="--leave-one-out"):
        P.build_plan(("continuous",), (), ("int8",), known)
    with pytest.raises(UserError, match="--techniques: unknown"):
        P.parse_names("continuous,bogus", "--techniques", known, ())


def test_quality_gate_sums_the_lossy_allowances_and_holds_lossless_configs_to_agreement():
    g = Gates()
    assert quality_verdict(0.015, 0.2, ["fp8"], g) == (True, [])
    ok, why = quality_verdict(0.025, 0.9, ["fp8"], g)
    assert not ok and "perplexity" in why[0]
    assert quality_verdict(0.025, 0.9, ["fp8", "fp8_kv"], g)[0]        # 2 % + 1 %
    ok, why = quality_verdict(0.0, 0.5, [], g)
    assert not ok and "greedy agreement" in why[0]
    assert quality_verdict(None, None, [], g) == (None, [])


def test_interaction_flag_compares_isolated_and_leave_one_out_gains():
    rows = [{"name": n, "concurrency": 1, "output_throughput": v}
            for n, v in (("baseline", 10.0), ("a", 20.0), ("b", 11.0), ("a+b", 12.0))]
    per = {"b": {"isolation": "b", "isolation-reference": "baseline", "leave-one-out": "a", "full": "a+b"}}
    (i,) = interactions(rows, per, [1], threshold=0.15)
    assert i["isolated_gain"] == pytest.approx(0.1) and i["loo_gain"] == pytest.approx(-0.4) and i["interacts"]
    steps = ladder_steps(rows, ["baseline", "a", "a+b"], ["a", "b"], [1])
    assert [round(s["gain"], 2) for s in steps] == [1.0, -0.4]


def test_greedy_agreement_stops_at_the_first_near_tie():
    ref, offsets = "Hello world, again", [0, 5, 11, 12]
    assert first_near_tie([3.0, 2.0, 0.1, 5.0]) == 2
    assert agrees(ref, offsets, [3.0, 2.0, 0.1, 5.0], "Hello world; other") == (True, 2)
    assert agrees(ref, offsets, [3.0, 2.0, 0.1, 5.0], "Hello there") == (False, 2)
    assert agrees(ref, offsets, [3.0] * 4, ref) == (True, 4)
    assert agrees(ref, offsets, [3.0] * 4, ref + " more")[0] is False


def test_worker_metrics_parse_kv_usage_and_preemptions():
    from bench.ablate import parse_worker_metrics, requests_for_tier, tier_slices

    text = ('# TYPE pdserve:kv_cache_usage_perc gauge\npdserve:kv_cache_usage_perc{worker_id="a"} 0.25\n'
            '# TYPE pdserve:num_preemptions counter\npdserve:num_preemptions_total{worker_id="a"} 3.0\n')
    assert parse_worker_metrics(text) == {"usage": 0.25, "preempt": 3.0}
    assert [requests_for_tier(c, 64, 8) for c in (1, 16, 64)] == [8, 32, 64]
    warm, tiers = tier_slices((1, 16, 64), 64, 8, 2)   # disjoint: no server sees a prompt twice
    assert (warm.start, warm.stop) == (0, 2) and [(t.start, t.stop) for t in tiers] == [(2, 10), (10, 42), (42, 106)]


def test_bad_flags_are_one_line_exit_2(capsys):
    from deploy import cli

    for argv, fragment in ((["--concurrency", "0"], "--concurrency"), (["--techniques", "spec"], "spec needs"),
                           (["--quality-stride", "0"], "--quality-stride")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "ablate", *argv])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and fragment in err and err.count("\n") == 1, err


@pytest.mark.model
def test_small_ablation_end_to_end(ray_session, tmp_path, capsys):
    from deploy import cli

    address = ray_session.get_runtime_context().gcs_address
    out = tmp_path / "ablate.json"
    argv = ["bench", "ablate", "--techniques", "continuous,fp8-broken", "--isolation", "fp8-broken",
            "--leave-one-out", "continuous,fp8-broken", "--concurrency", "1,2", "--num-prompts", "3",
            "--min-requests", "2", "--max-tokens", "3", "--num-warmups", "0", "--greedy-prompts", "3",
            "--greedy-tokens", "4", "--quality-max-tokens", "96", "--quality-context", "64", "--quality-stride", "32",
            "--serve-args", "--num-blocks 64 --max-num-seqs 4 --threads-per-worker 1",
            "--ray-address", address, "--json", str(out), "--plot", str(tmp_path / "plots"),
            "--report", str(tmp_path / "report.md"), "--no-progress"]
    cli.main(argv)
    table = capsys.readouterr().out
    doc = json.loads(out.read_text())
    rows = doc["configs"]
    names = {"baseline", "continuous", "continuous+fp8-broken", "fp8-broken"}
    assert {r["name"] for r in rows} == names and len(rows) == 8
    for r in rows:
        assert r["error"] is None, (r["name"], doc["servers"][r["name"]])
        for key in ("name", "techniques", "concurrency", "output_throughput", "request_goodput", "p99_ttft_ms",
                    "p99_itl_ms", "perplexity", "greedy_agreement", "quality_ok", "kv_cache_usage_peak",
                    "num_preemptions"):
            assert key in r, key
        # the KV peak is sampled from the live workers' /metrics every METRICS_POLL_S: a tier of 3
        # short requests can finish between two samples (0.0, seen on a fresh-clone run), so every
        # row must have been scraped (not None) and some row must have caught the cache in use
        assert r["output_throughput"] > 0 and r["completed"] == r["num_requests"]
        assert r["kv_cache_usage_peak"] is not None and r["kv_cache_usage_peak"] >= 0
        assert r["name"] in table
    assert max(r["kv_cache_usage_peak"] for r in rows) > 0
    verdict = {r["name"]: r["quality_ok"] for r in rows}
    assert verdict == {"baseline": True, "continuous": True, "continuous+fp8-broken": False, "fp8-broken": False}
    assert doc["analysis"]["quality"]["continuous"]["greedy_agreement"] >= 0.75
    assert doc["analysis"]["quality"]["fp8-broken"]["perplexity_delta"] > 1.0
    assert {(i["technique"], i["concurrency"]) for i in doc["analysis"]["interactions"]
            if i["interacts"] is not None} == {("fp8-broken", 1), ("fp8-broken", 2)}
    for png in (tmp_path / "plots").iterdir():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, png
    assert len(list((tmp_path / "plots").iterdir())) == 4
    _assert_report_rows_match(doc, (tmp_path / "report.md").read_text())
    # --resume: nothing left to run, the same document
    cli.main(argv + ["--resume"])
    assert json.loads(out.read_text())["configs"] == rows


def _assert_report_rows_match(doc, report: str):
    from bench.ablate_report import TABLE_COLUMNS, cell

    section = report.split("## All figures", 1)[1].split("## Serve commands", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| config")]
    parsed = {(cells[0], int(cells[1])): cells for cells in
              ([c.strip() for c in ln.strip("|").split("|")] for ln in lines)}
    assert len(parsed) == len(doc["configs"])
    for r in doc["configs"]:
        assert parsed[(r["name"], r["concurrency"])] == [cell(r, k, d) for _, k, d in TABLE_COLUMNS]
    assert "fails its quality gate" in report and "## Isolation and leave-one-out" in report


@pytest.mark.parametrize("argv, fragment", [
    (["--batching", "bogus"], "--batching must be continuous or static"),
    (["--batching", "static", "--mode", "disagg"], "--batching static: only with --mode agg"),
    (["--batching", "static", "--speculative-method", "ngram"], "--batching static: speculative"),
])
def test_serve_batching_flag_is_checked_before_anything_starts(argv, fragment, capsys):
    from deploy import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and fragment in err and err.count("\n") == 1, err
