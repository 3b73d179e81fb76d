"""Calibrated parameters of an FP8 E4M3 KV cache: per layer and KV head, stored beside the model.

The cache stores ``(x - offset) / scale`` in E4M3 (max 448) for K (after RoPE) and V, and
attention reads ``stored * scale``:

- **offset** ([head_dim] per layer and KV head): the mean of that head's K (or V) over a
  calibration pass. Attention is unchanged by it: every key of a sequence loses the same vector,
  which shifts a query's scores by one constant (softmax removes it); every value loses the same
  vector, and the output (a convex combination of values) is that vector short, so
  engine/models/llama.py adds the V offset back to the attention output. What changes is what
  E4M3's 3 mantissa bits are spent on: a channel that carries a large constant (K of the bundled
  model has channels whose mean is most of their range) is rounded relative to the part that
  varies. This is SageAttention's "smooth K" (Zhang et al. 2024), here calibrated once instead of
  computed per block, and extended to V. Offsets are rounded to values bf16 and fp16 hold exactly,
  so engines of any compute dtype subtract the same numbers. Measured on the bundled model (bf16,
  WikiText-2, 8,192 tokens, context 1024, stride 512; the torch reference): per-head scales alone
  +1.14% perplexity, with K offsets +0.83%, with K and V offsets +0.74%.
- **scale** (per layer and KV head): ``KV_SCALE_MARGIN * amax / 448``, where amax is the largest
  |x - offset| of that head in the calibration pass. A margin of 2 costs E4M3 almost nothing (a
  float format keeps the same relative precision in every binade; only values below 2**-9 of the
  range become subnormal) and keeps K/V a little larger than anything seen in calibration from
  saturating.

The calibration pass reads ``calibration.txt`` (about 450 tokens of held text shipped with pdserve,
never the evaluation text). The parameters live in ``<model dir>/pdserve_kv_scales.json``,
written once (atomically, under a lock) by the first engine started with ``--kv-cache-dtype
fp8_e4m3`` and read by every later one, so a prefill and a decode worker of one model hold the
same parameters (the transfer compatibility key carries their digest). The file records a
fingerprint of the weights it was calibrated on (``weights_fingerprint``); a file whose fingerprint
differs from the weights now in the directory (a checkpoint replaced in place, say by a fine-tune)
is recalibrated with a warning, never used stale; a file without one (written before pdserve
recorded it) is used as it is, with a warning that says how to get one recorded. A missing file is
calibrated, never replaced by a silent 1.0; a file of format 1 (scales without offsets, from an
older pdserve) is recalibrated; a malformed one (shapes other than the model's, scales fp32 cannot
hold, offsets bf16 or fp16 cannot hold exactly, not UTF-8 JSON) or one that cannot be stored is
an error naming the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from engine.errors import UserError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

KV_SCALES_FILE = "pdserve_kv_scales.json"
KV_SCALE_MARGIN = 2.0
FP8_E4M3_MAX = 448.0
CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
FORMAT_VERSION = 2
OFFSET_MIN = 2.0 ** -14
OFFSET_MAX = 65280.0
"""Offsets smaller than OFFSET_MIN (fp16's smallest normal) are 0 and larger than OFFSET_MAX (the
largest bf16 number fp16 holds) are clamped: every compute dtype holds the rest exactly."""
FP32_MIN_NORMAL, FP32_MAX = 2.0 ** -126, 3.4028234663852886e38
"""A scale must be a normal fp32 number: the cache divides by it in fp32."""

Rows = tuple[tuple[float, ...], ...]             # [num_layers][num_kv_heads]
Offsets = tuple[tuple[tuple[float, ...], ...], ...]   # [num_layers][num_kv_heads][head_dim]


@dataclass(frozen=True)
class KVScales:
    """An E4M3 cache's quantization parameters (the cache holds ``(x - offset) / scale``).

    k_scale / v_scale: [num_layers][num_kv_heads] fp32 dequantization scales.
    k_offset / v_offset: [num_layers][num_kv_heads][head_dim] offsets subtracted before
    quantization (empty tuples: none, as in tests that need only scales).
    """

    k_scale: Rows
    v_scale: Rows
    k_offset: Offsets = ()
    v_offset: Offsets = ()
    calibration: str = ""     # how they were obtained (tokens, text, dtype), for people
    weights: str = ""         # weights_fingerprint of the model calibrated on ("": not recorded)

    def digest(self) -> str:
        """16 hex digits of SHA-256 over scales and offsets (exact float reprs): equal iff they are."""
        blob = json.dumps({"k": self.k_scale, "v": self.v_scale, "ko": self.k_offset, "vo": self.v_offset},
                          separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def layer(self, l: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """(k_scale, v_scale) of layer l as fp32 [num_kv_heads] tensors."""
        import torch

        return (torch.tensor(self.k_scale[l], dtype=torch.float32), torch.tensor(self.v_scale[l], dtype=torch.float32))

    def layer_offsets(self, l: int) -> tuple["torch.Tensor", "torch.Tensor"] | None:
        """(k_offset, v_offset) of layer l as fp32 [num_kv_heads, head_dim] tensors, or None without offsets."""
        import torch

        if not self.k_offset:
            return None
        return (torch.tensor(self.k_offset[l], dtype=torch.float32), torch.tensor(self.v_offset[l], dtype=torch.float32))

    def to_json(self) -> str:
        fields = {"format_version": FORMAT_VERSION, "dtype": "fp8_e4m3", "calibration": self.calibration,
                  **({"weights": self.weights} if self.weights else {}),
                  "k_scale": self.k_scale, "v_scale": self.v_scale, "k_offset": self.k_offset, "v_offset": self.v_offset}

        def value(v: object) -> str:   # a list one layer a line: 30 layers x 3 heads x 64 channels stay readable
            if not isinstance(v, tuple):
                return json.dumps(v)
            return "[\n" + ",\n".join("  " + json.dumps(layer) for layer in v) + "\n ]"

        return "{\n" + ",\n".join(f' "{k}": {value(v)}' for k, v in fields.items()) + "\n}\n"

    @classmethod
    def from_dict(cls, obj: dict, num_layers: int, num_kv_heads: int, head_dim: int, where: str) -> "KVScales":
        """A parsed file (format 2), checked against the model's shape; raises UserError naming
        ``where`` for anything malformed: shapes, scales that are not normal fp32 numbers, offsets
        that bf16 or fp16 cannot hold exactly."""
        def bad(why: str) -> UserError:
            return _malformed(where, why)

        if obj.get("format_version") != FORMAT_VERSION or obj.get("dtype") != "fp8_e4m3":
            raise bad(f"expected format_version {FORMAT_VERSION} and dtype fp8_e4m3")
        scales = []
        for name in ("k_scale", "v_scale"):
            rows = obj.get(name)
            if (not isinstance(rows, list) or len(rows) != num_layers
                    or any(not isinstance(r, list) or len(r) != num_kv_heads for r in rows)):
                raise bad(f"{name} must be [{num_layers} layers][{num_kv_heads} KV heads]")
            if any(not _number(x) or not FP32_MIN_NORMAL <= x <= FP32_MAX for r in rows for x in r):
                raise bad(f"{name} values must be positive finite numbers fp32 holds (2**-126 to 3.4e38)")
            scales.append(tuple(tuple(float(x) for x in r) for r in rows))
        offsets = []
        for name in ("k_offset", "v_offset"):
            rows = obj.get(name)
            if (not isinstance(rows, list) or len(rows) != num_layers
                    or any(not isinstance(r, list) or len(r) != num_kv_heads for r in rows)
                    or any(not isinstance(h, list) or len(h) != head_dim for r in rows for h in r)):
                raise bad(f"{name} must be [{num_layers} layers][{num_kv_heads} KV heads][{head_dim} channels]")
            if any(not _number(x) or abs(x) == float("inf") or x != x for r in rows for h in r for x in h):
                raise bad(f"{name} values must be finite numbers")
            if not _exact_in_bf16_and_fp16(rows):
                raise bad(f"{name} values must be numbers bf16 and fp16 both hold exactly (as calibration writes them)")
            offsets.append(tuple(tuple(tuple(float(x) for x in h) for h in r) for r in rows))
        weights = obj.get("weights", "")
        if not isinstance(weights, str):
            raise bad("weights must be the fingerprint string calibration writes")
        return cls(scales[0], scales[1], offsets[0], offsets[1], str(obj.get("calibration", "")), weights)


def calibrate_kv(keys: Sequence["torch.Tensor"], values: Sequence["torch.Tensor"], calibration: str) -> KVScales:
    """The parameters from one calibration pass: keys[l] / values[l] [tokens, num_kv_heads,
    head_dim] (any float dtype) are layer l's K (after RoPE) and V. Offsets: the per-channel mean
    over tokens, rounded to a value bf16 and fp16 both hold exactly (0 below OFFSET_MIN); scales:
    ``KV_SCALE_MARGIN * amax(|x - offset|) / 448`` per head (a zero amax is taken as 1e-6)."""
    import torch

    def offset(x: torch.Tensor) -> torch.Tensor:
        # (any constant is a valid offset: one beyond fp16's range is clamped to its largest bf16 number)
        mean = x.float().mean(dim=0).to(torch.bfloat16).float().clamp(-OFFSET_MAX, OFFSET_MAX)   # [Hkv, D]
        return torch.where(mean.abs() < OFFSET_MIN, torch.zeros_like(mean), mean)

    def scale(x: torch.Tensor, off: torch.Tensor) -> tuple[float, ...]:
        amax = (x.float() - off).abs().amax(dim=(0, 2)).clamp_min(1e-6)          # [Hkv]
        return tuple(float(a) * KV_SCALE_MARGIN / FP8_E4M3_MAX for a in amax)

    k_off = [offset(k) for k in keys]
    v_off = [offset(v) for v in values]
    return KVScales(tuple(scale(k, o) for k, o in zip(keys, k_off)), tuple(scale(v, o) for v, o in zip(values, v_off)),
                    tuple(_nested(o) for o in k_off), tuple(_nested(o) for o in v_off), calibration)


def weights_fingerprint(model_dir: Path) -> str:
    """16 hex digits of SHA-256 over what identifies a checkpoint's weights: config.json, and for
    each ``*.safetensors`` file its name, size, header (tensor names, dtypes, shapes, offsets) and
    64 samples of 4 KiB spread evenly over its data (the whole data when smaller than that). It
    changes when a checkpoint is replaced (a fine-tune or another quantization moves every sample),
    not necessarily for a single edited byte; it reads ~256 KiB, not the weights. Raises OSError
    when a file cannot be read."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    config = model_dir / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"\0{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            head = f.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
            if header_len > min(_MAX_HEADER, size - 8):   # not a safetensors header (safetensors caps it at 100 MB)
                header_len = 0
            h.update(head + f.read(header_len))
            start = f.tell()
            data = size - start
            step = max(_SAMPLE, data // _SAMPLES)
            for offset in range(start, size, step):
                f.seek(offset)
                h.update(f.read(_SAMPLE))
    return h.hexdigest()[:16]


_SAMPLE, _SAMPLES = 4096, 64
_MAX_HEADER = 100_000_000


def load_or_calibrate(model_dir: Path, num_layers: int, num_kv_heads: int, head_dim: int,
                      calibrate: Callable[[], KVScales]) -> KVScales:
    """The model's stored parameters; if there are none, only format 1's, or ones calibrated on
    other weights (their fingerprint differs from ``weights_fingerprint(model_dir)``),
    ``calibrate()`` and store them with the fingerprint (once, locked). UserError naming the file
    for one that is malformed, unreadable or cannot be written (a read-only file system, a
    directory in its place)."""
    from engine.model_loader import _file_lock

    path = Path(model_dir) / KV_SCALES_FILE
    try:
        weights = weights_fingerprint(Path(model_dir))
    except OSError as e:
        raise UserError(f"--kv-cache-dtype fp8_e4m3: cannot read {e.filename or model_dir} to check the KV scales "
                        f"against the weights ({e.strerror or e}): fix or remove it") from None
    stored = _current(_read(path, num_layers, num_kv_heads, head_dim), weights, path, quiet=True)
    if stored is not None:
        return stored
    with ExitStack() as locked:
        try:
            locked.enter_context(_file_lock(Path(model_dir) / f".{KV_SCALES_FILE}.lock"))
        except OSError as e:   # PermissionError, a read-only file system (EROFS), ...
            raise _cannot_store(model_dir, e) from None
        # another process may have calibrated while we waited; one that recalibrates says why, once
        stored = _current(_read(path, num_layers, num_kv_heads, head_dim), weights, path)
        if stored is not None:
            return stored
        scales = replace(calibrate(), weights=weights)
        try:
            _write_atomically(path, scales.to_json())
        except OSError as e:
            raise _cannot_store(model_dir, e) from None
        return scales


def _write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part (a temp file, renamed; removed on failure)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _cannot_store(model_dir: Path, e: OSError) -> UserError:
    return UserError(f"--kv-cache-dtype fp8_e4m3: no current KV scales in {model_dir} (none, or calibrated on other "
                     f"weights) and they cannot be stored there ({e.strerror or e}); run once where the model "
                     f"directory is writable, or copy {KV_SCALES_FILE} from a machine whose weights are the same")


def _current(stored: KVScales | None, weights: str, path: Path, quiet: bool = False) -> KVScales | None:
    """``stored`` unless it records a fingerprint other than ``weights`` (None: recalibrate). One
    that records none is used, with a warning (``quiet`` or not: it is returned on the first read)."""
    if stored is not None and not stored.weights:
        log.warning("%s records no weights fingerprint (written by an older pdserve), so it cannot be checked "
                    "against the weights now in %s: using it as it is; remove it to recalibrate and record one",
                    path, path.parent)
    if stored is None or not stored.weights or stored.weights == weights:
        return stored
    if not quiet:
        log.warning("%s was calibrated on other weights (fingerprint %s, the directory's weights now %s): "
                    "recalibrating the FP8 KV scales", path, stored.weights, weights)
    return None


def _read(path: Path, num_layers: int, num_kv_heads: int, head_dim: int) -> KVScales | None:
    """The parameters in ``path``; None if it does not exist or holds format 1 (to recalibrate)."""
    if not path.exists():
        return None
    if not path.is_file():
        raise UserError(f"--kv-cache-dtype fp8_e4m3: {path} is not a file (remove it to recalibrate)")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"--kv-cache-dtype fp8_e4m3: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise _malformed(path, "not UTF-8 text") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise _malformed(path, f"not JSON ({e.msg})") from None
    except RecursionError:
        raise _malformed(path, "not JSON this parser can read (nested too deep)") from None
    if not isinstance(obj, dict):
        raise _malformed(path, "expected a JSON object")
    if type(obj.get("format_version")) is int and obj["format_version"] == 1:   # (true is not format 1)
        log.info("%s holds format 1 (scales without offsets, from an older pdserve): recalibrating", path)
        return None
    return KVScales.from_dict(obj, num_layers, num_kv_heads, head_dim, str(path))


def _malformed(where: Path | str, why: str) -> UserError:
    return UserError(f"--kv-cache-dtype fp8_e4m3: malformed KV scales in {where}: {why} (delete the file to recalibrate)")


def _exact_in_bf16_and_fp16(rows: list) -> bool:
    """Whether every number in the nested lists equals its bf16 and its fp16 rounding."""
    import torch

    x = torch.tensor(rows, dtype=torch.float64)
    return bool(torch.equal(x.to(torch.bfloat16).double(), x) and torch.equal(x.half().double(), x))


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _nested(t: "torch.Tensor") -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(x) for x in row) for row in t.tolist())
