"""pdserve bench peers: argument parsing and the side-by-side table (the servers themselves are run by hand)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.peers import RssSampler, ServerSpec, peers_table, process_label, rss_breakdown
from engine.errors import UserError


def test_server_spec_needs_a_name_and_a_port_placeholder():
    s = ServerSpec.parse("vllm=python -m vllm --port {port}")
    assert (s.name, s.command) == ("vllm", "python -m vllm --port {port}")
    for bad in ("no-equals {port}", "=cmd {port}", "x=cmd without port"):
        with pytest.raises(UserError, match="--server"):
            ServerSpec.parse(bad)


def test_table_gives_ratios_to_the_first_server_and_shows_errors():
    res = dict(output_throughput=100.0, median_ttft_ms=900, p99_ttft_ms=1400, median_tpot_ms=28, p99_itl_ms=59, failed=0)
    rows = peers_table([{"name": "ref", "result": res, "peak_rss_mib": 4000},
                        {"name": "ours", "result": {**res, "output_throughput": 150.0}, "peak_rss_mib": 2000},
                        {"name": "broken", "error": "RuntimeError: server exited", "peak_rss_mib": 0}])
    lines = rows.splitlines()
    assert "1.00" in lines[2] and "1.50" in lines[3] and "server exited" in lines[4]


def test_rounds_summary_takes_each_ratio_within_its_round():
    """bench peers --rounds: per server its median output tok/s over the rounds it served in, and the
    median, least and most of its ratio to the round's first server (a round where the reference
    failed gives no ratio; a server's failed round is left out of its figures)."""
    from bench.peers import rounds_summary, rounds_table

    def row(name, tput):
        return {"name": name, "result": {"output_throughput": tput}} if tput else {"name": name, "error": "x"}

    rounds = [[row("vllm", 400.0), row("int8", 600.0)],   # a slow host minute for both
              [row("vllm", 520.0), row("int8", 780.0)],
              [row("vllm", None), row("int8", 800.0)],    # the reference failed
              [row("vllm", 500.0), row("int8", None)],    # int8 failed
              [row("vllm", 480.0), row("int8", 816.0)]]
    vllm, int8 = rounds_summary(rounds)
    assert (vllm["rounds"], vllm["output_throughput_median"], vllm["ratio_median"]) == (4, 490.0, 1.0)
    assert (int8["rounds"], int8["output_throughput_median"]) == (4, 790.0)
    # ratios within rounds 1, 2 and 5: 1.5, 1.5, 1.7 (round 3 has no reference, round 4 no int8)
    assert (int8["ratio_median"], int8["ratio_least"], int8["ratio_most"]) == (1.5, 1.5, 1.7)
    table = rounds_table([vllm, int8], 5).splitlines()
    assert table[2].split() == ["vllm", "4", "490.0", "1.00", "1.00", "1.00"]
    assert table[3].split() == ["int8", "4", "790.0", "1.50", "1.50", "1.70"]
    failed = rounds_summary([[row("vllm", 400.0), row("broken", None)]])[1]
    assert failed["output_throughput_median"] is None and "ratio_median" not in failed
    assert rounds_table([failed], 1).splitlines()[2].split() == ["broken", "0", "error", "-", "-", "-"]


def test_rounds_must_be_at_least_one():
    from bench.peers import command

    with pytest.raises(UserError, match="--rounds"):
        command(server=["a=x {port}"], rounds=0, floors=False)


def test_rss_sampler_counts_child_processes():
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(64 * 2**20); time.sleep(30)"])
    try:
        sampler = RssSampler(os.getpid())
        import time

        deadline = time.monotonic() + 20
        while sampler.sample() < 64 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sampler.peak >= 64 * 2**20
        by = {p: (n, b) for p, n, b in sampler.peak_by_process}
        assert sum(b for _, b in by.values()) == sampler.peak   # the breakdown is of the peak sample
        assert any(b >= 64 * 2**20 for _, b in by.values())  # the child's label holds its 64 MiB
    finally:
        child.kill()
        child.wait()


def test_workload_floor_adds_prefill_flops_over_gemm_peak_and_decode_weight_reads_over_bandwidth():
    from types import SimpleNamespace

    from bench.floors import MachineFloors, workload_floor
    from bench.peers import add_floor

    cfg = SimpleNamespace(num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                          head_dim=4, vocab_size=32)
    machine = MachineFloors("bfloat16", 2, gemm_flops=1e6, memcpy_bytes_per_s=1e5)
    f = workload_floor(cfg, [10, 20, 30], output_tokens=4, concurrency=2, machine=machine)
    per_layer = 8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16          # qkv, o, gate/up/down
    params = 2 * per_layer + 32 * 8                          # + the LM head
    prefill = sum(2 * 2 * per_layer * n + 2 * 32 * 8 + 2 * 2 * n * n * 8 for n in (10, 20, 30))
    assert f.weight_bytes == 2 * params and f.decode_steps == 2 * 3  # 2 waves x (4 - 1) steps
    assert f.prefill_flops == prefill and f.prefill_s == prefill / 1e6
    assert f.decode_s == 6 * 2 * params / 1e5 and f.floor_s == f.prefill_s + f.decode_s
    assert abs(f.output_tok_s - 12 / f.floor_s) < 1e-9
    row = {"name": "x", "result": {"output_throughput": f.output_tok_s / 4, "median_ttft_ms": 1, "p99_ttft_ms": 2,
                                   "median_tpot_ms": 3, "p99_itl_ms": 4, "failed": 0},
           "prompt_lens": [10, 20, 30], "peak_rss_mib": 1}
    add_floor(row, cfg, 4, 2, machine)
    assert abs(row["floor_fraction"] - 0.25) < 1e-9
    assert peers_table([row]).splitlines()[2].split()[-2] == "25"


