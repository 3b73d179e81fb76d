"""The FP8 KV scales file (pdserve_kv_scales.json, engine/quantization/kv_scales.py) when it is
bad: a one-line UserError naming the file (exit 2 from the CLI), never a traceback and never
silently wrong output. Each case was found by a break-it pass (2026-12-06) as a traceback or as
wrong text: a file that is not UTF-8, nested too deep, a directory in its place, a read-only file
system (EROFS is not a PermissionError), offsets of another head_dim (the fused loop read them
misindexed), scales fp32 cannot hold and offsets fp16 cannot hold (garbage text), ``true`` read as
format 1, and `pdserve serve` printing Ray's wrapped traceback for a worker's bad file."""

from __future__ import annotations

import copy
import errno
import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from engine.errors import UserError
from engine.quantization.kv_scales import KV_SCALES_FILE, calibrate_kv, load_or_calibrate

LAYERS, HKV, D = 3, 2, 8


def _good() -> dict:
    k = torch.linspace(-1, 1, 8)[:, None, None].expand(8, HKV, D) + torch.arange(D) / D
    return json.loads(calibrate_kv([k] * LAYERS, [k * 3] * LAYERS, "test").to_json())


def _never() -> None:
    pytest.fail("must not recalibrate over a bad file")


def _expect_user_error(tmp_path: Path, match: str | None = None) -> UserError:
    with pytest.raises(UserError, match=match) as e:
        load_or_calibrate(tmp_path, LAYERS, HKV, D, _never)
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)
    return e.value


def test_a_file_that_is_not_utf8_is_a_user_error(tmp_path):
    (tmp_path / KV_SCALES_FILE).write_bytes(json.dumps(_good()).encode("utf-16"))   # BOM ff fe
    _expect_user_error(tmp_path)


def test_deeply_nested_json_is_a_user_error(tmp_path):
    (tmp_path / KV_SCALES_FILE).write_text("[" * 200_000 + "]" * 200_000)
    _expect_user_error(tmp_path)


def test_a_directory_in_the_files_place_is_a_user_error(tmp_path):
    (tmp_path / KV_SCALES_FILE).mkdir()
    _expect_user_error(tmp_path)


def test_a_read_only_file_system_is_a_user_error(tmp_path, monkeypatch):
    """EROFS (a read-only mount; root ignores mode bits, so chmod does not show it) is not a PermissionError."""
    import engine.model_loader as model_loader

    @contextmanager
    def read_only_lock(path):
        raise OSError(errno.EROFS, "Read-only file system", str(path))
        yield

    monkeypatch.setattr(model_loader, "_file_lock", read_only_lock)
    (tmp_path / KV_SCALES_FILE).write_text(json.dumps({"format_version": 1}))   # to recalibrate
    with pytest.raises(UserError) as e:
        load_or_calibrate(tmp_path, LAYERS, HKV, D, lambda: pytest.fail("cannot store it"))
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name,value", [("k_scale", 1e-50), ("v_scale", 1e50)])
def test_scales_that_fp32_cannot_hold_are_refused(tmp_path, name, value):
    """1e-50 is 0 in fp32 (the cache divides by it), 1e50 is inf: both passed "positive finite"."""
    obj = _good()
    obj[name] = [[value] * HKV] * LAYERS
    (tmp_path / KV_SCALES_FILE).write_text(json.dumps(obj))
    _expect_user_error(tmp_path, name)


def test_offsets_fp16_cannot_hold_are_refused(tmp_path):
    """The docstring promises offsets every compute dtype holds exactly; 1e5 is inf in fp16."""
    obj = _good()
    obj["k_offset"] = [[[1e5] * D] * HKV] * LAYERS
    (tmp_path / KV_SCALES_FILE).write_text(json.dumps(obj))
    _expect_user_error(tmp_path, "k_offset")


