"""The runtime flags every engine-starting command shares (``generate``, ``serve``, the engine
benchmarks): ``--dtype``, ``--threads-per-worker``, ``--kv-cache-memory``, ``--num-blocks``,
``--max-num-batched-tokens``; resolved and checked here, torch-free, before any worker starts.

``resolve_runtime(...)`` turns the flags into a `RuntimeOptions` (a concrete dtype, each
worker's threads and cores, the KV cache size) or raises UserError naming the option and what
is allowed (deploy/cli.py prints it on one line, exit status 2).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
import typer

from engine import platform
from engine.config import (DEFAULT_IDLE_MAX_NUM_BATCHED_TOKENS, DEFAULT_KV_CACHE_BYTES,  # noqa: F401 - serve's defaults
                           DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_PREFILL_FIRST_RATIO)
from engine.errors import UserError

# Chunked-prefill token budget of one forward (decode tokens + prefill chunks), for serve.
# Measured 2026-12-01 (2-core Zen 5, bf16, agg 1 worker x 2 threads; `pdserve bench serve`,
# 32 ShareGPT prompts, 64 tokens, ignore_eos, concurrency 16; machine load 17-40, two rounds):
#   budget 512: 77 / 138 output tok/s, ITL p99 2643 / 838 ms
#   budget 256: 136 / 106 / 140 tok/s,   ITL p99 713 / 768 / 569 ms
#   budget 128: 93 / 139 tok/s,          ITL p99 602 / 505 ms, TTFT p99 the lowest of round 2
# Throughput is the same within the noise; a step's time grows with its prefill chunk, so the
# smallest budget keeps decode rows from stalling behind a prefill (ITL p99).
# DEFAULT_MAX_NUM_BATCHED_TOKENS = 128: engine/config.py (benchmarks build serve's engine from it too)
# The budget of a step with no decode row in it (engine/config.py): a burst at an idle engine is
# prefilled in few big steps, which stall nobody's next token. 2048 = vLLM's CPU default budget.
# DEFAULT_IDLE_MAX_NUM_BATCHED_TOKENS = 2048: engine/config.py (benchmarks build serve's engine from it too)
# A step with decode rows takes that budget too when the requests waiting for their prompt are at
# least this many times the decode rows (engine/config.py SchedulerConfig.prefill_first_ratio).
# 0.5, measured 2026-12-01 on `bench peers`' workload (32 ShareGPT prompts, 5,373 tokens, 64 out,
# concurrency 16): after the burst's first 2048-token step ~10 rows decode while 6 prompts (~1,200
# tokens) still wait; at 1.0 they were chunked 128 tokens a step behind the decode rows (10 more
# steps, the burst's last first token later), at 0.5 they go in one step. Engine alone, closed loop,
# interleaved in one process (heavy, load 3.5-3.9, so absolute figures are ~10x slow): 1.0 139 steps,
# TTFT p99 19.3-20.3 s; 0.5 129 steps, 6.2-6.8 s; tok/s 18-29 vs 34-47. The scheduler alone with a
# step-time model (15 ms + 0.45 ms a prefill token + 0.8 ms a decode row): TTFT p99 1722 -> 1487 ms,
# ITL p99 77 -> 81 ms, tok/s +2.5%; no worse at 64 prompts x concurrency 8 or 32, or 256 tokens out.
# Served (quiet, `bench peers --no-floors`, agg defaults, one server at a time; load 2.2 at start):
# 0.5 388.2 tok/s, TTFT p50/p99 922 / 1176 ms, ITL p99 88; 1.0 374.2, 899 / 1255, 113. An earlier
# quiet pair (1.0 first: 369.5, 928 / 1273) had the 0.5 server disturbed (median ITL 35 vs 25 ms).
# DEFAULT_PREFILL_FIRST_RATIO = 0.5: engine/config.py (benchmarks build serve's engine from it too)
# A prefill worker's step budget (disagg): it never decodes, so no ITL bounds it. Measured 2026-12-01
# (quiet, `bench peers` workload, disagg 1P+1D, one core each, --local-prefill-threshold 128): 2048:
# 371 output tok/s, 512: 300; every prompt through P at 128 with the old scheduler: 244. Each step also
# pushes every chunk's KV layer by layer, a cost per chunk and layer on the prefill worker's one core.
DEFAULT_PREFILL_MAX_NUM_BATCHED_TOKENS = 2048
# Default KV cache per worker: this much, or less where memory is short (below).
# DEFAULT_KV_CACHE_BYTES = 2 * 2**30: engine/config.py (benchmarks build serve's engine from it too)
DEFAULT_KV_MEMORY_FRACTION = 0.2   # of MemAvailable, shared by the workers of this host
# Of a default-sized KV cache, what a prefill worker gets (disagg): 2 GiB -> 1 GiB, 45k tokens of the
# bundled model in flight or cached on it. Measured (quiet, bench peers, disagg 1P+1D): peak RSS
# 7044-7157 MiB with 2 GiB each, 1.49-1.51x vLLM CPU's 4749 MiB at its 2 GiB (the bound: 1.5x).
DEFAULT_PREFILL_KV_FRACTION = 0.5
MEMORY_HEADROOM = 0.9              # KV + weights of all workers must fit in this much of MemAvailable
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1,
                      "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}

_PANEL = "Runtime"


def dtype_option():
    return typer.Option("auto", "--dtype", rich_help_panel=_PANEL,
                        help="auto | float32 | bfloat16 | float16. auto: bf16 where the device has native bf16 "
                             "(AVX512-BF16/AMX, or a GPU with bf16), else float32.")


def threads_option():
    return typer.Option(None, "--threads-per-worker", rich_help_panel=_PANEL,
                        help="torch threads of each worker, bound to its own cores "
                             "(default: the available cores divided among the workers on this host).")


def kv_memory_option():
    return typer.Option(None, "--kv-cache-memory", rich_help_panel=_PANEL,
                        help="KV cache per worker, e.g. 2GiB (default: 2 GiB, or 20% of the available memory "
                             "divided among the workers if less). Exclusive with --num-blocks.")


def num_blocks_option():
    return typer.Option(None, "--num-blocks", rich_help_panel=_PANEL,
                        help="KV cache blocks per worker (instead of --kv-cache-memory).")


def batched_tokens_option(default: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS):
    return typer.Option(default, "--max-num-batched-tokens", rich_help_panel=_PANEL,
                        help="Token budget of one forward: decode tokens + chunked-prefill chunks.")


def prefill_batched_tokens_option():
    return typer.Option(DEFAULT_PREFILL_MAX_NUM_BATCHED_TOKENS, "--prefill-max-num-batched-tokens",
                        rich_help_panel=_PANEL,
                        help="Token budget of a prefill worker's step (disagg mode; it never decodes, so no "
                             "decode row waits behind it): chunks this long hand prompts to the decode worker early.")


def check_prefill_batched_tokens(value: int, max_num_seqs: int) -> int:
    """--prefill-max-num-batched-tokens must be >= --max-num-seqs (as every budget); UserError naming it otherwise."""
    if value < max(1, max_num_seqs):
        raise UserError(f"--prefill-max-num-batched-tokens {value}: must be >= --max-num-seqs ({max_num_seqs})")
    return value


def idle_batched_tokens_option():
    return typer.Option(DEFAULT_IDLE_MAX_NUM_BATCHED_TOKENS, "--idle-max-num-batched-tokens", rich_help_panel=_PANEL,
                        help="Token budget of a step with no decode row (prompts arriving at an idle engine); "
                             "never below --max-num-batched-tokens.")


def prefill_first_ratio_option():
    return typer.Option(DEFAULT_PREFILL_FIRST_RATIO, "--prefill-first-ratio", rich_help_panel=_PANEL,
                        help="A step with decode rows also takes --idle-max-num-batched-tokens when the requests "
                             "waiting for their prompt are at least this many times the decode rows (a burst); "
                             "0: only steps with no decode row.")


def check_prefill_first_ratio(value: float) -> float:
    """--prefill-first-ratio must be a finite number >= 0; UserError naming it otherwise."""
    if not 0 <= value < float("inf"):
        raise UserError(f"--prefill-first-ratio {value}: must be a number >= 0")
    return value


def check_idle_batched_tokens(value: int) -> int:
    """--idle-max-num-batched-tokens must be >= 1; UserError naming it otherwise."""
    if value < 1:
        raise UserError(f"--idle-max-num-batched-tokens {value}: must be >= 1")
    return value


@dataclass(frozen=True)
class RuntimeOptions:
    """What the runtime flags resolved to. dtype: "float32" | "bfloat16" | "float16".
    cores[i]: the CPU ids worker i is bound to (None: do not bind, e.g. a remote Ray cluster).
    Exactly one of num_blocks / kv_cache_memory_bytes is set."""

    dtype: str
    dtype_reason: str
    threads: int
    cores: tuple[tuple[int, ...], ...] | None
    shared_cores: bool
    num_blocks: int | None
    kv_cache_memory_bytes: int | None
    max_num_batched_tokens: int

    def describe(self, prefill_kv_cache_memory_bytes: int | None = None) -> str:
        """The start-up line: dtype and why, ISA, threads and cores, KV cache (a prefill worker's
        too, where it differs: ``prefill_kv_cache_memory_bytes``, see default_prefill_kv_cache_bytes)."""
        kv = (f"{self.num_blocks} KV blocks" if self.num_blocks is not None
              else f"KV cache {platform.format_bytes(self.kv_cache_memory_bytes or 0)}")
        if prefill_kv_cache_memory_bytes:
            kv += f" per decode worker, {platform.format_bytes(prefill_kv_cache_memory_bytes)} per prefill worker,"
        else:
            kv += " per worker,"
        where = ("" if self.cores is None else
                 " on cores " + " | ".join(platform.format_cores(c) for c in self.cores))
        shared = " (more workers than cores: cores shared)" if self.shared_cores else ""
        return (f"dtype {self.dtype} ({self.dtype_reason}), isa {platform.cpu_isa()}, "
                f"{self.threads} thread(s) per worker{where}{shared}, {kv} "
                f"max_num_batched_tokens {self.max_num_batched_tokens}")


def resolve_runtime(*, model_dir: Path | None, dtype: str, threads_per_worker: int | None,
                    kv_cache_memory: str | None, num_blocks: int | None, max_num_batched_tokens: int,
                    num_workers: int = 1, device: str = "cpu", block_size: int = 16, max_num_seqs: int = 1,
                    bind_cores: bool = True) -> RuntimeOptions:
    """Check and resolve the runtime flags for ``num_workers`` workers on this host.

    model_dir: the HF-layout directory (its config.json and safetensors headers size the KV
    blocks and weights); None skips the memory check. bind_cores False: a remote cluster, whose
    cores this host does not know (threads only). Raises UserError naming the option.
    """
    resolved = platform.resolve_dtype_name(dtype, device)
    if bind_cores and device == "cpu":
        assignment = platform.assign_cores(num_workers, threads_per_worker)
        threads, cores, shared = assignment.threads, assignment.cores, assignment.shared
    else:
        if threads_per_worker is not None and threads_per_worker < 1:
            raise UserError(f"--threads-per-worker {threads_per_worker}: must be >= 1")
        threads, cores, shared = threads_per_worker or 1, None, False
    if max_num_batched_tokens < max(1, max_num_seqs):
        raise UserError(f"--max-num-batched-tokens {max_num_batched_tokens}: must be >= --max-num-seqs "
                        f"({max_num_seqs}), so every running request can decode each step")
    blocks, kv_bytes = _kv_size(model_dir, resolved, kv_cache_memory, num_blocks, num_workers, block_size)
    return RuntimeOptions(resolved, platform.dtype_reason(dtype, resolved, device), threads, cores, shared,
                          blocks, kv_bytes, max_num_batched_tokens)


def _kv_size(model_dir: Path | None, dtype: str, kv_cache_memory: str | None, num_blocks: int | None,
             num_workers: int, block_size: int) -> tuple[int | None, int | None]:
    if kv_cache_memory is not None and num_blocks is not None:
        raise UserError("--kv-cache-memory and --num-blocks both size the KV cache: give one of them")
    if num_blocks is not None and num_blocks < 1:
        raise UserError(f"--num-blocks {num_blocks}: must be >= 1")
    available = platform.available_memory_bytes()
    if kv_cache_memory is not None:
        kv_bytes, option = platform.parse_bytes(kv_cache_memory), f"--kv-cache-memory {kv_cache_memory}"
    elif num_blocks is not None:
        per = block_bytes(model_dir, dtype, block_size) if model_dir is not None else None
        kv_bytes = None if per is None else num_blocks * per
        option = f"--num-blocks {num_blocks}"
    else:
        kv_bytes = default_kv_cache_bytes(num_workers, available)
        option = "the default KV cache"
    per_block = block_bytes(model_dir, dtype, block_size) if model_dir is not None else None
    if per_block is not None and available is not None and kv_bytes is not None:
        if kv_bytes < per_block:
            raise UserError(f"{option}: smaller than one KV block ({platform.format_bytes(per_block)})")
        weights = weight_bytes(model_dir, dtype)
        need = num_workers * (kv_bytes + weights)
        if need > MEMORY_HEADROOM * available:
            most = max(0, int(MEMORY_HEADROOM * available / num_workers - weights))
            raise UserError(f"{option}: {num_workers} worker(s) x ({platform.format_bytes(kv_bytes)} KV + "
                            f"{platform.format_bytes(weights)} weights) do not fit in the "
                            f"{platform.format_bytes(available)} of memory available; use at most "
                            f"{platform.format_bytes(most)} of KV cache per worker")
    if num_blocks is not None:
        return num_blocks, None
    return None, kv_bytes


def default_prefill_kv_cache_bytes(rt: RuntimeOptions, kv_cache_memory: str | None,
                                   num_blocks: int | None) -> int | None:
    """A prefill worker's KV cache when neither --kv-cache-memory nor --num-blocks was given:
    DEFAULT_PREFILL_KV_FRACTION of the default. It holds a prompt only from its prefill to the decode
    worker's Release (plus its prefix cache), where the decode worker holds every sequence for its
    whole life. None (every worker alike) when the user sized the cache."""
    if kv_cache_memory is not None or num_blocks is not None or rt.kv_cache_memory_bytes is None:
        return None
    return int(rt.kv_cache_memory_bytes * DEFAULT_PREFILL_KV_FRACTION)


def local_model_dir(model: str) -> Path | None:
    """The model's HF-layout directory on this host, or None where this host cannot resolve it
    (a path that exists only on the Ray cluster's nodes): the workers then report it."""
    from engine.model_loader import resolve_model

    try:
        return resolve_model(model)
    except UserError:
        return None


def check_model(model: str, *, local_cluster: bool, max_model_len: int | None = None) -> Path | None:
    """The model's directory on this host (see local_model_dir), checked before any worker starts.

    local_cluster: the workers run on this host (an embedded Ray), so a model this host cannot
    resolve is the user's error now, not a worker's traceback later. Raises UserError for that and
    for a --max-model-len beyond the model's context (vLLM refuses it too)."""
    from engine.model_loader import resolve_model

    model_dir = local_model_dir(model)
    if model_dir is None and local_cluster:
        resolve_model(model)  # raises the loader's one-line UserError
    if model_dir is not None and max_model_len is not None:
        from engine.model_config import ModelConfig

        limit = ModelConfig.from_pretrained(model_dir).max_model_len
        if max_model_len > limit:
            raise UserError(f"--max-model-len {max_model_len} exceeds the model's context of {limit} tokens "
                            f"(max_position_embeddings); use at most {limit}")
    return model_dir


def check_draft_vocab_size(draft_dir: Path | None, draft_vocab_size: int | None) -> None:
    """--speculative-draft-vocab-size within the draft model's vocabulary (draft_dir: its directory
    on this host; None, e.g. a remote cluster's model: the worker checks it). UserError otherwise."""
    if draft_dir is None or draft_vocab_size is None:
        return
    from engine.model_config import ModelConfig

    vocab = ModelConfig.from_pretrained(draft_dir).vocab_size
    if not 1 <= draft_vocab_size <= vocab:
        raise UserError(f"--speculative-draft-vocab-size must be in [1, {vocab}] (the draft model's vocabulary), "
                        f"got {draft_vocab_size}")


def default_kv_cache_bytes(num_workers: int, available: int | None) -> int:
    """DEFAULT_KV_CACHE_BYTES per worker, or DEFAULT_KV_MEMORY_FRACTION of the available memory
    shared among the workers if that is less (MiB-aligned)."""
    if available is None:
        return DEFAULT_KV_CACHE_BYTES
    share = int(DEFAULT_KV_MEMORY_FRACTION * available / max(1, num_workers))
    return max(2**20, min(DEFAULT_KV_CACHE_BYTES, share) // 2**20 * 2**20)


def block_bytes(model_dir: Path, dtype: str, block_size: int) -> int | None:
    """Bytes one KV block holds over every layer, K and V (engine/kv_cache.py's layout); None
    when config.json is unreadable or not a decoder's (the model loader then says what is wrong)."""
    try:
        c = json.loads((Path(model_dir) / "config.json").read_text())
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        kv_heads = c.get("num_key_value_heads") or heads
        return 2 * c["num_hidden_layers"] * block_size * kv_heads * head_dim * _ELEMENT_BYTES[dtype]
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def weight_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes of the model's weights in ``dtype``: parameter counts from the safetensors headers
    (read without loading a tensor); 0 for files that are not safetensors."""
    params = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, t in header.items():
                if name != "__metadata__":
                    count = 1
                    for d in t["shape"]:
                        count *= d
                    params += count
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            continue
    return params * _ELEMENT_BYTES[dtype]

