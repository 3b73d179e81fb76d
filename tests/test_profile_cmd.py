"""pdserve profile with the real model on tiny shapes: a profile the planner loads, a plot, and
one-line errors for bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

from planner.profile import WorkerProfile


def _profile(*args: str):
    return subprocess.run([sys.executable, "-m", "deploy.cli", "profile", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.model
def test_profile_writes_a_profile_the_planner_reads(tmp_path):
    out = tmp_path / "p.json"
    r = _profile("--isl", "16,48", "--batch", "1,3", "--context", "16,40", "--repeats", "1", "--threads", "1",
                 "--max-num-batched-tokens", "32", "--kv-cache-memory-gib", "0.05", "--json", str(out),
                 "--plot", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    prof = WorkerProfile.load(out)
    assert [p.isl for p in prof.prefill] == [16, 48] and len(prof.decode) == 4
    assert all(d.tokens_per_s == pytest.approx(d.batch / (d.itl_ms / 1000)) for d in prof.decode)
    assert prof.meta["threads"] == 1 and prof.meta["max_num_batched_tokens"] == 32
    assert (tmp_path / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [(["--isl", "a,b"], "--isl"), (["--batch", "0"], "--batch"),
                                           (["--threads", "999"], "--threads")])
def test_profile_bad_input_is_one_line_and_status_2(args, message, tmp_path):
    r = _profile(*args, "--json", str(tmp_path / "x.json"))
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
