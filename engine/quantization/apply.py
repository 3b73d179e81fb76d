"""Swap the decoder's ``nn.Linear`` modules for the chosen linear method, once at load."""

from __future__ import annotations

from torch import nn

from engine.errors import UserError


def apply_quantization(model: nn.Module, method: str) -> None:
    """Replace every ``nn.Linear`` of ``model.model.layers`` in place (the LM head stays as it is)."""
    if method != "none":
        raise UserError(f"--quantization {method}: not available yet")
