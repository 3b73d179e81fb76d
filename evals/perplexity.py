"""``pdserve eval ppl``: perplexity of a text through pdserve's own runtime and paged KV cache.

Method: the sliding window of the Hugging Face perplexity guide ("Perplexity of fixed-length
models"). Windows of ``context`` tokens start every ``stride`` tokens; each window scores only
the tokens the previous window did not (the first window scores all but its first token), each
conditioned on up to ``context - 1`` tokens before it; perplexity = exp(sum of NLL / tokens
scored). Every token of the text but the first is scored exactly once when stride < context (with stride == context, as in the guide, each window's
first token is context only).

Each window is one sequence in the paged cache: its tokens are prefilled in chunks of at most
``chunk_tokens`` (chunked prefill, so later chunks attend over K/V already in the cache), and its
last ``decode_tokens`` scored positions go through the decode path one token per forward. Both
paths read the same cache, in the cache's dtype (``--kv-cache-dtype``), so an FP8 KV cache is
exercised on prefill and decode alike.

A configuration is (dtype, quantization, kv_cache_dtype); ``--compare`` runs a matrix of them at
one dtype and reports each one's perplexity relative to the unquantized baseline of that dtype.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import typer

from engine.errors import UserError
from engine.quantization import check_kv_cache_dtype, check_quantization

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"  # ../shared/data beside the repo
DEFAULT_TEXT = SHARED_DATA / "wikitext-2-raw-test.txt"

COMPARE_MATRIX: tuple[tuple[str, str], ...] = (
    ("none", "auto"), ("fp8", "auto"), ("int8", "auto"), ("none", "fp8_e4m3"), ("fp8", "fp8_e4m3"),
)
"""(quantization, kv_cache_dtype) pairs ``--compare`` runs; the first is the baseline."""


@dataclass(frozen=True)
class EvalConfig:
    """One configuration of the runtime under evaluation."""

    dtype: str
    quantization: str = "none"
    kv_cache_dtype: str = "auto"

    @property
    def label(self) -> str:
        return f"{self.dtype} w={self.quantization} kv={self.kv_cache_dtype}"


@dataclass(frozen=True)
class WindowPlan:
    """One window of the sliding-window evaluation over ``token_ids[begin:end]``.

    first_target: the first position whose token this window scores (targets are
    ``first_target .. end - 1``; the logits for target t come from position t - 1).
    """

    begin: int
    end: int
    first_target: int

    @property
    def num_targets(self) -> int:
        return self.end - self.first_target


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    num_tokens: int          # tokens scored
    nll_sum: float           # nats
    num_decode_tokens: int   # of num_tokens, scored through the decode path
    num_windows: int


def plan_windows(num_tokens: int, context: int, stride: int) -> list[WindowPlan]:
    """The HF guide's windows over ``num_tokens`` tokens. Raises ValueError on bad sizes."""
    if context < 2 or not 1 <= stride <= context:
        raise ValueError(f"need context >= 2 and 1 <= stride <= context, got context={context} stride={stride}")
    if num_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score, got {num_tokens}")
    windows, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + context, num_tokens)
        first_target = max(prev_end, begin + 1)
        if first_target < end:  # (stride == context leaves a last window of one token: nothing to score)
            windows.append(WindowPlan(begin, end, first_target))
        prev_end = end
        if end == num_tokens:
            break
    return windows


