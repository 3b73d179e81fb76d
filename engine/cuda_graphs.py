"""CUDA graphs for decode steps: one captured forward per batch size, replayed with new inputs.

A decode step of a small model is mostly kernel-launch overhead on a GPU (30 layers x ~15
launches); replaying a captured graph launches them all at once. Graphs fix every tensor's
address and shape, so each captured batch size owns static input buffers (token ids,
positions, slot mapping, context lengths, block tables); a batch of ``n`` decode rows runs the
smallest captured size ``>= n``, its extra rows padded to attend one token of a scratch block
the block manager never hands out. What makes the forward capturable: the ``"triton"``
backend's decode path reads the batch kind off shapes and never synchronizes with the host.

CUDA only; CPU paths never import or call this (ModelRunner is unchanged). The pure part,
``pad_decode_batch``, is tested on CPU; capture and replay are checked by bench/gpu_check.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.batch import SeqChunk


@dataclass(frozen=True)
class DecodeInputs:
    """Host-side inputs of one padded decode step (lists of ints, one entry per row)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]     # every row exactly max_blocks long


def pad_decode_batch(chunks: Sequence[SeqChunk], batch_size: int, max_blocks: int, block_size: int,
                     scratch_block: int) -> DecodeInputs:
    """Decode chunks (one token, one logit each) padded to ``batch_size`` rows.

    Real rows' block tables are padded with ``scratch_block`` (never read: the kernel stops at
    seq_len). Padding rows write their K/V into slot 0 of ``scratch_block`` and attend that one
    token, so they cannot touch a live sequence's cache. Raises ValueError for a chunk that is
    not a decode token, more chunks than batch_size, or a context needing more than max_blocks.
    """
    if len(chunks) > batch_size:
        raise ValueError(f"{len(chunks)} decode rows do not fit a captured batch of {batch_size}")
    ids, positions, slots, lens, tables = [], [], [], [], []
    for i, c in enumerate(chunks):
        if c.num_tokens != 1 or c.num_logits != 1:
            raise ValueError(f"chunk {i}: a CUDA-graph decode step takes one token with one logit")
        needed = -(-c.seq_len // block_size)
        if needed > max_blocks or len(c.block_table) < needed:
            raise ValueError(f"chunk {i}: context {c.seq_len} needs {needed} blocks (captured for {max_blocks}, "
                             f"block table has {len(c.block_table)})")
        table = list(c.block_table[:needed]) + [scratch_block] * (max_blocks - needed)
        ids.append(c.token_ids[0])
        positions.append(c.start_pos)
        slots.append(table[c.start_pos // block_size] * block_size + c.start_pos % block_size)
        lens.append(c.seq_len)
        tables.append(table)
    for _ in range(batch_size - len(chunks)):
        ids.append(0)
        positions.append(0)
        slots.append(scratch_block * block_size)
        lens.append(1)
        tables.append([scratch_block] * max_blocks)
    return DecodeInputs(ids, positions, slots, lens, tables)


class CUDAGraphDecoder:
    """Captured decode forwards of a ModelRunner (``device="cuda"``, ``attention_backend="triton"``).

    batch_sizes: the sizes captured (a step of n rows runs the smallest size >= n).
    max_context: the longest context a captured step may attend (sizes the block tables).
    scratch_block: a block id the caller never allocates to a sequence (default: the last).
    Capturing moves the model's RoPE frequencies to the device once (an H2D copy inside a
    capture is not allowed). Raises ValueError when the runner cannot be captured.
    """

    def __init__(self, runner, batch_sizes: Sequence[int] = (1, 16, 64), max_context: int = 2048,
                 scratch_block: int | None = None) -> None:
        import torch

        if runner.device.type != "cuda" or runner.ops.name != "triton":
            raise ValueError("CUDA graphs need a ModelRunner on cuda with attention_backend='triton' "
                             f"(got {runner.device.type}, {runner.ops.name!r})")
        self.runner = runner
        self.block_size = runner.block_size
        self.max_blocks = -(-max_context // self.block_size)
        self.scratch_block = runner.num_blocks - 1 if scratch_block is None else scratch_block
        runner.model.inv_freq = runner.model.inv_freq.to(runner.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], torch.Tensor]] = {}
        pool = None
        for size in sorted(set(batch_sizes), reverse=True):    # largest first: the others reuse its pool
            graph, buffers, logits = self._capture(size, pool)
            pool = graph.pool()
            self._graphs[size] = (graph, buffers, logits)

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def decode(self, chunks: Sequence[SeqChunk]):
        """Logits [len(chunks), vocab] float32 of one decode step (a copy, safe to keep)."""
        size = next((s for s in self.batch_sizes if s >= len(chunks)), None)
        if size is None:
            raise ValueError(f"{len(chunks)} decode rows exceed the largest captured batch {self.batch_sizes[-1]}")
        graph, buffers, logits = self._graphs[size]
        self._fill(buffers, pad_decode_batch(chunks, size, self.max_blocks, self.block_size, self.scratch_block))
        graph.replay()
        return logits[:len(chunks)].clone()

    def _capture(self, size: int, pool):
        import torch

        from kernels.attention import AttentionMetadata

        dev = self.runner.device
        buffers = {
            "input_ids": torch.zeros(size, dtype=torch.int64, device=dev),
            "positions": torch.zeros(size, dtype=torch.int64, device=dev),
            "slot_mapping": torch.zeros(size, dtype=torch.int64, device=dev),
            "seq_lens": torch.ones(size, dtype=torch.int64, device=dev),
            "block_tables": torch.zeros(size, self.max_blocks, dtype=torch.int64, device=dev),
            "logits_indices": torch.arange(size, dtype=torch.int64, device=dev),
        }
        self._fill(buffers, pad_decode_batch([], size, self.max_blocks, self.block_size, self.scratch_block))
        meta = AttentionMetadata(slot_mapping=buffers["slot_mapping"], seq_lens=buffers["seq_lens"],
                                 query_start_loc=torch.arange(size + 1, dtype=torch.int64, device=dev),
                                 block_tables=buffers["block_tables"], groups=())

        def step():
            return self.runner.model(buffers["input_ids"], buffers["positions"], self.runner.kv_cache, meta,
                                     buffers["logits_indices"], self.runner.ops)

        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):                       # compile the Triton kernels, warm the allocator
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = step()
        return graph, buffers, logits

    @staticmethod
    def _fill(buffers, inputs: DecodeInputs) -> None:
        import torch

        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"):
            buffers[name].copy_(torch.tensor(getattr(inputs, name), dtype=torch.int64))
