"""Model resolution and the GGUF import cache (atomic under concurrent processes), config errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from engine.errors import UserError
from engine.model_config import ModelConfig
from engine.model_loader import resolve_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bundled_model_resolves_to_hf_directory(model_path):
    assert (model_path / "config.json").is_file()
    assert any(model_path.glob("*.safetensors")) and (model_path / "tokenizer.json").is_file()
    assert resolve_model("smollm2-135m-instruct") == model_path  # cached: the second call is instant


def test_unknown_model_name_names_the_allowed_values():
    with pytest.raises(UserError, match="unknown model 'no-such-model'.*smollm2-135m-instruct"):
        resolve_model("no-such-model")


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_non_gguf_file_is_rejected(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(UserError, match=r"not a \.gguf file"):
        resolve_model(str(f))


def test_unsupported_architecture_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2}))
    save_file({"wte.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        ModelConfig.from_pretrained(resolve_model(str(tmp_path)))


def test_unreadable_safetensors_is_a_user_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="model.safetensors is not a readable safetensors file"):
        resolve_model(str(tmp_path))


_RACER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import engine.model_loader as ml

    def slow_convert(gguf, out):
        with open(os.environ["LOG"], "a") as f:
            f.write(f"convert {os.getpid()}\\n")
        time.sleep(1.0)
        (out / "config.json").write_text("{}")

    ml._convert_gguf = slow_convert
    print(ml.import_gguf(Path(sys.argv[1])))
""")


def test_gguf_import_is_done_once_when_processes_race(tmp_path):
    """Two processes import the same GGUF at once: one converts, both get the complete directory.

    The conversion itself is replaced by a slow stub: this checks the lock/rename protocol only
    (the real import is exercised by the model_path fixture).
    """
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    env = dict(os.environ, PDSERVE_CACHE_DIR=str(tmp_path / "cache"), LOG=str(tmp_path / "log"),
               PYTHONPATH=REPO)
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(gguf)], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    target = tmp_path / "cache" / "models" / "tiny"
    assert outs == [str(target), str(target)]
    assert (tmp_path / "log").read_text().count("convert") == 1
    assert (target / "config.json").is_file()
    leftovers = [p.name for p in (tmp_path / "cache" / "models").iterdir() if ".tmp-" in p.name]
    assert leftovers == []

