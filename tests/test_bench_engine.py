"""bench engine's decode floor: the roofline counts the KV cache a step reads, not only the weights."""

import pytest

from bench.engine import decode_floor


def test_decode_floor_counts_weights_and_kv_cache():
    # SmolLM2-135M bf16 at batch 16, 128 tokens of context: 270 MB of weights, 47 MB of K/V.
    f = decode_floor(weight_bytes=270_000_000, kv_bytes=47_000_000, flops=4.5e9, bytes_per_s=50e9, flops_per_s=800e9)
    assert f["bound"] == "memory"
    assert f["floor_s"] == pytest.approx(317e6 / 50e9)
    assert f["weights_s"] == pytest.approx(270e6 / 50e9)
    assert f["compute_s"] == pytest.approx(4.5e9 / 800e9)


def test_decode_floor_turns_compute_bound_when_the_flops_dominate():
    f = decode_floor(weight_bytes=1_000, kv_bytes=1_000, flops=1e12, bytes_per_s=1e9, flops_per_s=1e12)
    assert f["bound"] == "compute" and f["floor_s"] == pytest.approx(1.0) and f["memory_s"] == pytest.approx(2e-6)
