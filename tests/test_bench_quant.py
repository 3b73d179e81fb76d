"""bench quant's floor columns and decode-step statistics (pure arithmetic over measured rows) and the probes they use."""

import pytest

from bench.floors import measure_int8_gemm_peak
from bench.quant import add_floor


def test_floor_columns_and_the_bound_over_none():
    decode = [{"batch": 16, "method": "none", "ms": 14.0}, {"batch": 16, "method": "int8", "ms": 10.0},
              {"batch": 1, "method": "int8", "ms": 5.0}]   # no batch-1 linears row: left as it is
    linears = [{"batch": 16, "method": "none", "ms": 11.0, "weight_MB": 250.0, "params": 125_000_000},
               {"batch": 16, "method": "int8", "ms": 7.0, "weight_MB": 125.0, "params": 125_000_000}]
    add_floor(decode, linears, read_gbps=25.0, peak_gops={"none": 400, "int8": 1000})
    none, int8, b1 = decode
    # none: reading 250 MB at 25 GB/s (10 ms) takes longer than 4 GOP at 400 GOP/s (10 ms) -- a tie
    assert (none["linears_ms"], none["rest_ms"], none["read_floor_ms"], none["compute_floor_ms"]) == (11.0, 3.0, 10.0, 10.0)
    assert (none["floor_ms"], none["linears_pct_of_floor"]) == (10.0, 91)
    # int8: 125 MB read in 5 ms, 4 GOP at 1000 GOP/s in 4 ms: the read bounds it
    assert (int8["read_floor_ms"], int8["compute_floor_ms"], int8["floor_ms"], int8["linears_pct_of_floor"]) == (5.0, 4.0, 5.0, 71)
    # (10 + 3) / (5 + 3): the speed-up the floors allow with the rest as measured
    assert int8["bound_vs_none"] == 1.62 and none["bound_vs_none"] == 1.0
    assert "floor_ms" not in b1 and "bound_vs_none" not in b1


def test_compute_floor_decides_when_it_is_the_longer():
    decode = [{"batch": 32, "method": "none", "ms": 30.0}]
    add_floor(decode, [{"batch": 32, "method": "none", "ms": 25.0, "weight_MB": 250.0, "params": 125_000_000}],
              read_gbps=50.0, peak_gops={"none": 400})
    assert decode[0]["read_floor_ms"] == 5.0 and decode[0]["compute_floor_ms"] == 20.0 and decode[0]["floor_ms"] == 20.0


@pytest.mark.filterwarnings("ignore:TF32 acceleration")   # torch's mkldnn.flags() says it on every CPU
def test_the_int8_peak_is_probed_only_where_onednn_runs_it():
    import torch

    from engine.platform import cpu_flags

    with torch.backends.mkldnn.flags(enabled=False):   # torch's scalar fallback: no peak of anything
        assert measure_int8_gemm_peak(n=64, repeats=1) is None
    peak = measure_int8_gemm_peak(n=64, repeats=1)
    assert (peak is None) == ("avx512_vnni" not in cpu_flags())


def test_peaks_are_given_for_the_methods_asked_and_none_for_fp8():
    from bench.quant import gemm_peaks
    from engine.platform import cpu_flags

    assert set(gemm_peaks("bfloat16", ["none", "fp8"])) == {"none"}
    want = {"none", "int8"} if "avx512_vnni" in cpu_flags() else {"none"}
    assert set(gemm_peaks("bfloat16", ["none", "int8"])) == want


def fake_runner_class(monkeypatch, quant):
    """A runner whose forward advances bench.quant's clock by its next step time (ms): the bench's
    arithmetic, no model."""
    clock = [0.0]
    monkeypatch.setattr(quant.time, "perf_counter", lambda: clock[0])

    class Runner:
        attention_backend = "cpp"

        def __init__(self, steps_ms):
            self.steps = iter(steps_ms)

        def forward(self, chunks):
            clock[0] += next(self.steps) / 1e3

    return Runner


def test_decode_rows_give_the_best_the_median_and_the_paired_median_ratio(monkeypatch):
    """Each method's best and median step, and the median over rounds of none's step over the
    method's in the same round (a clock the fake runners advance: the bench's arithmetic, no model)."""
    import bench.quant as quant

    Runner = fake_runner_class(monkeypatch, quant)
    # two warm-up steps each, then three rounds; round 2 is slow for both (a burst of load)
    runners = {"none": Runner([99, 99, 14.0, 28.0, 15.0]), "int8": Runner([99, 99, 10.0, 20.0, 10.5])}
    none, int8 = quant.decode_rows(runners, context=16, steps=3, batches=(1,), consecutive=0)
    assert "ms_consecutive" not in int8
    assert (none["ms"], none["ms_median"], none["speedup_vs_none_median"]) == (14.0, 15.0, 1.0)
    assert (int8["ms"], int8["ms_median"], int8["speedup_vs_none"]) == (10.0, 10.5, 1.4)
    assert int8["speedup_vs_none_median"] == 1.4    # rounds: 1.4, 1.4, 1.43


