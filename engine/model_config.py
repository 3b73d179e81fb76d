"""ModelConfig: the architecture facts the runtime needs, read once from an HF config.json.

Read with transformers' ``AutoConfig`` (the config only; transformers never runs our forward).
Frozen and hashable, so it can key caches and be compared between workers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UserError

# The Llama family, one implementation (engine/models/llama.py). Sliding windows (Mistral) are
# not applied: contexts here stay within the window.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (``rope_type``: default, linear or llama3)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    name: str                      # identity: the checkpoint directory's name
    path: str                      # HF-layout directory the weights load from
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    rms_norm_eps: float
    rope: RopeConfig
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    tie_word_embeddings: bool
    qkv_bias: bool                 # Qwen2, or Llama with attention_bias
    o_bias: bool                   # Llama with attention_bias
    mlp_bias: bool
    dtype: str                     # the checkpoint's dtype ("float32", "bfloat16", ...)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> "ModelConfig":
        """Read ``path/config.json`` (and generation_config.json for extra EOS ids).

        Raises UserError if the config cannot be read or names an unsupported architecture.
        """
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig

        path = Path(path)
        try:
            hf = AutoConfig.from_pretrained(str(path))
        except (ValueError, OSError, KeyError) as e:
            raise UserError(f"cannot read the model config in {str(path)!r}: {str(e).splitlines()[0]}") from e
        arch = (getattr(hf, "architectures", None) or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UserError(f"unsupported architecture {arch!r} in {str(path)!r}: "
                            f"supported are {', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = hf.num_attention_heads
        attention_bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            name=path.name,
            path=str(path),
            architecture=arch,
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            vocab_size=hf.vocab_size,
            max_model_len=hf.max_position_embeddings,
            rms_norm_eps=hf.rms_norm_eps,
            rope=_rope_config(hf),
            eos_token_ids=_eos_token_ids(hf, path),
            bos_token_id=getattr(hf, "bos_token_id", None),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            dtype=str(getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "float32").replace("torch.", ""),
        )


def _rope_config(hf) -> RopeConfig:
    # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters.
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    if theta is None:
        raise UserError("model config has no rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UserError(f"unsupported RoPE type {rope_type!r}: supported are {', '.join(SUPPORTED_ROPE_TYPES)}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_token_ids(hf, path: Path) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [getattr(hf, "eos_token_id", None)]
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    for src in sources:
        for i in ([src] if isinstance(src, int) else (src or [])):
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)
