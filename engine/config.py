"""Engine configuration: frozen dataclasses, validated at construction. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.spec_decode.config import SpeculativeConfig

# `pdserve serve`'s defaults for an agg or decode worker (the measurements behind each value are in
# deploy/runtime_options.py, which uses them; bench/closed_loop.py builds the same engine from them).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 128        # a step's token budget with decode rows in it
DEFAULT_IDLE_MAX_NUM_BATCHED_TOKENS = 2048  # a step's budget with none (or prefill-first)
DEFAULT_PREFILL_FIRST_RATIO = 0.5           # prefill-first while waiting prompts >= this x decode rows
DEFAULT_KV_CACHE_BYTES = 2 * 2**30          # a worker's KV cache (less where memory is short)

Batching = Literal["continuous", "static"]


@dataclass(frozen=True)
class SchedulerConfig:
    """max_num_seqs: most requests in the running batch.
    max_num_batched_tokens: token budget of one forward (decode tokens + prefill chunks).
    idle_max_num_batched_tokens: the budget of a step with no decode row in it (a burst arriving at
        an idle engine): such a step delays nobody's next token, so its prompts are prefilled in
        bigger chunks, fewer steps. None = max_num_batched_tokens; never below it.
    prefill_first_ratio: a step with decode rows also takes idle_max_num_batched_tokens when the
        requests waiting for (the rest of) their prompt number at least this many times the decode
        rows (a burst: mostly waiting). None or 0 = only steps with no decode row.
    max_model_len: longest sequence (prompt + output); None = the model's context length.
    batching: "continuous" (iteration-level, Orca/vLLM) or "static" (HF generate style, for comparison).
    max_waiting: most queued requests before add() refuses with RESOURCE_EXHAUSTED; None = unbounded.
    static_padding: static batching only. True (default): pad as a contiguous-cache engine (HF
        ``generate``) does: prompts left-padded to the batch's longest (the padding is computed,
        its result discarded), every row attends the batch's longest context, and each row
        reserves KV for the longest prompt plus the largest max_tokens. False: a paged static
        batch, where only finished rows are padding (rows are attended in groups of similar
        length, as in continuous batching).
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    idle_max_num_batched_tokens: int | None = None
    prefill_first_ratio: float | None = None
    max_model_len: int | None = None
    batching: Batching = "continuous"
    enable_chunked_prefill: bool = True
    max_waiting: int | None = None
    static_padding: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}) so every running request can decode each step")
        if self.idle_max_num_batched_tokens is not None and self.idle_max_num_batched_tokens < 1:
            raise ValueError(f"idle_max_num_batched_tokens must be >= 1, got {self.idle_max_num_batched_tokens}")
        if self.prefill_first_ratio is not None and not self.prefill_first_ratio >= 0:
            raise ValueError(f"prefill_first_ratio must be >= 0, got {self.prefill_first_ratio}")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """block_size: tokens per KV block. num_blocks: blocks in the cache; None = derive from
    memory_bytes (default 512 MiB). watermark: fraction of blocks kept free at admission."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")

    def resolved_memory_bytes(self) -> int | None:
        if self.num_blocks is not None:
            return None
        return self.memory_bytes if self.memory_bytes is not None else 512 * 2**20


@dataclass(frozen=True)
class EngineConfig:
    """model: a name ("smollm2-135m-instruct") or an HF-layout directory.
    dtype: "auto" | "float32" | "bfloat16" | "float16" of weights, activations and KV cache
        ("auto": bf16 where the device has native bf16, else fp32; see engine/platform.py;
        logits, RMSNorm and softmax stay fp32); device: "cpu" or "cuda[:i]".
    num_threads: torch intra-op threads for this engine (None = leave torch's setting).
    quantization: the decoder's linear method, "none" | "int8" | "fp8" (engine/quantization).
    kv_cache_dtype: "auto" (= dtype) | "fp8_e4m3" (calibrated scales stored beside the model).
    cpu_cores: CPU ids this engine's process is bound to (None = leave the affinity alone).
    speculative: speculative decoding (engine/spec_decode/); None = off. Continuous batching only.
    """

    model: str = "smollm2-135m-instruct"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    dtype: str = "auto"
    device: str = "cpu"
    num_threads: int | None = None
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    cpu_cores: tuple[int, ...] | None = None
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        from engine.quantization import KV_CACHE_DTYPES, QUANTIZATION_METHODS

        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
