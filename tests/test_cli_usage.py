"""Usage errors of the `pdserve` command: every sub-command given an unknown flag, and an unknown
command, print one line naming the problem with the command's usage, and exit with status 2 —
no traceback. Also the serve flags a vLLM user types (parsed only; nothing starts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from deploy import cli

REPO = Path(__file__).resolve().parents[1]


def _leaf_commands(cmd, path=()):
    subs = getattr(cmd, "commands", None)
    if not subs:
        yield list(path)
        return
    for name, sub in subs.items():
        yield from _leaf_commands(sub, (*path, name))


LEAVES = list(_leaf_commands(typer.main.get_command(cli.app)))


def _run(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    return exc.value.code, capsys.readouterr().err


def test_every_command_is_covered():
    assert ["serve"] in LEAVES and ["bench", "serve"] in LEAVES and len(LEAVES) >= 8


@pytest.mark.parametrize("path", LEAVES, ids=" ".join)
def test_unknown_flag_is_one_usage_line_exit_2(path, capsys):
    code, err = _run([*path, "--bogus-flag"], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "--bogus-flag" in lines[0] and f"Usage: pdserve {' '.join(path)}" in lines[0]


@pytest.mark.parametrize("argv", [["bogus"], ["bench", "bogus"]], ids=" ".join)
def test_unknown_command_exit_2(argv, capsys):
    code, err = _run(argv, capsys)
    assert code == 2
    assert err.count("\n") == 1 and "No such command 'bogus'" in err and "Usage: pdserve" in err


@pytest.mark.parametrize("argv, fragment", [
    (["serve", "--max-model-len", "1"], "--max-model-len"),
    (["serve", "--num-blocks", "x"], "--num-blocks"),
    (["serve", "a-model", "--model", "another"], "MODEL 'a-model' and --model 'another' differ"),
    (["serve", "--chat-template", "/nonexistent/t.jinja"], "--chat-template"),
    (["serve", "--generation-config", "/nonexistent"], "--generation-config"),
    (["serve", "--mode", "both"], "--mode"),
    (["serve", "--router-policy", "random"], "--router-policy"),
    (["serve", "--router-temperature", "-1"], "--router-temperature"),
    (["serve", "--registry", "http://h:1/0"], "--registry"),
    (["router", "--registry", "redis://h:1/x"], "--registry"),
    (["serve", "--kv-overlap-score-weight", "-1"], "--kv-overlap-score-weight"),
    # NaN passed the `< 0` checks and the CLI started Ray
    (["serve", "--router-temperature", "nan"], "--router-temperature must be a finite number >= 0, got nan"),
    (["serve", "--router-temperature", "inf"], "--router-temperature"),
    (["serve", "--kv-overlap-score-weight", "nan"], "--kv-overlap-score-weight must be a finite number >= 0"),
    (["serve", "--kv-overlap-score-weight", "inf"], "--kv-overlap-score-weight"),
    # a gRPC timeout past ~9.2e9 s expires at once: every request was DEADLINE_EXCEEDED
    (["serve", "--request-timeout", "1e12"], "--request-timeout"),
    (["serve", "--request-timeout", "inf"], "--request-timeout"),
    (["serve", "--abort-timeout", "1e300"], "--abort-timeout"),
    (["serve", "--hold-lease", "inf"], "--hold-lease"),
    (["router", "--registry", "redis://127.0.0.1:1/0", "--drain-seconds", "-1"], "--drain-seconds"),
    (["serve", "nosuchmodel"], "unknown model 'nosuchmodel'"),  # the workers would run here: say it now
    (["bench", "quant", "--steps", "0"], "--steps"),   # no steps timed: it failed after loading both models
    (["serve", "--max-model-len", "100000"], "--max-model-len 100000 exceeds the model's context of 8192"),
    (["serve", "--port", "99999"], "--port"),
    (["serve", "--http-port", "-2"], "--http-port"),
    (["serve", "--speculative-method", "draft", "--speculative-model", "/nonexistent"],
     "--speculative-model: unknown model '/nonexistent'"),
    (["serve", "--speculative-method", "ngram", "--speculative-model", "smollm2-135m-instruct"],
     "--speculative-model is for --speculative-method draft"),
    # found by a break-it pass: caught only inside the worker (a traceback, exit 1), or ignored
    (["serve", "--speculative-method", "draft", "--speculative-model", "smollm2-135m-instruct",
      "--speculative-draft-vocab-size", "49153"], "--speculative-draft-vocab-size must be in [1, 49152]"),
    (["serve", "--speculative-quantization", "int8"], "--speculative-quantization needs --speculative-method"),
    (["serve", "--spec-ngram-max", "8"], "--spec-ngram-max needs --speculative-method"),
    # planner flags without the planner were ignored without a word
    (["serve", "--slo", "ttft:500,itl:50"], "--slo is for the SLA planner: add --autoscale (with --profile), or drop --slo"),
    (["serve", "--profile", "/tmp/p.json"], "--profile is for the SLA planner: add --autoscale"),
    (["serve", "--planner-interval", "5"], "--planner-interval is for the SLA planner: add --autoscale"),
    (["serve", "--autoscale", "--slo", "ttft:500"], "--autoscale needs --profile"),
    # an empty key served with no authentication at all
    (["serve", "--api-key", ""], "--api-key: the key is empty, which would leave the API open"),
    (["serve", "--api-key", "  "], "--api-key: the key is empty"),
    (["serve", "--api-key", "sk-1 "], "--api-key: the key starts or ends with whitespace"),
    (["router", "--registry", "redis://127.0.0.1:1/0", "--api-key", ""], "--api-key: the key is empty"),
    (["router", "--registry", "redis://127.0.0.1:1/0", "--port", "99999"], "--port"),
])
def test_bad_serve_values_exit_2_before_anything_starts(argv, fragment, capsys):
    code, err = _run(argv, capsys)
    assert code == 2 and fragment in err and err.count("\n") == 1, err


def test_subprocess_has_no_traceback():
    """The real entry point (python -m deploy.cli), as a user runs it."""
    for argv in (["bogus"], ["generate", "--bogus"]):
        r = subprocess.run([sys.executable, "-m", "deploy.cli", *argv], cwd=REPO, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "Usage: pdserve" in r.stderr, r.stderr


def test_serve_help_is_grouped_by_concern():
    import typer.testing

    out = typer.testing.CliRunner().invoke(cli.app, ["serve", "--help"], prog_name="pdserve",
                                           env={"COLUMNS": "200"}).output
    for panel in ("Model", "Cluster", "Scheduler and KV cache", "Network", "Router", "Timeouts, leases and retries"):
        assert f" {panel} " in out, panel
    for flag in ("--served-model-name", "--max-model-len", "--no-enable-prefix-caching", "--chat-template",
                 "--generation-config", "--reservation-lease", "--hold-lease", "--transfer-timeout",
                 "--prefill-attempts", "--abort-timeout", "--worker-rpc-timeout", "--request-timeout"):
        assert flag in out, flag


def test_serve_flags_reach_the_worker_and_router_configs(monkeypatch, tmp_path):
    """What `serve` would start, captured instead of started (the cluster tests start real ones).
    The model must exist: with an embedded Ray its workers would run here, so serve checks it."""
    from deploy import serve_cmd

    captured = {}

    async def fake_serve(spec, router_config, ray_address, n_routers=1, scaling=None):
        captured.update(spec=spec, router=router_config, n_routers=n_routers, scaling=scaling)

    monkeypatch.setattr(serve_cmd, "_serve", fake_serve)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    cli.main(["serve", "smollm2-135m-instruct", "--served-model-name", "smol", "--max-model-len", "1024",
              "--no-enable-prefix-caching", "--chat-template", str(template), "--hold-lease", "7",
              "--reservation-lease", "9", "--prefill-attempts", "3", "--transfer-timeout", "4",
              "--request-timeout", "5", "--worker-rpc-timeout", "1.5", "--registry", "redis://127.0.0.1:6390/2",
              "--router-policy", "round-robin", "--router-temperature", "0.5", "--routers", "2"])
    spec, router = captured["spec"], captured["router"]
    assert spec.registry_url == "redis://127.0.0.1:6390/2" and captured["n_routers"] == 2
    assert (router.routing.policy, router.routing.temperature) == ("round-robin", 0.5)
    w = spec.worker_configs()[0]
    assert (w.model, w.served_model_name, w.max_model_len, w.enable_prefix_caching, w.transfer_timeout_s) == (
        "smollm2-135m-instruct", "smol", 1024, False, 4.0)
    flow, service = router.flow(), router.service()
    assert (flow.hold_lease_s, flow.reservation_lease_s, flow.prefill_attempts) == (7.0, 9.0, 3)
    assert (service.served_model_name, service.chat_template, service.request_timeout_s) == (
        "smol", str(template), 5.0)
    assert router.worker_rpc_timeout_s == 1.5
    # No secret flag or variable: serve makes one, and the routers hold the workers' secret.
    assert spec.internal_secret and router.internal_secret == spec.internal_secret


def test_empty_api_key_variable_is_a_usage_error_and_a_key_reaches_the_router(monkeypatch, capsys):
    """PDSERVE_API_KEY='' (click reads an empty variable as unset) served with no authentication;
    a real key from the variable reaches the router; RouterConfig itself refuses an empty key."""
    from deploy import serve_cmd
    from router.app import RouterConfig

    captured = {}

    async def fake_serve(spec, router_config, ray_address, n_routers=1, scaling=None):
        captured.update(router=router_config, scaling=scaling)

    monkeypatch.setattr(serve_cmd, "_serve", fake_serve)
    monkeypatch.setenv("PDSERVE_API_KEY", "")
    code, err = _run(["serve"], capsys)
    assert code == 2 and "$PDSERVE_API_KEY: the key is empty" in err and err.count("\n") == 1, err
    assert not captured
    monkeypatch.setenv("PDSERVE_API_KEY", "sk-env")
    cli.main(["serve"])
    assert captured["router"].api_key == "sk-env" and captured["scaling"].planner is None
    with pytest.raises(ValueError, match="empty"):
        RouterConfig(api_key="")


def test_router_replica_takes_the_api_key(monkeypatch):
    """`pdserve router` had no --api-key: a replica joining a serve that has one served its public API open."""
    from deploy import router_cmd

    captured = {}

    async def fake_run(url, config):
        captured.update(url=url, config=config)

    monkeypatch.setattr(router_cmd, "_run", fake_run)
    cli.main(["router", "--registry", "redis://127.0.0.1:6390/0", "--api-key", "sk-r"])
    assert captured["config"].api_key == "sk-r"
    monkeypatch.setenv("PDSERVE_API_KEY", "sk-env")
    cli.main(["router", "--registry", "redis://127.0.0.1:6390/0"])
    assert captured["config"].api_key == "sk-env"


def test_autoscale_takes_the_slo_and_interval(monkeypatch, tmp_path):
    from deploy import serve_cmd

    captured = {}

    async def fake_serve(spec, router_config, ray_address, n_routers=1, scaling=None):
        captured.update(scaling=scaling)

    monkeypatch.setattr(serve_cmd, "_serve", fake_serve)
    monkeypatch.setattr("deploy.plan_cmd.load_profile", lambda path: path)
    cli.main(["serve", "--autoscale", "--profile", str(tmp_path / "p.json"), "--slo", "ttft:500,itl:50",
              "--planner-interval", "5"])
    planner = captured["scaling"].planner
    assert (planner.ttft_slo_ms, planner.itl_slo_ms, planner.interval_s) == (500.0, 50.0, 5.0)
    cli.main(["serve", "--autoscale", "--profile", str(tmp_path / "p.json")])
    planner = captured["scaling"].planner
    assert (planner.ttft_slo_ms, planner.itl_slo_ms, planner.interval_s) == (2000.0, 200.0, 60.0)


def test_serve_disagg_defaults_give_each_role_its_step_budget(monkeypatch, capsys):
    """Defaults (captured, nothing started): the prefill worker steps in 2048-token chunks, the decode
    worker keeps the chunked-prefill budget and takes the idle budget in a burst; the start-up line
    gives each role's KV cache."""
    from deploy import runtime_options, serve_cmd

    captured = {}

    async def fake_serve(spec, router_config, ray_address, n_routers=1, scaling=None):
        captured.update(spec=spec, router=router_config)

    monkeypatch.setattr(serve_cmd, "_serve", fake_serve)
    cli.main(["serve", "--mode", "disagg"])
    by_role = {w.role: w for w in captured["spec"].worker_configs()}
    p, d = by_role["prefill"], by_role["decode"]
    assert p.max_num_batched_tokens == runtime_options.DEFAULT_PREFILL_MAX_NUM_BATCHED_TOKENS == 2048
    assert d.max_num_batched_tokens == runtime_options.DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert d.idle_max_num_batched_tokens == runtime_options.DEFAULT_IDLE_MAX_NUM_BATCHED_TOKENS
    assert p.prefill_first_ratio == d.prefill_first_ratio == runtime_options.DEFAULT_PREFILL_FIRST_RATIO
    assert p.kv_cache_memory_bytes == int(d.kv_cache_memory_bytes * runtime_options.DEFAULT_PREFILL_KV_FRACTION)
    fmt = runtime_options.platform.format_bytes
    assert (f"KV cache {fmt(d.kv_cache_memory_bytes)} per decode worker, {fmt(p.kv_cache_memory_bytes)} per prefill "
            "worker") in capsys.readouterr().out
    cli.main(["serve", "--mode", "disagg", "--prefill-max-num-batched-tokens", "64", "--max-num-batched-tokens", "96",
              "--kv-cache-memory", "256MiB"])
    assert f"KV cache {fmt(256 * 2**20)} per worker," in capsys.readouterr().out
    by_role = {w.role: w for w in captured["spec"].worker_configs()}
    assert (by_role["prefill"].max_num_batched_tokens, by_role["decode"].max_num_batched_tokens) == (64, 96)
    assert by_role["prefill"].kv_cache_memory_bytes == by_role["decode"].kv_cache_memory_bytes == 256 * 2**20


