"""Swap the decoder's ``nn.Linear`` modules for the chosen linear method, once at load.

Every ``nn.Linear`` under ``model.model.layers`` (the attention and MLP projections) becomes a
kernels.linear module: ``DenseLinear`` (none), ``Int8Linear`` (int8) or ``Fp8Linear`` (fp8).
The LM head (tied to the embedding or not) gets a method too, ``model.head_method``: with int8
the head is int8 per vocabulary row (at batch 1 it reads as many bytes as 17 of the 30 decoder
layers' linears of the bundled model, so it decides much of the decode step); with none and fp8
it is the fastest dense kernel in the model dtype (FP8 keeps the head, as vLLM does). The
embedding lookup keeps its own table.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quantization import check_quantization
from kernels.linear import DenseLinear, Fp8Linear, Int8Linear


def apply_quantization(model: nn.Module, method: str, weight_scales: dict[str, torch.Tensor] | None = None) -> int:
    """Replace the decoder's linears in place; return how many were replaced.

    weight_scales: per-output-channel scales of an FP8 checkpoint, by the linear's module name
    (``model.layers.0.self_attn.q_proj``); only used with ``method="fp8"``.
    """
    check_quantization(method)
    replaced = 0
    for name, parent in list(model.named_modules()):
        if not name.startswith("model.layers."):
            continue
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, child_name, make_linear(child, method, (weight_scales or {}).get(f"{name}.{child_name}")))
                replaced += 1
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.head_method = Int8Linear(head.detach(), None) if method == "int8" else DenseLinear(head.detach(), None)
    return replaced


def make_linear(linear: nn.Linear, method: str, weight_scale: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> nn.Module:
    """The linear method ``method`` for one ``nn.Linear`` (weight [N, K] in the model dtype, or E4M3)."""
    weight, bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    if method == "int8":
        return Int8Linear(weight, bias)
    if method == "fp8":
        compute = dtype or (bias.dtype if bias is not None and weight.dtype == torch.float8_e4m3fn else
                            weight.dtype if weight.dtype != torch.float8_e4m3fn else torch.bfloat16)
        return Fp8Linear(weight, bias, compute, weight_scale)
    return DenseLinear(weight, bias)
