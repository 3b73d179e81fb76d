"""The fused C++ decoder loop (kernels/decoder_loop.py) against the Python layer loop, on the real
model: the same logits bit for bit (bf16: unquantized, int8, an FP8 KV cache; fp32; prefill chunks in each row bucket,
a continued chunk, decode steps, a layer hook between layers), and a forward it does not cover
runs the Python loop; where int8 down_proj runs on AMX its SiLU goes through the fused op.

Each check asserts which loop ran (``model.decoder_path``), so a fused path that silently fell
back fails here. Skipped, with the reason, only where the kernel library cannot be built."""

from __future__ import annotations

import pytest
import torch

from engine.batch import SeqChunk
from engine.model_runner import ModelRunner
from kernels.cpu_attention import load_extension
from kernels import linear


@pytest.fixture(scope="module", params=[("none", "auto", torch.bfloat16), ("int8", "auto", torch.bfloat16),
                                        ("none", "fp8_e4m3", torch.bfloat16), ("none", "auto", torch.float32)],
                ids=["bf16", "int8", "fp8-kv", "fp32"])
def runner(request, model_path) -> ModelRunner:
    op, reason = load_extension()
    if op is None:
        pytest.skip(f"the kernel library cannot be built here: {reason}")
    quantization, kv_cache_dtype, dtype = request.param
    # Every linear takes its quiet-machine kernel (linear.py's `preferred`: bf16 small_gemm /
    # small_gemm (amx_gemm on AMX CPUs) / onednn_packed, int8 w8a8_vnni (w8a8_amx from 16 rows on AMX
    # CPUs) or w8a8_avx2; fp32: F.linear at 1 row, MKL's
    # prepacked kernel at 16, oneDNN's at 512, so the test covers the three): on a loaded host the load-time timing can pick
    # int8's dequant_dense at 16 rows, a kernel the C++ loop does not call (that bucket then runs
    # the Python loop, logged), and this test is about the fused path, not about that timing.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear, "_choice_cache", {})
        mp.setattr(linear, "_fastest", lambda kernels, *args, **kw: _preferred(kernels, *args, **kw))
        runner = ModelRunner(model_path, dtype=dtype, num_blocks=48, quantization=quantization,
                             kv_cache_dtype=kv_cache_dtype)
    loop = runner.model.decoder_loop
    assert loop is not None and all(loop.reason(b) == "" for b in range(len(linear.BUCKETS))), \
        [loop.reason(b) for b in range(len(linear.BUCKETS))]
    return runner


def _preferred(kernels, in_features, dtype, device, rows, preferred=None, *args, **kw) -> str:
    if dtype == torch.float32 and "mkl_packed" in kernels:   # fp32: every kind the loop calls, one a bucket
        return "F.linear" if rows == linear.BUCKETS[0] else "mkl_packed" if rows == linear.BUCKETS[1] else \
            "onednn_packed" if "onednn_packed" in kernels else "mkl_packed"
    if preferred in kernels:
        return preferred
    if rows > linear.BUCKETS[0] and "mkl_packed" in kernels:
        return "mkl_packed"
    return "F.linear" if "F.linear" in kernels else next(iter(kernels))


def _forward(runner: ModelRunner, chunks: list[SeqChunk], path: str, layer_hook=None) -> torch.Tensor:
    loop = runner.model.decoder_loop
    runner.model.decoder_loop = loop if path == "fused" else None
    try:
        logits = runner.forward(chunks, layer_hook)
    finally:
        runner.model.decoder_loop = loop
    assert runner.model.decoder_path == path
    return logits


def test_fused_loop_equals_python_loop(runner):
    """Both loops over the same tokens, each into its own blocks: equal logits at every forward."""
    long = list(range(3, 3 + 140))   # > 128 rows: the prefill bucket (oneDNN / int8 prefill kernels)
    short = list(range(50, 50 + 9))
    tables = {"python": ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11]), "fused": ([20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [30, 31])}
    steps = [
        lambda t: [SeqChunk(long, 0, t[0], 1)],                                   # 140-token prefill
        lambda t: [SeqChunk(short[:5], 0, t[1], 5)],                               # a 5-row chunk, every row's logits
        lambda t: [SeqChunk(short[5:], 5, t[1], 1), SeqChunk([7], 140, t[0], 1)],  # continued chunk + a decode row
        lambda t: [SeqChunk([8], 141, t[0], 1), SeqChunk([9], 9, t[1], 1)],        # decode, batch 2
        lambda t: [SeqChunk([10], 142, t[0], 1)],                                  # decode, batch 1
    ]
    for i, step in enumerate(steps):
        expected = _forward(runner, step(tables["python"]), "python")
        got = _forward(runner, step(tables["fused"]), "fused")
        assert torch.equal(got, expected), f"step {i}: max |diff| {(got - expected).abs().max().item()}"