def test_a_command_that_exits_with_a_status_keeps_it(capsys, monkeypatch):
    """click *returns* typer.Exit's code under standalone_mode=False; main must still exit with it."""
    import typer

    def fails():
        raise typer.Exit(3)

    monkeypatch.setattr(cli, "app", typer.Typer())
    cli.app.command("fails")(fails)
    cli.app.command("other")(lambda: None)  # two commands, so "fails" is a sub-command
    code, _ = _run(["fails"], capsys)
    assert code == 3


def test_worker_env_carries_threads_the_openmp_wait_settings_and_debug_hooks_only():
    """A worker actor's runtime_env: its thread count (not the driver's), the libgomp wait settings
    the user set (read when torch loads, so they must be there from the start; a joined Ray
    cluster's actors do not inherit the driver's environment), the numerics overrides and
    PDSERVE_DEBUG_* hooks; nothing else."""
    from deploy.cluster import worker_env

    environ = {"OMP_NUM_THREADS": "7", "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "", "HOME": "/root",
               "PDSERVE_DEBUG_FP8_SCALE": "0"}
    assert worker_env(2, environ) == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE",
                                      "PDSERVE_DEBUG_FP8_SCALE": "0"}
    assert worker_env(1, {"GOMP_SPINCOUNT": "1000"}) == {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "1000"}
    # the INT8 down_proj scheme override (engine/quantization/apply.py): every worker alike
    from engine.quantization.apply import INT8_DOWN_ACT_ENV

    assert worker_env(1, {INT8_DOWN_ACT_ENV: "g32"}) == {"OMP_NUM_THREADS": "1", INT8_DOWN_ACT_ENV: "g32"}
