"""FP8 checkpoints: ``float8_e4m3fn`` linear weights with a ``weight_scale`` beside each.

The layout is the one vLLM's ``fp8`` and compressed-tensors loaders read (and llm-compressor /
Hugging Face FP8 checkpoints write): for a linear ``P`` the tensors ``P.weight`` [N, K]
float8_e4m3fn and ``P.weight_scale`` (fp32/bf16/fp16; a scalar, [1], [N] or [N, 1]; the weight
is ``weight.float() * scale`` per output row). ``P.input_scale`` (static activation scales) is
accepted and ignored: pdserve quantizes activations dynamically per token.

Checked once on the safetensors headers and the (small) scale tensors, before any weight is
loaded: an E4M3 weight without its scale, a scale without an E4M3 weight, a scale of the wrong
shape or dtype, or one that is not finite and positive is a UserError naming the tensor (the
CLI prints one line and exits 2 before any worker starts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from engine.errors import UserError

SCALE_SUFFIX = ".weight_scale"
IGNORED_SUFFIXES = (".input_scale",)


@dataclass(frozen=True)
class Fp8Weight:
    """One linear of an FP8 checkpoint: qweight [N, K] float8_e4m3fn, scale [N] float32."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(dtype)


def _fail(model_dir: Path, what: str) -> UserError:
    return UserError(f"--model: FP8 checkpoint {str(model_dir)!r}: {what}")


def check_scale(model_dir: Path, name: str, scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """A checkpoint's weight_scale as [out_features] float32; UserError if malformed."""
    if scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise _fail(model_dir, f"{name} has dtype {str(scale.dtype).removeprefix('torch.')}; "
                               "allowed float32, bfloat16, float16")
    if scale.numel() not in (1, out_features) or scale.dim() > 2 or (scale.dim() == 2 and scale.shape[1] != 1):
        raise _fail(model_dir, f"{name} has shape {list(scale.shape)}; allowed [], [1], "
                               f"[{out_features}] or [{out_features}, 1]")
    s = scale.float().reshape(-1).expand(out_features).contiguous()
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise _fail(model_dir, f"{name} holds a value that is not finite and positive")
    return s


def fp8_layer_names(model_dir: Path, tensors: dict[str, tuple[torch.dtype, list[int]]]) -> set[str]:
    """Module names of the E4M3 linears, from (dtype, shape) by tensor name; UserError on any scale
    without its weight or weight without its scale."""
    fp8 = {n[: -len(".weight")] for n, (dt, _) in tensors.items() if dt == torch.float8_e4m3fn and n.endswith(".weight")}
    other = sorted(n for n, (dt, _) in tensors.items() if dt == torch.float8_e4m3fn and not n.endswith(".weight"))
    if other:
        raise _fail(model_dir, f"{other[0]} is float8_e4m3fn; only linear weights may be")
    scales = {n[: -len(SCALE_SUFFIX)] for n in tensors if n.endswith(SCALE_SUFFIX)}
    if fp8 - scales:
        raise _fail(model_dir, f"{sorted(fp8 - scales)[0]}{SCALE_SUFFIX} is missing "
                               "(every float8_e4m3fn weight needs its weight_scale)")
    if scales - fp8:
        raise _fail(model_dir, f"{sorted(scales - fp8)[0]}{SCALE_SUFFIX} has no float8_e4m3fn weight beside it")
    return fp8


def read_headers(files: Iterable[Path]) -> dict[str, tuple[torch.dtype, list[int]]]:
    """(dtype, shape) of every tensor in the safetensors ``files``, from their headers only."""
    from safetensors import safe_open

    from safetensors import SafetensorError

    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    sl = st.get_slice(name)
                    out[name] = (_DTYPES.get(sl.get_dtype(), torch.uint8), list(sl.get_shape()))
        except (SafetensorError, OSError) as e:
            raise UserError(f"model directory {str(f.parent)!r}: {f.name} is not a readable safetensors "
                            f"file ({e})") from None
    return out


_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8}


def check_fp8_checkpoint(model_dir: Path) -> None:
    """Validate an FP8 checkpoint's scales (a no-op for a checkpoint without E4M3 weights)."""
    files = sorted(model_dir.glob("*.safetensors"))
    headers = read_headers(files)
    names = fp8_layer_names(model_dir, headers)
    if not names:
        return
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name.endswith(SCALE_SUFFIX):
                    out_features = headers[name[: -len(SCALE_SUFFIX)] + ".weight"][1][0]
                    check_scale(model_dir, name, st.get_tensor(name), out_features)


def split_fp8(model_dir: Path, weights: Iterable[tuple[str, torch.Tensor]],
              dtype: torch.dtype) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, Fp8Weight]]:
    """Pass a checkpoint's tensors through, each E4M3 weight dequantized to ``dtype`` (so every
    ``--quantization`` can run an FP8 checkpoint); the E4M3 weights themselves, by module name,
    fill the returned dict as the iterator is consumed (``--quantization fp8`` keeps them as they are)."""
    fp8: dict[str, Fp8Weight] = {}

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        pending_q: dict[str, torch.Tensor] = {}
        pending_s: dict[str, torch.Tensor] = {}
        for name, t in weights:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name.endswith(SCALE_SUFFIX):
                pending_s[name[: -len(SCALE_SUFFIX)]] = t
            elif t.dtype == torch.float8_e4m3fn:
                pending_q[name[: -len(".weight")]] = t
            else:
                yield name, t
                continue
            for module in list(pending_q.keys() & pending_s.keys()):
                q = pending_q.pop(module)
                s = check_scale(model_dir, module + SCALE_SUFFIX, pending_s.pop(module), q.shape[0])
                fp8[module] = Fp8Weight(q, s)
                yield module + ".weight", fp8[module].dequantized(dtype)
        if pending_q or pending_s:  # (check_fp8_checkpoint reports these first, with the same words)
            fp8_layer_names(model_dir, {**{k + ".weight": (torch.float8_e4m3fn, []) for k in pending_q},
                                        **{k + SCALE_SUFFIX: (torch.float32, []) for k in pending_s}})

    return gen(), fp8