def test_a_layer_hook_runs_between_fused_layers(runner):
    """With a layer hook the fused loop runs a layer a call: the hook for layer l sees layer l's
    K written and layer l + 1's not yet, as in the Python loop; the logits are equal."""
    cache, n = runner.kv_cache.data, runner.model_config.num_layers

    def run(path: str, block: int) -> torch.Tensor:
        cache[:, :, block] = 0
        seen: list[tuple[int, bool, bool]] = []

        def hook(l: int) -> None:
            seen.append((l, bool((cache[l, 0, block] != 0).any()), l + 1 < n and bool((cache[l + 1, 0, block] != 0).any())))

        logits = _forward(runner, [SeqChunk([1, 2, 3], 0, [block], 1)], path, layer_hook=hook)
        assert seen == [(l, True, False) for l in range(n)]
        return logits

    assert torch.equal(run("fused", 41), run("python", 40))


def test_the_reference_backend_runs_the_python_loop(runner):
    runner.forward([SeqChunk([1, 2, 3], 0, [42], 1)], pad_to_longest=True)   # the torch reference backend
    assert runner.model.decoder_path == "python"
    runner.forward([SeqChunk([1, 2, 3], 0, [43], 1)])
    assert runner.model.decoder_path == "fused"


def test_int8_mlp_on_amx_runs_as_one_op(runner):
    """Where gate/up and down_proj both run the AMX INT8 kernel, the fused loop calls mlp_w8a8_gemm
    once a layer (int8_gemm_amx.cpp: the MLP in one parallel region) and neither silu_mul_w8a8_gemm
    nor silu_mul; where only down_proj does, silu_mul_w8a8_gemm (down_proj's SiLU in its
    quantization); every other linear kernel keeps silu_mul then the linear."""
    mlp = runner.model.model.layers[0].mlp
    bucket = linear.bucket_index(5)
    amx = [getattr(lin, "kernel_names", [""] * len(linear.BUCKETS))[bucket] == "w8a8_amx"
           for lin in (mlp.gate_up_proj, mlp.down_proj)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _forward(runner, [SeqChunk(list(range(60, 65)), 0, [44], 5)], "fused")
    calls = {e.key: e.count for e in prof.key_averages()}
    n = runner.model_config.num_layers
    want = ("pdserve_int8_amx::mlp_w8a8_gemm" if all(amx) else
            "pdserve_int8_amx::silu_mul_w8a8_gemm" if amx[1] else "pdserve_ops::silu_mul")
    for op in ("pdserve_int8_amx::mlp_w8a8_gemm", "pdserve_int8_amx::silu_mul_w8a8_gemm", "pdserve_ops::silu_mul"):
        assert calls.get(op, 0) == (n if op == want else 0), (op, calls.get(op, 0))


def test_int8_qkv_on_amx_rotates_and_writes_the_cache_in_its_epilogue(runner):
    """Where the QKV linear runs the AMX INT8 kernel over a bf16 cache, the fused loop calls
    qkv_rope_w8a8_gemm once a layer and neither rope_split nor write_kv_cache (int8_gemm_amx.cpp);
    every other kernel keeps the linear, rope_split and write_kv_cache."""
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    amx = getattr(qkv, "kernel_names", [""] * len(linear.BUCKETS))[linear.bucket_index(5)] == "w8a8_amx"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _forward(runner, [SeqChunk(list(range(60, 65)), 0, [45], 5)], "fused")
    calls = {e.key: e.count for e in prof.key_averages()}
    n = runner.model_config.num_layers
    assert calls.get("pdserve_int8_amx::qkv_rope_w8a8_gemm", 0) == (n if amx else 0)
    for op in ("pdserve_ops::rope_split", "pdserve_attn::write_kv_cache"):
        assert calls.get(op, 0) == (0 if amx else n), op
