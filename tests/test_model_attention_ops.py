"""The torch reference attention ops (kernels/) against a naive per-token, per-head softmax."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.attention import MAX_PADDED_QUERY_LEN, AttentionMetadata, get_attention_backend, partition_by_length

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, GROUP, HEAD_DIM = 64, 4, 2, 3, 8


def naive_attention(query, key_cache, value_cache, seqs, tables, scale):
    out, row = torch.empty_like(query), 0
    for (start, qlen), table in zip(seqs, tables):
        slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start + qlen)]
        keys = key_cache.view(-1, KV_HEADS, HEAD_DIM)[slots]
        values = value_cache.view(-1, KV_HEADS, HEAD_DIM)[slots]
        for i in range(qlen):
            for h in range(KV_HEADS * GROUP):
                scores = keys[: start + i + 1, h // GROUP] @ query[row + i, h] * scale
                out[row + i, h] = scores.softmax(0) @ values[: start + i + 1, h // GROUP]
        row += qlen
    return out


def scattered_tables(seqs, seed=0):
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    tables = []
    for start, qlen in seqs:
        n = -(-(start + qlen) // BLOCK_SIZE)
        tables.append(blocks[:n])
        blocks = blocks[n:]
    return tables


@pytest.mark.parametrize("seqs", [
    [(0, 1), (7, 1), (30, 1)],                                # decode only: one dense group
    [(0, 20), (5, 1), (30, 3), (12, 17), (0, 1), (40, 40)],   # prefill chunks, decode, verification
    [(0, MAX_PADDED_QUERY_LEN + 1)],                          # one long prefill from 0 (causal)
    [(9, MAX_PADDED_QUERY_LEN + 3), (2, 1)],                  # a long chunk after cached tokens
    [(0, 1), (120, 1), (2, 1), (1, 2), (110, 3)],             # short and long contexts: two groups
])
@pytest.mark.parametrize("group_by_length", [True, False])
def test_paged_attention_matches_naive_softmax(seqs, group_by_length):
    gen = torch.Generator().manual_seed(0)
    key_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    value_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    tables = scattered_tables(seqs)
    meta = AttentionMetadata.build([s for s, _ in seqs], [q for _, q in seqs], tables, BLOCK_SIZE,
                                   group_by_length=group_by_length)
    query = torch.randn(sum(q for _, q in seqs), KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    ops = get_attention_backend("torch")
    got = ops.paged_attention(query, key_cache, value_cache, meta, 0.3)
    assert (got - naive_attention(query, key_cache, value_cache, seqs, tables, 0.3)).abs().max().item() < 1e-5


def test_mixed_context_lengths_are_split_into_groups():
    meta = AttentionMetadata.build([0, 120, 2, 1, 110], [1, 1, 1, 2, 3], scattered_tables(
        [(0, 1), (120, 1), (2, 1), (1, 2), (110, 3)]), BLOCK_SIZE)
    assert sorted(g.max_seq_len for g in meta.groups) == [3, 121]


def brute_force_cost(lens, overhead):
    """Least cost over every split of the sorted lengths into contiguous runs."""
    lens = sorted(lens)
    if not lens:
        return 0
    return min(len(lens[:k]) * lens[k - 1] + overhead + brute_force_cost(lens[k:], overhead)
               for k in range(1, len(lens) + 1))


@pytest.mark.parametrize("seed", range(30))
def test_partition_by_length_is_optimal_and_covers_each_sequence_once(seed):
    rng = random.Random(seed)
    n, overhead = rng.randint(0, 8), rng.choice([0, 5, 64, 10**6])
    seqs = rng.sample(range(100), n)
    lens = [rng.randint(1, 300) for _ in range(n)]
    groups = partition_by_length(seqs, lens, overhead)
    assert sorted(s for g in groups for s in g) == sorted(seqs)
    assert all(g == sorted(g, key=seqs.index) for g in groups)  # input order kept
    length = dict(zip(seqs, lens))
    cost = sum(len(g) * max(length[s] for s in g) + overhead for g in groups)
    assert cost == brute_force_cost(lens, overhead)


def test_write_kv_cache_follows_the_slot_mapping():
    seqs = [(3, 2), (0, 5)]
    tables = scattered_tables(seqs, seed=1)
    meta = AttentionMetadata.build([3, 0], [2, 5], tables, BLOCK_SIZE)
    expected = [tables[0][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in (3, 4)]
    expected += [tables[1][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(5)]
    assert meta.slot_mapping.tolist() == expected
    key_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    value_cache = torch.zeros_like(key_cache)
    key, value = torch.randn(7, KV_HEADS, HEAD_DIM), torch.randn(7, KV_HEADS, HEAD_DIM)
    get_attention_backend("torch").write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping)
    assert torch.equal(key_cache.view(-1, KV_HEADS, HEAD_DIM)[expected], key)
    assert torch.equal(value_cache.view(-1, KV_HEADS, HEAD_DIM)[expected], value)
    assert key_cache.abs().sum().item() == pytest.approx(key.abs().sum().item())


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown attention backend 'nonesuch'"):
        get_attention_backend("nonesuch")
