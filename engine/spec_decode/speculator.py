"""The engine's speculative-decoding state: proposer, per-request acceptance, step-time model,
counters. Pure Python (the verification sampling is in rejection.py).

Each step (engine/llm_engine.py):
1. ``drafts(running)`` -> request id -> draft tokens, for decode rows only: the proposer
   suggests up to each row's room, choose_k cuts each proposal to its k (k = 0: no entry).
2. the scheduler attaches them to the rows' chunks (lookahead slots) and the runner verifies
   every row's k + 1 positions inside the step's one forward;
3. ``observe(plan, result, seconds)`` updates acceptance rates, the step-time model and the
   counters;
4. ``prefill_drafts(updated)``: a draft model prefills the prompts whose first token was just
   sampled (engine/spec_decode/draft.py).

Estimates age out: an adaptive policy that keeps every row at k = 0 measures nothing more, so
acceptance scored by a run of unlucky requests, or a draft cost measured in a load spike, would
keep speculation off for good. After ``REARM_STEPS`` steps in a row whose speculable rows had
room but ran with k = 0, the pooled acceptance and the draft cost return to their priors: the
next rows whose first draft pays at the priors and this load are drafted and measured again. The
cost is bounded: where drafting really does not pay, one draft prefill and a step or two of
drafting per REARM_STEPS steps; at high load the priors do not pay either, and nothing runs.

Penalties and min_tokens are honoured exactly: each draft position is sampled with the output
extended by the drafts before it (rejection.verify_one_hot). Requests that ask for logprobs are
never speculated (k = 0, the plain decode row): the verification path does not return them yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from engine.plan import SchedulePlan, StepResult
from engine.request import Request, RequestState
from proto.sampling import SamplingParams
from engine.spec_decode.adaptive import (HYSTERESIS, AcceptanceRate, Candidate, DraftCost, StepTimeModel, choose_k,
                                         draft_cost)
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer


REARM_STEPS = 1024
"""Steps with room for drafts but none verified after which the estimates return to their priors
(at c1 here ~13 s; one re-measurement there costs ~0.2 s: under 2%)."""


def can_speculate(params: SamplingParams) -> bool:
    """Whether drafts for this request are verified (see the module docstring)."""
    return getattr(params, "logprobs", None) is None


@dataclass
class SpecCounters:
    """num_drafts: verification rows (requests verified, summed over steps);
    num_draft_tokens / num_accepted_tokens: drafts verified / accepted;
    num_verify_steps: steps with at least one verification row;
    num_rearms: times the estimates returned to their priors (the module docstring);
    k_histogram[k]: decode rows of speculable requests scheduled with k drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    num_rearms: int = 0
    k_histogram: list[int] = field(default_factory=list)


