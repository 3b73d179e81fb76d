"""The target model's tokenizer, for prompt lengths and for counting output tokens when the target
reports no usage. Loaded lazily and at most once; transformers and the engine are imported only then."""

from __future__ import annotations

import sys
from typing import Any

from engine.errors import UserError


class LazyTokenizer:
    """``get()`` -> a Hugging Face tokenizer or None.

    tokenizer_path: ``--tokenizer`` (an HF directory or hub id; a load failure is a UserError).
    model: the target's model name; pdserve's own names (e.g. "smollm2-135m-instruct") resolve through
    ``engine.model_loader.resolve_model``. Any other name gives None, with one warning on stderr.
    """

    def __init__(self, tokenizer_path: str | None, model: str | None) -> None:
        self._path, self._model = tokenizer_path, model
        self._loaded = False
        self._tok: Any = None

    def get(self) -> Any:
        if not self._loaded:
            self._tok = self._load()
            self._loaded = True
        return self._tok

    def set_model(self, model: str) -> None:
        """Name the model once the target reports it (before any ``get``)."""
        if not self._loaded and self._model is None:
            self._model = model

    def _load(self) -> Any:
        if self._path:
            return _auto_tokenizer(self._path)
        if self._model:
            from engine.model_loader import resolve_model

            try:
                path = resolve_model(self._model)  # cheap for an unknown name: no transformers import
            except UserError as e:
                print(f"pdserve bench: no tokenizer for model {self._model!r} ({e}); "
                      "pass --tokenizer PATH for exact token counts", file=sys.stderr)
                return None
            return _auto_tokenizer(str(path))
        return None


def _auto_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise UserError(f"cannot load a tokenizer from {path} ({type(e).__name__}: {e})") from None
