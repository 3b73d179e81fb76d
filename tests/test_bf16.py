"""bf16 against fp32 on the same weights, with the real model and the shared ShareGPT prompts.

bf16 keeps 8 bits of mantissa: every matmul output, the residual stream and the LM head's
logits are rounded to ~3 significant digits (accumulation, RMSNorm, softmax and the returned
logits are fp32). Measured here (2026-12-01, teacher-forced over 8 prompts): the top-1
log-probability differs from fp32's by 0.03 nats on average and 0.24 at most, and where the two
argmaxes differ, fp32's top-2 gap was at most 0.23 nats. The tolerances below are about twice
those figures:

- logits: |log p_bf16 - log p_fp32| of fp32's top-1 token <= LOGPROB_TOL at every position
  (max) and <= MEAN_LOGPROB_TOL on average;
- greedy agreement: the same token at every position where fp32's top-2 gap is >= NEAR_TIE_NATS;
  a greedy run is compared up to its first near-tie (after it, the two may rightly differ).

No skip on CPUs without native bf16 (AVX2-only): torch emulates bf16 there, slower but the
same rounding, so these tests run everywhere.
"""

from __future__ import annotations

import pytest
import torch

from evals.greedy import NEAR_TIE_NATS
from tests.conftest import sharegpt_prompts

pytestmark = pytest.mark.model

LOGPROB_TOL = 0.5
MEAN_LOGPROB_TOL = 0.08
N_PROMPTS = 4
PROMPT_CHARS = 600
MAX_PROMPT_TOKENS = 128
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llms(model_path):
    from engine.llm import LLM

    torch.set_num_threads(1)  # the test machine's 2 cores are shared
    return {dt: LLM(model_path, dtype=dt, num_blocks=96) for dt in (torch.float32, torch.bfloat16)}


@pytest.fixture(scope="module")
def prompts(llms):
    llm = llms[torch.float32]
    return [llm.encode(p[:PROMPT_CHARS], chat=True)[:MAX_PROMPT_TOKENS] for p in sharegpt_prompts(N_PROMPTS)]


def _teacher_forced_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 log-probabilities of every next token, one prefill forward."""
    from engine.batch import SeqChunk

    table = list(range(-(-len(ids) // llm.runner.block_size)))
    return torch.log_softmax(llm.runner.forward([SeqChunk(ids, 0, table, num_logits=len(ids))]), -1)


def test_bf16_runs_in_bf16_and_returns_fp32_logits(llms, prompts):
    llm = llms[torch.bfloat16]
    assert llm.runner.kv_cache.data.dtype is torch.bfloat16
    assert {p.dtype for p in llm.runner.model.parameters()} == {torch.bfloat16}
    assert _teacher_forced_logprobs(llm, prompts[0][:8]).dtype is torch.float32


def test_bf16_logits_within_tolerance_and_argmax_agrees_away_from_near_ties(llms, prompts):
    diffs, checked = [], 0
    for ids in prompts:
        ref = _teacher_forced_logprobs(llms[torch.float32], ids)
        got = _teacher_forced_logprobs(llms[torch.bfloat16], ids)
        top2 = ref.topk(2, dim=-1)
        d = (ref.gather(1, top2.indices[:, :1]) - got.gather(1, top2.indices[:, :1])).abs().flatten()
        diffs.append(d)
        clear = (top2.values[:, 0] - top2.values[:, 1]) >= NEAR_TIE_NATS
        agree = ref.argmax(-1) == got.argmax(-1)
        bad = (clear & ~agree).nonzero().flatten().tolist()
        assert not bad, f"bf16 argmax differs from fp32 at clear positions {bad[:5]} of a {len(ids)}-token prompt"
        checked += int(clear.sum())
    d = torch.cat(diffs)
    assert checked > 0.5 * d.numel(), "too few clear positions to test agreement"
    assert d.max() <= LOGPROB_TOL, f"max |Δ log p| {d.max():.3f} > {LOGPROB_TOL}"
    assert d.mean() <= MEAN_LOGPROB_TOL, f"mean |Δ log p| {d.mean():.3f} > {MEAN_LOGPROB_TOL}"


def test_bf16_greedy_decode_agrees_with_fp32_up_to_the_first_near_tie(llms, prompts):
    """The decode path (paged cache in bf16, batched): same tokens as fp32 until fp32's top-2
    gap first falls below NEAR_TIE_NATS; the chosen token's log-probability within tolerance."""
    from proto.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    ref = llms[torch.float32].generate(prompts, params)
    got = llms[torch.bfloat16].generate(prompts, params)
    compared = 0
    for r, g in zip(ref, got):
        for k, (lp_ref, lp_got) in enumerate(zip(r.logprobs, g.logprobs)):
            (_, l1), (_, l2) = lp_ref.top[:2]
            if l1 - l2 < NEAR_TIE_NATS:
                break
            assert g.token_ids[k] == r.token_ids[k], f"token {k}: bf16 {g.token_ids[k]} vs fp32 {r.token_ids[k]}"
            assert abs(lp_got.logprob - lp_ref.logprob) <= LOGPROB_TOL, (k, lp_got.logprob, lp_ref.logprob)
            compared += 1
    assert compared >= N_PROMPTS * 2, f"only {compared} tokens before a near-tie: the test checks too little"


def test_bf16_runner_weights_and_cache_are_on_huge_pages(llms):
    """engine/huge_pages.py: the weights the linears read and the KV cache are advised for huge pages."""
    from engine.huge_pages import HUGE_PAGE_BYTES, module_tensors
    from tests.test_huge_pages import thp_mode, vma_flags

    if thp_mode() not in ("always", "madvise"):
        pytest.skip("transparent huge pages are off on this host (/sys/kernel/mm/transparent_hugepage/enabled)")
    runner = llms[torch.bfloat16].runner
    big = [t for t in module_tensors(runner.model)
           if t.layout == torch.strided and t.numel() * t.element_size() >= 3 << 20]
    assert len(big) >= 30   # every layer's gate/up weight at least (3.5 MB in bf16)
    assert all("hg" in vma_flags(t.data_ptr() + t.numel() * t.element_size() // 2) for t in big)
    cache = runner.kv_cache.data
    assert cache.numel() * cache.element_size() > 2 * HUGE_PAGE_BYTES
    assert "hg" in vma_flags(cache.data_ptr() + cache.numel() * cache.element_size() // 2)
