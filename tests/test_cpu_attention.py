"""The in-place CPU attention kernel (kernels/cpu_attention.py) against the torch reference.

The reference (kernels/torch_ref.py, itself checked against a naive softmax in
test_model_attention_ops.py) is the oracle. Tolerances: fp32 caches 2e-5 absolute (both sides
accumulate in fp32, in different orders); bf16 caches: both sides against an fp32 reference
on the same bf16-rounded inputs, the kernel within 1.6e-2 (two bf16 ulps at the outputs'
magnitude ~1: the kernel rounds once, at the output) and no worse than the bf16 reference;
FP8 E4M3 caches: against an exact fp32 read of the dequantized cache, 5e-5 for fp32 queries and
the bf16 rule for bf16 queries (no worse than the reference's FP8 path). Every kind of row goes
through the kernel: decode, verification, prefill chunks from position 0 and continued ones.
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
    # past one partition of keys (256): the online rescaling between partitions; one sequence
    # alone: its keys split over several items (split-K) and merged
    "long contexts": [(600, 1), (300, 3), (260, 40), (0, 300)],
    "one long decode": [(900, 1)],
}
BIG = {"long contexts", "one long decode"}   # block size 16 only (the test cache holds 2,560 tokens)


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
    lean = AttentionMetadata.build(*args, dtype=dtype, groups=cpu_attention.CpuAttention.metadata_groups)
    return query, key_cache, value_cache, full, lean, args


# head_dim 64: the AVX-512 paths (block of 16 = one vector of scores; 32 = two; 4 = a partial one);
# head_dim 8: the portable path (8 % 16 != 0). The long contexts at block size 16 only (the test
# cache holds 2,560 tokens).
@pytest.mark.parametrize("batch,block_size,head_dim", [
    (batch, bs, d) for batch in BATCHES for bs, d in [(16, 64), (32, 64), (4, 64), (4, 8)]
    if batch not in BIG or bs == 16])
def test_fp32_matches_the_reference(cpu, batch, block_size, head_dim):
    query, kc, vc, full, lean, _ = case(BATCHES[batch], block_size, kv_heads=2, group=3, head_dim=head_dim,
                                     dtype=torch.float32)
    want = get_attention_backend("torch").paged_attention(query, kc, vc, full, 0.3)
    got = cpu.paged_attention(query, kc, vc, lean, 0.3)
    assert (got - want).abs().max().item() < 2e-5


def assert_bf16_rule(got, query, kc, vc, full, args) -> None:
    """The bf16 rule: the kernel's bf16 output within 1.6e-2 of attention computed in fp32 on the same
    bf16 inputs, and no further from it than the torch reference run in bf16."""
    ref = get_attention_backend("torch")
    exact = ref.paged_attention(query.float(), kc.float(), vc.float(), AttentionMetadata.build(*args), 0.125)
    err = (got.float() - exact).abs().max().item()
    ref_err = (ref.paged_attention(query, kc, vc, full, 0.125).float() - exact).abs().max().item()
    assert err < 1.6e-2 and err <= ref_err + 1e-6


@pytest.mark.parametrize("batch", ["decode", "verification", "mixed", "long contexts"])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (16, 128), (16, 32), (16, 8)])  # AVX512-BF16 dots, and not
def test_bf16_within_tolerance_of_fp32(cpu, batch, block_size, head_dim):
    query, kc, vc, full, lean, args = case(BATCHES[batch], block_size, kv_heads=3, group=3, head_dim=head_dim,
                                           dtype=torch.bfloat16)
    got = cpu.paged_attention(query, kc, vc, lean, 0.125)
    assert got.dtype == torch.bfloat16
    assert_bf16_rule(got, query, kc, vc, full, args)


@pytest.mark.parametrize("mode", ["fp32", "default"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_pv_modes_within_tolerance_of_fp32(cpu, monkeypatch, mode, head_dim):
    """Decode and verification rows with P V as bf16 pair dot products (the default, P split hi + lo)
    and with PDSERVE_ATTN_DECODE=fp32 (the earlier fp32 P V, kept as the A/B fallback): both held to
    the bf16 rule above, and the two within 2 bf16 ulps of each other."""
    seqs = BATCHES["decode"] + BATCHES["verification"] + [(420, 1), (517, 5)]   # odd tails, two partitions
    query, kc, vc, full, lean, args = case(seqs, 16, kv_heads=3, group=3, head_dim=head_dim, dtype=torch.bfloat16)
    if mode == "fp32":
        monkeypatch.setenv("PDSERVE_ATTN_DECODE", "fp32")
    got = cpu.paged_attention(query, kc, vc, lean, 0.125)
    monkeypatch.delenv("PDSERVE_ATTN_DECODE", raising=False)
    other = cpu.paged_attention(query, kc, vc, lean, 0.125)
    assert_bf16_rule(got, query, kc, vc, full, args)
    assert (got.float() - other.float()).abs().max().item() < 1.6e-2


@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 5])
def test_bf16_decode_rows_at_every_block_size_and_group(cpu, block_size, group):
    """The decode and verification rows' bf16 scores (keys side by side in 128-bit lanes, rows of a
    KV head in tiles of up to 4) at 1-15 rows per KV head: partial 16-key groups (block size 4, a
    context ending inside a block), two 16-key groups per block (32), one to four row tiles; held
    to the bf16 rule of test_bf16_within_tolerance_of_fp32."""
    qlens = [q for q in (1, 2, 5, 15) if q * group < 16]   # below the prefill tile path's 16 rows
    seqs = [(start, q) for start in (0, 13, 31, 50) for q in qlens]   # within the 640 tokens of block size 4
    query, kc, vc, full, lean, args = case(seqs, block_size, kv_heads=3, group=group, head_dim=64, dtype=torch.bfloat16)
    assert_bf16_rule(cpu.paged_attention(query, kc, vc, lean, 0.125), query, kc, vc, full, args)


AMX_DECODE_BATCHES = {
    # enough sequences for every thread: one item over all 3 KV heads (whole blocks), contexts
    # ending at and around block edges
    "decode": [(s, 1) for s in (250, 15, 16, 31, 0, 47, 100, 7)],
    # verification runs of 2 tokens (6 and 10 rows a KV head at groups 3 and 5: 10 is past the
    # AMX path's 8, back to attend_item), partial 16-key groups
    "verification": [(30, 2), (15, 2), (0, 2), (63, 1), (9, 2), (70, 1)],
    # past one 512-key partition: the rescaling between them; too few sequences for whole items
    "long": [(600, 1), (530, 2), (1000, 1)],
    # one sequence alone: its keys split over several items (split-K) and merged
    "one long decode": [(900, 1)],
}


@pytest.mark.parametrize("batch", list(AMX_DECODE_BATCHES))
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 64), (16, 32)])
@pytest.mark.parametrize("group", [1, 3, 5])
@pytest.mark.parametrize("mode", ["whole", "heads", "off"])
def test_bf16_decode_rows_on_amx_tiles_within_tolerance_of_fp32(cpu, monkeypatch, batch, block_size, head_dim,
                                                                 group, mode):
    """Decode and verification rows through AMX tiles where the CPU has AMX-BF16 (attend_decode_amx:
    S^T = K Q^T and O = P V as tile products, P split hi + lo) with items over every KV head
    ("whole", the default) or one head ("heads"), and through attend_item ("off",
    PDSERVE_ATTN_AMX_DECODE=0; elsewhere all three take attend_item): held to the bf16 rule of
    test_bf16_within_tolerance_of_fp32, and within 2 bf16 ulps of attend_item."""
    monkeypatch.setenv("PDSERVE_ATTN_AMX_DECODE", {"whole": "1", "heads": "heads", "off": "0"}[mode])
    query, kc, vc, full, lean, args = case(AMX_DECODE_BATCHES[batch], block_size, kv_heads=3, group=group,
                                           head_dim=head_dim, dtype=torch.bfloat16)
    got = cpu.paged_attention(query, kc, vc, lean, 0.125)
    assert_bf16_rule(got, query, kc, vc, full, args)
    monkeypatch.setenv("PDSERVE_ATTN_AMX_DECODE", "0")
    other = cpu.paged_attention(query, kc, vc, lean, 0.125)
    assert (got.float() - other.float()).abs().max().item() < 1.6e-2


TILE_BATCHES = {
    # chunks of 16, 8 and 6 tokens: 16 to 48 rows per KV head at groups 1-3 (the kernel's prefill
    # tile path: one, two or three vectors of 16 rows), and rows below it (the row path)
    "tile shapes": [(0, 16), (100, 8), (30, 6), (63, 16)],
    # one 16-token chunk across the 512-key partition edge, alone: its keys split over two items,
    # and the tile's first rows see no key of the second (no max, no sum: the merge skips them)
    "split tile": [(500, 16)],
    # a 150-token prompt from 0: 10 tiles, key steps of 64 with a partial last one (22 keys: a
    # partial 16-key group on the AMX path, a partial 16-pair P V product)
    "prompt": [(0, 150)],
}


@pytest.mark.parametrize("batch", list(TILE_BATCHES))
@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("amx", ["on", "off"])
def test_bf16_prefill_tiles_within_tolerance_of_fp32(cpu, monkeypatch, batch, group, head_dim, amx):
    """The prefill tile path (QK^T and PV as bf16 products, P rounded to bf16) at every tile height,
    held to the bf16 rule of test_bf16_within_tolerance_of_fp32: through AMX tiles where the CPU
    has AMX-BF16 ("on"; elsewhere both runs take vdpbf16ps) and through vdpbf16ps ("off",
    PDSERVE_ATTN_AMX=0)."""
    monkeypatch.setenv("PDSERVE_ATTN_AMX", "1" if amx == "on" else "0")
    query, kc, vc, full, lean, args = case(TILE_BATCHES[batch], 16, kv_heads=2, group=group, head_dim=head_dim,
                                           dtype=torch.bfloat16)
    assert_bf16_rule(cpu.paged_attention(query, kc, vc, lean, 0.125), query, kc, vc, full, args)


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


def fp8_case(seqs, kv_heads, per_head, seed=0):
    """An E4M3 cache written as the runner writes it (x / scale, saturated), its scales, and
    the same K/V dequantized to fp32 (what an exact reader sees)."""
    from kernels.torch_ref import quantize_kv

    query, kc, vc, full, lean, args = case(seqs, 16, kv_heads, 3, 64, torch.float32, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    n = kv_heads if per_head else 1
    k_scale, v_scale = (torch.rand(n, generator=gen) * 0.01 + 0.002 for _ in range(2))
    k8, v8 = (quantize_kv((x * 0.5).view(-1, kv_heads, 64), s).view(x.shape) for x, s in ((kc, k_scale), (vc, v_scale)))
    k32, v32 = (x.float() * s.view(1, 1, -1, 1).expand(1, 1, kv_heads, 1) for x, s in ((k8, k_scale), (v8, v_scale)))
    return query, (k8, v8), (k32, v32), (k_scale, v_scale), full, lean


@pytest.mark.parametrize("batch", ["decode", "mixed", "long contexts"])
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_cache_is_read_with_its_scales(cpu, batch, per_head):
    """FP8 E4M3 caches: the kernel dequantizes in place; fp32 queries match an exact fp32 read of the
    dequantized cache to 5e-5, bf16 queries within bf16's tolerance and no worse than the reference's
    FP8 path (which rounds the dequantized K/V to bf16 before attending)."""
    query, (k8, v8), (k32, v32), (ks, vs), full, lean = fp8_case(BATCHES[batch], kv_heads=3, per_head=per_head)
    ref = get_attention_backend("torch")
    exact = ref.paged_attention(query, k32, v32, full, 0.125)
    got = cpu.paged_attention(query, k8, v8, lean, 0.125, k_scale=ks, v_scale=vs)
    assert (got - exact).abs().max().item() < 5e-5
    assert (ref.paged_attention(query, k8, v8, full, 0.125, k_scale=ks, v_scale=vs) - exact).abs().max() < 5e-5
    q16 = query.to(torch.bfloat16)
    exact16 = ref.paged_attention(q16.float(), k32, v32, full, 0.125)
    got16 = cpu.paged_attention(q16, k8, v8, lean, 0.125, k_scale=ks, v_scale=vs)
    full16 = AttentionMetadata.build([s for s, _ in BATCHES[batch]], [q for _, q in BATCHES[batch]],
                                     scattered_tables(BATCHES[batch], 16), 16, dtype=torch.bfloat16)
    ref16 = ref.paged_attention(q16, k8, v8, full16, 0.125, k_scale=ks, v_scale=vs)
    err, ref_err = ((x.float() - exact16).abs().max().item() for x in (got16, ref16))
    assert got16.dtype == torch.bfloat16 and err < 1.6e-2 and err <= ref_err + 1e-6


@pytest.mark.parametrize("batch", ["decode", "verification", "long"])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("mode", ["whole", "heads", "off"])
def test_fp8_decode_rows_on_amx_tiles_are_read_with_their_scales(cpu, monkeypatch, batch, per_head, mode):
    """FP8 caches through attend_decode_amx (K and V rows converted to bf16 before their tiles, the K
    scale on the scores, the V scale on the output) in each item mode of
    test_bf16_decode_rows_on_amx_tiles_within_tolerance_of_fp32: bf16 queries within bf16's tolerance
    of an exact read of the dequantized cache, no worse than the reference's FP8 path, and within 2
    bf16 ulps of attend_item."""
    seqs = AMX_DECODE_BATCHES[batch]
    query, (k8, v8), (k32, v32), (ks, vs), full, lean = fp8_case(seqs, kv_heads=3, per_head=per_head)
    ref = get_attention_backend("torch")
    q16 = query.to(torch.bfloat16)
    exact16 = ref.paged_attention(q16.float(), k32, v32, full, 0.125)
    full16 = AttentionMetadata.build([s for s, _ in seqs], [q for _, q in seqs], scattered_tables(seqs, 16), 16,
                                     dtype=torch.bfloat16)
    ref_err = (ref.paged_attention(q16, k8, v8, full16, 0.125, k_scale=ks, v_scale=vs).float() - exact16).abs().max().item()
    monkeypatch.setenv("PDSERVE_ATTN_AMX_DECODE", {"whole": "1", "heads": "heads", "off": "0"}[mode])
    got = cpu.paged_attention(q16, k8, v8, lean, 0.125, k_scale=ks, v_scale=vs)
    err = (got.float() - exact16).abs().max().item()
    assert got.dtype == torch.bfloat16 and err < 1.6e-2 and err <= ref_err + 1e-6
    monkeypatch.setenv("PDSERVE_ATTN_AMX_DECODE", "0")
    other = cpu.paged_attention(q16, k8, v8, lean, 0.125, k_scale=ks, v_scale=vs)
    assert (got.float() - other.float()).abs().max().item() < 1.6e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("mode", ["whole", "heads"])
def test_decode_rows_over_a_cache_with_padded_heads(cpu, monkeypatch, dtype, mode):
    """K/V as a [..., :64] view of 72-wide heads (the kernel accepts any head stride): the AMX decode
    path's result equals attend_item's within 2 bf16 ulps. (Its FP8 copy of all heads' span, 136
    values a token, once wrote past its buffer: heap corruption that aborted the process in some
    runs only, which no assertion here sees; the kernel now copies each head alone.)"""
    gen = torch.Generator().manual_seed(3)
    seqs, hkv, group = [(20 + 7 * i, 1) for i in range(16)], 2, 4

    def padded_cache():
        wide = torch.zeros(NUM_BLOCKS, 16, hkv, 72)
        wide[..., :64] = torch.randn(NUM_BLOCKS, 16, hkv, 64, generator=gen)
        return wide.to(dtype)[..., :64]

    kc, vc = padded_cache(), padded_cache()
    query = torch.randn(len(seqs), hkv * group, 64, generator=gen).to(torch.bfloat16)
    scales = {"k_scale": torch.tensor([0.5]), "v_scale": torch.tensor([0.5])} if dtype != torch.bfloat16 else {}
    lean = AttentionMetadata.build([s for s, _ in seqs], [q for _, q in seqs], scattered_tables(seqs, 16), 16,
                                   dtype=torch.bfloat16, groups=cpu_attention.CpuAttention.metadata_groups)
    monkeypatch.setenv("PDSERVE_ATTN_AMX_DECODE", {"whole": "1", "heads": "heads"}[mode])
    got = cpu.paged_attention(query, kc, vc, lean, 0.125, **scales)
    monkeypatch.setenv("PDSERVE_ATTN_AMX_DECODE", "0")
    want = cpu.paged_attention(query, kc, vc, lean, 0.125, **scales)
    assert got.isfinite().all() and (got.float() - want.float()).abs().max().item() < 1.6e-2


@pytest.mark.parametrize("query_len", [1, 16])   # the decode rows and the prefill tiles convert blocks alike
def test_fp8_values_are_read_exactly_with_bf16_queries(cpu, query_len):
    """Every E4M3 byte but NaN, as V of the only visible key (softmax weight exactly 1): the
    output is V x v_scale exactly, so the kernel's E4M3 -> bf16 conversion loses nothing
    (subnormals, both signs, the largest finite 448 included)."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)   # 254 values
    values = torch.zeros(256, dtype=torch.uint8)
    values[:codes.numel()] = codes
    vc = torch.zeros(2, 16, 4, 64, dtype=torch.uint8)
    vc[0, :, :, :] = values.view(4, 64)   # every token of block 0 holds the 256 codes
    vc = vc.view(torch.float8_e4m3fn)
    kc = torch.zeros_like(vc)   # all scores equal: with one visible key its weight is 1
    query = torch.randn(query_len, 4, 64).to(torch.bfloat16)
    meta = AttentionMetadata.build([0], [query_len], [[0, 1]], 16, dtype=torch.bfloat16,
                                   groups=cpu_attention.CpuAttention.metadata_groups)
    scale = torch.tensor([0.5])
    got = cpu.paged_attention(query, kc, vc, meta, 0.125, k_scale=scale, v_scale=scale)
    want = (values.view(torch.float8_e4m3fn).float() * 0.5).view(4, 64)
    assert torch.equal(got[0].float(), want)   # the first query sees key 0 only


