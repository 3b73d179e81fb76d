"""Triton kernels (kernels/triton/) under TRITON_INTERPRET=1 against their torch references.

Not collected by the suite (no ``test_`` prefix): tests/test_triton_kernels.py runs this file in
a child pytest with TRITON_INTERPRET=1, so the interpreter setting never reaches other tests.
Shapes are tiny: the interpreter runs every program of a grid in Python.

Tolerances (max abs error against the reference, which computes in fp32 from the same inputs):
fp32 1e-5; fp16 outputs 2e-3 (about two fp16 ulps at 1); bf16 outputs 1.6e-2 (two bf16 ulps);
FP8 caches 1e-5 (the reference dequantizes the same E4M3 bytes exactly, so only summation
order differs). FP8 GEMM and RMSNorm, relative to the largest output: fp32 1e-5; the GEMM's bf16 /
fp16 outputs one rounding (2^-7 / 2^-10); RMSNorm's two (2^-6 / 2^-9: the fused residual is
rounded before the norm, then the output). The interpreter converts fp32 to bf16 by truncation (torch and GPUs round to
nearest), so bf16 outputs may differ by one more ulp than on a GPU.
"""

from __future__ import annotations

import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run through tests/test_triton_kernels.py (TRITON_INTERPRET=1 before triton is imported)")
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.attention import AttentionMetadata, get_attention_backend  # noqa: E402
from kernels.triton.decode_attention import decode_attention_ref, paged_decode_attention  # noqa: E402

