"""bench/gpu_check.py on a machine without CUDA, its pure helpers, and the CUDA-graph decoder's
padding (engine/cuda_graphs.py), all without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check import check, decode_kv_bytes, format_report, greedy_agreement, hbm_floor_ms, perplexity_checks
from engine.batch import SeqChunk
from engine.cuda_graphs import pad_decode_batch

REPO_ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("argv,prefix", [
    (("bench.gpu_check",), "gpu-check: error: "),
    (("deploy.cli", "bench", "gpu-check"), "pdserve: error: "),
])
def test_without_cuda_one_line_and_status_2(argv, prefix):
    proc = _run(*argv)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix) and "needs a CUDA device" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("args,message", [
    (("--skip-model", "--text", "some.txt"), "--text is the perplexity text of the model's checks, which --skip-model"),
    (("--text", "some.txt", "--ppl-tokens", "0"), "which --ppl-tokens 0 leaves out: drop one of the two"),
    (("--ppl-tokens", "1"), "--ppl-tokens must be 0 (no perplexity checks) or >= 2, got 1"),
    (("--dtype", "int8"), "--dtype must be one of"),
])
def test_a_wrong_option_is_named_before_the_device_is_looked_for(args, message):
    proc = _run("bench.gpu_check", *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "CUDA" not in lines[0], proc.stderr


def test_hbm_floor():
    # 270 MB of bf16 weights at 4.0 TB/s: 0.0675 ms; K/V bytes add to what must be read.
    assert hbm_floor_ms(270_000_000, 4.0e12) == pytest.approx(0.0675)
    kv = decode_kv_bytes(batch=16, context=512, num_layers=30, num_kv_heads=3, head_dim=64, element_size=2)
    assert kv == 2 * 16 * 512 * 30 * 3 * 64 * 2
    assert hbm_floor_ms(270_000_000, 4.0e12, kv) == pytest.approx((270_000_000 + kv) / 4.0e12 * 1e3)
    with pytest.raises(ValueError, match="bandwidth"):
        hbm_floor_ms(1, 0.0)


def test_check_and_greedy_agreement():
    assert check("a", 1e-6, 1e-5)["ok"] and not check("a", 1e-4, 1e-5)["ok"] and check("a", 5.0, None)["ok"]
    # Step 1 differs at a near tie (gap 0.1 < 0.5): fine. Step 3 differs with a clear winner: not.
    assert greedy_agreement([1, 2, 3, 4], [2.0, 0.1, 3.0, 3.0], [1, 9, 3, 4], 0.5) == {
        "steps": 4, "differ": 1, "differ_not_near_tie": [], "ok": True}
    result = greedy_agreement([1, 2, 3, 4], [2.0, 0.1, 3.0, 3.0], [1, 9, 3, 7], 0.5)
    assert result["differ"] == 2 and result["differ_not_near_tie"] == [3] and not result["ok"]
    with pytest.raises(ValueError):
        greedy_agreement([1], [0.1, 0.2], [1], 0.5)


def test_format_report():
    result = {"device": "NVIDIA H200", "bandwidth_GBps": 4000.0, "weight_bytes": 270_000_000, "ok": False,
              "seconds": 42.0,
              "checks": [check("attention bf16", 0.004, 1.6e-2), check("fp8 gemm", 0.1, 2 ** -7)],
              "decode": [{"batch": 16, "context": 512, "eager_ms": 9.5, "graph_ms": 1.25, "floor_ms": 0.0675,
                          "floor_kv_ms": 0.09, "graph_over_floor": 18.5}]}
    text = format_report(result)
    assert "NVIDIA H200" in text and "4000 GB/s" in text and "270 MB" in text
    assert any(line.startswith("attention bf16") and line.endswith("yes") for line in text.splitlines())
    assert any(line.startswith("fp8 gemm") and line.endswith("NO") for line in text.splitlines())
    assert "   16      512      9.50      1.25     0.068      0.090        18.5x" in text
    assert text.splitlines()[-1].startswith("all checks passed: NO")


def test_pad_decode_batch():
    chunks = [SeqChunk([7], 5, [3, 4]), SeqChunk([8], 0, [9])]   # contexts 6 and 1, block size 4
    got = pad_decode_batch(chunks, batch_size=4, max_blocks=3, block_size=4, scratch_block=15)
    assert got.input_ids == [7, 8, 0, 0]
    assert got.positions == [5, 0, 0, 0]
    assert got.slot_mapping == [4 * 4 + 1, 9 * 4, 15 * 4, 15 * 4]   # padding rows write the scratch block only
    assert got.seq_lens == [6, 1, 1, 1]
    assert got.block_tables == [[3, 4, 15], [9, 15, 15], [15, 15, 15], [15, 15, 15]]


@pytest.mark.parametrize("chunks,message", [
    ([SeqChunk([1, 2], 0, [0])], "one token"),
    ([SeqChunk([1], 0, [0], num_logits=0)], "one token"),
    ([SeqChunk([1], 12, [0, 1, 2, 3])], "captured for 3"),
    ([SeqChunk([1], 4, [0])], "block table has 1"),
    ([SeqChunk([1], 0, [0])] * 5, "do not fit"),
])
def test_pad_decode_batch_refuses(chunks, message):
    with pytest.raises(ValueError, match=message):
        pad_decode_batch(chunks, batch_size=4, max_blocks=3, block_size=4, scratch_block=15)


def _ppl(device, dtype, ppl, quant="none", kv="auto"):
    return {"device": device, "dtype": dtype, "quantization": quant, "kv_cache_dtype": kv, "perplexity": ppl}


def test_perplexity_checks():
    runs = [_ppl("cpu", "float32", 20.0), _ppl("cuda", "float32", 20.01), _ppl("cuda", "bfloat16", 20.2),
            _ppl("cuda", "bfloat16", 20.5, "fp8"), _ppl("cuda", "bfloat16", 20.5, kv="fp8_e4m3"),
            _ppl("cuda", "bfloat16", 21.0, "fp8", "fp8_e4m3")]
    checks = {c["name"].split(" (")[0]: c for c in perplexity_checks(runs, "bfloat16")}
    fp32 = checks["perplexity cuda fp32 vs cpu fp32"]
    assert fp32["max_err"] == pytest.approx(5e-4) and fp32["ok"]
    assert checks["perplexity cuda bfloat16 vs cpu fp32"]["ok"]                # 1% off: inside bf16's 2%
    fp8 = checks["perplexity bfloat16 w=fp8 kv=auto"]            # +1.49%: inside the 2% goal
    assert fp8["max_err"] == pytest.approx(20.5 / 20.2 - 1) and fp8["tol"] == 0.02 and fp8["ok"]
    assert not checks["perplexity bfloat16 w=none kv=fp8_e4m3"]["ok"]   # +1.49% against a 1% goal
    assert checks["perplexity bfloat16 w=fp8 kv=fp8_e4m3"]["tol"] is None
    runs[1]["perplexity"] = 20.1                                  # fp32 on cuda 0.5% off cpu: a bug
    assert not perplexity_checks(runs, "bfloat16")[0]["ok"]
    assert perplexity_checks(runs[:1], "bfloat16") == []          # no cuda runs: nothing to check
    # A broken bf16 baseline makes the quantized runs look fine beside it: its own check fails.
    broken = [dict(r, perplexity=r["perplexity"] * 250) if r["device"] == "cuda" and r["dtype"] == "bfloat16" else r
              for r in runs]
    by_name = {c["name"].split(" (")[0]: c for c in perplexity_checks(broken, "bfloat16")}
    assert not by_name["perplexity cuda bfloat16 vs cpu fp32"]["ok"]


def test_ppl_tokens_bad_text_names_the_option(tmp_path):
    from bench.gpu_check import _ppl_tokens
    from engine.errors import UserError

    with pytest.raises(UserError, match="--text: cannot read .*--ppl-tokens 0"):
        _ppl_tokens(tmp_path, tmp_path / "missing.txt", 16)


@pytest.mark.model
def test_cpu_reference_builds_no_cpu_kernels(tmp_path):
    """gpu-check's CPU fp32 reference runs torch's ops: on a lent GPU machine it must not spend a
    minute compiling the C++ CPU kernels (a fresh process, an empty kernel cache, no compiler)."""
    code = ("import torch, kernels.cpu_attention as ca\n"
            "from bench.gpu_check import CPU_REFERENCE\n"
            "from engine.model_runner import ModelRunner\n"
            "r = ModelRunner('smollm2-135m-instruct', dtype=torch.float32, num_blocks=4, **CPU_REFERENCE)\n"
            "print(r.attention_backend, r.layer_ops, ca._loaded is None)\n")
    env = dict(os.environ, CXX=str(tmp_path / "no-compiler"), PDSERVE_KERNEL_CACHE=str(tmp_path / "kernels"),
               PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["torch", "torch", "True"], proc.stdout
