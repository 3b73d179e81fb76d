"""The in-place CPU attention kernel (kernels/cpu_attention.py) against the torch reference.

The reference (kernels/torch_ref.py, itself checked against a naive softmax in
test_model_attention_ops.py) is the oracle. Tolerances: fp32 caches 2e-5 absolute (both sides
accumulate in fp32, in different orders); bf16 caches: both sides against an fp32 reference
on the same bf16-rounded inputs, the kernel within 1.6e-2 (two bf16 ulps at the outputs'
magnitude ~1: the kernel rounds once, at the output) and no worse than the bf16 reference.
"""

from __future__ import annotations

import logging
import random
import re

import pytest
import torch

import kernels.cpu_attention as cpu_attention
from kernels.attention import MAX_PADDED_QUERY_LEN, AttentionMetadata, get_attention_backend

NUM_BLOCKS = 160
LONG = MAX_PADDED_QUERY_LEN + 5

# (start_pos, query_len) per sequence
BATCHES = {
    "decode": [(250, 1), (15, 1), (16, 1), (31, 1), (0, 1), (47, 1), (100, 1)],      # at/around block edges
    "verification": [(30, 4), (15, 1), (0, 16), (63, 2), (9, MAX_PADDED_QUERY_LEN)],
    "mixed": [(0, LONG), (5, 1), (40, 3), (33, LONG), (0, 2), (17, 1)],               # prefill from 0 and continued
    "one long prefill": [(0, LONG)],
    "one continued chunk": [(48, LONG)],
}


def scattered_tables(seqs, block_size, seed=0):
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    tables = []
    for start, qlen in seqs:
        n = -(-(start + qlen) // block_size)
        assert n <= len(blocks), "the test cache is too small for this batch"
        tables.append(blocks[:n] + [blocks[-1]] * 2)   # longer than needed, as the block manager hands out
        blocks = blocks[n:]
    return tables


@pytest.fixture(scope="module")
def cpu():
    return get_attention_backend("cpu")


def case(seqs, block_size, kv_heads, group, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    num_tokens = sum(q for _, q in seqs)
    query = (torch.randn(num_tokens, kv_heads * group, head_dim, generator=gen) * 2).to(dtype)
    tables = scattered_tables(seqs, block_size, seed)
    args = ([s for s, _ in seqs], [q for _, q in seqs], tables, block_size)
    full = AttentionMetadata.build(*args, dtype=dtype)
    lean = AttentionMetadata.build(*args, dtype=dtype, groups="long")
    return query, key_cache, value_cache, full, lean, args


def new_kv(cache, meta):
    """The K (or V) this forward's tokens wrote, read back through the slot mapping."""
    return cache.view(-1, *cache.shape[2:]).index_select(0, meta.slot_mapping)


@pytest.mark.parametrize("batch", list(BATCHES))
# head_dim 64: the AVX-512 paths (block of 16 = one vector of scores; 32 = two; 4 = a partial one);
# head_dim 8: the portable path (8 % 16 != 0)
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 64), (4, 64), (4, 8)])
def test_fp32_matches_the_reference(cpu, batch, block_size, head_dim):
    query, kc, vc, full, lean, _ = case(BATCHES[batch], block_size, kv_heads=2, group=3, head_dim=head_dim,
                                     dtype=torch.float32)
    want = get_attention_backend("torch").paged_attention(query, kc, vc, full, 0.3)
    got = cpu.paged_attention(query, kc, vc, lean, 0.3)
    assert (got - want).abs().max().item() < 2e-5
    fresh = cpu.paged_attention(query, kc, vc, lean, 0.3, key=new_kv(kc, lean), value=new_kv(vc, lean))
    assert (fresh - want).abs().max().item() < 2e-5


