"""Speculative-decoding series of a worker (worker/metrics.py) and the acceptance rate that
``pdserve status`` prints (deploy/status_cmd.py), from EngineStats counts (no model, no server)."""

from __future__ import annotations

from types import SimpleNamespace

from deploy.status_cmd import acceptance_rate
from worker.metrics import k_histogram

VALUES = ["smollm2", "d0", "decode"]


def test_k_histogram_has_one_cumulative_bucket_per_k():
    fam = k_histogram((5, 0, 2, 3), VALUES)           # 5 rows with k=0, 2 with k=2, 3 with k=3
    assert fam.name == "pdserve:spec_decode_k"
    samples = {(s.name, s.labels.get("le")): s.value for s in fam.samples}
    assert [samples[("pdserve:spec_decode_k_bucket", le)] for le in ("0", "1", "2", "3", "+Inf")] == [5, 5, 7, 10, 10]
    assert samples[("pdserve:spec_decode_k_count", None)] == 10
    assert samples[("pdserve:spec_decode_k_sum", None)] == 2 * 2 + 3 * 3
    assert all(s.labels["worker_id"] == "d0" for s in fam.samples)


def test_k_histogram_of_a_worker_without_speculation_is_empty():
    fam = k_histogram((), VALUES)
    samples = {(s.name, s.labels.get("le")): s.value for s in fam.samples}
    assert samples[("pdserve:spec_decode_k_bucket", "+Inf")] == 0 and samples[("pdserve:spec_decode_k_count", None)] == 0


def test_acceptance_rate_is_accepted_over_verified_drafts():
    assert acceptance_rate(SimpleNamespace(spec_draft_tokens=40, spec_accepted_tokens=30)) == 0.75
    assert acceptance_rate(SimpleNamespace(spec_draft_tokens=0, spec_accepted_tokens=0)) is None