def test_fp8_scales_are_checked(cpu):
    query, (k8, v8), _, (ks, vs), _, lean = fp8_case(BATCHES["decode"], kv_heads=3, per_head=True)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        cpu.paged_attention(query, k8, v8, lean, 0.1)
    with pytest.raises(ValueError, match="scales are for an FP8 cache"):
        cpu.paged_attention(query, k8.float(), v8.float(), lean, 0.1, k_scale=ks, v_scale=vs)
    with pytest.raises(RuntimeError, match="1 or num_kv_heads"):
        cpu.paged_attention(query, k8, v8, lean, 0.1, k_scale=torch.ones(2), v_scale=torch.ones(2))


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


def test_a_new_build_removes_the_least_recently_loaded_finished_builds(tmp_path):
    """prune_builds keeps the builds loaded most recently (stamp mtimes), never the current one, a
    build still under way (no stamp file) or anything not named as a build."""
    import os

    def build(name, loaded_at=None):
        path = tmp_path / f"paged_attention-avx512-torch2.13.0_cpu-{name}"
        path.mkdir()
        (path / "paged_attention.so").write_bytes(b"\0" * 64)
        if loaded_at is not None:
            (path / "source.sha256").write_text(name + "\n")
            os.utime(path / "source.sha256", (loaded_at, loaded_at))
        return path

    current = build("cccccccccccc", loaded_at=100)   # the oldest stamp, but the one just built
    old = [build(f"{i:012d}", loaded_at=1000 + i) for i in range(5)]
    busy = build("bbbbbbbbbbbb")                      # another process's build, not finished
    other = tmp_path / "notes"                        # stamped, not named as a build
    other.mkdir()
    (other / "source.sha256").write_text("x\n")
    os.utime(other / "source.sha256", (1, 1))
    elsewhere = tmp_path / "elsewhere"                # a stamped build behind a symlink
    elsewhere.mkdir()
    (elsewhere / "source.sha256").write_text("x\n")
    os.utime(elsewhere / "source.sha256", (1, 1))
    link = tmp_path / "paged_attention-avx512-torch2.13.0_cpu-linklinklink"
    link.symlink_to(elsewhere, target_is_directory=True)
    odd = build("dddddddddddd")                       # a directory where the stamp should be
    (odd / "source.sha256").mkdir()
    removed = cpu_attention.prune_builds(current, keep=2)
    assert sorted(removed) == sorted(old[:3])
    assert all(p.exists() for p in (current, old[3], old[4], busy, other, elsewhere / "source.sha256", link, odd))
    assert not any(p.exists() for p in old[:3])
    assert cpu_attention.prune_builds(current, keep=2) == []


