"""Draft-model proposer: a smaller (or quantized) model with the same tokenizer proposes k tokens
greedily, on its own paged KV cache, before the target verifies them.

The draft's cache has its own block manager (no prefix caching); each request's draft blocks
are allocated when it first drafts and freed with it (``release``, called on finish and abort,
and ``forget`` for anything no longer running). What the draft cache holds is tracked as the
tokens whose K/V it computed: after a verification, the longest common prefix of those and the
request's tokens is still valid, the rest is recomputed (overwritten) by the next catch-up chunk.
A prompt prefilled by this engine's target enters the draft cache at the end of the step that
sampled its first token (``prefill``, called by the engine through Speculator.prefill_drafts:
the draft's share of processing the prompt, before the first token is returned, as the target's
prefill is). Any other context new to the draft cache, e.g. a prompt whose KV came from a
prefill worker (P/D), is recomputed on the decode side, once, at the request's first drafted
step, in a forward of its own (timed in ``prefill_seconds``, which the step-time model of
speculation does not learn as the cost of drafting); nothing is shipped. Both are counted in
``num_prefill_tokens``. A request that is not worth drafting for at that load never pays either.

Drafts are the draft model's argmax: a deterministic function of the context, so q is one-hot
and rejection.verify_one_hot is exact for every target sampling setting.
"""

from __future__ import annotations

import time
from typing import Sequence

from engine.block_manager import BlockManager
from engine.request import Request
from engine.spec_decode.config import MAX_SPECULATIVE_TOKENS


