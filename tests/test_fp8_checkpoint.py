"""FP8 checkpoints (engine/quantization/checkpoint.py): E4M3 weights with ``weight_scale`` load
as they are under ``--quantization fp8`` (the same logits as quantizing the bf16 model at load),
dequantized under the other methods; missing or malformed scales are a one-line error, exit 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import UserError
from engine.quantization.checkpoint import check_fp8_checkpoint
from kernels.linear import quantize_fp8_per_channel

REPO = Path(__file__).resolve().parents[1]
LINEAR = "model.layers.0.mlp.down_proj"


def tiny_checkpoint(tmp_path: Path, scale: torch.Tensor | None, *, weight_dtype=torch.float8_e4m3fn) -> Path:
    """A directory with a config.json and one safetensors file holding one [4, 8] linear."""
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text("{}")
    tensors = {f"{LINEAR}.weight": torch.randn(4, 8).to(weight_dtype), "model.norm.weight": torch.ones(8)}
    if scale is not None:
        tensors[f"{LINEAR}.weight_scale"] = scale
    save_file(tensors, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("scale", [torch.ones(4), torch.ones(4, 1), torch.tensor(0.5), torch.ones(1).bfloat16()])
def test_well_formed_scales_pass(tmp_path, scale):
    check_fp8_checkpoint(tiny_checkpoint(tmp_path, scale))


@pytest.mark.parametrize("scale,weight_dtype,fragment", [
    (None, torch.float8_e4m3fn, f"{LINEAR}.weight_scale is missing"),
    (torch.ones(3), torch.float8_e4m3fn, "has shape [3]; allowed [], [1], [4] or [4, 1]"),
    (torch.ones(4, 2), torch.float8_e4m3fn, "has shape [4, 2]"),
    (torch.tensor([1.0, -1.0, 1.0, 1.0]), torch.float8_e4m3fn, "not finite and positive"),
    (torch.tensor([1.0, float("nan"), 1.0, 1.0]), torch.float8_e4m3fn, "not finite and positive"),
    (torch.ones(4, dtype=torch.int32), torch.float8_e4m3fn, "has dtype int32; allowed float32, bfloat16, float16"),
    (torch.ones(4), torch.float32, "has no float8_e4m3fn weight beside it"),
])
def test_missing_or_malformed_scales_are_refused_naming_the_tensor(tmp_path, scale, weight_dtype, fragment):
    with pytest.raises(UserError) as e:
        check_fp8_checkpoint(tiny_checkpoint(tmp_path, scale, weight_dtype=weight_dtype))
    assert str(e.value).startswith("--model: FP8 checkpoint") and fragment in str(e.value), str(e.value)


def test_cli_prints_one_line_and_exits_2_before_loading(tmp_path):
    d = tiny_checkpoint(tmp_path, torch.tensor([1.0, 0.0, 1.0, 1.0]))
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "eval", "ppl", "--model", str(d), "--max-tokens", "8"],
                       cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "--model: FP8 checkpoint" in lines[0] and "weight_scale holds a value that is not finite" in lines[0]


@pytest.fixture(scope="module")
def fp8_model_dir(model_path, tmp_path_factory) -> Path:
    """The bundled model written as an FP8 checkpoint: every decoder linear that fp8 quantizes E4M3 +
    weight_scale [N, 1]; those it keeps in the model dtype (apply.fp8_keeps_dense) stay bf16, as
    in a checkpoint made for this policy (vLLM's ``ignore`` list)."""
    from engine.quantization.apply import fp8_keeps_dense

    d = tmp_path_factory.mktemp("fp8ckpt")
    for f in model_path.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "pdserve_kv_scales.json":
            shutil.copy(f, d / f.name)
    out = {}
    for name, t in load_file(str(model_path / "model.safetensors")).items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight") and \
                not fp8_keeps_dense(name.removesuffix(".weight"), 30):
            q, s = quantize_fp8_per_channel(t.bfloat16())
            out[name], out[name.removesuffix("weight") + "weight_scale"] = q, s[:, None]
        else:
            out[name] = t.bfloat16()
    save_file(out, str(d / "model.safetensors"))
    return d


@pytest.mark.model
def test_fp8_checkpoint_runs_as_stored_and_dequantized(model_path, fp8_model_dir):
    from engine.batch import SeqChunk
    from engine.model_runner import ModelRunner

    ids = list(range(100, 140))

    def logits(path, quantization):
        runner = ModelRunner(str(path), num_blocks=4, dtype=torch.bfloat16, quantization=quantization)
        return runner.forward([SeqChunk(ids, 0, [0, 1, 2], len(ids))])

    from_bf16 = logits(model_path, "fp8")          # quantized at load
    from_ckpt = logits(fp8_model_dir, "fp8")       # the checkpoint's E4M3 values and scales, as stored
    assert torch.equal(from_ckpt, from_bf16)
    dequantized = logits(fp8_model_dir, "none")    # the same weights dequantized, bf16 activations
    assert float((dequantized - from_ckpt).abs().max()) < 0.1 * float(from_ckpt.abs().max())
    assert (dequantized.argmax(-1) == from_ckpt.argmax(-1)).float().mean() > 0.8


def test_a_fused_linear_takes_its_parts_weights_and_scales_in_order(monkeypatch):
    from engine.models import llama
    from engine.quantization.apply import checkpoint_weight
    from engine.quantization.checkpoint import Fp8Weight

    monkeypatch.setattr(llama, "FUSED_PROJECTIONS", {"mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
                        raising=False)
    parts = {f"model.layers.3.mlp.{p}": Fp8Weight(*quantize_fp8_per_channel(torch.randn(n, 8)))
             for p, n in (("gate_proj", 4), ("up_proj", 6))}
    fused = checkpoint_weight(parts, "model.layers.3.mlp.gate_up_proj")
    gate, up = parts["model.layers.3.mlp.gate_proj"], parts["model.layers.3.mlp.up_proj"]
    assert fused.qweight.shape == (10, 8) and torch.equal(fused.scale, torch.cat([gate.scale, up.scale]))
    assert torch.equal(fused.qweight.float(), torch.cat([gate.qweight, up.qweight]).float())
    assert checkpoint_weight(parts, "model.layers.3.mlp.gate_proj") is gate
    assert checkpoint_weight({}, "model.layers.3.mlp.gate_up_proj") is None
