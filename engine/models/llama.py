"""The Llama family in one implementation: Llama 2/3 (llama3 RoPE scaling), SmolLM, Mistral
(no sliding window), Qwen2 (QKV bias); tied or untied LM head.

Our own forward over a flat token batch and the paged KV cache: RMSNorm, rotary position
embeddings (rotate-half convention, as in HF checkpoints), grouped-query attention through
kernels/attention.py, SwiGLU MLP. Parameter names are the HF checkpoint's, so weights load as they
are. (Fusing Q/K/V and gate/up into one matmul each was measured slower with MKL on the AVX2 CPUs
here, by 15-20% per matmul at batch 32, so the projections stay separate.)

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


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, 1, head_dim] (broadcast over heads)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by position (rotate-half: pairs (i, i + D/2))."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.head_dim ** -0.5
        # FP8 KV cache: fp32 [num_kv_heads] dequantization scales, set at load (None: cache in the compute dtype).
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, ops: AttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = apply_rope(self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        kv_scales = {} if self.k_scale is None else {"k_scale": self.k_scale, "v_scale": self.v_scale}
        ops.write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping, **kv_scales)
        # A backend that reads the new K/V directly (a prefill chunk from position 0) says so; never
        # with an FP8 cache, where prefill must attend over the same quantized bytes as decode.
        new_kv = {"key": k, "value": v} if getattr(ops, "reads_new_kv", False) and not kv_scales else {}
        out = ops.paged_attention(q, key_cache, value_cache, meta, self.scale, **kv_scales, **new_kv)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, ops: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, key_cache, value_cache, meta, ops)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        # The LM head's linear method, set at load by engine.quantization (None: F.linear on the weight).
        self.head_method: nn.Module | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta: AttentionMetadata, logits_indices: torch.Tensor, ops: AttentionBackend,
                layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions [T] int64 -> logits [len(logits_indices), vocab] float32.

        Writes every token's K/V into ``kv_cache`` and calls ``layer_hook(l)`` after layer l.
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq.to(x.device), x.dtype)
        for l, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, kv_cache.key(l), kv_cache.value(l), meta, ops)
            if layer_hook is not None:
                layer_hook(l)
        x = self.model.norm(x.index_select(0, logits_indices))
        if self.head_method is not None:
            return self.head_method(x).float()
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
        # copy=True: safetensors hands out views of the memory-mapped file; the matmuls ran
        # slower on those file pages than on freshly allocated memory in our measurements.
        self.load_state_dict({k: v.to(device=device, dtype=dtype, copy=True) for k, v in state.items()}, assign=True)

