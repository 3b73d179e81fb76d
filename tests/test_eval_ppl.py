"""`pdserve eval ppl`: the sliding-window plan (pure), the perplexity through our runtime against
transformers on the same weights (fp32), the JSON it writes and its bad input (exit 2)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evals.perplexity import plan_windows

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("n,context,stride", [(10, 4, 2), (11, 4, 3), (9, 3, 3), (5, 8, 4), (2, 2, 1)])
def test_windows_score_every_token_once_with_at_most_context_before_it(n, context, stride):
    windows = plan_windows(n, context, stride)
    scored = [t for w in windows for t in range(w.first_target, w.end)]
    expected = list(range(1, n)) if stride < context else [t for t in range(1, n) if t % context]
    assert scored == expected
    for w in windows:
        assert w.end - w.begin <= context and w.begin < w.first_target < w.end + 1


def hf_sliding_window_ppl(hf_model, ids: list[int], context: int, stride: int) -> float:
    """The HF perplexity guide's loop, written out (labels -100 on context tokens, loss = mean NLL)."""
    import torch

    nll_sum, count, prev_end = 0.0, 0, 0
    x = torch.tensor([ids])
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        trg_len = end - prev_end
        input_ids = x[:, begin:end]
        labels = input_ids.clone()
        labels[:, :-trg_len] = -100
        with torch.inference_mode():
            loss = hf_model(input_ids, labels=labels, attention_mask=torch.ones_like(input_ids)).loss
        n_valid = int((labels != -100).sum()) - 1  # the labels shift drops one
        nll_sum += float(loss) * n_valid
        count += n_valid
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll_sum / count)


@pytest.mark.model
def test_perplexity_matches_transformers_fp32(model_path, tokenizer, shared_data_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from engine.model_runner import ModelRunner
    from evals.perplexity import evaluate

    ids = tokenizer((shared_data_dir / "wikitext-2-raw-test.txt").read_text()[:2000])["input_ids"][:300]
    context, stride = 128, 64
    runner = ModelRunner(model_path, block_size=16, num_blocks=8, dtype=torch.float32)
    # chunk_tokens < context and decode_tokens > 0: chunked prefill and the decode path both score tokens.
    ours = evaluate(runner, ids, context, stride, decode_tokens=4, chunk_tokens=48)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    reference = hf_sliding_window_ppl(hf, ids, context, stride)
    assert ours.num_tokens == len(ids) - 1 and ours.num_decode_tokens == 4 * ours.num_windows
    assert abs(ours.perplexity / reference - 1) < 0.005, (ours.perplexity, reference)


def pdserve_eval(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "deploy.cli", "eval", "ppl", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.model
def test_cli_writes_the_json_the_issue_names(model_path, tmp_path, monkeypatch, capsys):
    from deploy import cli

    out = tmp_path / "ppl.json"
    monkeypatch.setattr(sys, "argv", ["pdserve", "eval", "ppl", "--max-tokens", "64", "--context", "32",
                                      "--stride", "16", "--json", str(out)])
    cli.main()
    obj = json.loads(out.read_text())
    assert obj["config"] == {"dtype": "float32", "quantization": "none", "kv_cache_dtype": "auto"}
    assert obj["num_tokens"] == 63 and 1 < obj["perplexity"] < 1000
    assert "perplexity" in capsys.readouterr().out


@pytest.mark.model
def test_compare_prints_each_row_once_as_its_run_finishes(model_path, monkeypatch, capsys):
    """The table is printed a row at a time as the runs finish, each configuration once (also in a
    log: `2>&1 | tee` had shown every row twice), so a run that fails later leaves the earlier rows."""
    from deploy import cli

    monkeypatch.setattr(sys, "argv", ["pdserve", "eval", "ppl", "--max-tokens", "48", "--context", "32",
                                      "--stride", "16", "--compare", "--matrix", "none/auto,none/fp8_e4m3"])
    cli.main()
    captured = capsys.readouterr()
    rows = [line for line in (captured.out + captured.err).splitlines()   # (not tqdm's "float32 w=none ..." bars)
            if re.match(r"float32 +none +(auto|fp8_e4m3) +\d", line)]
    assert len(rows) == 2 and rows[0].split()[2] == "auto" and rows[1].split()[2] == "fp8_e4m3", rows

    from evals import perplexity

    real = perplexity.run_config

    def fail_second(model, cfg, *args):
        if cfg.kv_cache_dtype == "fp8_e4m3":
            raise RuntimeError("the second run fails")
        return real(model, cfg, *args)

    monkeypatch.setattr(perplexity, "run_config", fail_second)
    with pytest.raises(RuntimeError, match="second run"):
        perplexity.command(model="smollm2-135m-instruct", dtype="float32", quantization="none", kv_cache_dtype="auto",
                           text=None, context=32, stride=16, max_tokens=48, decode_tokens=8, compare=True,
                           matrix="none/auto,none/fp8_e4m3", json_out=None)
    out = capsys.readouterr().out
    assert re.search(r"^float32 +none +auto +\d", out, re.M), out     # the first run's row is already out


def test_unknown_quantization_is_one_line_exit_2():
    result = pdserve_eval("--quantization", "int4")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve: error: --quantization"), result.stderr
    assert "none, int8, fp8" in lines[0]


@pytest.mark.parametrize("args,fragment", [
    (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype"),
    (["--dtype", "float64"], "--dtype"),
    (["--stride", "0"], "--stride"),
    (["--text", "/nonexistent/text.txt"], "--text"),
    (["--compare", "--quantization", "fp8"], "--compare"),
    (["--matrix", "none/auto"], "--matrix"),
    (["--compare", "--matrix", "int8/auto"], "--matrix"),
    (["--compare", "--matrix", "none/auto,int4/auto"], "--matrix: --quantization"),
    (["--compare", "--matrix", "none/auto,int8"], "--matrix"),
])
def test_bad_input_is_one_line_exit_2_in_process(args, fragment, monkeypatch, capsys):
    from deploy import cli

    monkeypatch.setattr(sys, "argv", ["pdserve", "eval", "ppl", *args])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("pdserve: error: " + fragment), err


def test_matrix_chooses_the_compared_configurations():
    from evals.perplexity import _configs

    configs = _configs("bfloat16", "none", "auto", True, "none/auto, int8/auto,none/fp8_e4m3")
    assert [(c.quantization, c.kv_cache_dtype) for c in configs] == [
        ("none", "auto"), ("int8", "auto"), ("none", "fp8_e4m3")]
    assert len(_configs("bfloat16", "none", "auto", True)) == 5