def test_decode_rows_time_a_method_s_consecutive_steps_apart_from_its_first(monkeypatch):
    """Each round: a method's first step (after another method's) in ms, the ``consecutive`` steps
    after it in ms_consecutive; the paired ratio is per round, of the consecutive steps' means."""
    import bench.quant as quant

    Runner = fake_runner_class(monkeypatch, quant)
    # warm-up 2, then two rounds of 1 + 3 steps; the first step of each round is the slow one,
    # none's consecutive means differ between rounds (13, 15), and no round's mean is its median
    runners = {"none": Runner([99, 99, 13.0, 12.0, 11.0, 16.0, 15.0, 14.0, 12.0, 19.0]),
               "int8": Runner([99, 99, 9.0, 8.0, 7.0, 4.5, 9.5, 9.5, 7.0, 6.5])}
    none, int8 = quant.decode_rows(runners, context=16, steps=2, batches=(1,), consecutive=3)
    assert (int8["ms"], int8["ms_median"]) == (9.0, 9.25)
    assert (int8["ms_consecutive"], int8["ms_consecutive_median"]) == (4.5, 7.0)
    assert int8["speedup_vs_none_consecutive"] == round(11.0 / 4.5, 2)
    # per round: none's mean over int8's mean (13 / 6.5, 15 / 7.67), then their median
    assert int8["speedup_vs_none_consecutive_median"] == round((13.0 / 6.5 + 15.0 / (23.0 / 3)) / 2, 2) == 1.98
    assert none["speedup_vs_none_consecutive_median"] == 1.0


def test_isolated_rows_pair_each_round_s_processes():
    """bench quant --isolated: per batch and method the least step, the median over rounds of each
    process's median, and the per-round ratio of none's median to the method's (adjacent processes)
    as its median, least and most (the bench's arithmetic, no model)."""
    from bench.isolated_step import isolated_rows

    ms = 1e-3
    rounds = [   # round 2 is a slow host minute for both; int8's round 3 has one stray slow step
        {"none": {16: [12 * ms, 10 * ms, 11 * ms]}, "int8": {16: [7 * ms, 6 * ms, 6.5 * ms]}},
        {"none": {16: [20 * ms, 22 * ms, 21 * ms]}, "int8": {16: [14 * ms, 14 * ms, 15 * ms]}},
        {"none": {16: [11 * ms, 11 * ms, 12 * ms]}, "int8": {16: [6 * ms, 40 * ms, 5.5 * ms]}},
    ]
    none, int8 = isolated_rows(rounds)
    assert (none["batch"], none["rounds"], none["steps"]) == (16, 3, 3)
    assert (none["ms"], none["ms_median"], none["speedup_vs_none_median"]) == (10.0, 11.0, 1.0)
    # int8's process medians: 6.5, 14, 6 -> their median 6.5; per round 11 / 6.5, 21 / 14, 11 / 6
    assert (int8["ms"], int8["ms_median"]) == (5.5, 6.5)
    assert int8["speedup_vs_none_median"] == round(11 / 6.5, 2) == 1.69
    assert (int8["speedup_vs_none_least"], int8["speedup_vs_none_most"]) == (1.5, round(11 / 6, 2))


def test_an_isolated_process_times_real_decode_steps_and_reports_a_failure():
    """run_process starts bench.isolated_step in its own Python: the real model's decode steps come
    back as seconds per batch size; a child that fails (an unknown method) raises with its error."""
    from bench.isolated_step import run_process

    steps = run_process("smollm2-135m-instruct", "none", "bfloat16", 16, [1, 2], 3, 2)
    assert sorted(steps) == [1, 2] and all(len(ts) == 3 and all(0 < t < 10 for t in ts) for ts in steps.values())
    unknown = r"isolated_step \(int4\) exited [1-9]: UserError: --quantization: unknown method 'int4'"
    with pytest.raises(RuntimeError, match=unknown):
        run_process("smollm2-135m-instruct", "int4", "bfloat16", 16, [1], 1, 2)


def test_best_time_warms_up_for_the_time_asked_before_timing(monkeypatch):
    """A GEMM probe's first calls run slow (a process's first oneDNN calls); best_time keeps calling
    untimed until warmup_s has passed, so a slow start never becomes the peak. On a fake clock: calls
    take 50, 40, 30 ms, then 2 ms."""
    import bench.floors as floors

    clock = [0.0]
    durations = iter([0.050, 0.040, 0.030] + [0.002] * 20)
    calls = []

    def fn():
        calls.append(clock[0])
        clock[0] += next(durations)

    monkeypatch.setattr(floors.time, "perf_counter", lambda: clock[0])
    assert floors.best_time(fn, repeats=2, warmup_s=0.1) == pytest.approx(0.002)
    assert len(calls) == 5                      # 50 + 40 + 30 ms untimed (past 0.1 s), then 2 timed
    durations = iter([0.050, 0.040, 0.030])
    calls.clear()
    assert floors.best_time(fn, repeats=2) == pytest.approx(0.030)   # default: one untimed call
    assert len(calls) == 3