@pytest.mark.parametrize("batch", ["decode", "verification", "mixed"])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 128), (16, 8)])  # AVX512-BF16 dots, and not
def test_bf16_within_tolerance_of_fp32(cpu, batch, block_size, head_dim):
    query, kc, vc, full, lean, args = case(BATCHES[batch], block_size, kv_heads=3, group=3, head_dim=head_dim,
                                           dtype=torch.bfloat16)
    ref = get_attention_backend("torch")
    exact = ref.paged_attention(query.float(), kc.float(), vc.float(), AttentionMetadata.build(*args), 0.125)
    got = cpu.paged_attention(query, kc, vc, lean, 0.125, key=new_kv(kc, lean), value=new_kv(vc, lean))
    assert got.dtype == torch.bfloat16
    err = (got.float() - exact).abs().max().item()
    ref_err = (ref.paged_attention(query, kc, vc, full, 0.125).float() - exact).abs().max().item()
    assert err < 1.6e-2 and err <= ref_err + 1e-6


def test_threads_split_the_work_without_changing_the_result(cpu):
    query, kc, vc, _, lean, _ = case(BATCHES["decode"] * 3, 16, kv_heads=3, group=3, head_dim=64, dtype=torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.paged_attention(query, kc, vc, lean, 0.125)
        torch.set_num_threads(2)
        two = cpu.paged_attention(query, kc, vc, lean, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)   # each (sequence, KV head) is computed by one thread, in one order


def test_metadata_for_the_kernel_builds_only_the_long_groups():
    seqs = BATCHES["mixed"]
    tables = scattered_tables(seqs, 16)
    lean = AttentionMetadata.build([s for s, _ in seqs], [q for _, q in seqs], tables, 16, groups="long")
    assert [g.token_index is not None for g in lean.groups] == [True, True]
    assert [g.max_query_len for g in lean.groups] == [LONG, LONG]
    assert AttentionMetadata.build([3], [1], [[0]], 16, groups="none").groups == ()
    with pytest.raises(ValueError, match="groups must be"):
        AttentionMetadata.build([3], [1], [[0]], 16, groups="some")


def test_fp8_scales_are_refused_until_supported(cpu):
    query, kc, vc, _, lean, _ = case(BATCHES["decode"], 16, 1, 1, 16, torch.float32)
    with pytest.raises(NotImplementedError, match="FP8"):
        cpu.paged_attention(query, kc, vc, lean, 0.1, k_scale=1.0, v_scale=1.0)


def test_auto_falls_back_to_the_reference_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(cpu_attention, "_loaded", (None, "no C++ compiler ('c++' not on PATH)"))
    with caplog.at_level(logging.WARNING, logger="kernels.attention"):
        backend = get_attention_backend("auto")
    assert backend.name == "torch"
    assert "no C++ compiler" in caplog.text and "torch reference" in caplog.text
    with pytest.raises(RuntimeError, match="unavailable: no C"):
        get_attention_backend("cpu")


def test_auto_chooses_the_kernel_when_it_builds(cpu):
    assert get_attention_backend("auto").name == "cpu"


def test_build_without_a_compiler_returns_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))   # nothing built there yet
    monkeypatch.setenv("CXX", "no-such-compiler-pdserve")
    module, reason = cpu_attention._build()
    assert module is None and "no-such-compiler-pdserve" in reason


def test_the_build_key_covers_every_source_and_header(monkeypatch, tmp_path):
    included = {name for src in cpu_attention.SOURCES
                for name in re.findall(r'#include "([^"]+)"', src.read_text())}
    assert included and included <= {h.name for h in cpu_attention.HEADERS}
    assert {s.name for s in cpu_attention.SOURCES} >= {"paged_attention.cpp", "layer_ops.cpp"}
    header = tmp_path / "simd_math.h"
    header.write_text(cpu_attention.HEADERS[0].read_text())
    monkeypatch.setattr(cpu_attention, "HEADERS", (header,))
    before = cpu_attention._stamp()
    header.write_text(header.read_text() + "// an edit\n")
    assert cpu_attention._stamp() != before   # a header edit is a new build, never a stale one