def test_process_labels_and_the_breakdown_line():
    assert process_label("ray::WorkerActor", ["ray::WorkerActor"]) == "ray::WorkerActor"
    assert process_label("raylet", ["/x/raylet", "--a"]) == "raylet"
    assert process_label("python3.11", ["/v/bin/python", "-u", "/r/log_monitor.py", "--x"]) == "log_monitor.py"
    assert process_label("python", ["/v/bin/python", "-m", "deploy.cli", "serve"]) == "deploy.cli"
    line = rss_breakdown([{"name": "d", "peak_rss_by_process": [{"process": "ray::WorkerActor", "count": 2,
                                                                  "rss_mib": 2048.4}]}])
    assert line.splitlines()[1] == "  d: ray::WorkerActor x2 2048"


@pytest.mark.model
def test_engine_row_runs_the_closed_loop_with_serve_defaults(model_path):
    """bench/closed_loop.py: serve's default scheduler; every prompt served, at most
    max_concurrency in flight, counted by bench serve's summarize (one ITL per token after the first)."""
    from dataclasses import replace

    from bench import closed_loop
    from bench.peers import engine_row_command
    from deploy import runtime_options as ro  # the values serve's flags default to
    from engine.config import CacheConfig
    from engine.llm_engine import LLMEngine

    cfg = closed_loop.serve_default_config(str(model_path))
    s = cfg.scheduler
    assert (s.max_num_batched_tokens, s.idle_max_num_batched_tokens, s.prefill_first_ratio, s.max_num_seqs) == (
        ro.DEFAULT_MAX_NUM_BATCHED_TOKENS, ro.DEFAULT_IDLE_MAX_NUM_BATCHED_TOKENS, ro.DEFAULT_PREFILL_FIRST_RATIO, 32)
    assert not cfg.cache.enable_prefix_caching and cfg.dtype == "auto"
    engine = LLMEngine(replace(cfg, cache=CacheConfig(num_blocks=64, enable_prefix_caching=False),
                               num_threads=None, cpu_cores=None))
    running = []
    step = engine.step
    engine.step = lambda: (running.append(len(engine.scheduler.running) + len(engine.scheduler.waiting)), step())[1]
    doc = closed_loop.run(engine, [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14]], max_concurrency=2,
                          max_tokens=4)
    assert doc["completed"] == 4 and doc["failed"] == 0 and doc["total_output_tokens"] == 16
    assert doc["total_input_tokens"] == 14 and max(running) == 2
    assert doc["p99_itl_ms"] > 0 and doc["median_ttft_ms"] > 0 and doc["output_throughput"] > 0
    assert engine.block_manager.num_used_blocks == 0
    argv = engine_row_command("m", 32, 64, 16, False, 2, None)
    assert argv[1:3] == ["-m", "bench.closed_loop"] and "--no-ignore-eos" in argv and "--dataset-path" not in argv


def test_cpu_window_counts_by_label_from_the_window_start_and_the_rest_of_the_host():
    from bench.cpu_usage import CpuUsage, by_label, host_busy_seconds, usage_line

    # /proc/stat: user nice system idle iowait irq softirq steal -> busy = all but idle and iowait
    assert host_busy_seconds("cpu  100 5 50 900 40 3 2 1 0 0\ncpu0 1 2 3 4\n", 100) == 1.61
    with pytest.raises(ValueError):
        host_busy_seconds("intr 1 2\n", 100)
    start = {1: ("router", 2.0), 2: ("ray::WorkerActor", 10.0), 3: ("raylet", 1.0)}
    last = {1: ("router", 2.5), 2: ("ray::WorkerActor", 21.0), 3: ("raylet", 1.25), 4: ("raylet", 0.5)}
    assert by_label(start, last) == [("ray::WorkerActor", 1, 11.0), ("raylet", 2, 0.75), ("router", 1, 0.5)]
    usage = CpuUsage(8.0, tuple(by_label(start, last)), client_cpu_s=1.0, host_busy_cpu_s=15.5,
                     load_1m_start=2.0, load_1m_end=2.5)
    doc = usage.as_dict()
    assert (doc["server_cpu_s"], doc["other_cpu_s"]) == (12.25, 2.25)
    line = usage_line("pdserve-agg", doc)
    assert "raylet x2 0.8" in line and "other 2.2" in line and "load 2.0 -> 2.5" in line
    assert CpuUsage(1.0, (), 0.0, None, 0.0, 0.0).as_dict()["other_cpu_s"] is None


def test_cpu_window_measures_a_busy_child():
    """A child that burns CPU: its label gets it (its own process), and the host's busy time covers it."""
    from bench.cpu_usage import CpuWindow

    code = ("import sys, time\nsys.stdin.readline()\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3: pass\ntime.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        window = CpuWindow(child.pid, process_label)   # before the child burns (it waits for a line)
        child.stdin.write(b"go\n")
        child.stdin.flush()
        import time

        deadline = time.monotonic() + 20
        while window.finish().server_cpu_s < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        usage = window.finish()
        assert usage.server_cpu_s >= 0.3 and usage.by_process[0][1] == 1
        assert usage.host_busy_cpu_s is None or usage.host_busy_cpu_s >= 0.3
    finally:
        child.kill()
        child.wait()


def test_engine_row_carries_its_prompt_lengths_to_the_floor():
    from bench.peers import engine_row_fields

    doc = {"output_throughput": 500.0, "completed": 2, "prompt_lens": [10, 20]}
    assert engine_row_fields(doc) == {"result": {"output_throughput": 500.0, "completed": 2}, "prompt_lens": [10, 20]}
    assert engine_row_fields({"completed": 1}) == {"result": {"completed": 1}}
