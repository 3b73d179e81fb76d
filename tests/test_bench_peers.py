"""pdserve bench peers: argument parsing and the side-by-side table (the servers themselves are run by hand)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.peers import RssSampler, ServerSpec, peers_table
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


def test_rss_sampler_counts_child_processes():
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(64 * 2**20); time.sleep(30)"])
    try:
        sampler = RssSampler(os.getpid())
        import time

        deadline = time.monotonic() + 20
        while sampler.sample() < 64 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sampler.peak >= 64 * 2**20
    finally:
        child.kill()
        child.wait()
