"""What the engine hands back to its callers: per-request outputs, layer-hook chunk info, stats.
Pure Python dataclasses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class RequestTimes:
    """Where a finished request's time went on this engine, in seconds (vLLM's per-request
    intervals): queue = arrival -> first scheduled; prefill = first scheduled -> first token;
    decode = first token -> finish. An interval the request never reached is None."""

    queue_s: float | None
    prefill_s: float | None
    decode_s: float | None


@dataclass
class RequestOutput:
    """One streamed update of one request.

    new_token_ids: tokens generated since the previous output (the first output of a request
        started with generate_remote does not repeat first_token_id).
    text_delta: text that became safe to show (see proto/detokenizer.py).
    finish_reason: "stop" | "length" | "abort" | "error" once finished, else None.
    kv_block_ids: for a finished hold_kv request, the blocks it still holds (until release_kv).
    logprobs: per new token, the sampler's TokenLogprobs, when params.logprobs is set.
    times: on the final output, where the request's time went (RequestTimes).
    """

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    usage: Usage
    kv_block_ids: list[int] | None = None
    logprobs: list | None = None
    times: RequestTimes | None = None  # on the final output


@dataclass(frozen=True)
class RemoteReservation:
    """A decode side's blocks for a prompt whose KV comes from outside.

    block_ids: destination block i receives the prompt's logical block i.
    num_cached_blocks: the first n of them already hold the prompt's KV (this engine's prefix
        cache): the sender writes only the rest (shared blocks: writing them would be a race).
    """

    block_ids: list[int]
    num_cached_blocks: int = 0


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk of a forward, as the layer hook sees it (layer-wise KV streaming).

    block_ids: blocks that this chunk's new tokens are written to; the tokens take positions
    start_pos .. start_pos + num_tokens - 1. is_last_chunk: the request's prefill completes here.
    """

    request_id: str
    block_ids: tuple[int, ...]
    start_pos: int
    num_tokens: int
    is_last_chunk: bool


@dataclass(frozen=True)
class EngineStats:
    """kv_blocks_used counts blocks held by requests (running, waiting for remote KV, held for a
    transfer); cached-but-free blocks count as free.

    Speculative decoding (all 0 when off): spec_num_drafts = verification rows (one request
    verified in one step), spec_num_draft_tokens / spec_num_accepted_tokens = drafts verified /
    accepted (acceptance rate = their ratio; mean accepted length = 1 + accepted / drafts rows),
    spec_num_verify_steps = steps with a verification row, spec_k_histogram[k] = decode rows of
    speculable requests that ran with k drafts (k = 0 included).
    """

    kv_blocks_total: int
    kv_blocks_used: int
    kv_usage: float
    running: int
    waiting: int
    waiting_for_remote_kv: int
    held_kv: int
    num_preemptions: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    num_evictions: int
    num_steps: int
    block_size: int
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_verify_steps: int = 0
    spec_k_histogram: tuple[int, ...] = ()
