"""The Llama family in one implementation: Llama 2/3 (llama3 RoPE scaling), SmolLM, Mistral
(no sliding window), Qwen2 (QKV bias); tied or untied LM head.

Our own forward over a flat token batch and the paged KV cache: RMSNorm, rotary position
embeddings (rotate-half convention, as in HF checkpoints), grouped-query attention through
kernels/attention.py, SwiGLU MLP. Parameter names are the HF checkpoint's, so weights load as they
are; at the end of loading, Q/K/V become one ``qkv_proj`` and gate/up one ``gate_up_proj`` (one
matmul each instead of three and two: with oneDNN's bf16 kernels on the AVX512-BF16 machines the
fused matmuls cost 25-45% less than the separate ones at 1-16 rows; see ``FUSED_PROJECTIONS``).

Reference: Touvron et al., "Llama 2" (2023); Su et al., "RoFormer" (2021) for RoPE;
Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_cache import PagedKVCache
from engine.model_config import ModelConfig, RopeConfig
from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.decoder_loop import DecoderLoop
from kernels.layer_ops import TorchLayerOps, apply_rope  # noqa: F401  (apply_rope: re-exported)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, lops: TorchLayerOps | None = None) -> torch.Tensor:
        if lops is not None:   # (called as a module, so forward hooks see it: int8 calibration does)
            return lops.rms_norm(x, self.weight, self.eps)
        # Normalize in fp32 whatever the model dtype, as the reference implementation does.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with linear or llama3 scaling applied.

    llama3: Meta's Llama 3.1 frequency-dependent scaling (long wavelengths divided by factor,
    short ones kept, a smooth ramp between).
    """
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


