"""pdserve bench kv-transfer: GiB/s of each KV transport vs memcpy, and how much transfer hides under prefill.

Two real processes: this one sends, a spawned receiver holds the destination caches and polls its
transports (as a decode worker would; NIXL needs it, see MACHINE-NOTES). Three parts:

1. Bandwidth. A cache of 1 KiB blocks (one layer, ``block_size=1``, one head of 256 fp32) is
   written in runs of ``chunk`` bytes separated by gaps, so each descriptor is exactly one chunk
   (K and V of a run are two chunks). GiB/s = bytes / (``write`` call .. handle DONE), median of
   repeats; the memcpy column is a single-threaded ``copy_`` of as many bytes (at least 64 MiB),
   its repeats alternating with the transfer's so both see the same load on a shared machine;
   ``ratio`` = backend / memcpy (``*_best``: from the fastest repeat of each).
2. The KV of a 1,000-token prompt in the SmolLM2-135M layout (30 layers, 3 KV heads, head dim 64,
   block size 16, fp32: 63 blocks, 46 MB), written whole and layer by layer; and the same prompt
   in the KV formats served (``--kv-cache-dtype auto`` with bf16: 23 MB; ``fp8_e4m3``: the E4M3
   bytes as they are, 12 MB), whole, beside each other (``prompt_1000_by_dtype``).
3. Overlap. Prefill a 1,000-token prompt with the real model; the runner's per-layer hook hands
   layer l to a ``LayerStream``, which writes its blocks at once from another thread.
   exposed = (time the hooks block the forward) + (time from the end of the forward until the
   last layer is DONE); overlap = 1 - exposed / (time to move the same layers, layer by layer,
   after the prefill). A wall-clock variant (streaming run minus the median compute-only run) is
   reported beside it; on a shared 2-core machine prefill times vary by more than the transfer
   takes, so that variant is noise here.

JSON: ``rows`` (``backend``, ``chunk_bytes``, ``gib_s``, ``memcpy_gib_s``, ``ratio``, ...),
``prompt_1000`` per backend, ``prompt_1000_by_dtype`` per backend and KV dtype, ``overlap`` (0-1, for nixl if it ran), ``overlap_by_backend``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import typer

from bench.options import int_list

CHUNKS = [1 << k for k in range(10, 27, 2)]  # 1 KiB, 4 KiB, ..., 64 MiB
BW_NUM_BLOCKS = 1 << 16  # 1 KiB blocks: K and V regions of 64 MiB each
MAX_RUNS = 2048  # bounds the descriptor count (and Python framing cost) for small chunks
SMOL = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)
PROMPT_TOKENS = 1000
MODEL = "smollm2-135m-instruct"
FORMAT_DTYPES = ("bfloat16", "float8_e4m3fn")
"""KV dtypes of the served formats compared per 1,000-token prompt (fp8: scales digest set, as served)."""


def command(
    backend: str = typer.Option("all", help="nixl | torch | tcp | all"),
    json_out: Path = typer.Option(None, "--json", help="write the results here"),
    chunks: str = typer.Option("", help="comma-separated chunk sizes in bytes (default 1 KiB..64 MiB, x4)"),
    min_time_s: float = typer.Option(0.3, help="repeat each measurement at least this long"),
    overlap: bool = typer.Option(True, help="run the layer-wise streaming overlap test (loads the model)"),
    model: str = typer.Option(MODEL, help="model for the overlap test"),
) -> None:
    """pdserve bench kv-transfer: GiB/s of each KV transport vs memcpy, and overlap."""
    from engine.errors import UserError

    backends = ["nixl", "torch", "tcp"] if backend == "all" else [backend]
    if any(b not in ("nixl", "torch", "tcp") for b in backends):
        raise UserError(f"--backend must be nixl, torch, tcp or all, got {backend!r}")
    sizes = int_list(chunks, "--chunks", example="1048576,4194304") if chunks else CHUNKS
    if any(s < 1024 or s % 1024 or s > BW_NUM_BLOCKS * 1024 for s in sizes):
        raise UserError("--chunks: sizes must be multiples of 1024 between 1 KiB and 64 MiB")
    doc = run(backends, sizes, min_time_s, overlap, model)
    print(table(doc))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {json_out}")


def run(backends: list[str], sizes: list[int], min_time_s: float, overlap: bool, model: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    doc: dict[str, Any] = {"bench": "kv-transfer", "backends": backends, "rows": [], "prompt_1000": {}, "prompt_1000_by_dtype": {},
                           "overlap": None, "overlap_by_backend": {},
                           "machine": {"cpus": os.cpu_count(), "torch_threads": 1, "python": sys.version.split()[0]}}
    runner = _load_runner(model) if overlap else None
    for name in backends:
        with _Pair(name, model) as pair:
            doc["rows"] += [_bandwidth_row(pair, size, min_time_s) for size in sizes]
            doc["prompt_1000"][name] = _prompt_transfer(pair, min_time_s)
            doc["prompt_1000_by_dtype"][name] = _format_transfers(pair, min_time_s)
            if runner is not None:
                doc["overlap_by_backend"][name] = _overlap(pair, runner)
    if doc["overlap_by_backend"]:
        first = "nixl" if "nixl" in doc["overlap_by_backend"] else backends[0]
        doc["overlap"] = doc["overlap_by_backend"][first]["overlap"]
        doc["overlap_backend"] = first
    return doc


# -- the two processes ----------------------------------------------------------------------------
def _bw_spec():
    from engine.kv_cache import KVCacheSpec
    return KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=256, block_size=1, num_blocks=BW_NUM_BLOCKS)


def _smol_spec(dtype: str = "float32"):
    import torch

    from engine.kv_cache import KVCacheSpec
    digest = "bench" if dtype == "float8_e4m3fn" else ""
    return KVCacheSpec(num_blocks=math.ceil(PROMPT_TOKENS / SMOL["block_size"]) + 8, dtype=getattr(torch, dtype),
                       scales_digest=digest, **SMOL)


def _filled(spec, seed: int):
    import torch

    from engine.kv_cache import PagedKVCache
    cache = PagedKVCache(spec)
    cache.data.copy_((torch.rand(spec.shape, generator=torch.Generator().manual_seed(seed)) + 0.5).to(spec.dtype))
    return cache


def _receiver_main(conn, backend: str, model_id: str) -> None:
    """The receiving process: register both caches, send their metadata, poll until told to stop."""
    import torch

    from kv_transfer import CompatKey, create_transport
    torch.set_num_threads(1)
    transports = []
    metas = []
    for spec in (_bw_spec(), _smol_spec(), *(_smol_spec(d) for d in FORMAT_DTYPES)):
        t = create_transport(backend)
        metas.append(t.register_cache(_filled(spec, 7), CompatKey.from_spec(spec, model_id)))
        transports.append(t)
    conn.send(metas)
    while not conn.poll(0.0005):
        for t in transports:
            t.poll_notifications()
    for t in transports:
        t.close()


class _Pair:
    """This process's sending transports (bandwidth cache, SmolLM2-layout cache) + the receiver."""

    def __init__(self, backend: str, model_id: str) -> None:
        self.backend, self.model_id = backend, model_id

    def __enter__(self) -> "_Pair":
        import multiprocessing as mp

        from kv_transfer import CompatKey, create_transport
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver_main, args=(child, self.backend, self.model_id), daemon=True)
        self.proc.start()
        deadline = time.monotonic() + 180
        while not self.conn.poll(0.5):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the {self.backend} receiver process did not start "
                                   f"(exit code {self.proc.exitcode})")
        bw_meta, self.smol_meta, *format_metas = self.conn.recv()
        self.bw_cache, self.smol_cache = _filled(_bw_spec(), 1), _filled(_smol_spec(), 2)
        self.bw, self.smol = create_transport(self.backend), create_transport(self.backend)
        self.bw.register_cache(self.bw_cache, CompatKey.from_spec(self.bw_cache.spec, self.model_id))
        self.smol.register_cache(self.smol_cache, CompatKey.from_spec(self.smol_cache.spec, self.model_id))
        self.bw_peer, self.smol_peer = self.bw.add_peer(bw_meta), self.smol.add_peer(self.smol_meta)
        self.formats = {}  # KV dtype -> (transport, peer, cache)
        for dtype, meta in zip(FORMAT_DTYPES, format_metas):
            cache, t = _filled(_smol_spec(dtype), 3), create_transport(self.backend)
            t.register_cache(cache, CompatKey.from_spec(cache.spec, self.model_id))
            self.formats[dtype] = (t, t.add_peer(meta), cache)
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.send("stop")
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
        self.bw.close()
        self.smol.close()
        for t, _, _ in self.formats.values():
            t.close()


