"""The draft model's reduced vocabulary: its LM head computes logits for the first N token ids
only (FR-Spec: Zhao et al. 2025, "Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling", which restricts the draft's head to the most frequent
tokens).

Why the first N ids: a byte-level BPE tokenizer (GPT-2's and SmolLM2's) numbers its tokens in
the order their merges were learned, and each merge was the most frequent pair left in the
tokenizer's training corpus, so the ids are already a frequency ranking, fitted on a corpus far
larger than any we hold and on none of our benchmark prompts. Measured on the bundled model's
greedy replies (32 ShareGPT and 32 grounded prompts of ``pdserve bench spec``, 64 tokens each),
the share of reply tokens inside the set, first-N ids vs a frequency ranking counted on the 668
ShareGPT prompts the benchmark does not use:

    N          4096         8192         16384        32768
    ids        0.80 / 0.78  0.88 / 0.88  0.95 / 0.93  0.99 / 0.97   (ShareGPT / grounded)
    counted    0.85 / 0.81  0.90 / 0.87  0.95 / 0.93  0.99 / 0.98

so the ranking costs nothing to ship. With the head restricted, the draft's argmax is its best
token among ids < N; the drafts stay a deterministic function of the context (q one-hot), so
verification (rejection.verify_one_hot) is exact whatever N is: a token the draft cannot propose
costs acceptance, never correctness.
"""

from __future__ import annotations

def restrict_lm_head(model, vocab_size: int) -> None:
    """Make ``model`` (an engine.models LlamaForCausalLM after engine.quantization has set its
    ``head_method``) compute logits [rows, vocab_size] float32 for token ids 0..vocab_size-1, with
    the same linear method as its full head (int8 per vocabulary row, or the dense kernel).
    The embedding lookup keeps the whole table. Idempotent.

    Raises ValueError if vocab_size is not in [1, the model's vocabulary].
    """
    full = model.config.vocab_size
    if not 1 <= vocab_size <= full:
        raise ValueError(f"draft vocabulary size must be in [1, {full}] (the draft model's vocabulary), "
                         f"got {vocab_size}")
    from kernels.linear import DenseLinear, Int8Linear

    head = model.head_method
    if head is not None and head.out_features == vocab_size:
        return
    if isinstance(head, Int8Linear):   # its own int8 rows (the model holds no other copy of a rotated head)
        model.head_method = head.first_rows(vocab_size)
        return
    weight = (model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight).detach()
    model.head_method = DenseLinear(weight[:vocab_size].contiguous(), None, decode_only=True)   # (fp8 keeps the head dense)