def test_a_rebuild_unmarks_its_directory_until_it_finishes(monkeypatch, tmp_path):
    """A build into a directory holding an earlier build's stamp (its library gone) removes the stamp
    first: until the new one is written, prune_builds elsewhere takes the directory for a build
    under way and leaves it alone. (The compile fails here: CXX is ``false``.)"""
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    build_dir = cpu_attention.cache_dir()
    build_dir.mkdir(parents=True)
    (build_dir / "source.sha256").write_text(cpu_attention._stamp() + "\n")
    module, reason = cpu_attention._build()
    assert module is None and "failed" in reason
    assert not (build_dir / "source.sha256").exists()


def test_a_build_with_a_directory_where_its_stamp_should_be_returns_a_reason(monkeypatch, tmp_path):
    """load_extension never raises: an odd stamp path is no exception either."""
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    (cpu_attention.cache_dir() / "source.sha256").mkdir(parents=True)
    module, reason = cpu_attention._build()
    assert module is None and reason


def test_loading_a_cached_build_marks_it_used(cpu):
    """_load_cached touches the stamp file, the time prune_builds ranks builds by."""
    import os

    build_dir = cpu_attention.cache_dir()
    stamp_file = build_dir / "source.sha256"
    before = stamp_file.stat().st_mtime
    os.utime(stamp_file, (before - 3600, before - 3600))   # (an hour back, never far: it is the real cache)
    try:
        assert cpu_attention._load_cached(build_dir / f"{cpu_attention.EXTENSION}.so", stamp_file,
                                          cpu_attention._stamp())
        assert stamp_file.stat().st_mtime >= before
    finally:
        if stamp_file.stat().st_mtime < before:
            os.utime(stamp_file, (before, before))


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
    before = cpu_attention._stamp()
    monkeypatch.setattr(cpu_attention, "_native_target", lambda: "avx512f avx512_bf16 amx_tile")
    assert cpu_attention._stamp() != before   # another CPU (-march=native) is another build


