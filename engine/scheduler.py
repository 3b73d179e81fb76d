"""Continuous-batching scheduler: decides, each step, which requests run and how many tokens each.

Request lifecycle (states in engine/request.py, legal moves in ``request.TRANSITIONS``):

1. ``add`` puts a request in WAITING (FCFS queue). A decode worker's ``add_remote`` instead
   allocates the prompt's blocks at once and parks it in WAITING_FOR_REMOTE_KV (no compute).
2. ``schedule`` builds a plan under a token budget (``max_num_batched_tokens``) and
   ``max_num_seqs``: first one decode token for every RUNNING request, then the next prefill
   chunk of RUNNING requests still in prefill, then admits WAITING/PREEMPTED requests in FCFS
   order (reusing cached prefix blocks; the last admitted may get a partial chunk = chunked
   prefill). Admission stops at the first request that does not fit (no overtaking). A step
   with no decode row stalls no one's next token: its budget is ``idle_max_num_batched_tokens``;
   so is a step where the requests waiting for their prompt are ``prefill_first_ratio`` x the decode
   rows or more (prefill-first while the batch is mostly waiting: a burst).
   Speculative decoding: the engine passes draft tokens for some decode rows; after every decode
   row, prefill chunk and admission is planned, each such row gets its drafts appended (a
   verification row of k + 1 tokens) if the budget they left and *lookahead* KV slots fit
   without preempting anyone, else it stays a plain decode row (drafts never displace prefill
   work: under a full budget they would only add rejected tokens). The lookahead blocks are
   allocated now, so the verification forward never fails to allocate.
3. When a running request needs a block and none is free, the newest running request not yet in
   this step's plan is preempted by recompute: RUNNING -> PREEMPTED, its blocks freed, its
   prompt + generated tokens requeued at the head of the queue (if none, the request itself).
4. ``remote_kv_ready`` moves WAITING_FOR_REMOTE_KV -> RUNNING once a prefill worker's KV landed.
5. ``update(plan, result)`` applies the step: computed counts, prefix-cache hashes for newly
   full blocks, sampled tokens, stop checks (proto/stop.py: EOS, stop token ids, max_tokens,
   max_model_len) -> FINISHED_STOPPED / FINISHED_LENGTH. Stop *strings* are found by the detokenizer and applied
   with ``finish``. A verification row appends its emitted tokens one by one (a stop ends the run
   and drops the rest); only the input token and the accepted drafts count as computed, so the
   rejected drafts' slots are rewritten later and never enter the prefix cache or its hashes.
6. Finishing frees the blocks, except for a ``hold_kv`` request (prefill worker): its blocks stay
   held until ``release_kv``. ``abort`` frees everything at any state (FINISHED_ABORTED).

With ``batching="static"`` (or ``policy=StaticBatching()``) steps 2-3 are replaced by that policy
(engine/static_batching.py), which admits through ``admit_reserved`` and never edits the queues itself.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Mapping, Sequence

from engine.block_manager import NO_HIT, BlockManager, cdiv
from engine.config import SchedulerConfig
from engine.plan import SchedulePlan, ScheduledChunk, StepResult
from engine.request import Request, RequestState
from proto.sampling import InvalidRequest
from proto.stop import token_stop_reason

if TYPE_CHECKING:
    from engine.static_batching import StaticBatching

_FINISHED = {"stop": RequestState.FINISHED_STOPPED, "length": RequestState.FINISHED_LENGTH}


class CapacityError(RuntimeError):
    """Not enough room right now (queue full, KV blocks for a reservation): retry later."""


class _PlanBuilder:
    """Accumulates one step's chunks under the token budget."""

    def __init__(self, token_budget: int) -> None:
        self.budget = token_budget
        self.chunks: list[ScheduledChunk] = []
        self.decode_rows: dict[str, int] = {}  # request id -> index of its one-token decode chunk
        self.scheduled: set[str] = set()
        self.preempted: list[str] = []
        self.freed: list[int] = []

    def add(self, req: Request, num_tokens: int, block_ids: Sequence[int]) -> None:
        start = req.num_computed_tokens
        is_last = start + num_tokens == req.num_tokens
        if is_last and num_tokens == 1:
            self.decode_rows[req.request_id] = len(self.chunks)
        self.chunks.append(ScheduledChunk(req.request_id, tuple(req.all_token_ids[start:start + num_tokens]),
                                          start, tuple(block_ids), int(is_last), is_last))
        self.scheduled.add(req.request_id)
        self.budget -= num_tokens

    def add_drafts(self, request_id: str, drafts: tuple[int, ...], block_ids: Sequence[int]) -> None:
        """Turn the request's decode chunk into a verification row (last token + drafts)."""
        i = self.decode_rows[request_id]
        c = self.chunks[i]
        self.chunks[i] = replace(c, token_ids=c.token_ids + drafts, block_ids=tuple(block_ids),
                                 num_logits=1 + len(drafts), draft_token_ids=drafts)
        self.budget -= len(drafts)

    def build(self) -> SchedulePlan:
        return SchedulePlan(tuple(self.chunks), tuple(self.preempted), tuple(self.freed))