FP8 = torch.float8_e4m3fn
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def random_decode_batch(seq_lens, num_heads, num_kv_heads, head_dim, block_size, cache_dtype, query_dtype,
                        seed=0):
    """Random caches and query; each sequence's blocks drawn at random from a shuffled pool."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    pool = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int64)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = pool[used:used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # FP8 inputs are produced by torch's cast (the interpreter's fp32 -> fp8 conversion is unreliable).
    key_cache = (torch.randn(shape, generator=gen) * 2).to(cache_dtype)
    value_cache = (torch.randn(shape, generator=gen) * 2).to(cache_dtype)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(query_dtype)
    return query, key_cache, value_cache, table, torch.tensor(seq_lens, dtype=torch.int64)


# -- paged decode attention --------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype,query_dtype,k_scale,v_scale", [
    (torch.float32, torch.float32, None, None),
    (torch.float16, torch.float16, None, None),
    (torch.bfloat16, torch.bfloat16, None, None),
    (FP8, torch.float32, 0.05, 0.02),                                  # per-layer scalar scales
    (FP8, torch.bfloat16, torch.tensor([0.05, 0.2]), torch.tensor([0.01, 0.03])),   # per KV head
])
def test_decode_attention_dtypes(cache_dtype, query_dtype, k_scale, v_scale):
    # Context lengths not multiples of the block size (16) nor of the slice (32 keys per tile).
    q, kc, vc, table, lens = random_decode_batch([1, 17, 50, 77], 6, 2, 64, 16, cache_dtype, query_dtype)
    got = paged_decode_attention(q, kc, vc, table, lens, 0.125, k_scale, v_scale, num_splits=3, block_n=32)
    want = decode_attention_ref(q, kc, vc, table, lens, 0.125, k_scale, v_scale)
    assert got.dtype == query_dtype and got.shape == q.shape
    assert max_err(got, want) <= TOL[query_dtype]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size,block_n", [(4, 16), (16, 16)])
def test_decode_attention_gqa_and_block_sizes(num_heads, num_kv_heads, block_size, block_n):
    q, kc, vc, table, lens = random_decode_batch([3, 30, 9], num_heads, num_kv_heads, 32, block_size,
                                                 torch.float32, torch.float32, seed=1)
    got = paged_decode_attention(q, kc, vc, table, lens, 0.2, num_splits=2, block_n=block_n)
    assert max_err(got, decode_attention_ref(q, kc, vc, table, lens, 0.2)) <= 1e-5


@pytest.mark.parametrize("num_splits", [1, 4, 7])
def test_decode_attention_split_count_does_not_change_result(num_splits):
    # 7 slices of a 41-token context: the last slices are empty and must not contribute.
    q, kc, vc, table, lens = random_decode_batch([41, 5], 6, 2, 32, 8, torch.float32, torch.float32, seed=2)
    got = paged_decode_attention(q, kc, vc, table, lens, 0.2, num_splits=num_splits, block_n=16)
    assert max_err(got, decode_attention_ref(q, kc, vc, table, lens, 0.2)) <= 1e-5


def test_fp8_decode_attention_is_close_to_unquantized():
    # The scales are really applied: K/V quantized as x / scale, attended, against fp32 K/V.
    q, kc, vc, table, lens = random_decode_batch([20, 33], 6, 2, 32, 16, torch.float32, torch.float32, seed=3)
    # Calibrated scales: each KV head's largest |K| maps to E4M3's largest value (448).
    k_scale = kc.abs().amax(dim=(0, 1, 3)) / 448
    v_scale = vc.abs().amax().item() / 448
    k8 = (kc / k_scale.view(1, 1, 2, 1)).to(FP8)
    v8 = (vc / v_scale).to(FP8)
    got = paged_decode_attention(q, k8, v8, table, lens, 0.2, k_scale, v_scale, num_splits=2, block_n=16)
    exact = decode_attention_ref(q, kc, vc, table, lens, 0.2)
    # E4M3 keeps 3 mantissa bits (K/V off by up to 6%; here the reference on the same bytes is off by
    # 6.5% of the largest output): 10% of the largest output. A dropped scale is off by 100x.
    assert max_err(got, exact) <= 0.1 * exact.abs().max().item()


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(query=a["query"].int()), "query dtype"),
    (lambda a: a.update(query=a["query"][:, :5]), "multiple of num_kv_heads"),
    (lambda a: a.update(key_cache=a["key_cache"].to(FP8), value_cache=a["value_cache"].to(FP8)), "needs k_scale"),
    (lambda a: a.update(key_cache=a["key_cache"].transpose(1, 3).contiguous().transpose(1, 3)), "stride 1"),
    (lambda a: a.update(value_cache=a["value_cache"][:, :, :1]), "value_cache"),
    (lambda a: a.update(context_lens=a["context_lens"][:1]), "context_lens"),
    (lambda a: a.update(row_to_seq=torch.zeros(1, dtype=torch.int64)), "row_to_seq"),
    (lambda a: a.update(block_tables=a["block_tables"].float()), "block_tables must be int"),
    (lambda a: a.update(k_scale=torch.ones(3)), "num_kv_heads=2"),
])
def test_decode_attention_rejects_bad_input(change, message):
    q, kc, vc, table, lens = random_decode_batch([5, 9], 6, 2, 32, 4, torch.float32, torch.float32)
    args = dict(query=q, key_cache=kc, value_cache=vc, block_tables=table, context_lens=lens, scale=0.2)
    change(args)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args)


# -- the "triton" attention backend against the "torch" one -------------------------------------
def backend_case(seqs, dtype, seed=0):
    """Metadata (the triton backend's, with long-chunk groups only, and the reference's), new K/V
    and queries for sequences given as (start_pos, num_new_tokens)."""
    gen = torch.Generator().manual_seed(seed)
    block_size, num_blocks = 4, 64
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for start, qlen in seqs:
        n = -(-(start + qlen) // block_size)
        tables.append(pool[:n])
        pool = pool[n:]
    metas = {groups: AttentionMetadata.build([s for s, _ in seqs], [q for _, q in seqs], tables, block_size,
                                             groups=groups) for groups in ("long", "all")}
    num_tokens = sum(q for _, q in seqs)
    cache_shape = (num_blocks, block_size, 2, 32)
    caches = [(torch.randn(cache_shape, generator=gen) * 0.5).to(dtype) for _ in range(2)]
    new_kv = [torch.randn(num_tokens, 2, 32, generator=gen) for _ in range(2)]
    query = torch.randn(num_tokens, 6, 32, generator=gen)
    return metas, caches, new_kv, query


BACKEND_BATCHES = [
    [(0, 1), (12, 1), (30, 1)],                  # decode batch: the kernel, one row per sequence
    [(0, 9), (12, 1), (30, 3)],                  # short prefill, decode, verification: all rows in the kernel
    [(0, 20), (12, 1), (5, 18), (30, 3)],        # long chunks from 0 (SDPA on new K/V) and after 5 (reference)
    [(0, 17)],                                   # one long chunk alone (no kernel launch)
]


@pytest.mark.parametrize("seqs", BACKEND_BATCHES)
def test_backend_matches_torch_backend(seqs):
    metas, (kc, vc), (k, v), query = backend_case(seqs, torch.float32)
    triton_ops, torch_ops = get_attention_backend("triton"), get_attention_backend("torch")
    assert triton_ops.name == "triton" and triton_ops.metadata_groups == "long"
    kc2, vc2 = kc.clone(), vc.clone()
    triton_ops.write_kv_cache(k, v, kc, vc, metas["long"].slot_mapping)
    torch_ops.write_kv_cache(k, v, kc2, vc2, metas["all"].slot_mapping)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    got = triton_ops.paged_attention(query, kc, vc, metas["long"], 0.17, key=k, value=v)
    assert max_err(got, torch_ops.paged_attention(query, kc2, vc2, metas["all"], 0.17)) <= 1e-5


def test_decode_attention_rows_of_short_chunks():
    # Rows map to sequences through row_to_seq, each with its own causal context; a 0 skips a row.
    q, kc, vc, table, _ = random_decode_batch([9, 23], 6, 2, 32, 4, torch.float32, torch.float32, seed=9)
    rows = torch.tensor([0, 0, 0, 1, 1, 1])
    q = torch.cat([q, q, q])[torch.tensor([0, 2, 4, 1, 3, 5])]
    lens = torch.tensor([7, 8, 9, 0, 22, 23])
    got = paged_decode_attention(q, kc, vc, table, lens, 0.2, row_to_seq=rows, num_splits=3, block_n=16)
    assert max_err(got, decode_attention_ref(q, kc, vc, table, lens, 0.2, row_to_seq=rows)) <= 1e-5
    assert torch.equal(got[3], torch.zeros_like(got[3]))


@pytest.mark.parametrize("seqs", BACKEND_BATCHES)
def test_backend_fp8_cache_with_per_head_scales(seqs):
    metas, (kc, vc), (k, v), query = backend_case(seqs, torch.float32, seed=4)
    # Calibrated per-KV-head scales: the largest |x| of the cache and the new tokens maps to 448.
    k_scale = torch.maximum(kc.abs().amax(dim=(0, 1, 3)), k.abs().amax(dim=(0, 2))) / 448
    v_scale = torch.maximum(vc.abs().amax(dim=(0, 1, 3)), v.abs().amax(dim=(0, 2))) / 448
    k8 = (kc / k_scale.view(1, 1, 2, 1)).to(FP8)
    v8 = (vc / v_scale.view(1, 1, 2, 1)).to(FP8)
    ops = get_attention_backend("triton")
    ops.write_kv_cache(k, v, k8, v8, metas["long"].slot_mapping, k_scale, v_scale)
    # The write stored x / scale as E4M3: read back it recovers x to E4M3 precision (~6% relative).
    flat_k = k8.view(-1, 2, 32)[metas["long"].slot_mapping].float() * k_scale.view(1, 2, 1)
    assert max_err(flat_k, k) <= 0.07 * k.abs().max().item()
    # Every row attends the quantized bytes (long chunks from 0 too, not the unquantized new K/V).
    got = ops.paged_attention(query, k8, v8, metas["long"], 0.17, k_scale, v_scale, key=k, value=v)
    deq_k = k8.float() * k_scale.view(1, 1, 2, 1)
    deq_v = v8.float() * v_scale.view(1, 1, 2, 1)
    want = get_attention_backend("torch").paged_attention(query, deq_k, deq_v, metas["all"], 0.17)
    assert max_err(got, want) <= 1e-5


# -- FP8 GEMM ----------------------------------------------------------------------------------
from kernels.triton.fp8_gemm import fp8_gemm, fp8_gemm_ref, fp8_linear, quantize_per_channel, quantize_per_token  # noqa: E402,E501


@pytest.mark.parametrize("out_dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7), (torch.float16, 2 ** -10)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_gemm_matches_reference(out_dtype, tol, with_bias):
    # M, N, K not multiples of the 16-wide tiles: masked edges in every dimension and a K tail.
    gen = torch.Generator().manual_seed(5)
    a, a_scale = quantize_per_token(torch.randn(5, 40, generator=gen))
    b, b_scale = quantize_per_channel(torch.randn(24, 40, generator=gen) * 0.1)
    bias = torch.randn(24, generator=gen) if with_bias else None
    got = fp8_gemm(a, b, a_scale, b_scale, bias, out_dtype, block_m=16, block_n=16, block_k=16)
    want = fp8_gemm_ref(a, b, a_scale, b_scale, bias, out_dtype)
    assert got.dtype == out_dtype and got.shape == (5, 24)
    # Relative to the output's size: fp32 summation order (fp32), one rounding of the output (bf16, fp16).
    assert max_err(got, want) <= tol * want.float().abs().max().item()


def test_fp8_linear_is_close_to_the_fp32_linear():
    # Per-token and per-channel scales really applied: against x @ W^T in fp32.
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 2, 48, generator=gen)
    w = torch.randn(20, 48, generator=gen) * 0.05
    wq, w_scale = quantize_per_channel(w)
    got = fp8_linear(x, wq, w_scale)
    exact = x @ w.T
    assert got.shape == (3, 2, 20)
    # Two E4M3 roundings per product (<= 6% each), averaging over K = 48: 5% of the largest output.
    assert max_err(got, exact) <= 0.05 * exact.abs().max().item()


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(a=a["a"].float()), "float8_e4m3fn"),
    (lambda a: a.update(b=a["b"][:, :8]), "same K"),
    (lambda a: a.update(a_scale=a["a_scale"][:2]), "per token"),
    (lambda a: a.update(b=a["b"].T.contiguous().T), "contiguous along K"),
    (lambda a: a.update(bias=torch.zeros(3)), "bias"),
    (lambda a: a.update(out_dtype=torch.int32), "out_dtype"),
])
def test_fp8_gemm_rejects_bad_input(change, message):
    a, a_scale = quantize_per_token(torch.randn(4, 16))
    b, b_scale = quantize_per_channel(torch.randn(16, 16))
    args = dict(a=a, b=b, a_scale=a_scale, b_scale=b_scale, bias=None, out_dtype=torch.float32)
    change(args)
    with pytest.raises(ValueError, match=message):
        fp8_gemm(**args)


# -- fused RMSNorm (+ residual) ----------------------------------------------------------------
from kernels.triton.rmsnorm import fused_add_rms_norm, rms_norm, rms_norm_ref  # noqa: E402


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -6), (torch.float16, 2 ** -9)])
def test_rms_norm_matches_reference(dtype, tol):
    # hidden 40: not a power of two, the row's block is masked.
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 40, generator=gen) * 3).to(dtype)
    w = (torch.rand(40, generator=gen) + 0.5).to(dtype)
    got, want = rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)
    assert got.dtype == dtype
    assert max_err(got, want) <= tol * want.float().abs().max().item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -6), (torch.float16, 2 ** -9)])
def test_rms_norm_fused_add_matches_reference(dtype, tol):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(5, 24, generator=gen).to(dtype)
    residual = (torch.randn(5, 24, generator=gen) * 4).to(dtype)
    w = (torch.rand(24, generator=gen) + 0.5).to(dtype)
    before = residual.clone()
    got, got_residual = fused_add_rms_norm(x, residual, w, 1e-6)
    want, want_residual = rms_norm_ref(x, w, 1e-6, residual)
    assert torch.equal(residual, before)                       # inputs are not modified
    # One fp32 add, one rounding: exact on a GPU; the interpreter rounds fp32 -> bf16 toward zero
    # (checked: it truncates), torch to nearest, so one bf16 ulp there.
    assert max_err(got_residual, want_residual) <= (2 ** -7 if dtype == torch.bfloat16 else 0) * want_residual.float().abs().max().item()
    assert max_err(got, want) <= tol * want.float().abs().max().item()


def test_rms_norm_matches_the_model_layer():
    # The kernel computes what engine/models/llama.py's RMSNorm computes (fp32 here).
    from engine.models.llama import RMSNorm

    layer = RMSNorm(32, 1e-5)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(32) + 0.5)
    x = torch.randn(4, 32)
    assert max_err(rms_norm(x, layer.weight.detach(), 1e-5), layer(x).detach()) <= 1e-5


@pytest.mark.parametrize("call,message", [
    (lambda: rms_norm(torch.randn(2, 3, 4), torch.ones(4), 1e-5), "num_tokens, hidden"),
    (lambda: rms_norm(torch.randn(2, 4), torch.ones(5), 1e-5), "weight"),
    (lambda: rms_norm(torch.randn(4, 2).T, torch.ones(4), 1e-5), "contiguous"),
    (lambda: fused_add_rms_norm(torch.randn(2, 4), torch.randn(3, 4), torch.ones(4), 1e-5), "residual shape"),
    (lambda: rms_norm(torch.randn(2, 4).double(), torch.ones(4), 1e-5), "not supported"),
])
def test_rms_norm_rejects_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# -- the backend inside the model ----------------------------------------------------------------
def test_backend_in_the_model_matches_torch_backend(model_path):
    # SmolLM2's shapes (9 query heads, 3 KV heads, head dim 64), 30 layers: a long prompt chunk
    # (SDPA on the new K/V) beside a short one (the kernel), then a decode step of both (the kernel);
    # every logit against the torch backend.
    from engine.batch import SeqChunk
    from engine.model_runner import ModelRunner

    logits = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(model_path, num_blocks=8, block_size=16, attention_backend=backend)
        prefill = runner.forward([SeqChunk(list(range(10, 27)), 0, [3, 5]), SeqChunk([40, 41, 42], 0, [6])])
        decode = runner.forward([SeqChunk([7], 17, [3, 5]), SeqChunk([8], 3, [6])])
        logits[backend] = torch.cat([prefill, decode])
    assert max_err(logits["triton"], logits["torch"]) <= 1e-3
