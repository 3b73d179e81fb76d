"""The runtime flags of `pdserve serve` and `pdserve generate` (--dtype, --threads-per-worker,
--kv-cache-memory, --num-blocks, --max-num-batched-tokens): bad values are one line naming the
option and what is allowed, exit status 2, before Ray or any worker starts (in-process, so a
started Ray would show in ray.is_initialized(); one subprocess checks the real command)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import platform

REPO = Path(__file__).resolve().parents[1]
NCORES = len(platform.available_cores())


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    from deploy import cli

    monkeypatch.setattr(sys, "argv", ["pdserve", *args])
    with pytest.raises(SystemExit) as e:
        cli.main()
    return e.value.code, capsys.readouterr().err


BAD = [
    (["--dtype", "fp8"], ["--dtype 'fp8'", "auto, float32, bfloat16, float16"]),
    (["--threads-per-worker", str(NCORES + 1), "--mode", "agg"], ["--threads-per-worker", f"{NCORES} are available"]),
    (["--threads-per-worker", "0"], ["--threads-per-worker 0", ">= 1"]),
    (["--kv-cache-memory", "100TiB"], ["--kv-cache-memory 100TiB", "do not fit", "use at most"]),
    (["--kv-cache-memory", "lots"], ["--kv-cache-memory 'lots'", "2GiB"]),
    (["--num-blocks", "100000000"], ["--num-blocks 100000000", "do not fit"]),
    (["--num-blocks", "64", "--kv-cache-memory", "1GiB"], ["--kv-cache-memory and --num-blocks", "one of"]),
    (["--max-num-batched-tokens", "4"], ["--max-num-batched-tokens 4", "--max-num-seqs"]),
    (["--idle-max-num-batched-tokens", "0"], ["--idle-max-num-batched-tokens 0", ">= 1"]),
    (["--prefill-first-ratio", "-1"], ["--prefill-first-ratio -1", ">= 0"]),
    (["--prefill-max-num-batched-tokens", "8"], ["--prefill-max-num-batched-tokens 8", "--max-num-seqs"]),
]
if not platform.has_native_fp16():
    BAD.append((["--dtype", "float16"], ["--dtype float16", "no native fp16", "auto, float32 or bfloat16"]))


@pytest.mark.parametrize("args, fragments", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_serve_bad_runtime_flag_is_one_line_exit_2_before_any_worker(monkeypatch, capsys, args, fragments):
    import ray

    from deploy import cluster

    # Ray may already run in this test session (the serving tests' cluster): what must not happen
    # is that this command starts or joins one.
    started = []
    monkeypatch.setattr(cluster, "init_ray", lambda *a, **k: started.append((a, k)))
    was_initialized = ray.is_initialized()
    code, err = run_cli(monkeypatch, capsys, "serve", *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("pdserve: error:"), err
    for f in fragments:
        assert f in lines[0], lines[0]
    assert not started and ray.is_initialized() == was_initialized


@pytest.mark.parametrize("args, fragments", BAD[:2], ids=["dtype", "threads"])
def test_generate_bad_runtime_flag(monkeypatch, capsys, args, fragments):
    code, err = run_cli(monkeypatch, capsys, "generate", *[a for a in args if a not in ("--mode", "agg")], "hi")
    assert code == 2 and all(f in err for f in fragments), err


def test_serve_bad_dtype_as_a_real_command():
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", "--dtype", "double"], cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == "pdserve: error: --dtype 'double': expected one of auto, float32, bfloat16, float16"


@pytest.mark.parametrize("args, fragment", [(["--dtypes", "fp8"], "--dtype 'fp8'"),
                                            (["--threads", str(NCORES + 1)], f"--threads {NCORES + 1}"),
                                            (["--batch-sizes", "1,x"], "--batch-sizes"),
                                            (["--quantization", "none,int4"], "--quantization"),
                                            (["--kv-cache-dtype", "fp16"], "--kv-cache-dtype")])
def test_bench_engine_bad_flags(monkeypatch, capsys, args, fragment):
    code, err = run_cli(monkeypatch, capsys, "bench", "engine", *args)
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("methods, fragment", [("none,bogus", "--methods 'none,bogus': unknown method 'bogus'"),
                                               (",", "--methods ','")])
def test_bench_quant_names_its_own_option(monkeypatch, capsys, methods, fragment):
    code, err = run_cli(monkeypatch, capsys, "bench", "quant", "--methods", methods)
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err
