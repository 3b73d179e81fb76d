"""The fused decoder-layer loop: every layer of a forward in one C++ call (kernels/csrc/decoder_loop.cpp).

The Python loop of ``LlamaForCausalLM.forward`` (the reference, kept) makes ~3,000 Python calls
a decode step of SmolLM2-135M (module attribute lookups, the linear and layer-op wrappers,
``torch.ops`` overload resolution, stride checks): 2.0-3.4 ms of an 8-14 ms step (2 threads,
torch.profiler op self-times against the step's wall clock). The C++ loop calls the same kernels
(``torch.ops.pdserve_*`` and aten's linear, through the dispatcher) in the same order on the
same arguments, so its logits equal the Python loop's bit for bit.

``build_decoder_loop(model, ops)`` (once, at load) resolves each linear's chosen kernel per row
bucket (kernels/linear.py's ``BUCKETS``) into a descriptor list, or says why it cannot; a
forward then runs fused when ``DecoderLoop.covers(...)`` holds, else the Python loop. With a
layer hook (a prefill worker's layer-wise KV push) the layers run one C++ call each, the hook
between. Not covered (the Python loop runs): any attention backend but the in-place CPU kernel
(FP8 KV calibration's recorder among them), the torch layer ops, non-CPU devices, and a row
bucket where some linear's kernel is one the C++ loop does not call (``KINDS``: e.g. int8's
``dequant_dense``, FP8's kernels).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch
from torch import nn

from kernels.attention import AttentionMetadata
from kernels.cpu_attention import CpuAttention
from kernels.linear import BUCKETS, MeasuredLinear, bucket_index

log = logging.getLogger(__name__)

KINDS = {"small_gemm": 0, "w8a8_vnni": 1, "F.linear": 2, "onednn_packed": 3, "w8a8_vnni_large": 4, "mkl_packed": 5,
         "w8a8_avx2": 6, "amx_gemm": 7,
         "w8a8_amx": 8}
"""kernels/linear.py kernel name -> the C++ loop's LinearKind (csrc/decoder_loop.cpp)."""

_EMPTY = torch.empty(0)   # a placeholder for an absent tensor (Tensor[] cannot hold None)


def linear_operands(linear: nn.Module, bucket: int) -> tuple[list[torch.Tensor], list[int]] | str:
    """The C++ loop's view of ``linear`` at row bucket ``bucket``: (tensors [a, b, bias],
    descriptor [kind, n, group, has_bias]), or the reason it has none (a str)."""
    if not isinstance(linear, MeasuredLinear):
        return f"{type(linear).__name__} is not a measured linear"
    name = linear.kernel_names[bucket]
    if name not in KINDS:
        return f"kernel {name} ({linear.method} {linear.out_features}x{linear.in_features})"
    if name in ("small_gemm", "amx_gemm"):   # (one packed weight, two kernels)
        a, b = linear._packed[name], _EMPTY
    elif name == "onednn_packed":
        a, b = linear._packed["onednn_packed"], _EMPTY
    elif name == "F.linear":
        a, b = linear.weight, _EMPTY
    elif name == "mkl_packed":   # (MKL's fp32 kernel reads the plain weight too)
        a, b = linear._packed["mkl_packed"], linear.weight
    else:   # w8a8_vnni, w8a8_vnni_large, w8a8_amx, w8a8_avx2 (the same operands)
        a, b = linear.qweight, linear.weight_scale
    bias = linear.bias
    desc = [KINDS[name], linear.out_features, getattr(linear, "group", 0), int(bias is not None)]
    return [a, b, _EMPTY if bias is None else bias], desc