def evaluate(runner, token_ids: Sequence[int], context: int, stride: int, *, decode_tokens: int = 8,
             chunk_tokens: int = 512, progress: Callable[[int], None] | None = None) -> PerplexityResult:
    """Sliding-window perplexity of ``token_ids`` through ``runner`` (an engine.model_runner.ModelRunner
    with at least ceil(context / block_size) KV blocks). ``progress(n)`` is called after each window."""
    import torch

    windows = plan_windows(len(token_ids), context, stride)
    needed = -(-context // runner.block_size)
    if runner.num_blocks < needed:
        raise ValueError(f"the runner's cache has {runner.num_blocks} blocks, a {context}-token window needs {needed}")
    block_table = list(range(needed))  # every window reuses the same blocks: one sequence at a time
    nll_sum, scored, decoded = 0.0, 0, 0
    for w in windows:
        logits, targets, n_dec = _window_logits(runner, token_ids, w, block_table, decode_tokens, chunk_tokens)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        nll_sum -= float(logprobs.gather(1, targets.to(logprobs.device)[:, None]).sum())
        scored += len(targets)
        decoded += n_dec
        if progress is not None:
            progress(1)
    return PerplexityResult(perplexity=math.exp(nll_sum / scored), num_tokens=scored, nll_sum=nll_sum,
                            num_decode_tokens=decoded, num_windows=len(windows))


def _window_logits(runner, token_ids: Sequence[int], w: WindowPlan, block_table: list[int],
                   decode_tokens: int, chunk_tokens: int):
    """Logits [num_targets, vocab] float32 predicting tokens first_target..end-1, and those targets [num_targets]."""
    import torch

    from engine.batch import SeqChunk

    # Positions begin .. end-2 are fed; the last num_targets of them need logits.
    feed = list(token_ids[w.begin:w.end - 1])
    n_dec = max(0, min(decode_tokens, w.num_targets, len(feed) - 1))  # at least one prefill token
    n_prefill = len(feed) - n_dec
    first_logit = len(feed) - w.num_targets   # index into feed of the first position needing logits
    parts = []
    for start in range(0, n_prefill, chunk_tokens):
        stop = min(start + chunk_tokens, n_prefill)
        num_logits = max(0, stop - max(start, first_logit))
        out = runner.forward([SeqChunk(feed[start:stop], start, block_table, num_logits)])
        if num_logits:
            parts.append(out)
    for pos in range(n_prefill, len(feed)):   # the decode path: one token per forward
        parts.append(runner.forward([SeqChunk(feed[pos:pos + 1], pos, block_table, 1)]))
    targets = torch.tensor(token_ids[w.first_target:w.end], dtype=torch.int64)
    return torch.cat(parts), targets, n_dec


# -- the command ----------------------------------------------------------------------------------
def command(
    model: str = typer.Option("smollm2-135m-instruct", "--model", "-m", help="Bundled model name, HF directory or .gguf file."),
    dtype: str = typer.Option("float32", "--dtype", help="Weights/activations dtype: float32, bfloat16 or float16."),
    quantization: str = typer.Option("none", "--quantization", help="Linear method: none, int8 or fp8."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="KV-cache dtype: auto (the model's) or fp8_e4m3."),
    text: Optional[Path] = typer.Option(None, "--text", help=f"UTF-8 text file (default {DEFAULT_TEXT})."),
    context: int = typer.Option(1024, "--context", help="Window length in tokens."),
    stride: int = typer.Option(512, "--stride", help="Tokens between window starts."),
    max_tokens: int = typer.Option(0, "--max-tokens", help="Evaluate only the first N tokens of the text (0 = all)."),
    decode_tokens: int = typer.Option(8, "--decode-tokens", help="Scored positions per window run through the decode path."),
    compare: bool = typer.Option(False, "--compare", help="Run bf16/fp32 baseline, fp8 and int8 weights, fp8 KV and "
                                                          "fp8 weights + fp8 KV at --dtype; print deltas vs the baseline."),
    matrix: Optional[str] = typer.Option(None, "--matrix", help="With --compare: the configurations to run, "
                                         "comma-separated QUANT/KV pairs, the baseline none/auto first "
                                         "(default: all five, e.g. none/auto,int8/auto,none/fp8_e4m3)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the result(s) as JSON here."),
) -> None:
    """Perplexity (sliding window, HF guide) through pdserve's runtime and paged KV cache."""
    configs = _configs(dtype, quantization, kv_cache_dtype, compare, matrix)
    _check_sizes(context, stride, max_tokens, decode_tokens)
    text_path = text or DEFAULT_TEXT
    token_ids = text_tokens(model, text_path, max_tokens)
    meta = {"model": model, "text": str(text_path), "context": context, "stride": stride, "load": _load()}
    _print_header(meta)
    runs = []
    for cfg in configs:   # each row as its run finishes: a run that fails later leaves the earlier ones in the log
        runs.append(run_config(model, cfg, token_ids, context, stride, decode_tokens))
        if compare:
            _add_delta(runs)
        print(_format_row(runs[-1]), flush=True)
    result = {**runs[0], **meta} if not compare else {"runs": runs, **meta}
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {json_out}")


def run_config(model: str, cfg: EvalConfig, token_ids: Sequence[int], context: int, stride: int,
               decode_tokens: int) -> dict:
    """Load the runtime in configuration ``cfg`` and evaluate; the JSON object of one run."""
    from tqdm import tqdm

    import torch

    from engine.model_runner import ModelRunner

    t0 = time.perf_counter()
    runner = ModelRunner(model, block_size=16, num_blocks=-(-context // 16), dtype=getattr(torch, cfg.dtype),
                         **_quant_kwargs(cfg))
    load_s = time.perf_counter() - t0
    windows = plan_windows(len(token_ids), context, stride)
    t0 = time.perf_counter()
    # (disable=None: a bar on a terminal only; in a log its carriage returns would share the rows' lines)
    with tqdm(total=len(windows), desc=cfg.label, unit="win", file=sys.stderr, leave=False, disable=None) as bar:
        r = evaluate(runner, token_ids, context, stride, decode_tokens=decode_tokens, progress=bar.update)
    return {"perplexity": r.perplexity, "num_tokens": r.num_tokens, "config": asdict(cfg),
            "nll_sum": r.nll_sum, "num_decode_tokens": r.num_decode_tokens, "num_windows": r.num_windows,
            "load_s": round(load_s, 2), "eval_s": round(time.perf_counter() - t0, 2)}


def _quant_kwargs(cfg: EvalConfig) -> dict:
    """ModelRunner keyword arguments for the quantized parts (only those that differ from the default)."""
    kwargs = {}
    if cfg.quantization != "none":
        kwargs["quantization"] = cfg.quantization
    if cfg.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = cfg.kv_cache_dtype
    return kwargs


def _configs(dtype: str, quantization: str, kv_cache_dtype: str, compare: bool,
             matrix: str | None = None) -> list[EvalConfig]:
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"--dtype: unknown dtype {dtype!r}; choose one of float32, bfloat16, float16")
    check_quantization(quantization)
    check_kv_cache_dtype(kv_cache_dtype)
    if matrix is not None and not compare:
        raise UserError("--matrix: only with --compare")
    if not compare:
        return [EvalConfig(dtype, quantization, kv_cache_dtype)]
    if (quantization, kv_cache_dtype) != ("none", "auto"):
        raise UserError("--compare runs its own matrix of --quantization and --kv-cache-dtype: give neither")
    pairs = COMPARE_MATRIX if matrix is None else parse_matrix(matrix)
    return [EvalConfig(dtype, q, kv) for q, kv in pairs]


def parse_matrix(matrix: str) -> tuple[tuple[str, str], ...]:
    """``"none/auto,int8/auto"`` -> (("none", "auto"), ("int8", "auto")); UserError naming
    ``--matrix`` for a malformed pair, an unknown name, or a first pair that is not the baseline."""
    pairs = []
    for item in matrix.split(","):
        parts = item.strip().split("/")
        if len(parts) != 2:
            raise UserError(f"--matrix: {item.strip()!r} is not QUANT/KV (e.g. int8/auto)")
        try:
            pairs.append((check_quantization(parts[0]), check_kv_cache_dtype(parts[1])))
        except UserError as e:
            raise UserError(f"--matrix: {e}") from None
    if pairs[0] != COMPARE_MATRIX[0]:
        raise UserError(f"--matrix: the first configuration must be the baseline none/auto, got {'/'.join(pairs[0])}")
    return tuple(pairs)


def _check_sizes(context: int, stride: int, max_tokens: int, decode_tokens: int) -> None:
    if context < 2:
        raise UserError(f"--context must be >= 2, got {context}")
    if not 1 <= stride <= context:
        raise UserError(f"--stride must be in [1, --context={context}], got {stride}")
    if max_tokens < 0 or max_tokens == 1:
        raise UserError(f"--max-tokens must be 0 (all) or >= 2, got {max_tokens}")
    if decode_tokens < 0:
        raise UserError(f"--decode-tokens must be >= 0, got {decode_tokens}")


def text_tokens(model: str, path: Path, max_tokens: int) -> list[int]:
    """The first ``max_tokens`` tokens (0: all) of UTF-8 text file ``path`` under ``model``'s tokenizer;
    UserError naming --text for a file that cannot be read or has fewer than 2 tokens."""
    from engine.model_loader import load_tokenizer, resolve_model

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--text: cannot read {str(path)!r}: {e.strerror if isinstance(e, OSError) else e}") from None
    if max_tokens:  # tokenize a prefix only (about 4 characters per token; 8x leaves a margin)
        text = text[:max_tokens * 8]
    ids = load_tokenizer(resolve_model(model))(text)["input_ids"]
    ids = ids[:max_tokens] if max_tokens else ids
    if len(ids) < 2:
        raise UserError(f"--text: {str(path)!r} has {len(ids)} tokens; at least 2 are needed")
    return ids


def _add_delta(runs: list[dict]) -> None:
    base = runs[0]["perplexity"]
    runs[-1]["delta_vs_baseline"] = runs[-1]["perplexity"] / base - 1.0


def _format_row(run: dict) -> str:
    c = run["config"]
    delta = run.get("delta_vs_baseline")
    d = "" if delta is None else f"{delta * 100:+.2f}%"
    return (f"{c['dtype']:<9} {c['quantization']:<6} {c['kv_cache_dtype']:<9} {run['perplexity']:>10.4f} {d:>8} "
            f"{run['num_tokens']:>8} {run['eval_s']:>8.1f}")


def _print_header(meta: dict) -> None:
    print(f"perplexity of {meta['text']} (context {meta['context']}, stride {meta['stride']}; load {meta['load']})")
    print(f"{'dtype':<9} {'quant':<6} {'kv':<9} {'perplexity':>10} {'delta':>8} {'tokens':>8} {'eval s':>8}", flush=True)


def _load() -> str:
    """The machine's load averages (benchmarks print them beside the figures)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