# -- measurements -------------------------------------------------------------------------------
def _repeat(fn, min_time_s: float, min_reps: int = 3, max_reps: int = 50) -> list:
    fn()  # warm-up (connection set-up, first-touch)
    times: list = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < min_time_s and len(times) < max_reps):
        times.append(fn())
    return times


def _timed_write(transport, peer: str, blocks: list[int], layers: list[int]) -> float:
    from kv_transfer import TransferState
    t0 = time.perf_counter()
    handle = transport.write(peer, blocks, blocks, layers, "", 60.0)
    if handle.wait() is not TransferState.DONE:
        raise RuntimeError(f"transfer {handle.state.name}: {handle.error}")
    return time.perf_counter() - t0


def _memcpy_timer(nbytes: int):
    """A single-threaded copy of ``nbytes`` (at least 64 MiB: DRAM-bound, like the transfers'
    working sets); returns (timer, bytes copied)."""
    import torch
    nbytes = max(nbytes, 64 << 20)
    src, dst = torch.rand(nbytes // 4), torch.empty(nbytes // 4)

    def once() -> float:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0
    return once, nbytes


def _bandwidth_row(pair: _Pair, chunk: int, min_time_s: float) -> dict[str, Any]:
    import numpy as np
    per_run = chunk // 1024
    n_runs = max(1, min(MAX_RUNS, BW_NUM_BLOCKS // (2 * per_run)))
    stride = BW_NUM_BLOCKS // n_runs
    # block ids as an array: no per-call list conversion inside the timed region
    blocks = (np.arange(n_runs)[:, None] * stride + np.arange(per_run)[None, :]).reshape(-1)
    nbytes = 2 * len(blocks) * 1024  # K and V
    memcpy, memcpy_bytes = _memcpy_timer(nbytes)
    # alternate transfer and memcpy repeats, so both see the same load on a shared machine
    pairs = _repeat(lambda: (_timed_write(pair.bw, pair.bw_peer, blocks, [0]), memcpy()), min_time_s)
    times, copies = [p[0] for p in pairs], [p[1] for p in pairs]
    gib_s, best = nbytes / statistics.median(times) / 2**30, nbytes / min(times) / 2**30
    mem, mem_best = memcpy_bytes / statistics.median(copies) / 2**30, memcpy_bytes / min(copies) / 2**30
    return {"backend": pair.backend, "chunk_bytes": chunk, "gib_s": round(gib_s, 3), "memcpy_gib_s": round(mem, 3),
            "ratio": round(gib_s / mem, 3), "gib_s_best": round(best, 3), "memcpy_gib_s_best": round(mem_best, 3),
            "ratio_best": round(best / mem_best, 3), "descriptors": 2 * n_runs, "bytes": nbytes,
            "repeats": len(times)}


def _prompt_blocks() -> list[int]:
    return list(range(math.ceil(PROMPT_TOKENS / SMOL["block_size"])))


def _prompt_transfer(pair: _Pair, min_time_s: float) -> dict[str, Any]:
    blocks, layers = _prompt_blocks(), list(range(SMOL["num_layers"]))
    whole = statistics.median(_repeat(lambda: _timed_write(pair.smol, pair.smol_peer, blocks, layers), min_time_s))
    layerwise = statistics.median(_repeat(lambda: _layerwise(pair, blocks), min_time_s))
    nbytes = len(blocks) * pair.smol_cache.spec.bytes_per_block_all_layers
    return {"tokens": PROMPT_TOKENS, "blocks": len(blocks), "bytes": nbytes, "whole_ms": round(whole * 1e3, 2),
            "layerwise_ms": round(layerwise * 1e3, 2), "gib_s": round(nbytes / whole / 2**30, 3)}


def _format_transfers(pair: _Pair, min_time_s: float) -> dict[str, Any]:
    """Per KV dtype: bytes and median time to write a 1,000-token prompt's KV whole."""
    blocks, layers, out = _prompt_blocks(), list(range(SMOL["num_layers"])), {}
    for dtype, (t, peer, cache) in pair.formats.items():
        whole = statistics.median(_repeat(lambda: _timed_write(t, peer, blocks, layers), min_time_s))
        nbytes = len(blocks) * cache.spec.bytes_per_block_all_layers
        out[dtype] = {"bytes": nbytes, "whole_ms": round(whole * 1e3, 2), "gib_s": round(nbytes / whole / 2**30, 3)}
    return out


def _layerwise(pair: _Pair, blocks: list[int]) -> float:
    from kv_transfer import TransferState
    t0 = time.perf_counter()
    handles = [pair.smol.write(pair.smol_peer, blocks, blocks, [layer], "", 60.0)
               for layer in range(SMOL["num_layers"])]
    if any(h.wait() is not TransferState.DONE for h in handles):
        raise RuntimeError("a layer transfer did not complete")
    return time.perf_counter() - t0


def _load_runner(model: str):
    from engine.model_runner import ModelRunner
    return ModelRunner(model, block_size=SMOL["block_size"], num_blocks=_smol_spec().num_blocks)


def _overlap(pair: _Pair, runner, reps: int = 2) -> dict[str, Any]:
    """Prefill with layer-wise streaming vs without; see the module docstring for the formula."""
    import torch

    from engine.batch import SeqChunk
    from kv_transfer import CompatKey, LayerStream, TransferState, create_transport
    spec = runner.kv_cache.spec
    if (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size) != tuple(SMOL.values()):
        raise RuntimeError(f"overlap test needs the SmolLM2 layout, the model has {spec}")
    blocks = _prompt_blocks()
    tokens = torch.randint(100, runner.model_config.vocab_size, (PROMPT_TOKENS,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    chunk = [SeqChunk(tokens, 0, blocks, 1)]
    sender = create_transport(pair.backend)  # streams from the runner's own cache
    sender.register_cache(runner.kv_cache, CompatKey.from_spec(spec, pair.model_id))
    peer = sender.add_peer(pair.smol_meta)
    try:
        runner.forward(chunk)  # warm-up
        compute, streamed, alone, exposed, hooks, tails = [], [], [], [], [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.forward(chunk)
            compute.append(time.perf_counter() - t0)

            stream = LayerStream(sender, peer, blocks, blocks, f"overlap-{len(compute)}", spec.num_layers, 60.0)
            hook_time = [0.0]

            def hook(layer: int) -> None:
                h0 = time.perf_counter()
                stream.layer_done(layer)
                hook_time[0] += time.perf_counter() - h0

            t0 = time.perf_counter()
            runner.forward(chunk, layer_hook=hook)
            t_fwd = time.perf_counter()
            if stream.wait() is not TransferState.DONE:
                raise RuntimeError(f"a streamed layer did not complete: {stream.error}")
            t_end = time.perf_counter()
            streamed.append(t_end - t0)
            exposed.append(hook_time[0] + (t_end - t_fwd))
            hooks.append(hook_time[0])
            tails.append(t_end - t_fwd)
            alone.append(_layerwise_from(sender, peer, blocks))
        transfer_alone = statistics.median(alone)
        exposed_direct = statistics.median(exposed)
        exposed_wall = max(0.0, statistics.median(streamed) - statistics.median(compute))
        return {"overlap": round(max(0.0, 1 - exposed_direct / transfer_alone), 3),
                "overlap_wallclock": round(max(0.0, 1 - exposed_wall / transfer_alone), 3),
                "prefill_ms": round(statistics.median(compute) * 1e3, 1),
                "prefill_streaming_ms": round(statistics.median(streamed) * 1e3, 1),
                "transfer_alone_ms": round(transfer_alone * 1e3, 2),
                "exposed_ms": round(exposed_direct * 1e3, 2), "hook_ms": round(statistics.median(hooks) * 1e3, 2),
                "tail_ms": round(statistics.median(tails) * 1e3, 2), "reps": reps}
    finally:
        sender.close()


def _layerwise_from(transport, peer: str, blocks: list[int]) -> float:
    from kv_transfer import TransferState
    t0 = time.perf_counter()
    handles = [transport.write(peer, blocks, blocks, [layer], "", 60.0) for layer in range(SMOL["num_layers"])]
    if any(h.wait() is not TransferState.DONE for h in handles):
        raise RuntimeError("a layer transfer did not complete")
    return time.perf_counter() - t0


# -- output ---------------------------------------------------------------------------------------
def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def table(doc: dict[str, Any]) -> str:
    lines = [f"{'backend':<8}{'chunk':>9}{'GiB/s':>9}{'memcpy':>9}{'ratio':>8}{'best ratio':>12}"]
    for r in doc["rows"]:
        lines.append(f"{r['backend']:<8}{_size(r['chunk_bytes']):>9}{r['gib_s']:>9.2f}{r['memcpy_gib_s']:>9.2f}"
                     f"{r['ratio']:>8.2f}{r['ratio_best']:>12.2f}")
    for name, p in doc["prompt_1000"].items():
        lines.append(f"{name}: KV of a {p['tokens']}-token prompt ({p['bytes'] / 2**20:.1f} MiB, SmolLM2 layout): "
                     f"{p['whole_ms']:.1f} ms whole, {p['layerwise_ms']:.1f} ms layer by layer")
    for name, formats in doc.get("prompt_1000_by_dtype", {}).items():
        cells = [f"{d.removeprefix('float8_')}: {f['bytes'] / 2**20:.1f} MiB, {f['whole_ms']:.1f} ms"
                 for d, f in formats.items()]
        lines.append(f"{name}: KV of a {PROMPT_TOKENS}-token prompt by KV dtype: " + "; ".join(cells))
    for name, o in doc["overlap_by_backend"].items():
        lines.append(f"{name}: overlap {o['overlap']:.1%} (wall-clock {o['overlap_wallclock']:.1%}); prefill "
                     f"{o['prefill_ms']:.0f} ms, with streaming {o['prefill_streaming_ms']:.0f} ms, transfer alone "
                     f"{o['transfer_alone_ms']:.1f} ms, exposed {o['exposed_ms']:.2f} ms (in hooks {o['hook_ms']:.2f}, "
                     f"after the forward {o['tail_ms']:.2f})")
    return "\n".join(lines)