class Speculator:
    """max_model_len: the scheduler's (positions never pass it). proposer: the draft model's
    (engine/spec_decode/draft.py) for method "draft"; the n-gram proposer is built here."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer=None) -> None:
        if config.method == "draft" and proposer is None:
            raise ValueError("speculative method draft needs the draft model's proposer")
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer or NgramProposer(config.ngram_min, config.ngram_max)
        self.time_model = StepTimeModel()
        self._reset_estimates()
        self.previous_k: dict[str, int] = {}
        # the k of the latest speculable decode row: a new request's "previous k" for the
        # hysteresis, as its acceptance starts at the pooled one (measured, quiet, c1 int8 draft
        # with a 16k head: one request drafted k = 1 for 32 rows, the next ones needed the (1 + h)
        # start margin at a ratio measured 0.72, none started, 7% of rows speculated)
        self.latest_k = 0
        self.counters = SpecCounters(k_histogram=[0] * (config.num_speculative_tokens + 1))
        self._candidates: frozenset[str] = frozenset()
        self._no_room: frozenset[str] = frozenset()  # candidates whose k was 0 for want of room
        self._idle_steps = 0  # steps in a row with room for drafts and none verified (REARM_STEPS)

    # ---- 1. proposing ------------------------------------------------------------------------
    def room(self, req: Request) -> int:
        """Most drafts worth verifying: k_max, and no draft past max_tokens or max_model_len."""
        return max(0, min(self.config.num_speculative_tokens,
                          req.params.max_tokens - len(req.output_token_ids) - 1,
                          self.max_model_len - req.num_tokens - 1))

    def drafts(self, running: Sequence[Request]) -> dict[str, tuple[int, ...]]:
        """Draft tokens for the decode rows of the next step (only rows with k >= 1 appear)."""
        decode = [r for r in running if r.state == RequestState.RUNNING and r.num_uncomputed_tokens == 1]
        self._forget({r.request_id for r in running})
        speculable = [r for r in decode if can_speculate(r.params)]
        self._candidates = frozenset(r.request_id for r in speculable)
        self._no_room = frozenset(r.request_id for r in speculable if self.room(r) == 0)
        eligible = self._worth_proposing(speculable, len(decode))
        if not self.proposer.is_free:  # a draft model: choose k first, then run it for that many tokens
            ks = self._choose({r.request_id: self.room(r) for r in eligible}, len(decode))
            drafts = self.proposer.propose_batch(eligible, ks)
            return {rid: d for rid, d in drafts.items() if d}
        proposals = {r.request_id: self.proposer.propose(r.request_id, r.all_token_ids, self.room(r)) for r in eligible}
        proposals = {rid: p for rid, p in proposals.items() if p}
        if not proposals:
            return {}
        ks = self._choose({rid: len(p) for rid, p in proposals.items()}, len(decode))
        return {rid: p[:ks[rid]] for rid, p in proposals.items() if ks[rid]}

    def _worth_proposing(self, eligible: list[Request], num_decode_rows: int) -> list[Request]:
        """Skip the proposer for rows whose first draft choose_k would refuse at this step's S
        and B: alpha <= (1 + h) x draft_cost (rows that had drafts last step are kept, for the
        hysteresis). At high load this is every row, and the step costs what a plain decode
        step costs (no proposing at all). A heuristic prune: choose_k could still have accepted
        such a row's draft after other rows raised S and B."""
        if not self.config.adaptive or not eligible:
            return eligible
        rows = max(num_decode_rows, 1)
        t = self.time_model.predict
        floor = (1 + HYSTERESIS) * draft_cost(rows, t(rows), t(rows + 1) + self._draft_forward_s(rows))
        return [r for r in eligible if self._rate(r.request_id).value > floor or self._previous_k(r.request_id)]

    def _choose(self, caps: dict[str, int], num_decode_rows: int) -> dict[str, int]:
        if not self.config.adaptive:
            return dict(caps)
        cands = [Candidate(rid, cap, self._rate(rid).value, self._previous_k(rid)) for rid, cap in caps.items()]
        return choose_k(cands, num_decode_rows, num_decode_rows, self.time_model,
                        draft_forward_s=self._draft_forward_s(len(cands)))

    def _previous_k(self, request_id: str) -> int:
        return self.previous_k.get(request_id, self.latest_k)

    def _draft_forward_s(self, rows: int) -> float:
        return 0.0 if self.draft_cost is None else self.draft_cost.predict(max(rows, 1), self.time_model)

    def prefill_drafts(self, requests: Sequence[Request]) -> None:
        """After a step: a draft model prefills the context of every decode row it has no cache
        for (a request whose first token was sampled in this step, or whose KV came from a
        prefill worker), if
        its first draft would pay at this load (_worth_proposing); the first drafted step then
        catches up one token instead of a whole prompt. A free proposer has nothing to prefill."""
        prefill = getattr(self.proposer, "prefill", None)
        if prefill is None:
            return
        decode = [r for r in requests if r.state == RequestState.RUNNING and r.num_uncomputed_tokens == 1]
        new = [r for r in decode if not self.proposer.holds(r.request_id) and can_speculate(r.params) and self.room(r) > 0]
        if new:
            prefill(self._worth_proposing(new, len(decode)))

    def release(self, request_id: str) -> None:
        """The request finished or was aborted: free what the proposer holds for it (draft blocks)."""
        release = getattr(self.proposer, "release", None)
        if release is not None:
            release(request_id)

    def _rate(self, request_id: str) -> AcceptanceRate:
        rate = self.acceptance.get(request_id)
        if rate is None:
            rate = self.acceptance[request_id] = AcceptanceRate(prior=self.pooled_acceptance.value)
        return rate

    def _forget(self, live: set[str]) -> None:
        self.proposer.forget(live)
        for table in (self.acceptance, self.previous_k):
            for rid in [r for r in table if r not in live]:
                del table[rid]

    # ---- 3. after the step -------------------------------------------------------------------
    def observe(self, plan: SchedulePlan, result: StepResult, seconds: float) -> None:
        """Learn from a finished step (``seconds``: drafting included): the target's step time vs
        batched tokens, a draft model's seconds per forward, acceptance per request. A draft
        model's one-time prefill of a context new to its cache is neither: it is left out."""
        if self.draft_cost is not None:
            draft_s, forwards, rows = self.proposer.take_drafting()
            seconds -= draft_s + self.proposer.take_prefill_seconds()
        self.time_model.observe(plan.num_batched_tokens, seconds)
        if self.draft_cost is not None and forwards:
            self.draft_cost.observe(draft_s / forwards, rows, self.time_model, seconds, plan.num_batched_tokens)
        c, verified = self.counters, 0
        for chunk in plan.chunks:
            k = len(chunk.draft_token_ids)
            is_decode_row = chunk.num_tokens == chunk.num_logits == k + 1
            if is_decode_row and chunk.request_id in self._candidates:
                c.k_histogram[k] += 1
                self.previous_k[chunk.request_id] = k
                # a row at its max_tokens (no room) says nothing about whether drafts pay: every
                # request's last row is one, and it set latest_k to 0, so each next request had to
                # clear the (1 + h) start margin (quiet, c1 ShareGPT, int8 self-draft with a 32k
                # head, ratio 0.51, acceptance 0.88: 7% of rows speculated, TPOT 1.00x)
                if chunk.request_id not in self._no_room:
                    self.latest_k = k
            if not k or chunk.request_id not in result.verified:
                continue
            accepted = len(result.verified[chunk.request_id]) - 1
            self._rate(chunk.request_id).observe(k, accepted)
            self.pooled_acceptance.observe(k, accepted)
            c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens = (c.num_drafts + 1, c.num_draft_tokens + k,
                                                                       c.num_accepted_tokens + accepted)
            verified += 1
        c.num_verify_steps += bool(verified)
        self._age(plan, verified)

    def _age(self, plan: SchedulePlan, verified: int) -> None:
        """Count steps whose speculable rows had room but verified nothing; at REARM_STEPS, back
        to the priors (the module docstring). Only an adaptive policy turns itself off."""
        if not self.config.adaptive:
            return
        had_room = any(ch.request_id in self._candidates and ch.request_id not in self._no_room for ch in plan.chunks)
        self._idle_steps = 0 if verified or not had_room else self._idle_steps + 1
        if self._idle_steps >= REARM_STEPS:
            self._idle_steps = 0
            self._reset_estimates()
            self.counters.num_rearms += 1

    def _reset_estimates(self) -> None:
        """Acceptance (pooled and per request) and a draft model's cost at their priors: at the
        start, and when estimates age out (_age)."""
        # a draft model's forwards, apart from the target's step (None: proposals cost nothing)
        self.draft_cost = None if self.proposer.is_free else DraftCost()
        # a draft model is chosen to agree with its target (an 8-bit copy of the bundled model:
        # ~93%), prompt lookup often finds nothing worth much: the priors before any verification.
        # A new request starts at what every request's drafts scored lately (a draft model's
        # agreement is mostly the model pair's): with a fixed prior below the break-even, a new
        # request was never drafted for, so its estimate never moved (int8 self-draft at c1,
        # measured: 7% of rows speculated at 0.91 acceptance, the first request's only)
        self.pooled_acceptance = AcceptanceRate(prior=0.5 if self.proposer.is_free else 0.8, decay=0.99)
        self.acceptance: dict[str, AcceptanceRate] = {}
