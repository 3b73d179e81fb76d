"""Triton kernels for GPUs, each beside a readable torch reference and a checking wrapper.

- ``decode_attention``: paged decode attention over the block table, split-K (flash-decoding)
  with grouped GQA, fp16/bf16/fp32 caches and FP8 E4M3 caches with K/V scales.
- ``backend``: the ``"triton"`` attention backend (kernels/attention.py interface).
- ``fp8_gemm``: FP8 E4M3 GEMM with per-token activation and per-output-channel weight scales.
- ``rmsnorm``: fused RMSNorm (+ residual add), fp32 math.

On a CPU they run only under ``TRITON_INTERPRET=1`` (set before triton is imported), which is
how tests/test_triton_kernels.py checks them against the references, in a child process.
Every kernel casts what it loads to fp32 at once: the interpreter computes bf16 arithmetic
wrongly (see ../shared/MACHINE-NOTES.md), and on GPUs the kernels are memory-bound anyway.
"""