class DecoderLoop:
    """Every decoder layer of a forward in one call of ``torch.ops.pdserve_loop.decoder_loop``.

    plans: per row bucket, (layer tensors, linear descriptors) in the C++ loop's layout, or the
    reason that bucket runs the Python loop.
    """

    def __init__(self, model: nn.Module, plans: Sequence[tuple[list[torch.Tensor], list[int]] | str]) -> None:
        cfg = model.config
        self._plans = tuple(plans)
        self._eps = float(model.model.layers[0].input_layernorm.eps)
        self._scale = float(model.model.layers[0].self_attn.scale)
        self._kv_scales = model.model.layers[0].self_attn.k_scale is not None
        self._dims = [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, int(self._kv_scales)]
        self._op = torch.ops.pdserve_loop.decoder_loop.default
        self._caches: tuple[object, list[torch.Tensor], list[torch.Tensor]] | None = None

    def reason(self, bucket: int) -> str:
        """Why row bucket ``bucket`` runs the Python loop ("" when it runs fused)."""
        plan = self._plans[bucket]
        return plan if isinstance(plan, str) else ""

    def covers(self, num_rows: int, ops: object, lops: object) -> bool:
        """Whether a forward of ``num_rows`` rows with attention backend ``ops`` and layer ops
        ``lops`` (the model's at this call: a caller may swap them after load) runs fused."""
        return (type(ops) is CpuAttention and getattr(lops, "name", "") == "cpu"
                and not isinstance(self._plans[bucket_index(num_rows)], str))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache, meta: AttentionMetadata,
            layer_hook: Callable[[int], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] embeddings (the residual stream, updated in place), cos/sin [T, D/2] float32
        (CppLayerOps.rope_tables) -> (the last layer's MLP output [T, H], the residual stream
        before it [T, H]), as the Python loop returns them. Writes every layer's K/V into kv_cache.

        layer_hook: called as ``layer_hook(l)`` after layer l (its K/V written); the layers then
        run one C++ call each (a prefill worker's layer-wise KV push), else all in one."""
        tensors, desc = self._plans[bucket_index(x.shape[0])]
        cached = self._caches
        if cached is None or cached[0] is not kv_cache:   # (calibration swaps the runner's cache)
            n = kv_cache.spec.num_layers
            cached = self._caches = (kv_cache, [kv_cache.key(l) for l in range(n)], [kv_cache.value(l) for l in range(n)])
        _, keys, values = cached
        meta_args = (meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc)
        if layer_hook is None:
            return self._op(x, None, cos, sin, keys, values, *meta_args, tensors, desc, self._dims, self._eps, self._scale)
        residual, nt, nd = None, len(tensors) // len(keys), len(desc) // len(keys)
        for l in range(len(keys)):
            x, residual = self._op(x, residual, cos, sin, keys[l:l + 1], values[l:l + 1], *meta_args,
                                   tensors[l * nt:(l + 1) * nt], desc[l * nd:(l + 1) * nd], self._dims, self._eps,
                                   self._scale)
            layer_hook(l)
        return x, residual


def _fp32_vector(scale: torch.Tensor) -> torch.Tensor:
    """An FP8 cache's scale as the attention op takes it: fp32 [1] or [Hkv], contiguous (as CpuAttention passes it)."""
    return scale.float().reshape(-1).contiguous()


def build_decoder_loop(model: nn.Module) -> tuple[DecoderLoop | None, str]:
    """The fused loop for ``model`` (its linears chosen, FP8 KV scales set), or (None, why not);
    the reason also names the row buckets that will run the Python loop."""
    if getattr(model.layer_ops, "name", "") != "cpu":
        return None, f"layer ops {getattr(model.layer_ops, 'name', '?')} (the C++ loop calls the cpu ones)"
    layers = model.model.layers
    if next(model.parameters()).device.type != "cpu":
        return None, "not a CPU model"
    from kernels.cpu_attention import load_extension

    if load_extension()[0] is None or not hasattr(torch.ops.pdserve_loop, "decoder_loop"):
        return None, f"the kernel library is unavailable: {load_extension()[1]}"
    if any(layer.self_attn.qkv_proj is None or layer.mlp.gate_up_proj is None for layer in layers):
        return None, "projections not fused (a model not loaded through load_weights)"
    if len({layer.input_layernorm.eps for layer in layers} | {layer.post_attention_layernorm.eps for layer in layers}) != 1:
        return None, "norms with different eps"
    plans: list[tuple[list[torch.Tensor], list[int]] | str] = []
    for bucket in range(len(BUCKETS)):
        tensors: list[torch.Tensor] = []
        desc: list[int] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            fp8 = attn.k_scale is not None
            offsets = attn.k_offset is not None
            tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        _fp32_vector(attn.k_scale) if fp8 else _EMPTY, _fp32_vector(attn.v_scale) if fp8 else _EMPTY,
                        attn.k_offset if offsets else _EMPTY, attn.v_offset if offsets else _EMPTY]
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                operands = linear_operands(linear, bucket)
                if isinstance(operands, str):
                    break
                tensors += operands[0]
                desc += operands[1]
            else:
                continue
            plans.append(f"{BUCKETS[bucket]} rows: {operands}")
            break
        else:
            plans.append((tensors, [int(d) for d in desc]))
    loop = DecoderLoop(model, plans)
    python = [loop.reason(b) for b in range(len(BUCKETS)) if loop.reason(b)]
    return loop, "; ".join(python)
