"""LLM: the offline API. ``LLM(model).generate(prompts, params)`` runs every prompt through the
one engine loop (``LLMEngine``: the scheduler's continuous batching, or its static-batching
policy with ``batching="static"``) and returns their completions in order.

A thin driver: it checks the prompts up front (so a bad one fails before any work, naming its
index), queues them all, steps the engine until none is unfinished, and joins each request's
streamed outputs (tokens, text deltas, logprobs) into one ``CompletionOutput``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import DEFAULT_MODEL
from engine.outputs import RequestOutput
from engine.sampler import TokenLogprobs
from proto.sampling import InvalidRequest, SamplingParams


@dataclass
class CompletionOutput:
    """One prompt's completion. token_ids ends with the EOS token when generation stopped on it;
    text leaves special tokens out (params.skip_special_tokens) and ends before a stop string.
    finish_reason: "stop" | "length". logprobs: one per token when params.logprobs is set."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    logprobs: list[TokenLogprobs] | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.text += out.text_delta
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(out.logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason or "length"


class LLM:
    """Offline generation on one engine.

    block_size / num_blocks / kv_cache_memory_bytes: the paged KV cache (num_blocks None = derive
    from kv_cache_memory_bytes or the default budget). dtype: a torch dtype or a --dtype name
    ("auto" resolves for the device, engine/platform.py); the default stays float32 so results
    match transformers' fp32 reference on every machine. max_num_seqs / max_num_batched_tokens: the scheduler's limits
    per step (at least one prompt is always admitted, whatever its length). batching:
    "continuous" or "static" (HF ``generate``-style lockstep batches, for comparison).
    quantization / kv_cache_dtype: as EngineConfig.
    """

    def __init__(self, model: str | os.PathLike[str] = DEFAULT_MODEL, *, block_size: int = 16,
                 num_blocks: int | None = None, kv_cache_memory_bytes: int | None = None,
                 dtype: object = "float32", device: str = "cpu", max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, batching: str = "continuous", quantization: str = "none",
                 kv_cache_dtype: str = "auto") -> None:
        config = EngineConfig(
            model=str(model), dtype=str(dtype).removeprefix("torch."), device=device, quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      batching=batching),
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, memory_bytes=kv_cache_memory_bytes))
        self.engine = LLMEngine(config)
        self.runner = self.engine.runner
        self.model_config = self.engine.model_config
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        """Token ids of a prompt; with chat=True, as one user message with the generation prompt."""
        return self.engine.encode(prompt, chat=chat)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 chat: bool = False) -> list[CompletionOutput]:
        """Complete each prompt (text, or token ids); one params for all or one per prompt.

        Raises InvalidRequest for an empty prompt, one that fills the model's context, or one
        whose prompt + max_tokens can never fit the KV cache (nothing is queued then).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = [self._prompt_ids(i, p, sp, chat) for i, (p, sp) in enumerate(zip(prompts, params_list))]
        request_ids = [self._add(p, sp) for p, sp in zip(ids, params_list)]
        results = {rid: CompletionOutput(p) for rid, p in zip(request_ids, ids)}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                results[out.request_id].add(out)
        return [results[rid] for rid in request_ids]

    def _add(self, prompt_ids: list[int], params: SamplingParams) -> str:
        rid = f"llm-{self._next_id}"
        self._next_id += 1
        self.engine.add_request(rid, prompt_ids, params)
        return rid

    def _prompt_ids(self, index: int, prompt: str | Sequence[int], params: SamplingParams, chat: bool) -> list[int]:
        ids = self.encode(prompt, chat=chat) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids or (isinstance(prompt, str) and not prompt):
            raise InvalidRequest("prompt", f"prompt {index} is empty: give at least one token")
        limit = self.model_config.max_model_len
        if len(ids) >= limit:
            raise InvalidRequest("prompt", f"prompt {index} has {len(ids)} tokens; the model's context is "
                                           f"{limit} tokens, so a prompt may have at most {limit - 1}")
        try:
            self.engine.scheduler.validate(len(ids), params.max_tokens)
        except InvalidRequest as e:
            raise InvalidRequest(e.field, f"prompt {index}: {str(e).split(': ', 1)[1]}") from None
        return ids
