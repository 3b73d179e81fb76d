"""The INT8 QKV projection with RoPE and the KV-cache write in its epilogue on AMX
(``torch.ops.pdserve_int8_amx.qkv_rope_w8a8_gemm``, kernels/csrc/int8_gemm_amx.cpp): q, the key
cache and the value cache hold, bit for bit, what the AMX INT8 linear, ``pdserve_ops.rope_split``
and ``pdserve_attn.write_kv_cache`` leave there, both where it runs as one parallel region (M <= 16,
one scale per token, D = 64, bf16 caches) and where it falls back to the three ops; other slots
untouched; a slot outside the cache refused with write_kv_cache's message, nothing written. (The
decoder loop that calls it equals the Python loop bit for bit: test_decoder_loop.py.) Skipped, with
the reason, only on a CPU without AMX-INT8."""

from __future__ import annotations

import pytest
import torch

from kernels.linear import Int8Linear


def case(m: int, h: int = 576, hq: int = 9, hkv: int = 3, d: int = 64, group: int | None = None, seed: int = 0,
         cache_dtype: torch.dtype = torch.bfloat16):
    """(linear, x, cos, sin, slots, key cache, value cache) with SmolLM2-135M's shapes by default:
    the caches filled with a pattern, the slots scattered over their blocks."""
    gen = torch.Generator().manual_seed(seed)
    layer = Int8Linear((torch.randn((hq + 2 * hkv) * d, h, generator=gen) * 0.05).bfloat16(), None, group=group or h)
    x = torch.randn(m, h, generator=gen).bfloat16()
    angles = torch.rand(m, d // 2, generator=gen) * 50
    blocks, bs = 40, 16
    slots = torch.randperm(blocks * bs, generator=gen)[:m].long()
    kc = torch.randn(blocks, bs, hkv, d, generator=gen).to(cache_dtype)
    return layer, x, angles.cos(), angles.sin(), slots, kc, kc.clone() * 2


def apart(layer, x, cos, sin, slots, kc, vc, hq: int = 9):
    qkv = layer.run_kernel("w8a8_amx", x)
    m, hkv, d = x.shape[0], kc.shape[2], kc.shape[3]
    q = torch.empty(m, hq, d, dtype=qkv.dtype)
    k, v = torch.empty(m, hkv, d, dtype=qkv.dtype), torch.empty(m, hkv, d, dtype=qkv.dtype)
    torch.ops.pdserve_ops.rope_split(q, k, v, qkv.contiguous(), cos, sin)
    torch.ops.pdserve_attn.write_kv_cache(k, v, kc, vc, slots, None, None)
    return q


def fused(layer, x, cos, sin, slots, kc, vc, hq: int = 9):
    q = torch.empty(x.shape[0], hq, kc.shape[3], dtype=torch.bfloat16)
    torch.ops.pdserve_int8_amx.qkv_rope_w8a8_gemm(x, layer.qweight, layer.weight_scale, layer.out_features, layer.group,
                                                   cos, sin, q, kc, vc, slots)
    return q


def ops_called(f) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        f()
    return {e.key: e.count for e in prof.key_averages()}


@pytest.mark.parametrize("m,one_region", [(1, True), (5, True), (16, True), (17, False), (40, False)])
def test_q_and_the_caches_equal_the_three_ops(amx_int8, m, one_region):
    layer, x, cos, sin, slots, kc, vc = case(m, seed=m)
    want_k, want_v = kc.clone(), vc.clone()
    want_q = apart(layer, x, cos, sin, slots, want_k, want_v)
    calls = ops_called(lambda: fused(layer, x, cos, sin, slots, kc, vc))
    q = fused(layer, x, cos, sin, slots, kc, vc)
    assert torch.equal(q, want_q) and torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert not torch.equal(kc, case(m, seed=m)[5])   # (the call wrote something)
    assert calls.get("pdserve_ops::rope_split", 0) == (0 if one_region else 1)


@pytest.mark.parametrize("kwargs", [dict(hq=4, hkv=2, h=128), dict(hq=3, hkv=1, h=96), dict(d=32, hq=6, hkv=2, h=128),
                                    dict(group=32), dict(cache_dtype=torch.float32)],
                         ids=["gqa-2", "h-96", "d-32", "groups-of-32", "fp32-cache"])
def test_other_shapes_and_the_ways_around(amx_int8, kwargs):
    """Other head counts and widths (H 96: k steps of 32 bytes) in one region; D = 32, groups of
    32 and an fp32 cache through the three ops."""
    hq = kwargs.get("hq", 9)
    layer, x, cos, sin, slots, kc, vc = case(16, seed=3, **kwargs)
    want_k, want_v = kc.clone(), vc.clone()
    want_q = apart(layer, x, cos, sin, slots, want_k, want_v, hq=hq)
    q = fused(layer, x, cos, sin, slots, kc, vc, hq=hq)
    assert torch.equal(q, want_q) and torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_strided_cache_blocks(amx_int8):
    """Caches whose blocks are views of a larger allocation (block stride beyond block_size rows)."""
    layer, x, cos, sin, slots, kc, vc = case(16, seed=4)
    big_k, big_v = torch.cat([kc, kc], dim=2), torch.cat([vc, vc], dim=2)   # [blocks, bs, 2 Hkv, D]
    view_k, view_v = big_k[:, :, :3], big_v[:, :, :3]
    assert not view_k.is_contiguous()
    want_k, want_v = view_k.clone(), view_v.clone()
    want_q = apart(layer, x, cos, sin, slots, want_k, want_v)
    q = fused(layer, x, cos, sin, slots, view_k, view_v)
    assert torch.equal(q, want_q) and torch.equal(view_k, want_k) and torch.equal(view_v, want_v)
    assert torch.equal(big_k[:, :, 3:], kc)   # the other half untouched


def test_caches_side_by_side_in_one_allocation_run_in_one_region(amx_int8):
    """K and V as the model allocates them, views of one tensor [2, blocks, bs, Hkv, D] side by side
    (not overlapping): one region, the same bits."""
    layer, x, cos, sin, slots, kc, vc = case(16, seed=7)
    both = torch.stack([kc, vc])
    want = both.clone()
    want_q = apart(layer, x, cos, sin, slots, want[0], want[1])
    scratch = both.clone()
    calls = ops_called(lambda: fused(layer, x, cos, sin, slots, scratch[0], scratch[1]))
    assert calls.get("pdserve_ops::rope_split", 0) == 0
    assert torch.equal(fused(layer, x, cos, sin, slots, both[0], both[1]), want_q) and torch.equal(both, want)


def test_one_tensor_for_both_caches_ends_with_v(amx_int8):
    """The same tensor as key and value cache (a break-it pass's case): V's rows are what stays, as
    write_kv_cache writes V after K, whatever the threads' order."""
    layer, x, cos, sin, slots, kc, _ = case(16, seed=6)
    want = kc.clone()
    want_q = apart(layer, x, cos, sin, slots, want, want)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        for _ in range(5):
            cache = kc.clone()
            assert torch.equal(fused(layer, x, cos, sin, slots, cache, cache), want_q) and torch.equal(cache, want)
    finally:
        torch.set_num_threads(before)


def test_bad_arguments_are_refused_with_the_reason(amx_int8):
    layer, x, cos, sin, slots, kc, vc = case(4, seed=5)
    before_k, before_v = kc.clone(), vc.clone()
    bad = slots.clone()
    bad[2] = kc.shape[0] * kc.shape[1]
    with pytest.raises(RuntimeError, match=r"slot 640 outside the cache's 640 slots"):
        fused(layer, x, cos, sin, bad, kc, vc)
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)   # nothing written
    with pytest.raises(RuntimeError, match=r"\(Hq \+ 2 Hkv\) D = n = 960"):
        fused(layer, x, cos, sin, slots, kc, vc, hq=8)
    with pytest.raises(RuntimeError, match=r"x must be bf16"):
        fused(layer, x.float(), cos, sin, slots, kc, vc)
    # caches whose D is not q's (n still (Hq + 2 Hkv) D for q's D): refused, not written as 64-wide
    # heads into 32-wide rows (found by a break-it pass)
    with pytest.raises(RuntimeError, match=r"one block_size, Hkv and D"):
        fused(layer, x, cos, sin, slots, kc[..., :32].contiguous(), vc[..., :32].contiguous())
    # a value cache of fewer blocks: slots bounded by each cache's capacity (write_kv_cache's check)
    with pytest.raises(RuntimeError, match=r"slot 500 outside the cache's 320 slots"):
        fused(layer, x, cos, sin, torch.tensor([1, 500, 2, 3]), kc, vc[:20].clone())
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)
