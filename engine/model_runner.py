"""ModelRunner: one model, one paged KV cache, one forward over a flat batch of chunks.

The shape every scheduler uses (chunked prefill, continuous batching, speculative
verification): ``forward(chunks)`` takes any mix of prefill chunks and decode tokens from many
sequences, writes their K/V into the cache through their block tables and returns the logits
the chunks ask for. The runner owns no request state: block ids come from the caller.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from engine.batch import SeqChunk
from engine.huge_pages import collapse_into_huge_pages, module_tensors
from engine.kv_cache import KVCacheSpec, PagedKVCache
from engine.model_config import ModelConfig
from engine.model_loader import resolve_model
from engine.quantization import check_kv_cache_dtype, check_quantization
from engine.quantization.apply import apply_quantization, weights_descriptor
from engine.quantization.checkpoint import Fp8Weight, split_fp8
from engine.quantization.kv_scales import CALIBRATION_TEXT, KVScales, calibrate_kv, load_or_calibrate
from engine.models.llama import LlamaForCausalLM
from kernels.attention import AttentionMetadata, get_attention_backend
from kernels.decoder_loop import build_decoder_loop
from kernels.layer_ops import get_layer_ops
from kernels.linear import kernel_summary, release_freed_memory

DEFAULT_KV_CACHE_BYTES = 512 * 2**20

log = logging.getLogger(__name__)


class ModelRunner:
    """Loads the model and allocates the KV cache at construction.

    model_path_or_config: a model name or path (see engine.model_loader.resolve_model) or a
        ModelConfig. block_size: tokens per KV block. num_blocks / kv_cache_memory_bytes: cache
        size (num_blocks wins; default DEFAULT_KV_CACHE_BYTES). dtype: weights, activations and
        cache (logits are always float32). attention_backend: see kernels.attention.BACKENDS;
        ``"auto"`` picks the in-place CPU kernel on CPU when it builds (logged, with the reason
        when not), the Triton kernel on CUDA; the choice is ``self.attention_backend``.
        quantization: how the decoder's linears run, chosen once here (engine.quantization:
        "none", "int8", "fp8"). kv_cache_dtype: "auto" (= dtype) or "fp8_e4m3". layer_ops: the
        decoder's small ops (kernels.layer_ops.LAYER_OPS: "auto" = the C++ ones on CPU when they
        build), the choice is ``self.layer_ops``. decoder_loop: run the decoder layers through the
        fused C++ loop where it covers a forward (kernels/decoder_loop.py; logged at load, and
        ``self.model.decoder_path`` names the loop the last forward ran); False: the Python loop.
    """

    def __init__(self, model_path_or_config: str | os.PathLike[str] | ModelConfig, *, block_size: int = 16,
                 num_blocks: int | None = None, kv_cache_memory_bytes: int | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 attention_backend: str = "auto", quantization: str = "none",
                 kv_cache_dtype: str = "auto", layer_ops: str = "auto", decoder_loop: bool = True) -> None:
        if isinstance(model_path_or_config, ModelConfig):
            self.model_config = model_path_or_config
        else:
            self.model_config = ModelConfig.from_pretrained(resolve_model(model_path_or_config))
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.ops = get_attention_backend(attention_backend, self.device)
        self._reference_ops = get_attention_backend("torch")
        self.attention_backend = self.ops.name
        log.info("attention backend: %s (asked for %s)", self.ops.name, attention_backend)
        self.quantization = check_quantization(quantization)
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
        self.model = load_model(self.model_config, dtype, self.device)
        self.model.layer_ops = get_layer_ops(layer_ops, self.device)
        self.layer_ops = self.model.layer_ops.name
        # After loading and before the cache: the linears' kernels are timed here, once.
        apply_quantization(self.model, quantization, fp8_weights=self.model.fp8_checkpoint)
        self.weights_descriptor = weights_descriptor(self.model, self.quantization)   # (for the KV compat key)
        log.info("linear kernels (1/16/512 rows): %s", kernel_summary(self.model))
        release_freed_memory()   # the weight copies no chosen kernel reads (kernels/linear.py)
        if self.device.type == "cpu":   # every decode step streams the weights from DRAM
            started = time.perf_counter()
            moved = collapse_into_huge_pages(module_tensors(self.model))
            log.info("weights on huge pages: %d MiB in %.2f s", moved >> 20, time.perf_counter() - started)
        cfg = self.model_config
        cache_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else dtype
        self.kv_scales: KVScales | None = None
        if kv_cache_dtype == "fp8_e4m3":
            self._use_fp8_kv_cache()
        if num_blocks is None:
            num_blocks = KVCacheSpec.blocks_for_memory(kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES,
                                                       cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                                       block_size, cache_dtype)
        spec = KVCacheSpec(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                           block_size=block_size, num_blocks=num_blocks, dtype=cache_dtype,
                           scales_digest=self.kv_scales.digest() if self.kv_scales is not None else "")
        self.kv_cache = PagedKVCache(spec, device=self.device)
        self._use_decoder_loop(decoder_loop)

    def _use_decoder_loop(self, wanted: bool) -> None:
        """Build the fused C++ layer loop (kernels/decoder_loop.py) after the linears and the KV
        scales are set, and say at load which forwards will run the Python loop and why."""
        self.model.decoder_loop = None
        if not wanted:
            log.info("decoder loop: python (decoder_loop=False)")
            return
        loop, reason = build_decoder_loop(self.model)
        self.model.decoder_loop = loop
        if loop is None:
            log.info("decoder loop: python for every forward: %s", reason)
        else:
            log.info("decoder loop: fused C++ with the cpu attention backend (a C++ call per layer with a layer hook)%s",
                     f"; python for {reason}" if reason else "")

    def _use_fp8_kv_cache(self) -> None:
        """Load (or calibrate once and store) the model's KV scales and offsets and hand them to
        every layer (offsets in the compute dtype: engine/models/llama.py subtracts them)."""
        if not getattr(self.ops, "supports_kv_scales", False):
            log.warning("attention backend %s has no FP8 KV cache support: using the torch reference", self.ops.name)
            self.ops = self._reference_ops
            self.attention_backend = self.ops.name
        cfg = self.model_config
        self.kv_scales = load_or_calibrate(Path(cfg.path), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                           self._calibrate_kv_scales)
        for l, layer in enumerate(self.model.model.layers):
            attn = layer.self_attn
            k_scale, v_scale = self.kv_scales.layer(l)
            attn.k_scale, attn.v_scale = k_scale.to(self.device), v_scale.to(self.device)
            offsets = self.kv_scales.layer_offsets(l)
            attn.k_offset, attn.v_offset = (None, None) if offsets is None else \
                (o.to(self.device, self.dtype).contiguous() for o in offsets)

    def _calibrate_kv_scales(self) -> KVScales:
        """One forward over the calibration text with a cache in the compute dtype, recording each
        layer's K (after RoPE) and V (engine/quantization/kv_scales.py calibrate_kv)."""
        from engine.model_loader import load_tokenizer

        cfg = self.model_config
        ids = load_tokenizer(cfg.path)(CALIBRATION_TEXT.read_text())["input_ids"][:cfg.max_model_len]
        spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.block_size,
                           -(-len(ids) // self.block_size), self.dtype)
        recorder = KVRecorder(self._reference_ops, cfg.num_layers)
        ops, cache = self.ops, getattr(self, "kv_cache", None)
        self.ops, self.kv_cache = recorder, PagedKVCache(spec, device=self.device)
        try:
            self.forward([SeqChunk(ids, 0, list(range(spec.num_blocks)), 1)], layer_hook=recorder.end_layer)
        finally:
            self.ops, self.kv_cache = ops, cache
        what = f"{len(ids)} tokens of {CALIBRATION_TEXT.name}, {str(self.dtype).removeprefix('torch.')}, " \
               f"quantization {self.quantization}"
        log.info("calibrated FP8 KV scales and offsets on %s", what)
        return calibrate_kv(recorder.keys, recorder.values, what)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.spec.num_blocks

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk], layer_hook: Callable[[int], None] | None = None, *,
                pad_to_longest: bool = False) -> torch.Tensor:
        """Run one forward; return logits [sum(c.num_logits), vocab] float32, in chunk order.

        layer_hook(l) is called right after layer l has written its K/V for every chunk.
        pad_to_longest: attend all decode rows padded to the longest context (static batching's
        baseline cost, always with the torch reference) instead of in groups of similar length
        or in place; the result is the same up to rounding. Grouping is done on CPU only:
        elsewhere a group's fixed cost (kernel launches) is unmeasured, and a paged kernel needs
        no padding at all.
        Raises ValueError for an empty batch, a chunk with no tokens, num_logits outside
        [0, num_tokens], a context beyond max_model_len, or a block table that is too short
        or names a block outside the cache.
        """
        self._check(chunks)
        input_ids, positions, logits_indices = self._flatten(chunks)
        # The padded baseline is the reference's padded attention: an in-place kernel pads nothing.
        ops = self._reference_ops if pad_to_longest else self.ops
        meta = AttentionMetadata.build([c.start_pos for c in chunks], [c.num_tokens for c in chunks],
                                       [c.block_table for c in chunks], self.block_size, self.device, self.dtype,
                                       group_by_length=self.device.type == "cpu" and not pad_to_longest,
                                       groups=getattr(ops, "metadata_groups", "all"))
        return self.model(input_ids, positions, self.kv_cache, meta, logits_indices, ops, layer_hook)

    def _flatten(self, chunks: Sequence[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """input_ids [T], positions [T] int64 and logits_indices [L] int64, or None when every row
        asks for its logits (decode: the model then skips the row gather). Built as one Python
        list and one tensor, split into views: one list-to-tensor copy a step instead of three."""
        flat: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        for c in chunks:
            offset = len(flat)
            flat.extend(c.token_ids)
            positions.extend(range(c.start_pos, c.seq_len))
            logits_indices.extend(range(offset + c.num_tokens - c.num_logits, offset + c.num_tokens))
        num_tokens, every_row = len(flat), len(logits_indices) == len(flat)
        flat.extend(positions)
        if not every_row:
            flat.extend(logits_indices)
        packed = torch.tensor(flat, dtype=torch.int64).to(self.device)
        if every_row:
            ids, pos = packed.split([num_tokens, num_tokens])
            return ids, pos, None
        return packed.split([num_tokens, num_tokens, len(logits_indices)])

    def _check(self, chunks: Sequence[SeqChunk]) -> None:
        if not chunks:
            raise ValueError("forward needs at least one chunk")
        max_len = self.model_config.max_model_len
        for i, c in enumerate(chunks):
            if c.num_tokens < 1:
                raise ValueError(f"chunk {i}: no tokens")
            if not 0 <= c.num_logits <= c.num_tokens:
                raise ValueError(f"chunk {i}: num_logits must be in [0, {c.num_tokens}], got {c.num_logits}")
            if c.start_pos < 0 or c.seq_len > max_len:
                raise ValueError(f"chunk {i}: context {c.seq_len} exceeds max_model_len {max_len}")
            needed = -(-c.seq_len // self.block_size)
            if len(c.block_table) < needed:
                raise ValueError(f"chunk {i}: block table has {len(c.block_table)} blocks, needs {needed}")
            if any(not 0 <= b < self.num_blocks for b in c.block_table[:needed]):
                raise ValueError(f"chunk {i}: block id outside [0, {self.num_blocks})")


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Build the model without initializing weights, then load its safetensors (memory-mapped).

    An FP8 checkpoint's E4M3 linears load dequantized to ``dtype``; the E4M3 weights and their
    scales are kept as ``model.fp8_checkpoint`` (module name -> Fp8Weight) for ``--quantization fp8``.
    """
    from safetensors import safe_open

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    files = sorted(Path(cfg.path).glob("*.safetensors"))

    def weights():
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)

    tensors, fp8 = split_fp8(Path(cfg.path), weights(), dtype)
    model.load_weights(tensors, dtype=dtype, device=device)
    model.fp8_checkpoint = {name: Fp8Weight(w.qweight.to(device), w.scale.to(device)) for name, w in fp8.items()}
    return model.eval()


class KVRecorder:
    """An attention backend for calibration: the torch reference, keeping every K and V written.
    ``end_layer(l)`` (the forward's layer hook) files the last write under layer l."""

    name = "calibration"
    metadata_groups = "all"

    def __init__(self, reference, num_layers: int) -> None:
        self._ref = reference
        self.paged_attention = reference.paged_attention
        self.keys: list[torch.Tensor | None] = [None] * num_layers     # [T, Hkv, D] each
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self._last = (key.detach().clone(), value.detach().clone())
        self._ref.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    def end_layer(self, l: int) -> None:
        assert self._last is not None, "layer hook before any K/V write"
        self.keys[l], self.values[l] = self._last
        self._last = None
