"""Activation-aware INT8 (engine/quantization/smoothing.py): SmoothQuant factors keep the product
while shrinking an outlier channel's hold on per-token scales; spiky inputs stay W8A16."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.quantization.smoothing import (HEAD_NAME, OUTLIER_RATIO, outlier_ratio, plan_input,
                                           record_input_amax, smoothing_factors)
from kernels.linear import Int8Linear

torch.manual_seed(0)
N, K = 64, 128


def outlier_input(rows: int, factor: float) -> torch.Tensor:
    x = torch.randn(rows, K)
    x[:, 7] *= factor          # one channel far above the rest, in every token (as in the real model)
    return x


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def test_smoothing_factors_follow_smoothquant_eq4():
    w, a = torch.rand(N, K) + 0.1, torch.rand(K) * 10 + 0.1
    s = smoothing_factors(a, w, alpha=0.5)
    assert torch.allclose(s, (a ** 0.5) / (w.abs().amax(0) ** 0.5))
    # after smoothing the activation and weight column ranges are equal (alpha = 0.5)
    assert torch.allclose(a / s, w.abs().amax(0) * s, rtol=1e-5)


def test_smoothing_cuts_w8a8_error_on_an_outlier_channel():
    w, x = torch.randn(N, K) * 0.05, outlier_input(32, 30.0)
    ref = F.linear(x, w)
    plain = Int8Linear(w, None)
    plan = plan_input(x.abs().amax(0), w)
    assert plan.w8a8 and plan.smooth is not None
    smoothed = Int8Linear(w, None, plan.smooth, plan.w8a8)
    e_plain, e_smooth = rel_err(plain.run_kernel("w8a8_int_mm", x), ref), rel_err(smoothed.run_kernel("w8a8_int_mm", x), ref)
    assert e_smooth < e_plain / 2, (e_plain, e_smooth)
    # the W8A16 kernel reads x / s against W * s: the same product
    assert rel_err(smoothed.run_kernel("w8a16_int8pack", x), ref) < 0.01
    assert rel_err(x @ smoothed.dequantized_weight().t(), ref) < 0.01


def test_a_spiky_input_keeps_its_activations_unquantized():
    w, x = torch.randn(N, K) * 0.05, outlier_input(32, 4 * OUTLIER_RATIO)
    assert outlier_ratio(x.abs().amax(0)) > OUTLIER_RATIO
    plan = plan_input(x.abs().amax(0), w)
    assert plan == plan_input(x.abs().amax(0), w) and not plan.w8a8 and plan.smooth is None
    lin = Int8Linear(w, None, plan.smooth, plan.w8a8)
    assert lin.kernel_choices == ("w8a16_int8pack",)
    assert rel_err(lin(x), F.linear(x, w)) < 0.01
    assert plan_input(None, w).w8a8 and plan_input(None, w).smooth is None   # no statistics: plain W8A8


def test_record_input_amax_sees_every_linear_and_the_head_input():
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Sequential(nn.Linear(K, N), nn.Linear(N, K))])
    model.model.norm = nn.LayerNorm(K)
    x = outlier_input(5, 3.0)

    def run() -> None:
        model.model.norm(model.model.layers[0](x))

    amax = record_input_amax(model, run)
    assert set(amax) == {"model.layers.0.0", "model.layers.0.1", HEAD_NAME}
    assert torch.equal(amax["model.layers.0.0"], x.abs().amax(0))
    assert amax["model.layers.0.1"].shape == (N,) and amax[HEAD_NAME].shape == (K,)
    run()                                                          # hooks removed afterwards
    assert not model.model.layers[0][0]._forward_hooks and not model.model.norm._forward_hooks
