// The output rows of the decode-sized GEMM kernels (small_gemm.cpp, int8_gemm.cpp,
// int8_gemm_prefill.cpp, and the AMX ones, small_gemm_amx.cpp and int8_gemm_amx.cpp): bf16, each
// rounded once from the kernel's fp32 sum, or those same bf16 values widened to fp32. Why fp32:
// the LM head's logits are wanted in fp32 (the sampler's softmax and log-probabilities), and
// widening the bf16 logits took a second pass over [rows, vocab] (16 rows: 1.5 MB read, 3 MB
// written, 0.2-0.23 ms of a 10.5 ms int8 decode step, timed inside the step on the Zen 4 host,
// 2026-12-06; 0.21-0.27 ms of 8-11 ms on the AMX host, 2026-12-07). Why the bf16 values rather
// than the unrounded sums: the head's kernel is chosen per batch-size bucket by timing
// (kernels/linear.py), and oneDNN's and F.linear give bf16 only; unrounded sums from some kernels
// would make a row's logits, and so a greedy token near a tie, depend on the batch it ran in and
// on the timing (a break-it pass found 3 argmax changes in 64 rows between a bf16 and an unrounded
// head). Rounded, every kernel's logits are forward(x).float() bit for bit (subnormals flushed as
// vcvtneps2bf16 flushes them).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <optional>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace pdserve_gemm_out {

// Rows of out [M, N] (row stride ld elements, last dim contiguous), bf16 or fp32.
struct OutRows {
  void* base;
  int64_t ld;
  bool f32;

  // The rows from row r on.
  OutRows from_row(int64_t r) const {
    return {f32 ? static_cast<void*>(static_cast<float*>(base) + r * ld)
                : static_cast<void*>(static_cast<at::BFloat16*>(base) + r * ld), ld, f32};
  }

#if defined(__AVX512BF16__)
  // out[m, col .. col + 15] = v rounded to bf16 (nearest-even), where mask: stored as bf16, or
  // widened back to fp32 (exact).
  void store(int64_t m, int64_t col, __mmask16 mask, __m512 v) const {
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(v);
    if (f32) {
      const __m512i widened = _mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16);
      _mm512_mask_storeu_ps(static_cast<float*>(base) + m * ld + col, mask, _mm512_castsi512_ps(widened));
    } else {
      _mm256_mask_storeu_epi16(static_cast<at::BFloat16*>(base) + m * ld + col, mask, rounded);
    }
  }
#endif
};

#if defined(__AVX512BF16__)
// The lanes of a 16-column store with `left` columns left in the row (all 16 when left >= 16):
// the mask of every kernel's last, partial column tile.
inline __mmask16 columns_mask(int64_t left) {
  return left >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << left) - 1);
}
#endif

// out's rows, after checking it is a bf16 or fp32 [M, N] with contiguous rows that do not overlap
// (threads write disjoint columns of every row).
inline OutRows out_rows(const at::Tensor& out) {
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "out must be bf16 or float32 [M, N], rows contiguous");
  TORCH_CHECK(out.size(0) <= 1 || out.stride(0) >= out.size(1),
              "out's rows must not overlap (row stride ", out.stride(0), " < ", out.size(1), " columns)");
  return {out.data_ptr(), out.stride(0), out.scalar_type() == at::kFloat};
}

// The dtype an int8 kernel writes: bf16 (the default: the activations') or float32.
inline at::ScalarType out_dtype(const std::optional<at::ScalarType>& requested) {
  const at::ScalarType t = requested.value_or(at::kBFloat16);
  TORCH_CHECK(t == at::kBFloat16 || t == at::kFloat, "out_dtype must be bfloat16 or float32, got ", t);
  return t;
}

}  // namespace pdserve_gemm_out
