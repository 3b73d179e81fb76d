"""bench engine's decode floor (the roofline counts the KV cache a step reads, not only the weights) and its rows."""

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


def test_rows_are_every_dtype_method_and_kv_dtype_with_the_plain_dtype_keeping_its_name():
    from bench.engine import _configs, _short

    rows = _configs(["float32", "bfloat16"], "none, int8", "auto,fp8_e4m3")
    assert list(rows) == ["float32", "float32+kv:fp8_e4m3", "float32+int8", "float32+int8+kv:fp8_e4m3",
                          "bfloat16", "bfloat16+kv:fp8_e4m3", "bfloat16+int8", "bfloat16+int8+kv:fp8_e4m3"]
    assert rows["bfloat16+int8"] == ("bfloat16", "int8", "auto")
    assert _short("bfloat16+int8+kv:fp8_e4m3") == "bf16+int8+kv:fp8" and _short("float32") == "fp32"


def test_an_int8_row_takes_the_int8_gemm_peak_and_the_others_their_dtype():
    from types import SimpleNamespace

    import torch

    from bench.engine import _gemm_peak

    floors = {"gemm_flops": {"bfloat16": 400e9, "float32": 100e9, "int8": 850e9}}
    int8 = SimpleNamespace(dtype=torch.bfloat16, quantization="int8")
    fp8_fp32 = SimpleNamespace(dtype=torch.float32, quantization="fp8")
    none_fp32 = SimpleNamespace(dtype=torch.float32, quantization="none")
    assert _gemm_peak(floors, int8) == 850e9
    assert _gemm_peak(floors, fp8_fp32) == 400e9   # FP8 weights are multiplied as bf16 on CPUs
    assert _gemm_peak(floors, none_fp32) == 100e9
    assert _gemm_peak(floors, None) == 100e9       # the transformers row: fp32
    # no int8 probe in the run (no int8 row, or no oneDNN VNNI kernel): the dtype's peak
    assert _gemm_peak({"gemm_flops": {"bfloat16": 400e9}}, int8) == 400e9
