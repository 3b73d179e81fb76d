"""Static batching, for comparison only: how HF ``generate`` and FasterTransformer batch.

Up to ``max_num_seqs`` waiting requests are admitted together, each reserving KV for its
prompt plus the batch's largest ``max_tokens`` up front (a contiguous-cache system reserves the
maximum length). The whole batch is prefilled first, then decoded in lockstep; a request that
finishes keeps its slot and is computed like padding (one token per step, result discarded)
until the batch's longest request finishes; then the batch is freed and the next one admitted.
Aborting a member turns it into padding too; its blocks are freed when the batch ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.block_manager import cdiv
from engine.plan import SchedulePlan, ScheduledChunk
from engine.request import Request, RequestState

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


class StaticBatcher:
    def __init__(self, scheduler: "Scheduler") -> None:
        self.s = scheduler
        self.members: list[Request] = []
        self.padding_pos: dict[str, int] = {}  # finished member -> next padding position

    @property
    def active(self) -> bool:
        return bool(self.members)

    def keeps_as_padding(self, req: Request) -> bool:
        if req not in self.members:
            return False
        self.padding_pos[req.request_id] = req.num_computed_tokens
        return True

    def schedule(self) -> SchedulePlan:
        if not self.members:
            self._admit_batch()
        budget = self.s.config.max_num_batched_tokens
        chunks = []
        prefilling = [r for r in self.members
                      if not r.is_finished and (r.num_uncomputed_tokens > 1 or not r.output_token_ids)]
        for req in (prefilling or self.members):
            if budget <= 0:
                break
            chunk = self._chunk(req, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_tokens
        return SchedulePlan(tuple(chunks))

    def _chunk(self, req: Request, budget: int) -> ScheduledChunk | None:
        table = tuple(self.s.bm.block_table(req.request_id))
        if req.is_finished:
            pos = self.padding_pos[req.request_id]
            if pos >= len(table) * self.s.bm.block_size:
                return None  # finished at max_model_len: nothing left to pad into
            return ScheduledChunk(req.request_id, (req.all_token_ids[-1],), pos, table, 0, True, True)
        start = req.num_computed_tokens
        n = min(req.num_uncomputed_tokens, budget)
        is_last = start + n == req.num_tokens
        return ScheduledChunk(req.request_id, tuple(req.all_token_ids[start:start + n]), start, table,
                              int(is_last), is_last)

    def _admit_batch(self) -> None:
        batch = list(self.s.waiting)[: self.s.config.max_num_seqs]
        while batch and not self._fits(batch):
            batch.pop()
        if not batch:
            return
        max_new = max(r.params.max_tokens for r in batch)
        for req in batch:
            length = min(req.num_prompt_tokens + max_new, self.s.max_model_len)
            assert self.s.bm.allocate(req.request_id, length) is not None
            self.s.waiting.remove(req)
            req.block_ids = self.s.bm.block_table(req.request_id)
            req.move_to(RequestState.RUNNING)
            self.s.running.append(req)
        self.members = batch

    def _fits(self, batch: list[Request]) -> bool:
        max_new = max(r.params.max_tokens for r in batch)
        bs, cap = self.s.bm.block_size, self.s.max_model_len
        need = sum(cdiv(min(r.num_prompt_tokens + max_new, cap), bs) for r in batch)
        return need <= self.s.bm.num_free_blocks

    def before_update(self, plan: SchedulePlan) -> None:
        for chunk in plan.chunks:
            if chunk.is_padding and chunk.request_id in self.padding_pos:
                self.padding_pos[chunk.request_id] += 1

    def after_update(self) -> None:
        if self.members and all(r.is_finished for r in self.members):
            for req in self.members:
                self.s.release(req)
            self.members, self.padding_pos = [], {}