def test_the_build_key_names_this_cpus_flags():
    if not cpu_attention._is_x86():
        pytest.skip("not x86: -march=native is not passed")
    assert "sse2" in cpu_attention._native_target().split()


@pytest.mark.parametrize("x_dtype,cache_dtype,scales", [
    (torch.bfloat16, torch.bfloat16, None), (torch.float32, torch.float32, None),
    (torch.float32, torch.bfloat16, None),               # converted as torch casts (round to nearest even)
    (torch.bfloat16, torch.float8_e4m3fn, "head"), (torch.float32, torch.float8_e4m3fn, "layer")])
def test_the_kv_write_stores_the_reference_bytes(cpu, x_dtype, cache_dtype, scales):
    from kernels.torch_ref import write_kv_cache

    gen = torch.Generator().manual_seed(3)
    tokens, kv_heads, d = 37, 3, 64
    # normal values, E4M3 subnormals (|x / scale| < 2^-6), values that saturate at 448, signed zeros
    k = torch.randn(tokens, kv_heads, d, generator=gen) * torch.tensor([0.05, 1.0, 40.0]).view(1, 3, 1)
    k[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-6, -1e-6])
    v = torch.randn(tokens, kv_heads, d, generator=gen)
    k, v = k.to(x_dtype), v.to(x_dtype)
    ks = vs = None
    if scales is not None:
        ks = torch.tensor([0.01, 0.02, 0.05]) if scales == "head" else torch.tensor([0.03])
        vs = ks * 0.5
    slots = torch.randperm(NUM_BLOCKS * 16, generator=gen)[:tokens]
    caches = [torch.zeros(NUM_BLOCKS, 16, kv_heads, d, dtype=cache_dtype) for _ in range(4)]
    write_kv_cache(k, v, caches[0], caches[1], slots, ks, vs)
    cpu.write_kv_cache(k, v, caches[2], caches[3], slots, ks, vs)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu.write_kv_cache(k[:1], v[:1], caches[2], caches[3], torch.tensor([NUM_BLOCKS * 16]), ks, vs)
    # a value cache of fewer blocks than the key cache: its own capacity bounds the slots (a break-it
    # pass found the value row written past the end of a half-size value cache)
    small = caches[3][: NUM_BLOCKS // 2].clone()
    with pytest.raises(RuntimeError, match="outside the cache's .* slots .*different numbers of slots"):
        cpu.write_kv_cache(k[:1], v[:1], caches[2], small, torch.tensor([NUM_BLOCKS // 2 * 16]), ks, vs)
