"""`pdserve generate` end to end as a subprocess: answers, JSON output, and every bad input
(one line on stderr, exit status 2, no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pdserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "deploy.cli", "generate", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve: error:"), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.model
def test_chat_prompt_gets_a_sensible_answer(model_path):
    # "Answer in one sentence.": the bare question's first token is a near-tie ("The" 25.33 vs
    # "L" 25.24 in fp32), and a bf16 rounding change flipped it into a French ramble; with the
    # instruction the top two first tokens are "The" and "Paris", 1.5 nats apart, fp32 and bf16.
    result = pdserve("--model", "smollm2-135m-instruct", "--chat", "--max-tokens", "24",
                     "What is the capital of France? Answer in one sentence.")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.model
def test_prompts_file_json_one_object_per_prompt_in_order(model_path, tmp_path):
    """Also with a budget below the offline engine's 256 sequences: fewer run at a time (it was a traceback)."""
    from engine.model_loader import load_tokenizer

    prompts = ["What is the capital of France?", "Count from one to ten.", "Name a color."]
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    result = pdserve("--chat", "--json", "--max-tokens", "8", "--prompts-file", str(f), "--max-num-batched-tokens", "16")
    assert result.returncode == 0, result.stderr
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(objects) == 3
    tok = load_tokenizer(model_path)
    for prompt, obj in zip(prompts, objects):
        assert set(obj) == {"prompt_token_ids", "token_ids", "text", "finish_reason"}
        expected = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           tokenize=True)
        assert obj["prompt_token_ids"] == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        if obj["finish_reason"] == "stop":
            assert obj["token_ids"][-1] == 2 and len(obj["token_ids"]) <= 8
        else:
            assert obj["finish_reason"] == "length" and len(obj["token_ids"]) == 8
        assert obj["text"] == tok.decode(obj["token_ids"], skip_special_tokens=True)


@pytest.mark.model
def test_prompt_longer_than_the_context(model_path, tmp_path):
    f = tmp_path / "long.jsonl"
    f.write_text(json.dumps({"prompt": "hello " * 9000}) + "\n")
    assert_user_error(pdserve("--prompts-file", str(f)), "prompt", "8192")


@pytest.mark.parametrize("args, fragments", [
    (["--max-tokens", "0", "hi"], ["max_tokens", ">= 1"]),
    (["--temperature", "-0.5", "hi"], ["temperature", ">= 0"]),
    (["--top-p", "0", "hi"], ["top_p", "(0, 1]"]),
    (["--top-p", "1.5", "hi"], ["top_p", "(0, 1]"]),
    ([""], ["prompt", "empty"]),
    (["--model", "no-such-model", "hi"], ["unknown model", "smollm2-135m-instruct"]),
    (["--model", "/nonexistent/dir", "hi"], ["unknown model", ".gguf"]),
    ([], ["PROMPT", "--prompts-file"]),
])
def test_bad_input_is_one_line_exit_2(args, fragments):
    assert_user_error(pdserve(*args), *fragments)


def test_unreadable_or_malformed_prompts_file(tmp_path):
    assert_user_error(pdserve("--prompts-file", str(tmp_path / "missing.jsonl")), "cannot read")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    assert_user_error(pdserve("--prompts-file", str(bad)), "bad.jsonl:2", "not JSON")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"prompt": ""}\n')
    assert_user_error(pdserve("--prompts-file", str(empty)), "prompt", "empty")


def test_not_a_model_path(tmp_path):
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"\0")
    assert_user_error(pdserve("--model", str(weights), "hi"), ".gguf")
    assert_user_error(pdserve("--model", str(tmp_path), "hi"), "config.json")


def test_unsupported_architecture(tmp_path):
    from safetensors.torch import save_file
    import torch

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    save_file({"wte.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    assert_user_error(pdserve("--model", str(tmp_path), "hi"), "unsupported architecture", "LlamaForCausalLM")