def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the longest common prefix of a and b, given that it is at least ``start``."""
    n = min(len(a), len(b))
    for i in range(min(start, n), n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelProposer:
    """runner: the draft's engine.model_runner.ModelRunner (its own cache). draft_vocab_size: N
    restricts the draft's LM head to token ids < N (engine/spec_decode/draft_vocab.py; None: the
    whole vocabulary). Raises ValueError if its vocabulary differs from the target's
    (target_vocab_size) or N is outside it."""

    is_free = False

    def __init__(self, runner, target_vocab_size: int, draft_vocab_size: int | None = None) -> None:
        if runner.model_config.vocab_size != target_vocab_size:
            raise ValueError(f"speculative model vocabulary {runner.model_config.vocab_size} != target's "
                             f"{target_vocab_size}: a draft model needs the target's tokenizer")
        if draft_vocab_size is not None:
            from engine.spec_decode.draft_vocab import restrict_lm_head

            restrict_lm_head(runner.model, draft_vocab_size)
        self.runner = runner
        self.bm = BlockManager(runner.num_blocks, runner.block_size, watermark=0.0, enable_prefix_caching=False)
        self._written: dict[str, list[int]] = {}
        # tokens the request had at its last drafting: a prefix of its tokens now (they only grow;
        # a preemption takes the request out of the running set, which forgets it), so the
        # comparison with _written starts there instead of at position 0 (O(drafts), not O(context))
        self._known: dict[str, int] = {}
        self.num_forwards = 0
        self.num_catchup_tokens = 0
        self.num_prefill_tokens = 0  # of those, in prefill forwards (a context new to the draft cache)
        self.prefill_seconds = 0.0   # their time, not yet taken by take_prefill_seconds
        self.prefill_seconds_total = 0.0
        self._last_drafting: tuple[float, int, int] = (0.0, 0, 0)

    def propose_batch(self, requests: Sequence[Request], ks: dict[str, int]) -> dict[str, tuple[int, ...]]:
        """Up to ks[id] greedy draft tokens per request, in 1 catch-up forward + (max k - 1)
        one-token forwards, batched over the requests. A request whose draft blocks do not fit
        gets none."""
        from engine.batch import SeqChunk

        rows = []
        for r in requests:
            k, tokens = ks.get(r.request_id, 0), r.all_token_ids
            if k <= 0 or self.bm.allocate(r.request_id, len(tokens) + k - 1) is None:
                continue
            written = self._written.get(r.request_id, ())
            start = min(common_prefix(written, tokens, self._known.get(r.request_id, 0)), len(tokens) - 1)
            self._known[r.request_id] = len(tokens)
            self.num_catchup_tokens += len(tokens) - start
            rows.append((r.request_id, k, tokens, start))
        rows = self._prefill_long_contexts(rows)
        drafts: dict[str, list[int]] = {rid: [] for rid, *_ in rows}
        chunks = [SeqChunk(tokens[start:], start, self.bm.block_table(rid)) for rid, _, tokens, start in rows]
        for rid, _, tokens, _ in rows:
            self._written[rid] = list(tokens)
        live = [(rid, k, len(tokens)) for rid, k, tokens, _ in rows]
        began, forwards = time.perf_counter(), 0
        while chunks:
            next_ids = self.runner.forward(chunks).argmax(dim=-1).tolist()
            self.num_forwards += 1
            forwards += 1
            for (rid, _, _), t in zip(live, next_ids):
                drafts[rid].append(t)
            live = [(rid, k, n) for rid, k, n in live if len(drafts[rid]) < k]
            chunks = []
            for rid, _, n in live:
                pos = n + len(drafts[rid]) - 1
                chunks.append(SeqChunk([drafts[rid][-1]], pos, self.bm.block_table(rid)))
                self._written[rid].append(drafts[rid][-1])
        if forwards:
            self._last_drafting = (time.perf_counter() - began, forwards, len(rows))
        return {rid: tuple(d) for rid, d in drafts.items()}

    def _prefill_long_contexts(self, rows: list) -> list:
        """Rows whose catch-up is longer than any verification's (k + 1 <= MAX_SPECULATIVE_TOKENS + 1
        tokens: a context the draft cache has not seen, e.g. a prompt whose KV came from a prefill
        worker, or a prompt prefilled by this engine's target only) get their context
        but the last token prefilled in one forward of its own, timed apart: a one-time prefill
        cost, which ``take_prefill_seconds`` hands to the caller so the step-time model of
        speculation does not learn it as the cost of drafting."""
        from engine.batch import SeqChunk

        long = [(rid, tokens, start) for rid, _, tokens, start in rows if len(tokens) - start > MAX_SPECULATIVE_TOKENS + 1]
        if not long:
            return rows
        began = time.perf_counter()
        self.runner.forward([SeqChunk(tokens[start:-1], start, self.bm.block_table(rid), 1)
                             for rid, tokens, start in long])
        elapsed = time.perf_counter() - began
        self.prefill_seconds += elapsed
        self.prefill_seconds_total += elapsed
        self.num_prefill_tokens += sum(len(tokens) - 1 - start for _, tokens, start in long)
        self.num_forwards += 1
        moved = {rid for rid, _, _ in long}
        return [(rid, k, tokens, len(tokens) - 1 if rid in moved else start) for rid, k, tokens, start in rows]

    def holds(self, request_id: str) -> bool:
        """Whether the draft cache holds (or held since its last release) K/V of this request."""
        return request_id in self._written

    def prefill(self, requests: Sequence[Request]) -> list[str]:
        """Prefill the draft cache with each request's context but its last token, in one forward,
        for requests it holds nothing for (called for a new decode row, e.g. a request whose
        first token was just sampled, so its first drafted step needs a one-token catch-up only). A request whose
        blocks do not fit is left to the catch-up. Counted in num_prefill_tokens and
        prefill_seconds_total, not in prefill_seconds: it runs after the step the step-time model
        measured. Returns the ids prefilled."""
        from engine.batch import SeqChunk

        rows = [(r.request_id, r.all_token_ids) for r in requests if not self.holds(r.request_id)]
        rows = [(rid, t) for rid, t in rows if len(t) > 1 and self.bm.allocate(rid, len(t)) is not None]
        if not rows:
            return []
        began = time.perf_counter()
        self.runner.forward([SeqChunk(t[:-1], 0, self.bm.block_table(rid), 1) for rid, t in rows])
        self.prefill_seconds_total += time.perf_counter() - began
        self.num_prefill_tokens += sum(len(t) - 1 for _, t in rows)
        self.num_forwards += 1
        for rid, t in rows:
            self._written[rid], self._known[rid] = list(t[:-1]), len(t) - 1
        return [rid for rid, _ in rows]

    def take_drafting(self) -> tuple[float, int, int]:
        """(seconds, forwards, rows) of the drafting forwards of the last propose_batch (its
        prefill forward excluded), or (0.0, 0, 0); reset by the call."""
        last, self._last_drafting = self._last_drafting, (0.0, 0, 0)
        return last

    def take_prefill_seconds(self) -> float:
        """Seconds spent in prefill forwards since the last call."""
        seconds, self.prefill_seconds = self.prefill_seconds, 0.0
        return seconds

    def release(self, request_id: str) -> None:
        self.bm.free(request_id)
        self._written.pop(request_id, None)
        self._known.pop(request_id, None)

    def forget(self, live_request_ids: set[str] | frozenset[str]) -> None:
        for rid in [r for r in self.bm.holders() if r not in live_request_ids]:
            self.release(rid)
