"""LLM: the offline API. ``LLM(model).generate(prompts, params)`` runs every prompt through the
paged-cache forward in shared batches and returns their completions in order.

A deliberately small loop (the batching engineer's scheduler takes it over later): each step
admits waiting prompts in order while their blocks fit (a prompt's blocks cover
``prompt + max_tokens`` tokens, reserved up front, so nothing is ever preempted), runs their
prefill together with one decode token of every running sequence in one forward, samples one
token per sequence, and frees the blocks of finished sequences.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.batch import SeqChunk
from engine.model_loader import DEFAULT_MODEL, load_tokenizer
from engine.model_runner import ModelRunner
from engine.sampler import Sampler, TokenLogprobs, make_generator
from proto.sampling import InvalidRequest, SamplingParams
from proto.stop import token_stop_reason


@dataclass
class CompletionOutput:
    """One prompt's completion. token_ids ends with the EOS token when generation stopped on it;
    text leaves special tokens out (params.skip_special_tokens). finish_reason: "stop" | "length"."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class _Sequence:
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                   # params.max_tokens, capped by the model's context
    generator: torch.Generator | None
    block_table: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None           # set when a stop string ended generation

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.token_ids)


class LLM:
    """Offline generation with one ModelRunner (see ModelRunner for the keyword arguments).

    max_num_batched_tokens: most prompt tokens prefilled in one forward (at least one prompt
    is always admitted, whatever its length). dtype: a torch dtype or a --dtype name ("auto"
    resolves for the device, engine/platform.py); the default stays float32 so results match
    transformers' fp32 reference on every machine.
    """

    def __init__(self, model: str | os.PathLike[str] = DEFAULT_MODEL, *, block_size: int = 16,
                 num_blocks: int | None = None, kv_cache_memory_bytes: int | None = None,
                 dtype: torch.dtype | str = torch.float32, device: str = "cpu", max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, quantization: str = "none", kv_cache_dtype: str = "auto") -> None:
        if isinstance(dtype, str):  # "auto" | "float32" | "bfloat16" | "float16" (engine/platform.py)
            from engine.platform import resolve_dtype

            dtype = resolve_dtype(dtype, device)
        self.runner = ModelRunner(model, block_size=block_size, num_blocks=num_blocks,
                                  kv_cache_memory_bytes=kv_cache_memory_bytes, dtype=dtype, device=device,
                                  quantization=quantization, kv_cache_dtype=kv_cache_dtype)
        self.model_config = self.runner.model_config
        self.tokenizer = load_tokenizer(self.model_config.path)
        self.sampler = Sampler()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        """Token ids of a prompt; with chat=True, as one user message with the generation prompt
        (exactly ``apply_chat_template(messages, add_generation_prompt=True)``)."""
        if chat:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                     add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return self.tokenizer(prompt)["input_ids"]

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 chat: bool = False) -> list[CompletionOutput]:
        """Complete each prompt (text, or token ids); one params for all or one per prompt.

        Raises InvalidRequest for an empty prompt or one that fills the model's context.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        seqs = [self._new_sequence(i, p, sp, chat) for i, (p, sp) in enumerate(zip(prompts, params_list))]
        self._run(seqs)
        return [self._output(s) for s in seqs]

    # -- internals -----------------------------------------------------------------------------

    def _new_sequence(self, index: int, prompt: str | Sequence[int], params: SamplingParams,
                      chat: bool) -> _Sequence:
        ids = self.encode(prompt, chat=chat) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids or (isinstance(prompt, str) and not prompt):
            raise InvalidRequest("prompt", f"prompt {index} is empty: give at least one token")
        limit = self.model_config.max_model_len
        if len(ids) >= limit:
            raise InvalidRequest("prompt", f"prompt {index} has {len(ids)} tokens; the model's context is "
                                           f"{limit} tokens, so a prompt may have at most {limit - 1}")
        max_tokens = min(params.max_tokens, limit - len(ids))
        if self._blocks_needed(len(ids) + max_tokens) > self.runner.num_blocks:
            raise InvalidRequest("max_tokens", f"prompt {index} plus max_tokens needs more KV blocks than the "
                                               f"cache has ({self.runner.num_blocks}); lower max_tokens")
        return _Sequence(index, ids, params, max_tokens, make_generator(params))

    def _blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.runner.block_size)

    def _run(self, seqs: list[_Sequence]) -> None:
        free_blocks = list(range(self.runner.num_blocks))
        waiting, running = list(seqs), []
        while waiting or running:
            admitted = self._admit(waiting, running, free_blocks)
            chunks = [SeqChunk([s.token_ids[-1]], s.num_tokens - 1, s.block_table) for s in running]
            chunks += [SeqChunk(s.prompt_token_ids, 0, s.block_table) for s in admitted]
            batch = running + admitted
            logits = self.runner.forward(chunks)
            out = self.sampler.sample(logits, [s.params for s in batch], [s.generator for s in batch])
            for i, s in enumerate(batch):
                self._append(s, out.token_ids[i], out.logprobs[i] if out.logprobs else None)
            running = [s for s in batch if s.finish_reason is None]
            for s in batch:
                if s.finish_reason is not None and s.block_table:
                    free_blocks.extend(s.block_table)
                    s.block_table = []

    def _admit(self, waiting: list[_Sequence], running: list[_Sequence], free_blocks: list[int]) -> list[_Sequence]:
        admitted: list[_Sequence] = []
        budget = self.max_num_batched_tokens
        while waiting and len(running) + len(admitted) < self.max_num_seqs:
            s = waiting[0]
            need = self._blocks_needed(len(s.prompt_token_ids) + s.max_tokens)
            if need > len(free_blocks) or (admitted and len(s.prompt_token_ids) > budget):
                break
            s.block_table = [free_blocks.pop() for _ in range(need)]
            budget -= len(s.prompt_token_ids)
            admitted.append(waiting.pop(0))
        return admitted

    def _append(self, s: _Sequence, token_id: int, logprobs: TokenLogprobs | None) -> None:
        s.token_ids.append(token_id)
        if logprobs is not None:
            s.logprobs.append(logprobs)
        s.finish_reason = token_stop_reason(token_id, len(s.token_ids), s.params, self.model_config.eos_token_ids)
        if s.finish_reason is None and len(s.token_ids) >= s.max_tokens:
            s.finish_reason = "length"  # the model's context is full
        if s.params.stop:
            self._check_stop_strings(s)

    def _check_stop_strings(self, s: _Sequence) -> None:
        text = self._detokenize(s.token_ids, s.params)
        hits = [text.find(stop) for stop in s.params.stop if stop in text]
        if hits:
            s.text, s.finish_reason = text[:min(hits)], "stop"

    def _detokenize(self, token_ids: list[int], params: SamplingParams) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)

    def _output(self, s: _Sequence) -> CompletionOutput:
        text = s.text if s.text is not None else self._detokenize(s.token_ids, s.params)
        return CompletionOutput(s.prompt_token_ids, s.token_ids, text, s.finish_reason or "length",
                                s.logprobs if s.params.logprobs is not None else None)