class Scheduler:
    """Owns the request queues; the block manager owns the blocks. Pure Python."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, *, max_model_len: int,
                 eos_token_ids: Sequence[int] = (), policy: "StaticBatching | None" = None) -> None:
        """policy: a batching policy replacing continuous batching (None: StaticBatching when
        config.batching is "static", else continuous batching)."""
        self.config = config
        self.bm = block_manager
        self.max_model_len = min(config.max_model_len or max_model_len, max_model_len)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}  # every request not yet released (held ones included)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the newest
        self.remote: dict[str, Request] = {}
        self.held: dict[str, Request] = {}
        self.num_preemptions = 0
        if policy is None and config.batching == "static":
            from engine.static_batching import StaticBatching
            policy = StaticBatching()
        self._static = policy
        if policy is not None:
            policy.bind(self)

    # ---- admission ---------------------------------------------------------------------------
    def validate(self, prompt_len: int, max_tokens: int) -> None:
        """Raise InvalidRequest if a request of this size could never run here."""
        if prompt_len < 1:
            raise InvalidRequest("prompt", "must contain at least one token")
        if prompt_len >= self.max_model_len:
            raise InvalidRequest("prompt", f"{prompt_len} tokens; at most {self.max_model_len - 1} fit the "
                                 f"model's context of {self.max_model_len}")
        need = cdiv(min(prompt_len + max_tokens, self.max_model_len), self.bm.block_size)
        if need > self.bm.num_blocks:
            raise InvalidRequest("max_tokens", f"prompt + max_tokens needs {need} KV blocks but the cache has "
                                 f"{self.bm.num_blocks}; lower max_tokens or shorten the prompt")

    def add(self, req: Request) -> None:
        """Queue a new request (state WAITING). Raises InvalidRequest, CapacityError, KeyError."""
        if req.request_id in self.requests:
            raise KeyError(f"request id {req.request_id!r} is already in use")
        self.validate(req.num_prompt_tokens, req.params.max_tokens)
        if self.config.max_waiting is not None and len(self.waiting) >= self.config.max_waiting:
            raise CapacityError(f"waiting queue full ({self.config.max_waiting} requests); retry later")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def add_remote(self, req: Request) -> list[int]:
        """Decode side: allocate blocks for the whole prompt now; the KV will be written from
        outside. Returns the block ids (logical block i of the prompt in block i). The prompt's
        longest cached prefix is taken from the prefix cache: its ``req.num_cached_tokens``
        tokens' blocks already hold their KV and must not be written (the sender skips them).
        Raises CapacityError (nothing changed) if they do not fit."""
        if self._static is not None:
            raise ValueError("remote KV needs continuous batching")
        if req.request_id in self.requests:
            raise KeyError(f"request id {req.request_id!r} is already in use")
        self.validate(req.num_prompt_tokens, req.params.max_tokens)
        prefix = self.bm.find_cached_prefix(req.prompt_token_ids)
        blocks = self.bm.allocate(req.request_id, req.num_prompt_tokens, prefix, use_watermark=True)
        if blocks is None:
            raise CapacityError(f"{cdiv(req.num_prompt_tokens, self.bm.block_size)} KV blocks needed, "
                                f"{self.bm.num_free_blocks} free; retry later")
        self.bm.note_prefix_query(req.num_prompt_tokens)
        req.num_cached_tokens = prefix.num_tokens
        req.state = RequestState.WAITING_FOR_REMOTE_KV
        req.block_ids = self.bm.block_table(req.request_id)
        self.requests[req.request_id] = req
        self.remote[req.request_id] = req
        return list(blocks)

    def remote_kv_ready(self, request_id: str, first_token_id: int) -> Request:
        """All KV layers of the prompt landed: the request runs with ``first_token_id`` as its
        first output token (may finish at once, e.g. max_tokens == 1 or EOS)."""
        req = self.remote.pop(request_id)
        req.move_to(RequestState.RUNNING)
        req.num_computed_tokens = req.num_prompt_tokens
        self.bm.cache_full_blocks(request_id, req.all_token_ids, req.num_computed_tokens)
        self.running.append(req)
        self._append_token(req, first_token_id)
        return req

    # ---- what a batching policy may do (engine/static_batching.py) ----------------------------------
    def waiting_requests(self, limit: int) -> list[Request]:
        """The first ``limit`` waiting requests, in queue order (a copy: the queue stays the scheduler's)."""
        return list(self.waiting)[:limit]

    def admit_reserved(self, req: Request, num_tokens: int) -> None:
        """Admit a waiting request with KV reserved for ``num_tokens`` tokens (WAITING -> RUNNING).
        Raises CapacityError, with nothing changed, if the blocks are not free."""
        if self.bm.allocate(req.request_id, num_tokens) is None:
            raise CapacityError(f"{req.request_id}: {num_tokens} tokens of KV do not fit")
        self.waiting.remove(req)
        req.block_ids = self.bm.block_table(req.request_id)
        req.move_to(RequestState.RUNNING)
        self.running.append(req)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self, drafts: Mapping[str, tuple[int, ...]] | None = None) -> SchedulePlan:
        """The next step's plan. drafts: request id -> draft tokens to verify on its decode row
        (speculative decoding; ignored by static batching)."""
        if self._static is not None:
            return self._static.schedule()
        plan = _PlanBuilder(self.config.max_num_batched_tokens)
        self._schedule_running(plan, decoding=True)
        if self._prefill_first(len(plan.decode_rows)):
            used = self.config.max_num_batched_tokens - plan.budget  # the decode rows' tokens
            plan.budget = max(plan.budget, self.config.idle_max_num_batched_tokens - used)
        self._schedule_running(plan, decoding=False)
        self._schedule_waiting(plan)
        if drafts:  # last: drafts are speculative work, prefill chunks are certain work
            self._attach_drafts(plan, drafts)
        return plan.build()

    def _prefill_first(self, num_decode_rows: int) -> bool:
        """Whether this step takes the prefill-first budget (``idle_max_num_batched_tokens``):
        when nothing decodes, or when the requests waiting for (the rest of) their prompt number
        at least ``prefill_first_ratio`` x the decode rows (a burst: most of the batch is waiting
        for its first token, and a few big steps delay few rows once instead of all rows for many
        small steps)."""
        cfg = self.config
        if not cfg.idle_max_num_batched_tokens:
            return False
        if num_decode_rows == 0:
            return True
        if not cfg.prefill_first_ratio:
            return False
        prefilling = len(self.waiting) + sum(1 for r in self.running if r.num_uncomputed_tokens > 1)
        return prefilling >= cfg.prefill_first_ratio * num_decode_rows

    def _schedule_running(self, plan: _PlanBuilder, *, decoding: bool) -> None:
        for req in list(self.running):
            if plan.budget <= 0:
                return
            if req.request_id in plan.scheduled or req.state != RequestState.RUNNING:
                continue  # already planned, or preempted earlier in this loop
            if (req.num_uncomputed_tokens == 1) != decoding:
                continue
            num_tokens = min(req.num_uncomputed_tokens, plan.budget)
            if self._allocate_or_preempt(req, num_tokens, plan):
                plan.add(req, num_tokens, self.bm.block_table(req.request_id))

    def _attach_drafts(self, plan: _PlanBuilder, drafts: Mapping[str, tuple[int, ...]]) -> None:
        """Lookahead slots for each row's drafts, within the budget, never preempting."""
        for rid, tokens in drafts.items():
            tokens = tuple(tokens[:max(plan.budget, 0)])
            req = self.requests.get(rid)
            if not tokens or rid not in plan.decode_rows or req is None:
                continue
            if self.bm.allocate(rid, req.num_computed_tokens + 1 + len(tokens)) is not None:
                plan.add_drafts(rid, tokens, self.bm.block_table(rid))

    def _allocate_or_preempt(self, req: Request, num_tokens: int, plan: _PlanBuilder) -> bool:
        """Make room for ``num_tokens`` more tokens of ``req``, preempting newer requests as
        needed. Returns False if ``req`` itself had to be preempted."""
        while self.bm.allocate(req.request_id, req.num_computed_tokens + num_tokens) is None:
            victim = next((r for r in reversed(self.running) if r.request_id not in plan.scheduled), None)
            self._preempt(victim, plan)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, plan: _PlanBuilder) -> None:
        plan.freed.extend(self.bm.free(req.request_id))
        plan.preempted.append(req.request_id)
        req.move_to(RequestState.PREEMPTED)
        req.num_computed_tokens = 0
        req.block_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def _schedule_waiting(self, plan: _PlanBuilder) -> None:
        while self.waiting and plan.budget > 0 and self._num_active() < self.config.max_num_seqs:
            req = self.waiting[0]
            prefix = self.bm.find_cached_prefix(req.all_token_ids) if req.num_computed_tokens == 0 else NO_HIT
            computed = max(req.num_computed_tokens, prefix.num_tokens)
            num_tokens = min(req.num_tokens - computed, plan.budget)
            if num_tokens < req.num_tokens - computed and not self.config.enable_chunked_prefill:
                return
            # the watermark keeps room for running requests to grow; an idle engine admits anything that fits
            if self.bm.allocate(req.request_id, computed + num_tokens, prefix, use_watermark=bool(self.running)) is None:
                return  # FCFS: nobody overtakes the head of the queue
            self._admit(req, computed, first=req.state == RequestState.WAITING)
            plan.add(req, num_tokens, self.bm.block_table(req.request_id))

    def _admit(self, req: Request, num_computed: int, *, first: bool) -> None:
        self.waiting.popleft()
        if first:
            req.num_cached_tokens = num_computed
            self.bm.note_prefix_query(req.num_prompt_tokens)
        req.num_computed_tokens = num_computed
        req.block_ids = self.bm.block_table(req.request_id)
        req.move_to(RequestState.RUNNING)
        self.running.append(req)

    def _num_active(self) -> int:
        return len(self.running) + len(self.remote)

    # ---- applying a result -------------------------------------------------------------------
    def update(self, plan: SchedulePlan, result: StepResult) -> list[Request]:
        """Apply a step's result. Returns the requests that got a new token (some now finished)."""
        if self._static is not None:
            self._static.before_update(plan)
        updated = []
        for chunk in plan.chunks:
            req = self.requests.get(chunk.request_id)
            if chunk.is_padding or req is None or req.state != RequestState.RUNNING:
                continue  # padding, or aborted since the plan was made
            if chunk.draft_token_ids:
                self._apply_verified(req, result.verified[req.request_id])
                updated.append(req)
                continue
            req.num_computed_tokens += chunk.num_tokens
            self.bm.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
            if chunk.num_logits:
                self._append_token(req, result.sampled[req.request_id])
                updated.append(req)
        if self._static is not None:
            self._static.after_update()
        return updated

    def _apply_verified(self, req: Request, tokens: Sequence[int]) -> None:
        """Append a verification row's tokens up to the first stop. The row's input token and
        its n - 1 accepted drafts are computed; the n-th token (the target's) is not yet."""
        for token_id in tokens:
            self._append_token(req, token_id)
            if req.is_finished:
                return  # freed (or held); the tokens after the stop are dropped
        req.num_computed_tokens += len(tokens)
        self.bm.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)

    def _append_token(self, req: Request, token_id: int) -> None:
        req.output_token_ids.append(token_id)
        if req.first_token_time is None:
            import time
            req.first_token_time = time.monotonic()
        state = self._stop_state(req, token_id)
        if state is not None:
            self.finish(req.request_id, state)

    def _stop_state(self, req: Request, token_id: int) -> RequestState | None:
        reason = token_stop_reason(token_id, len(req.output_token_ids), req.params, self.eos_token_ids,
                                   req.num_tokens, self.max_model_len)
        return None if reason is None else _FINISHED[reason]

    # ---- finishing ---------------------------------------------------------------------------
    def finish(self, request_id: str, state: RequestState) -> Request | None:
        """End a request (stop, length, abort, error); frees its blocks unless it holds its KV
        (hold_kv, normal finish). Returns it, or None if unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self._unqueue(req)
        req.move_to(state)
        keep = req.hold_kv and state in (RequestState.FINISHED_STOPPED, RequestState.FINISHED_LENGTH)
        if keep:
            self.held[request_id] = req
        elif self._static is not None and self._static.keeps_as_padding(req):
            pass  # static batching: its slot is computed as padding until the batch ends
        else:
            self.release(req)
        return req

    def abort(self, request_id: str) -> Request | None:
        """Free everything the request holds, at any state. Idempotent; None if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.is_finished:  # held KV (or a static-batch padding slot)
            if request_id in self.held:
                self.release_kv(request_id)
            return req
        return self.finish(request_id, RequestState.FINISHED_ABORTED)

    def release_kv(self, request_id: str) -> None:
        """Free the blocks a finished hold_kv request still holds. Idempotent."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.release(req)

    def _unqueue(self, req: Request) -> None:
        if req.state == RequestState.RUNNING:
            self.running.remove(req)
        elif req.state == RequestState.WAITING_FOR_REMOTE_KV:
            self.remote.pop(req.request_id, None)
        elif req in self.waiting:
            self.waiting.remove(req)

    def release(self, req: Request) -> None:
        """Free a finished request's blocks and forget it (used by static batching too)."""
        self.bm.free(req.request_id)
        req.block_ids = []
        self.requests.pop(req.request_id, None)

    # ---- introspection -----------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or (self._static is not None and self._static.active))

    def kv_slots(self) -> tuple[int, int]:
        """(allocated slots, filled slots): used blocks x block size, and distinct computed token
        positions in them. Their ratio gives KV waste."""
        filled: dict[int, int] = {}
        bs = self.bm.block_size
        for req in self.requests.values():
            for i, block_id in enumerate(self.bm.block_table(req.request_id)):
                n = min(bs, max(0, req.num_computed_tokens - i * bs))
                filled[block_id] = max(filled.get(block_id, 0), n)
        return self.bm.num_used_blocks * bs, sum(filled.values())
