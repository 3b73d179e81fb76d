"""Calibrated scales of an FP8 E4M3 KV cache: per layer and per KV head, stored beside the model.

The cache stores ``x / scale`` in E4M3 (max 448) and attention reads ``stored * scale``. The
scale of layer l, KV head h is ``KV_SCALE_MARGIN * amax / 448``, where amax is the largest |K|
(after RoPE) or |V| that head produced over a calibration pass of ``calibration.txt`` (about 450
tokens of held text shipped with pdserve, never the evaluation text). A margin of 2 costs E4M3
almost nothing (a float format keeps the same relative precision in every binade; only values
below 2**-9 of the range become subnormal) and keeps K/V a little larger than anything seen in
calibration from saturating.

The scales live in ``<model dir>/pdserve_kv_scales.json``, written once (atomically, under a
lock) by the first engine started with ``--kv-cache-dtype fp8_e4m3`` and read by every later one,
so a prefill and a decode worker of one model hold the same scales (the transfer compatibility
key carries their digest). A missing file is calibrated, never replaced by a silent 1.0; a
malformed one is an error naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.errors import UserError

KV_SCALES_FILE = "pdserve_kv_scales.json"
KV_SCALE_MARGIN = 2.0
FP8_E4M3_MAX = 448.0
CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
FORMAT_VERSION = 1


@dataclass(frozen=True)
class KVScales:
    """k_scale / v_scale: [num_layers][num_kv_heads] fp32 dequantization scales of an E4M3 cache."""

    k_scale: tuple[tuple[float, ...], ...]
    v_scale: tuple[tuple[float, ...], ...]
    calibration: str = ""     # how they were obtained (tokens, text, dtype), for people

    def digest(self) -> str:
        """16 hex digits of SHA-256 over the scales (exact float reprs): equal iff the scales are."""
        blob = json.dumps({"k": self.k_scale, "v": self.v_scale}, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def layer(self, l: int):
        """(k_scale, v_scale) of layer l as fp32 [num_kv_heads] tensors."""
        import torch

        return (torch.tensor(self.k_scale[l], dtype=torch.float32), torch.tensor(self.v_scale[l], dtype=torch.float32))

    def to_json(self) -> str:
        return json.dumps({"format_version": FORMAT_VERSION, "dtype": "fp8_e4m3", "calibration": self.calibration,
                           "k_scale": self.k_scale, "v_scale": self.v_scale}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, num_layers: int, num_kv_heads: int, where: str) -> "KVScales":
        """Parse and check; raises UserError naming ``where`` for anything malformed."""
        def bad(why: str) -> UserError:
            return UserError(f"--kv-cache-dtype fp8_e4m3: malformed KV scales in {where}: {why} "
                             f"(delete the file to recalibrate)")

        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise bad(f"not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or obj.get("format_version") != FORMAT_VERSION or obj.get("dtype") != "fp8_e4m3":
            raise bad(f"expected format_version {FORMAT_VERSION} and dtype fp8_e4m3")
        scales = []
        for name in ("k_scale", "v_scale"):
            rows = obj.get(name)
            if (not isinstance(rows, list) or len(rows) != num_layers
                    or any(not isinstance(r, list) or len(r) != num_kv_heads for r in rows)):
                raise bad(f"{name} must be [{num_layers} layers][{num_kv_heads} KV heads]")
            if any(not isinstance(x, (int, float)) or isinstance(x, bool) or not 0 < x < float("inf")
                   for r in rows for x in r):
                raise bad(f"{name} values must be positive finite numbers")
            scales.append(tuple(tuple(float(x) for x in r) for r in rows))
        return cls(scales[0], scales[1], str(obj.get("calibration", "")))


def scales_from_amax(k_amax, v_amax, calibration: str) -> KVScales:
    """[num_layers][num_kv_heads] amax of |K| and |V| -> scales (``KV_SCALE_MARGIN * amax / 448``)."""
    def conv(rows) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(max(float(a), 1e-6) * KV_SCALE_MARGIN / FP8_E4M3_MAX for a in r) for r in rows)

    return KVScales(conv(k_amax), conv(v_amax), calibration)


def load_or_calibrate(model_dir: Path, num_layers: int, num_kv_heads: int,
                      calibrate: Callable[[], KVScales]) -> KVScales:
    """The model's stored scales; if there are none, ``calibrate()`` and store them (once, locked)."""
    from engine.model_loader import _file_lock

    path = Path(model_dir) / KV_SCALES_FILE
    if path.is_file():
        return _read(path, num_layers, num_kv_heads)
    try:
        with _file_lock(Path(model_dir) / f".{KV_SCALES_FILE}.lock"):
            if path.is_file():   # another process calibrated while we waited
                return _read(path, num_layers, num_kv_heads)
            scales = calibrate()
            fd, tmp = tempfile.mkstemp(prefix=f".{KV_SCALES_FILE}.", dir=model_dir)
            with os.fdopen(fd, "w") as f:
                f.write(scales.to_json())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
            return scales
    except PermissionError as e:
        raise UserError(f"--kv-cache-dtype fp8_e4m3: no KV scales in {model_dir} and it is not writable "
                        f"({e.strerror}); run once where the model directory is writable") from None


def _read(path: Path, num_layers: int, num_kv_heads: int) -> KVScales:
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"--kv-cache-dtype fp8_e4m3: cannot read {path}: {e.strerror}") from None
    return KVScales.from_json(text, num_layers, num_kv_heads, str(path))
