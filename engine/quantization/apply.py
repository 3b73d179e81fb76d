"""Swap the decoder's ``nn.Linear`` modules for the chosen linear method, once at load.

Every ``nn.Linear`` under ``model.model.layers`` (the attention and MLP projections) becomes a
kernels.linear module: ``DenseLinear`` (none), ``Int8Linear`` (int8) or ``Fp8Linear`` (fp8).
The LM head (tied to the embedding or not) gets a method too,
``model.head_method``: with int8 the head is int8 per vocabulary row (at batch 1 it reads as many bytes as 17 of the 30 decoder
layers' linears of the bundled model, so it decides much of the decode step); with none and fp8
it is the fastest dense kernel in the model dtype (FP8 keeps the head, as vLLM does). The
embedding lookup keeps its own table.

INT8 is W8A8 with the residual stream rotated first (engine/quantization/rotation.py: a
randomized Hadamard folded into the weights, QuaRot-style), then one activation scale per token
for every linear but ``down_proj``, which keeps groups of 32 input channels (kernels.linear.
ACT_GROUP; INT8_ACT_GROUPS, INT8_HEAD_GROUP), or where AMX runs MX activations of the same
perplexity at AMX's per-token speed (int8_down_group). Chosen by perplexity (bf16, WikiText-2,
fake-quantized on 2,047 tokens unless said): without rotation one scale per token costs +4.7% (an
outlier channel, the "massive activations" of Sun et al. 2024 that the ``down_proj`` inputs of six
layers carry at 43-1,560x their median, leaves every other channel of its token a few levels);
SmoothQuant alpha 0.5 (Xiao et al. 2023) with those six kept W8A16: +1.57% (pdserve eval ppl, 8,192
tokens); per group of 64 +0.87%; per group of 32 +0.34%; weight-only W8A16 +0.51% (+0.44% through
pdserve eval ppl on 8,192 tokens). Through pdserve eval ppl, per group of 32: +0.54% on 8,192
tokens (context 1024, stride 512) and +0.54% on the whole WikiText-2 test text (304,688 tokens
scored, context 1024, stride 1024: bf16 24.886, int8 25.021). The rotation spreads the outliers of
the stream (not those of ``down_proj``'s inputs, which it does not reach): on 8,192 tokens, the
groups of before (qkv and gate/up 64, the head 32) +0.68%, rotated with one scale per token +0.11%.
VNNI's int8 products: kernels/csrc/int8_gemm.cpp reads the weight as int8 (half of bf16's bytes,
what a decode step at batch 1 streams) and multiplies twice as many pairs per instruction as bf16
(what decides batches of 16 and more).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from engine.quantization import check_quantization
from engine.quantization.checkpoint import Fp8Weight
from engine.quantization.rotation import rotate_residual
from kernels.linear import DenseLinear, Fp8Linear, Int8Linear, quantize_fp8_per_channel

DEBUG_SCALE_FACTOR_ENV = "PDSERVE_DEBUG_FP8_SCALE_FACTOR"
"""Debug hook (never set in serving): with ``fp8``, every weight is quantized with its correct
per-channel scale, then served with that scale times this factor: a deliberately broken
quantization, so quality gates (``pdserve bench ablate``) can be shown to catch one. Workers of
`pdserve serve` inherit it (deploy/cluster.py forwards PDSERVE_DEBUG_* to the Ray actors)."""


INT8_ACT_GROUPS = {"self_attn.qkv_proj": 0, "self_attn.o_proj": 0, "mlp.gate_up_proj": 0}
"""Input channels per activation scale of the INT8 linears whose inputs allow more than
kernels.linear.ACT_GROUP (32; 0 = the whole row, one scale per token); unfused q/k/v and gate/up
take their fused linear's. Wider groups are fewer int32 -> fp32 conversions in the kernel
(kernels/csrc/int8_gemm.cpp): at 16 rows, one thread, weights out of cache, 32 -> 64: qkv 57 -> 53
us, o 52 -> 46, gate_up 128 -> 110. One scale per token for qkv and gate/up needs the rotated
stream (rotation.py): unrotated it cost qkv alone +2.31%, gate_up alone +1.50% (pdserve eval ppl,
bf16, 16,384 WikiText-2 tokens; o_proj's attention outputs carry no outlier channels: +0.78%, then
and now one scale per token). Rotated, with the LM head also at one scale per token (8,192
tokens): +0.11% against +0.68% for the groups of before (qkv and gate_up 64, head 32); the 16-row
decode step 2-3% faster (Zen 4, 2 threads, A/B in one process, both build orders). down_proj keeps
32 (or MX: int8_down_group): its inputs, past the SiLU, are not rotated; at 64 outside the six layers whose inputs carry
the massive activations (2, 9, 10, 11, 28, 29 here: max/median channel amax 48-4,033, the others
4-28) it cost +0.16% more (unrotated), for ~12% of its 16-row time. Rotated, all layers (Emerald
Rapids, 2026-12-07; pdserve eval ppl, 8,192 WikiText-2 tokens): groups of 64 / 128 +0.35% /
+0.41% against +0.14%, and hot 16-row calls 35 -> 25 / 20 us on AMX, but the 16-row decode step
only 0.22 ms faster on average with 128 on AMX (8 A/B pairs of processes, each model alone,
medians: -0.48 to +0.10 ms of ~6.6; in the step down_proj's weights stream from L3): not worth
three times the perplexity cost.

Measured and not kept (2026-12-06, Zen 4, 2 threads; perplexity on 8,192 tokens each of the
ShareGPT dev text / WikiText-2 against bf16, where groups of 32 give +0.22% / +0.11%), all to give
down_proj one scale per token too, which alone ran the 16-row decode step 3.5-6% faster:
- down_proj's input rotated as the model runs (QuaRot's online Hadamard: diag(signs) kron(H_12,
  H_128) / sqrt(1536) after the SiLU, its transpose folded into down_proj's weight in fp32). As a
  separate C++ op it cost 10-12 us a call (16 x 1536 bf16), the step -1% to +2.7% (build order
  decides the sign). Fused into silu_mul (each row rotated in L1 as it is written, in-lane
  shuffles instead of full permutes) it still cost ~1 us a row on one core: the 12 x 12 mix alone
  is 1,152 fma a row (0.31 us at Zen 4's one zmm fma a cycle) and the 4 in-vector butterfly
  stages ~8 cycles a vector; silu_mul went 12 -> 23 us a call and the step did not gain (A/B in
  one process, both orders: groups of 32 10.00 / 9.28 ms, rotated 10.05 / 9.43). Perplexity,
  sign seeds 0-3: +0.17-0.38% / +0.17-0.53%. Cheaper transforms do no better: kron([[2, 2, -1],
  [2, -1, 2], [-1, 2, 2]] / 3, H_512) +0.07-0.33% / +0.18-0.50% (0.85 us a row), H_512 blocks
  alone +0.09-0.51% / +0.46-0.63%, and mixes across the row's 96 16-lane vectors only (no
  shuffles; seeds 0-2): H_12 x H_8 +0.07-0.28% / +0.25-0.57%, that 3 x 3 block x H_32 +0.20-0.31%
  / +0.26-0.48% (~0.3 us a row by its op count: at best ~2% off the step, for twice or more the
  perplexity cost of groups of 32).
- Unrotated, one scale per token: +0.65% / +1.17%; in all layers but the six that carry the
  massive activations +0.51% / +0.89%; with SmoothQuant's scales (Xiao et al. 2023) folded into
  up_proj's rows (free at run time; channel amax calibrated on calibration.txt) alpha 0.5 +0.93% /
  +1.75%, 0.7 +8.6% / +8.8%; each layer's 16 (64) calibrated largest channels taken out of the
  quantization into a bf16 product beside it (LLM.int8()'s decomposition, static) +0.53% / +0.79%
  (+0.38% / +0.63%). Even after the outliers are gone (amax max/median 3-6), one scale over 1,536
  channels loses more than groups of 32 do."""

INT8_HEAD_GROUP = 0
"""Input channels per activation scale of the INT8 LM head (0: one scale per token), as
INT8_ACT_GROUPS: its input is the rotated stream's final norm (unrotated, 64 cost +0.07% and one
scale per token +0.52% over 32)."""


INT8_DOWN_ACT_ENV = "PDSERVE_INT8_DOWN_ACT"
"""Overrides the choice of int8_down_group: ``mx`` or ``g32`` (A/B measurements; a prefill and a
decode worker must be given the same)."""


def int8_down_group(in_features: int, dtype: torch.dtype = torch.bfloat16) -> int | None:
    """down_proj's INT8 activation group: MX activations (kernels.linear.MX_GROUP) where the INT8
    kernels run on AMX tiles, else None (kernels.linear's default, groups of 32).

    MX (kernels/csrc/int8_activations.h quantize_row_mx: one scale per token, a power-of-two
    sub-scale per block of 32 channels, the OCP Microscaling formats' shared exponent, Rouhani et
    al. 2023) gives each block of 32 the precision of its own scale to within a factor of 2 (the
    power of two at or below it; 7 octaves under the token's largest block), and turns the product
    into two per-token products over the same weight (the hi and the lo digits), which AMX runs
    without a tile store and an fp32 step per group. Emerald Rapids, 2 threads, 2026-12-07:
    perplexity (pdserve eval ppl, bf16, 8,192 WikiText-2 tokens) +0.10% against +0.14% for groups
    of 32 (fake-quantized on 16,384 tokens: +0.33% both); down_proj hot at 16 rows 37 us against 49
    (groups of 32 on w8a8_vnni), at 512 rows 713-878 against 1,000-1,046 (w8a8_vnni_large); one
    int8 model, down_proj swapped between the two (A/B in one process, rounds of 60-80 steps or 6
    forwards): a 512-token prefill 1.08-1.18x faster (106.8 -> 94.6 ms, median of 8 rounds), the
    16-row decode step unchanged (per round 0.94-1.04x: down_proj's weights stream from L3 either
    way), batch 1 within 1-2% (0.97-1.04x; with the digits' products one after the other, before
    int8_gemm.cpp's tile_kernel_mx, 4.5% slower). The VNNI kernels run MX too (the same bits) but
    at twice the vpdpbusd of one scale per token (16 rows: 80 against 49 us), so without AMX
    down_proj keeps groups of 32."""
    choice = os.environ.get(INT8_DOWN_ACT_ENV, "")
    if choice not in ("", "mx", "g32"):
        raise ValueError(f"{INT8_DOWN_ACT_ENV}={choice!r}: expected mx or g32")
    from kernels.linear import MX_GROUP, int8_amx_available

    mx = choice == "mx" or (not choice and int8_amx_available(dtype))
    return MX_GROUP if mx and in_features % 32 == 0 else None


def int8_act_group(name: str, in_features: int, dtype: torch.dtype = torch.bfloat16) -> int | None:
    """The activation group of INT8 linear ``name`` (``model.layers.L.<proj>``) with
    ``in_features`` inputs and ``dtype`` activations, or None for kernels.linear's default
    (act_group); down_proj without an INT8_ACT_GROUPS entry: int8_down_group."""
    from engine.models import llama

    # (every entry of INT8_ACT_GROUPS, a fused projection also under its parts' names: an entry for
    # mlp.down_proj, say, takes effect rather than being ignored)
    for projection, group in INT8_ACT_GROUPS.items():
        parts = llama.FUSED_PROJECTIONS.get(projection, ())
        if name.endswith(("." + projection,) + tuple("." + p for p in parts)):
            group = group or in_features
            return group if in_features % group == 0 else None
    return int8_down_group(in_features, dtype) if name.endswith(".mlp.down_proj") else None


FP8_DENSE_PROJECTIONS = ("mlp.down_proj",)
FP8_DENSE_LAST_LAYERS = 1
"""With ``fp8``, these linears keep the model dtype: every ``down_proj`` and all of the last
decoder layer. Measured on the bundled model (bf16, fake-quantized W8A8 E4M3, 1,536-4,096
WikiText-2 tokens): one projection kind alone in FP8 costs down_proj +1.36%, up +0.78, k +0.74,
v +0.58, o +0.30, gate +0.11, q -0.05% (noise); one layer alone in FP8 costs at most +0.35%,
except the last (+0.81%). All in FP8: +2.95%; with these kept: +1.65% (down_proj also reads the
massive activations, see smoothing.py). They hold 27% of the decoder's linear weights. vLLM's
FP8 checkpoints keep such modules unquantized the same way (their ``ignore`` list)."""


def fp8_keeps_dense(name: str, num_layers: int) -> bool:
    """Whether linear ``name`` (``model.layers.L.<proj>``) stays in the model dtype under fp8."""
    layer = int(name.split(".")[2])
    return layer >= num_layers - FP8_DENSE_LAST_LAYERS or name.endswith(FP8_DENSE_PROJECTIONS)


def debug_scale_factor() -> float | None:
    """The factor of DEBUG_SCALE_FACTOR_ENV, or None when unset; ValueError if not a number."""
    value = os.environ.get(DEBUG_SCALE_FACTOR_ENV)
    return None if not value else float(value)


def apply_quantization(model: nn.Module, method: str, fp8_weights: dict[str, Fp8Weight] | None = None) -> int:
    """Replace the decoder's linears in place; return how many were replaced. With int8 the
    residual stream is rotated first (rotation.rotate_residual: the weights and norms change), so
    int8 and only int8 models hold rotated weights; the rotated head is then held by
    ``head_method`` alone (``lm_head`` is dropped: the embedding is not the head, whatever
    ``lm_head is None`` says elsewhere).

    fp8_weights: an FP8 checkpoint's E4M3 weights and per-output-channel scales, by the linear's
    module name (``model.layers.0.self_attn.q_proj``; engine/quantization/checkpoint.py); with
    ``method="fp8"`` those linears use them as they are (no requantization).
    """
    check_quantization(method)
    compute_dtype, weight_scales = None, {}
    if method == "fp8" and (factor := debug_scale_factor()) is not None:
        compute_dtype = model.model.embed_tokens.weight.dtype   # the weights become E4M3 below
        weight_scales = _corrupted_fp8_scales(model, factor)
    if method == "int8":   # before the linears are replaced: folded into their weights
        rotate_residual(model)
    replaced, num_layers = 0, len(model.model.layers)
    for name, parent in list(model.named_modules()):
        if not name.startswith("model.layers."):
            continue
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                full = f"{name}.{child_name}"
                if method == "fp8" and not weight_scales and fp8_keeps_dense(full, num_layers):
                    setattr(parent, child_name, make_linear(child, "none"))
                    replaced += 1
                    continue
                ckpt = checkpoint_weight(fp8_weights or {}, full) if method == "fp8" and full not in weight_scales else None
                group = int8_act_group(full, child.in_features, child.weight.dtype) if method == "int8" else None
                setattr(parent, child_name, make_linear(child, method, weight_scales.get(full), compute_dtype,
                                                        fp8_weight=ckpt, group=group))
                replaced += 1
    head = (model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight).detach()
    if method == "int8":
        model.head_method = Int8Linear(head, None, decode_only=True,   # logits: one row per sequence
                                       group=INT8_HEAD_GROUP or head.shape[1])
        model.lm_head = None   # (rotate_residual's untied head: its bytes now live in head_method alone)
    else:
        model.head_method = DenseLinear(head, None, decode_only=True)   # logits: one row per sequence
    return replaced


def weights_descriptor(model: nn.Module, method: str) -> str:
    """What the decoder's linears compute, for the KV-transfer compat key (kv_transfer/base.py
    CompatKey.weights): ``method``, and for int8 down_proj's activation scheme ("int8/down:mx" or
    "int8/down:g32", int8_down_group's choice follows the CPU)."""
    if method != "int8":
        return method
    from kernels.linear import MX_GROUP

    groups = sorted({"mx" if m.group == MX_GROUP else f"g{m.group}" for name, m in model.named_modules()
                     if name.endswith(".mlp.down_proj") and hasattr(m, "group")})
    return "int8/down:" + ",".join(groups)


def _corrupted_fp8_scales(model: nn.Module, factor: float) -> dict[str, torch.Tensor]:
    """Quantize every decoder linear to E4M3 in place (weight becomes float8_e4m3fn) and return its
    scale times ``factor``, by module name: what a checkpoint with a wrong ``weight_scale`` holds."""
    scales = {}
    for name, module in model.named_modules():
        if name.startswith("model.layers.") and type(module) is nn.Linear:
            q, scale = quantize_fp8_per_channel(module.weight.detach())
            module.weight = nn.Parameter(q, requires_grad=False)
            scales[name] = scale * factor
    return scales


def checkpoint_weight(fp8_weights: dict[str, Fp8Weight], name: str) -> Fp8Weight | None:
    """The checkpoint's E4M3 weight of linear ``name``; for a fused linear (engine.models.llama's
    FUSED_PROJECTIONS, e.g. ``qkv_proj`` = q, k, v stacked along the outputs) its parts' weights
    and per-output-channel scales concatenated in the same order (None if any part is missing)."""
    if name in fp8_weights:
        return fp8_weights[name]
    from engine.models import llama

    for fused, parts in getattr(llama, "FUSED_PROJECTIONS", {}).items():
        if name.endswith("." + fused):
            prefix = name[: -len(fused)]
            found = [fp8_weights.get(prefix + part) for part in parts]
            if all(w is not None for w in found):
                return Fp8Weight(torch.cat([w.qweight for w in found]), torch.cat([w.scale for w in found]))
    return None


def make_linear(linear: nn.Linear, method: str, weight_scale: torch.Tensor | None = None,
                dtype: torch.dtype | None = None, fp8_weight: Fp8Weight | None = None,
                group: int | None = None) -> nn.Module:
    """The linear method ``method`` for one ``nn.Linear`` (weight [N, K] in the model dtype, or E4M3
    with ``weight_scale``); fp8_weight: the checkpoint's E4M3 weight and scales (fp8)."""
    weight, bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    if fp8_weight is not None:
        dtype, weight, weight_scale = dtype or weight.dtype, fp8_weight.qweight, fp8_weight.scale
    if method == "int8":
        return Int8Linear(weight, bias, group=group)
    if method == "fp8":
        compute = dtype or (bias.dtype if bias is not None and weight.dtype == torch.float8_e4m3fn else
                            weight.dtype if weight.dtype != torch.float8_e4m3fn else torch.bfloat16)
        return Fp8Linear(weight, bias, compute, weight_scale)
    return DenseLinear(weight, bias)
