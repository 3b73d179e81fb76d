"""pdserve bench offline: the length distribution (pure) and one small end-to-end run of both
batching modes on the real model (checks the report's shape, not its speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.offline import output_lengths, parse_length_dist
from engine.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_lognormal_lengths_are_seeded_and_clipped():
    a = output_lengths(500, None, "lognormal:64:1.0:256", seed=3)
    assert a == output_lengths(500, None, "lognormal:64:1.0:256", seed=3)
    assert a != output_lengths(500, None, "lognormal:64:1.0:256", seed=4)
    assert min(a) >= 1 and max(a) == 256  # about 8% of draws exceed the cap
    assert 48 <= sorted(a)[250] <= 80     # median near 64
    assert output_lengths(3, 7, "lognormal:64:1.0:256", seed=0) == [7, 7, 7]


@pytest.mark.parametrize("spec", ["normal:64:1:256", "lognormal:64:1.0", "lognormal:0:1:256", "lognormal:a:1:2"])
def test_bad_length_dist_names_the_format(spec):
    with pytest.raises(UserError, match="lognormal:MEDIAN:SIGMA:CAP"):
        parse_length_dist(spec)


def test_both_modes_run_and_report(model_path, shared_data_dir, tmp_path):
    out = tmp_path / "offline.json"
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "offline", "--num-prompts", "5",
                           "--max-num-seqs", "2", "--output-len-dist", "lognormal:3:1.0:6", "--num-kv-blocks", "256",
                           "--threads", "1", "--json", str(out)],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "continuous / static output throughput:" in proc.stdout
    report = json.loads(out.read_text())
    lengths = output_lengths(5, None, "lognormal:3:1.0:6", seed=0)
    for mode in ("continuous", "static"):
        r = report[mode]
        assert r["total_output_tokens"] == sum(lengths)  # EOS ignored: every request makes its length
        assert 0 <= r["kv_waste"] < 1 and 0 < r["kv_usage_peak"] <= 1
        assert r["num_preemptions"] == 0 and r["output_throughput"] > 0 and r["request_throughput"] > 0
    assert report["static"]["static_padding"] is True
    assert report["continuous_over_static"] == pytest.approx(
        report["continuous"]["output_throughput"] / report["static"]["output_throughput"])
