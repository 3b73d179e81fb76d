"""The KV format descriptor in the transfer compatibility key: caches whose dtype or FP8 scales
differ are refused at handshake with both sides' values, and FP8 KV moves as FP8 bytes (half of
bf16's) over a real transport."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVCacheSpec, PagedKVCache
from engine.quantization.kv_scales import calibrate_kv
from kv_transfer import CompatKey, IncompatiblePeer, TransferState, create_transport

# The bundled model's layout; 63 blocks of 16 = 1,008 tokens: a 1,000-token prompt.
SMOL = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, num_blocks=64)
_KV = torch.linspace(-1, 1, 8)[:, None, None].expand(8, 3, 64)
DIGEST_A = calibrate_kv([_KV] * 30, [_KV * 2] * 30, "a").digest()
DIGEST_B = calibrate_kv([_KV] * 30, [_KV * 2 + 0.5] * 30, "b").digest()   # other V offsets


def fp8_spec(digest: str = DIGEST_A) -> KVCacheSpec:
    return KVCacheSpec(**SMOL, dtype=torch.float8_e4m3fn, scales_digest=digest)


def bf16_spec() -> KVCacheSpec:
    return KVCacheSpec(**SMOL, dtype=torch.bfloat16)


def test_descriptor_names_everything_a_blocks_bytes_depend_on():
    f = fp8_spec().kv_format
    assert str(f) == f"float8_e4m3fn/LKBTHD/bs16/L30/kv3x64/scales:{DIGEST_A}"
    assert fp8_spec().kv_format != fp8_spec(DIGEST_B).kv_format and DIGEST_A != DIGEST_B
    with pytest.raises(AttributeError):
        f.dtype = "bfloat16"   # frozen
    key = CompatKey.from_spec(fp8_spec(), "m")
    assert CompatKey.from_dict(key.to_dict()) == key


@pytest.mark.parametrize("ours,theirs,fragments", [
    (fp8_spec(), bf16_spec(), [f"kv_dtype: ours='float8_e4m3fn' peer='bfloat16'",
                               f"kv_scales_digest: ours='{DIGEST_A}' peer=''"]),
    (fp8_spec(DIGEST_A), fp8_spec(DIGEST_B), [f"kv_scales_digest: ours='{DIGEST_A}' peer='{DIGEST_B}'",
                                              "give every worker the same <model dir>/pdserve_kv_scales.json"]),
])
def test_pd_pair_with_different_kv_formats_is_refused_at_handshake(ours, theirs, fragments):
    """A prefill worker with fp8 KV and a decode worker with bf16 KV (or other scales), over tcp."""
    prefill, decode = create_transport("tcp"), create_transport("tcp")
    try:
        prefill.register_cache(PagedKVCache(ours), CompatKey.from_spec(ours, "smollm2"))
        decode_meta = decode.register_cache(PagedKVCache(theirs), CompatKey.from_spec(theirs, "smollm2"))
        with pytest.raises(IncompatiblePeer) as err:
            prefill.add_peer(decode_meta)
        message = str(err.value)
        print(message)
        for fragment in fragments:
            assert fragment in message
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("ours,theirs", [("int8/down:mx", "int8/down:g32"), ("none", "int8/down:mx")])
def test_pd_pair_whose_weights_compute_differently_is_refused_at_handshake(ours, theirs):
    """The same KV format but weights quantized otherwise (int8's down_proj activations follow the
    CPU: an AMX worker and another one; or bf16 against int8): the KV the prefill worker computed is
    not what the decode worker would have, so the pair is refused, naming both."""
    spec = bf16_spec()
    prefill, decode = create_transport("tcp"), create_transport("tcp")
    try:
        prefill.register_cache(PagedKVCache(spec), CompatKey.from_spec(spec, "smollm2", weights=ours))
        decode_meta = decode.register_cache(PagedKVCache(spec), CompatKey.from_spec(spec, "smollm2", weights=theirs))
        with pytest.raises(IncompatiblePeer, match=f"weights: ours='{ours}' peer='{theirs}'"):
            prefill.add_peer(decode_meta)
    finally:
        prefill.close()
        decode.close()


def test_a_peer_key_without_the_weights_field_reads_as_unquantized():
    key = CompatKey.from_spec(bf16_spec(), "m")
    old = {k: v for k, v in key.to_dict().items() if k != "weights"}
    assert CompatKey.from_dict(old) == key and key.weights == "none"
    with pytest.raises(IncompatiblePeer, match="weights=3 is not str"):
        CompatKey.from_dict({**old, "weights": 3})


def test_fp8_kv_travels_as_fp8_half_the_bytes_of_bf16():
    moved = {}
    for name, spec in (("fp8", fp8_spec()), ("bf16", bf16_spec())):
        src, dst = PagedKVCache(spec), PagedKVCache(spec)
        raw = src.data.view(torch.uint8)
        raw.copy_(torch.randint(0, 0x7F, raw.shape, dtype=torch.uint8))
        sender, receiver = create_transport("tcp"), create_transport("tcp")
        try:
            sender.register_cache(src, CompatKey.from_spec(spec, "smollm2"))
            peer = sender.add_peer(receiver.register_cache(dst, CompatKey.from_spec(spec, "smollm2")))
            blocks = list(range(63))   # a 1,000-token prompt
            h = sender.write(peer, blocks, blocks, list(range(spec.num_layers)), f"req-{name}", 30.0)
            assert h.wait() is TransferState.DONE, h.error
            assert torch.equal(dst.data[:, :, :63].view(torch.uint8), src.data[:, :, :63].view(torch.uint8))
            assert dst.data.dtype == spec.dtype
            moved[name] = h.nbytes
        finally:
            sender.close()
            receiver.close()
    assert moved["fp8"] * 2 == moved["bf16"] == 2 * 30 * 63 * 16 * 3 * 64 * 2
