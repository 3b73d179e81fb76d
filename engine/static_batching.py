"""Static batching, for comparison only: how HF ``generate`` and FasterTransformer batch.

Up to ``max_num_seqs`` waiting requests are admitted together. The whole batch is prefilled
first, then decoded in lockstep; a request that finishes keeps its slot and is computed like
padding (one token per step, result discarded) until the batch's longest request finishes; then
the batch is freed and the next one admitted. Aborting a member turns it into padding too; its
blocks are freed when the batch ends.

With ``SchedulerConfig.static_padding`` (the default) the batch is the rectangle a contiguous KV
cache imposes, as in HF ``generate``:
- prompts are left-padded to the batch's longest: each row computes ``longest prompt - its
  prompt`` padding tokens during prefill (placed after its prompt here, where decode later
  overwrites them; the result is discarded). The token count, so the linear layers' cost, is
  HF's; prefill attention stays per sequence.
- every decode step attends each row over the batch's longest context
  (``SchedulePlan.pad_to_longest``);
- each row reserves KV for the longest prompt plus the batch's largest ``max_tokens``.
Without it, rows reserve their own prompt plus the largest ``max_tokens`` and are attended in
groups of similar length (a paged static batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.block_manager import cdiv
from engine.plan import SchedulePlan, ScheduledChunk
from engine.request import Request

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


class StaticBatching:
    """A batching policy the Scheduler takes (``Scheduler(..., policy=StaticBatching())``, or
    ``SchedulerConfig.batching="static"``): it replaces steps 2-3 of the scheduler's lifecycle.
    It never edits the scheduler's queues itself: it reads the waiting queue and admits a request
    with ``Scheduler.admit_reserved``, frees one with ``Scheduler.release``."""

    def __init__(self) -> None:
        self.s: "Scheduler | None" = None
        self.pad = True
        self.members: list[Request] = []
        self.padding_pos: dict[str, int] = {}  # finished member -> next padding position
        self.prompt_padding: dict[str, int] = {}  # member -> prompt padding tokens not yet computed
        self._longest_prompt = 0
        self._prefill_phase = False  # the last plan prefilled (its padding chunks are prompt padding)

    def bind(self, scheduler: "Scheduler") -> None:
        """Called once by the scheduler that takes this policy."""
        self.s = scheduler
        self.pad = scheduler.config.static_padding

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
        # A row's prompt padding is computed once its prompt is (or the row ended: result discarded).
        padding = [r for r in self.members
                   if self.prompt_padding.get(r.request_id) and (r.output_token_ids or r.is_finished)]
        self._prefill_phase = bool(prefilling or padding)
        if self._prefill_phase:
            work = [(r, self._chunk) for r in prefilling] + [(r, self._prompt_padding_chunk) for r in padding]
        else:
            work = [(r, self._chunk) for r in self.members]
        for req, make in work:
            if budget <= 0:
                break
            chunk = make(req, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_tokens
        return SchedulePlan(tuple(chunks), pad_to_longest=self.pad)

    def _chunk(self, req: Request, budget: int) -> ScheduledChunk | None:
        table = tuple(self.s.bm.block_table(req.request_id))
        if req.is_finished:
            pos = self.padding_pos[req.request_id]
            if pos >= min(len(table) * self.s.bm.block_size, self.s.max_model_len):
                return None  # at max_model_len or the reservation's end: nothing left to pad into
            return ScheduledChunk(req.request_id, (req.all_token_ids[-1],), pos, table, 0, True, True)
        start = req.num_computed_tokens
        n = min(req.num_uncomputed_tokens, budget)
        is_last = start + n == req.num_tokens
        return ScheduledChunk(req.request_id, tuple(req.all_token_ids[start:start + n]), start, table,
                              int(is_last), is_last)

    def _prompt_padding_chunk(self, req: Request, budget: int) -> ScheduledChunk:
        """The next of the row's prompt-padding tokens, after its computed prompt (finite K/V)."""
        left = self.prompt_padding[req.request_id]
        start = self._longest_prompt - left
        return ScheduledChunk(req.request_id, (req.prompt_token_ids[-1],) * min(left, budget), start,
                              tuple(self.s.bm.block_table(req.request_id)), 0, False, True)

    def _admit_batch(self) -> None:
        batch = self.s.waiting_requests(self.s.config.max_num_seqs)
        while batch and not self._fits(batch):
            batch.pop()
        if not batch:
            return
        self._longest_prompt = max(r.num_prompt_tokens for r in batch)
        for req, length in zip(batch, self._reserved_lens(batch)):
            self.s.admit_reserved(req, length)
            if self.pad:
                self.prompt_padding[req.request_id] = self._longest_prompt - req.num_prompt_tokens
        self.members = batch

    def _reserved_lens(self, batch: list[Request]) -> list[int]:
        """Tokens of KV each row reserves: its prompt (the longest, when padded) + the largest max_tokens."""
        max_new = max(r.params.max_tokens for r in batch)
        longest = max(r.num_prompt_tokens for r in batch)
        return [min((longest if self.pad else r.num_prompt_tokens) + max_new, self.s.max_model_len) for r in batch]

    def _fits(self, batch: list[Request]) -> bool:
        need = sum(cdiv(n, self.s.bm.block_size) for n in self._reserved_lens(batch))
        return need <= self.s.bm.num_free_blocks

    def before_update(self, plan: SchedulePlan) -> None:
        for chunk in plan.chunks:
            if not chunk.is_padding:
                continue
            if self._prefill_phase:
                self.prompt_padding[chunk.request_id] -= chunk.num_tokens
            else:
                self.padding_pos[chunk.request_id] += 1  # a finished row's decode padding

    def after_update(self) -> None:
        if self.members and all(r.is_finished for r in self.members):
            for req in self.members:
                self.s.release(req)
            self.members, self.padding_pos, self.prompt_padding = [], {}, {}
