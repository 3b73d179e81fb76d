// silu(gate) * up for one row: the arithmetic of layer_ops.cpp's silu_mul (the fused gate/up
// output [T, 2I] -> [T, I]), in one place so the fused SiLU-and-quantize of int8_gemm_amx.cpp
// (silu_mul_w8a8_gemm) computes the same bf16 values bit for bit before it quantizes them.
//
// silu(x) = x * sigmoid(x) in fp32 with sigmoid from e = exp(-|x|) <= 1 (1 / (1 + e) for x >= 0,
// e / (1 + e) below), rounded to T, then the product with up rounded to T: the torch reference's two
// roundings (rounding once put the bf16 model measurably further from fp32, layer_ops.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "simd_math.h"

namespace pdserve_silu {

// out[i] = round(round(silu(gate[i])) * up[i]) for i < n; T float, bf16 or fp16.
template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (n % 16 == 0)
    for (; i < n; i += 16) {
      const __m512 x = pdserve_simd::load16(gate + i);
      const __m512 e = pdserve_simd::exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), e));
      const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
      const __m512 sig = _mm512_mask_mul_ps(inv, neg, inv, e);
      pdserve_simd::store16(out + i, _mm512_mul_ps(pdserve_simd::round16<T>(_mm512_mul_ps(x, sig)),
                                                   pdserve_simd::load16(up + i)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>)   // the fp32 model of CPUs without AVX-512 (the same formula, 8 lanes)
    for (; i + 8 <= n; i += 8) {
      const __m256 x = _mm256_loadu_ps(gate + i);
      const __m256 e = pdserve_simd::exp_neg8(_mm256_or_ps(x, _mm256_set1_ps(-0.f)));   // exp(-|x|)
      const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_add_ps(_mm256_set1_ps(1.f), e));
      const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(inv, e), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(up + i)));
    }
#endif
  for (; i < n; ++i) {
    const float x = static_cast<float>(gate[i]);
    out[i] = static_cast<T>(static_cast<float>(static_cast<T>(x / (1.f + std::exp(-x)))) * static_cast<float>(up[i]));
  }
}

}  // namespace pdserve_silu