# Fused module -> the checkpoint's modules it concatenates along the output dimension, in order.
# Per-output-channel quantization (int8, FP8) of the fused weight equals that of the parts: a
# checkpoint's per-module scales concatenate in the same order.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose output is the parts' outputs concatenated (weights and biases stacked)."""
    first = parts[0]
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                      device="meta")
    fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    return fused


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qkv_proj: nn.Module | None = None   # set by LlamaForCausalLM.fuse_projections
        self.scale = cfg.head_dim ** -0.5
        # FP8 KV cache: fp32 [num_kv_heads] dequantization scales, set at load (None: cache in the compute dtype).
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        # and [num_kv_heads, head_dim] offsets in the compute dtype, subtracted from K and V before they
        # are written (engine/quantization/kv_scales.py: attention is unchanged by a K offset; the V
        # offset is added back to the output), or None.
        self.k_offset: torch.Tensor | None = None
        self.v_offset: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, ops: AttentionBackend,
                lops: TorchLayerOps) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.qkv_proj is not None:
            qkv = self.qkv_proj.forward(x)
        else:   # not fused (a model built but not loaded through load_weights)
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        q, k, v = lops.rope_split(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        kv_scales = {} if self.k_scale is None else {"k_scale": self.k_scale, "v_scale": self.v_scale}
        if self.k_offset is not None:
            k, v = k - self.k_offset, v - self.v_offset
        ops.write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping, **kv_scales)
        # A backend that reads the new K/V directly (a prefill chunk from position 0) says so; never
        # with an FP8 cache, where prefill must attend over the same quantized bytes as decode.
        new_kv = {"key": k, "value": v} if getattr(ops, "reads_new_kv", False) and not kv_scales else {}
        out = ops.paged_attention(q, key_cache, value_cache, meta, self.scale, **kv_scales, **new_kv)
        if self.v_offset is not None:   # [T, Hq, D] += each query head's KV head's offset
            out = out.reshape(num_tokens, self.num_kv_heads, -1, self.head_dim).add_(self.v_offset[:, None])
        return self.o_proj.forward(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_proj: nn.Module | None = None   # set by LlamaForCausalLM.fuse_projections

    def forward(self, x: torch.Tensor, lops: TorchLayerOps) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj.forward(x)
        else:   # not fused
            gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        return self.down_proj.forward(lops.silu_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                ops: AttentionBackend, lops: TorchLayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (or the embeddings, with residual None); residual:
        the stream before it, updated in place. Returns (this layer's MLP output, residual): the
        stream after the layer is their sum, added by the next norm (one pass instead of two)."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, h = x, lops.rms_norm(x, ln1.weight, ln1.eps)
        else:
            h = lops.add_rms_norm(x, residual, ln1.weight, ln1.eps)
        h = self.self_attn.forward(h, cos, sin, key_cache, value_cache, meta, ops, lops)
        h = lops.add_rms_norm(h, residual, ln2.weight, ln2.eps)
        return self.mlp.forward(h, lops), residual


class LlamaForCausalLM(nn.Module):
    """Parameter names follow the HF checkpoint (``model.layers.N...``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)  # plain attribute: not a weight
        # The per-layer small ops (kernels/layer_ops.py), chosen at load by the runner.
        self.layer_ops: TorchLayerOps = TorchLayerOps()
        # The LM head's linear method (a kernels.linear MeasuredLinear: forward_float32 gives the
        # logits), set at load by engine.quantization (None: F.linear on the weight).
        self.head_method: nn.Module | None = None
        # The fused C++ layer loop (kernels/decoder_loop.py), set at load by the runner (None: the
        # Python loop below always); decoder_path names the loop the last forward ran.
        self.decoder_loop: DecoderLoop | None = None
        self.decoder_path = ""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta: AttentionMetadata, logits_indices: torch.Tensor | None, ops: AttentionBackend,
                layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions [T] int64 -> logits [len(logits_indices), vocab] float32
        (logits_indices [L] int64 rows of the batch; None: every row, in order).

        Writes every token's K/V into ``kv_cache`` and calls ``layer_hook(l)`` after layer l.
        """
        # The decoder's modules are called through .forward, not nn.Module.__call__: no hooks are
        # registered on them, and the call machinery cost ~1 us a module, 7 modules a layer.
        lops = self.layer_ops
        x = self.model.embed_tokens(input_ids)   # a fresh tensor: it becomes the residual stream
        cos, sin = lops.rope_tables(positions, self.inv_freq.to(x.device), x.dtype)
        loop = self.decoder_loop
        if loop is not None and loop.covers(x.shape[0], ops, lops):
            x, residual = loop.run(x, cos, sin, kv_cache, meta, layer_hook)
            self.decoder_path = "fused"
        else:   # the reference loop (and everything the fused one does not cover)
            residual = None
            for l, layer in enumerate(self.model.layers):
                x, residual = layer.forward(x, residual, cos, sin, kv_cache.key(l), kv_cache.value(l), meta, ops, lops)
                if layer_hook is not None:
                    layer_hook(l)
            self.decoder_path = "python"
        norm = self.model.norm
        if logits_indices is None:   # every row: the last residual add fused into the final norm
            x = lops.add_rms_norm(x, residual, norm.weight, norm.eps)
        else:
            x = norm(residual.index_select(0, logits_indices) + x.index_select(0, logits_indices), lops)
        if self.head_method is not None:   # (written as fp32 by its kernel where it can)
            return self.head_method.forward_float32(x)
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                     device: torch.device | str) -> None:
        """Load HF-named tensors (copied into fresh memory); every parameter must be provided.

        Raises ValueError naming missing or unexpected parameters.
        """
        state = {name: t for name, t in weights if not name.endswith("rotary_emb.inv_freq")}
        if self.lm_head is None:
            state.pop("lm_head.weight", None)  # tied: the embedding is the head
        expected = set(self.state_dict().keys())
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        # Fused once, straight from the checkpoint's tensors into their fused place: one copy of
        # every weight (load, then fuse, copied the Q/K/V and gate/up weights twice: ~0.5 s of a
        # worker's start on 2 cores, more when they are busy).
        state = _fused_state(state, self.config.num_layers, dtype, device)
        self.fuse_projections()
        # copy=True: safetensors hands out views of the memory-mapped file; the matmuls ran
        # slower on those file pages than on freshly allocated memory in our measurements.
        self.load_state_dict({k: v.to(device=device, dtype=dtype, copy=True) for k, v in state.items()}, assign=True)

    def fuse_projections(self) -> None:
        """Replace every layer's Q/K/V and gate/up linears by one fused linear each (see
        FUSED_PROJECTIONS), once, before the fused weights are loaded (on the meta device, as
        load_weights does, or after loading); the state dict then names the fused modules."""
        for layer in self.model.layers:
            for fused, parts in FUSED_PROJECTIONS.items():
                owner = layer.get_submodule(fused.split(".")[0])
                names = [p.split(".")[1] for p in parts]
                setattr(owner, fused.split(".")[1], fuse_linears([getattr(owner, n) for n in names]))
                for n in names:
                    delattr(owner, n)


def _fused_state(state: dict[str, torch.Tensor], num_layers: int, dtype: torch.dtype,
                 device: torch.device | str) -> dict[str, torch.Tensor]:
    """``state`` (HF names) with every layer's FUSED_PROJECTIONS parts replaced by the fused
    tensor (their concatenation along dim 0, each part converted to ``dtype`` as it is copied into
    fresh memory on ``device``); the other tensors are returned unchanged. Same bytes as
    ``torch.cat([p.to(dtype) for p in parts])``."""
    out = dict(state)
    for layer in range(num_layers):
        for fused, parts in FUSED_PROJECTIONS.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{layer}.{p}.{kind}" for p in parts]
                if names[0] not in out:   # no bias
                    continue
                tensors = [out.pop(n) for n in names]
                dst = torch.empty((sum(x.shape[0] for x in tensors), *tensors[0].shape[1:]), dtype=dtype, device=device)
                row = 0
                for x in tensors:
                    dst[row:row + x.shape[0]].copy_(x)
                    row += x.shape[0]
                out[f"model.layers.{layer}.{fused}.{kind}"] = dst
    return out

