"""Activation-aware INT8 W8A8: SmoothQuant smoothing factors and the inputs too spiky to quantize.

Per-token int8 activations lose most where one input channel is far larger than the rest: the
token's scale is set by that channel and every other channel keeps a few levels. Measured on the
bundled model (2,048 WikiText-2 tokens, bf16, fake-quantized, per-token x per-channel int8):
plain W8A8 +3.4% perplexity, W8A16 (weights only) +0.6%; the ``down_proj`` inputs of layers 1, 2,
9, 11, 28, 29 have a channel 43-1,560x their median (the "massive activations" of Sun et al.,
2024), and keeping only ``down_proj`` out of activation quantization recovered half of the loss.

So, per linear, from the per-input-channel amax over a calibration pass (``calibration.txt``):

- an input whose largest channel is over ``OUTLIER_RATIO`` x its median channel keeps its
  activations in the model dtype (W8A16: int8 weights, the same bytes read per step);
- every other input is smoothed (Xiao et al., "SmoothQuant", ICML 2023, eq. 4): per input channel
  j, ``s_j = amax|X_j|^alpha / amax|W_:,j|^(1 - alpha)``; the linear computes
  ``(x / s) @ (W * s)^T``, identical in exact arithmetic, with the activations' range moved into
  the weights where per-output-channel scales absorb it. alpha = 0.5 (the paper's default) measured
  best here: alpha 0.4 / 0.5 / 0.65 / 0.8 gave +2.0 / +1.4 / +1.8 / +3.2% without the W8A16
  exceptions; with them alpha 0.5 gave +0.8%.

The factors are computed at load from a forward in the model dtype (a few hundred tokens, well
under a second), so they follow whatever linears the model has (fused projections included):
the statistics are keyed by the module name of the linear whose input they describe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

SMOOTHING_ALPHA = 0.5
OUTLIER_RATIO = 50.0
HEAD_NAME = "lm_head"
"""Key of the LM head's input statistics (the final norm's output)."""


@dataclass(frozen=True)
class InputPlan:
    """How one int8 linear treats its input. smooth: [in_features] float32 factors s (the linear
    computes (x / s) @ (W * s)^T), or None; w8a8: whether activations may be quantized to int8."""

    smooth: torch.Tensor | None
    w8a8: bool


def outlier_ratio(act_amax: torch.Tensor) -> float:
    """Largest over median per-channel amax of one input ([in_features] float32)."""
    return float(act_amax.max() / act_amax.median().clamp(min=1e-12))


def smoothing_factors(act_amax: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTHING_ALPHA) -> torch.Tensor:
    """SmoothQuant's s [K] float32 for weight [N, K] and activation amax [K] (eq. 4), clamped away from 0."""
    w_amax = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
    return (act_amax.float().clamp(min=1e-5) ** alpha / w_amax ** (1.0 - alpha)).clamp(min=1e-5)


def plan_input(act_amax: torch.Tensor | None, weight: torch.Tensor) -> InputPlan:
    """The InputPlan of one linear from its calibration amax (None: no statistics, plain W8A8)."""
    if act_amax is None:
        return InputPlan(None, True)
    if outlier_ratio(act_amax) > OUTLIER_RATIO:
        return InputPlan(None, False)
    return InputPlan(smoothing_factors(act_amax, weight), True)


def record_input_amax(model: nn.Module, run_forward: Callable[[], None]) -> dict[str, torch.Tensor]:
    """Per-input-channel amax [in_features] float32 of every linear under ``model.model.layers``
    (by module name) and of the LM head's input (``HEAD_NAME``), over one ``run_forward()``."""
    amax: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        a = x.detach().reshape(-1, x.shape[-1]).float().abs().amax(dim=0)
        amax[name] = torch.maximum(amax[name], a) if name in amax else a

    handles = [module.register_forward_hook(lambda m, inputs, out, name=name: record(name, inputs[0]))
               for name, module in model.named_modules()
               if name.startswith("model.layers.") and isinstance(module, nn.Linear)]
    # The head reads the final norm's output (only at the positions that need logits: ask for all).
    handles.append(model.model.norm.register_forward_hook(lambda m, inputs, out: record(HEAD_NAME, out)))
    try:
        run_forward()
    finally:
        for h in handles:
            h.remove()
    return amax
