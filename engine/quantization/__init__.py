"""Quantization of the model runtime: which linear method the decoder uses and which dtype the
KV cache holds, both chosen once at load (``ModelRunner(..., quantization=, kv_cache_dtype=)``).

Names follow vLLM's flags: ``--quantization none|int8|fp8`` and ``--kv-cache-dtype auto|fp8_e4m3``.
Pure Python (no torch import at module level) so CLIs validate flags before loading anything.
"""

from __future__ import annotations

from engine.errors import UserError

QUANTIZATION_METHODS = ("none", "int8", "fp8")
"""none: the model dtype (the fastest bf16/fp32 kernel measured at load); int8: per-output-channel
symmetric int8 weights, activations quantized dynamically per token (the residual stream rotated
first; down_proj's per group of 32 channels); fp8: E4M3 weights with per-output-channel scales, activations quantized
dynamically per token (W8A8)."""

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
"""auto: the model dtype; fp8_e4m3: E4M3 with calibrated per-layer, per-KV-head scales."""


def check_quantization(name: str) -> str:
    """Return ``name`` if it is a known method; raise UserError naming ``--quantization`` otherwise."""
    if name not in QUANTIZATION_METHODS:
        raise UserError(f"--quantization: unknown method {name!r}; choose one of {', '.join(QUANTIZATION_METHODS)}")
    return name


def check_kv_cache_dtype(name: str) -> str:
    """Return ``name`` if it is a known KV-cache dtype; raise UserError naming ``--kv-cache-dtype`` otherwise."""
    if name not in KV_CACHE_DTYPES:
        raise UserError(f"--kv-cache-dtype: unknown dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return name