def _model_copy(model_path: Path, into: Path, scales: dict) -> Path:
    into.mkdir()
    for f in Path(model_path).iterdir():
        if f.name != KV_SCALES_FILE and not f.name.startswith("."):
            (into / f.name).symlink_to(f)
    (into / KV_SCALES_FILE).write_text(json.dumps(scales))
    return into


@pytest.mark.model
@pytest.mark.parametrize("decoder_loop", [True, False])
@pytest.mark.parametrize("factor", [0.5, 2])
def test_offsets_of_another_head_dim_are_refused_at_load(model_path, tmp_path, decoder_loop, factor):
    """The bundled model (head_dim 64) with offsets of head_dim 32 or 128 (same layers and KV
    heads): today load accepts them; the fused loop then reads the [3, 32] offsets as if they
    were [3, 64] (wrong logits, no error) and the Python loop fails on broadcasting."""
    from engine.model_runner import ModelRunner

    ModelRunner(model_path, num_blocks=4, dtype=torch.float32, kv_cache_dtype="fp8_e4m3")   # calibrated once
    obj = json.loads((Path(model_path) / KV_SCALES_FILE).read_text())
    bad = copy.deepcopy(obj)
    for key in ("k_offset", "v_offset"):
        bad[key] = [[h[:32] if factor < 1 else h + h for h in layer] for layer in obj[key]]
    d = _model_copy(model_path, tmp_path / "model", bad)
    with pytest.raises(UserError, match="head_dim|64") as e:
        ModelRunner(d, num_blocks=4, dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3", decoder_loop=decoder_loop)
    assert str(d) in str(e.value) and "\n" not in str(e.value)


def test_format_version_true_is_not_format_1(tmp_path):
    obj = _good()
    obj["format_version"] = True
    (tmp_path / KV_SCALES_FILE).write_text(json.dumps(obj))
    _expect_user_error(tmp_path, "format_version 2")


def test_offsets_calibration_could_not_have_written_are_refused(tmp_path):
    """0.1 is not a bf16 number: engines of different compute dtypes would subtract different offsets."""
    obj = _good()
    obj["v_offset"][0][0][0] = 0.1
    (tmp_path / KV_SCALES_FILE).write_text(json.dumps(obj))
    _expect_user_error(tmp_path, "v_offset values must be numbers bf16 and fp16 both hold exactly")


@pytest.mark.model
@pytest.mark.ray
def test_serve_reports_a_workers_bad_scales_file_in_one_line(ray_session, model_path, tmp_path):
    """The file is read inside the worker actors; the driver gets Ray's task error, whose text
    is the actor's traceback: ClusterController.start re-raises the worker's own UserError."""
    from deploy.cluster import ClusterSpec
    from deploy.local_cluster import LocalServing
    from router.app import RouterConfig

    d = _model_copy(model_path, tmp_path / "model", _good())   # 3 layers x 2 heads x 8: not this model's shape
    (d / KV_SCALES_FILE).write_text((d / KV_SCALES_FILE).read_text()[:-20])   # and truncated
    spec = ClusterSpec(model=str(d), mode="agg", num_decode=1, num_blocks=64, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(UserError) as e:
        with LocalServing(spec, RouterConfig(port=0, http_port=None, mode="agg")):
            pass
    message = str(e.value)
    assert "\n" not in message and str(d) in message and "not JSON" in message, message


def _checkpoint(into: Path, seed: int) -> None:
    from safetensors.torch import save_file

    into.mkdir(exist_ok=True)
    (into / "config.json").write_text('{"num_hidden_layers": 3}')
    save_file({"w": torch.randn(512, 256, generator=torch.Generator().manual_seed(seed))}, into / "model.safetensors")


def test_scales_calibrated_on_other_weights_are_recalibrated(tmp_path, caplog):
    """A checkpoint replaced in place (a fine-tune written over model.safetensors) must not keep
    the old weights' KV scales: the file records the weights' fingerprint and a mismatch
    recalibrates, with a warning. Unchanged weights reuse the file; so does a file from before
    fingerprints were recorded."""
    from engine.quantization.kv_scales import KVScales, weights_fingerprint

    _checkpoint(tmp_path, seed=0)
    calls = []

    def calibrate() -> KVScales:
        calls.append(1)
        return KVScales.from_dict(_good(), LAYERS, HKV, D, "test")

    first = load_or_calibrate(tmp_path, LAYERS, HKV, D, calibrate)
    stored = json.loads((tmp_path / KV_SCALES_FILE).read_text())
    assert len(calls) == 1 and stored["weights"] == first.weights == weights_fingerprint(tmp_path)
    assert load_or_calibrate(tmp_path, LAYERS, HKV, D, _never) == first      # same weights: read, not recalibrated

    _checkpoint(tmp_path, seed=1)                                            # the checkpoint replaced in place
    assert weights_fingerprint(tmp_path) != first.weights
    with caplog.at_level("WARNING", logger="engine.quantization.kv_scales"):
        second = load_or_calibrate(tmp_path, LAYERS, HKV, D, calibrate)
    assert len(calls) == 2 and second.weights == weights_fingerprint(tmp_path)
    assert "calibrated on other weights" in caplog.text
    assert json.loads((tmp_path / KV_SCALES_FILE).read_text())["weights"] == second.weights

    legacy = _good()                                                         # no "weights": used as it is
    (tmp_path / KV_SCALES_FILE).write_text(json.dumps(legacy))
    caplog.clear()
    with caplog.at_level("WARNING", logger="engine.quantization.kv_scales"):
        assert load_or_calibrate(tmp_path, LAYERS, HKV, D, _never).weights == ""
    assert "records no weights fingerprint" in caplog.text and "remove it to recalibrate" in caplog.text
    legacy["weights"] = 7
    (tmp_path / KV_SCALES_FILE).write_text(json.dumps(legacy))
    _expect_user_error(tmp_path, "weights must be the fingerprint")


def test_weights_fingerprint_reads_samples_not_the_whole_file(tmp_path):
    """Every 4 KiB sample and the header count; a config change counts; nothing else is read."""
    from engine.quantization.kv_scales import weights_fingerprint

    _checkpoint(tmp_path, seed=0)
    base = weights_fingerprint(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    data[header_end] ^= 0xFF                   # the first byte of the data: inside the first sample
    weights.write_bytes(bytes(data))
    assert weights_fingerprint(tmp_path) != base
    data[header_end] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert weights_fingerprint(tmp_path) == base
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 4}')
    assert weights_fingerprint(tmp_path) != base


def test_weights_that_cannot_be_read_are_named(tmp_path):
    (tmp_path / "model.safetensors").mkdir()                                 # a directory in a weight file's place
    with pytest.raises(UserError, match=r"cannot read .*model\.safetensors .*fix or remove it") as e:
        load_or_calibrate(tmp_path, LAYERS, HKV, D, _never)
    assert "\n" not in str(e.value)


def test_a_bogus_header_length_is_not_read_as_a_header(tmp_path):
    """A file whose first 8 bytes claim a huge header is hashed from its samples, not read whole."""
    from engine.quantization.kv_scales import weights_fingerprint

    (tmp_path / "model.safetensors").write_bytes((2 ** 62).to_bytes(8, "little") + bytes(range(256)) * 400)
    first = weights_fingerprint(tmp_path)
    assert len(first) == 16 and weights_fingerprint(tmp_path) == first


def test_a_failed_store_leaves_no_temp_file(tmp_path, monkeypatch):
    from engine.quantization.kv_scales import KVScales

    def refuse(src, dst):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("engine.quantization.kv_scales.os.replace", refuse)
    with pytest.raises(UserError, match="cannot be stored there .Read-only file system.*same"):
        load_or_calibrate(tmp_path, LAYERS, HKV, D, lambda: KVScales.from_dict(_good(), LAYERS, HKV, D, "test"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{KV_SCALES_FILE}.lock"]
