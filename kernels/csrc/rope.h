// Rotate-half RoPE of one head (Su et al. 2021, as HF checkpoints use): the arithmetic of
// layer_ops.cpp's rope_split, in one place so the INT8 QKV projection that rotates its heads as it
// writes them (int8_gemm_amx.cpp's qkv_rope_w8a8_gemm) gives the same bits.
//
// o[i] = x[i] c[i] - x[i + half] s[i], o[i + half] = x[i + half] c[i] + x[i] s[i], in fp32 from
// the fp32 cos/sin tables, rounded once to T.
#pragma once

#include <cstdint>

#include "simd_math.h"

namespace pdserve_rope {

// One head of d = 2 half elements, x -> o (may not overlap); c, s: the token's cos/sin [half].
template <typename T>
inline void rotate(T* o, const T* x, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (half % 16 == 0)
    for (; i < half; i += 16) {
      const __m512 x0 = pdserve_simd::load16(x + i), x1 = pdserve_simd::load16(x + half + i);
      const __m512 vc = _mm512_loadu_ps(c + i), vs = _mm512_loadu_ps(s + i);
      pdserve_simd::store16(o + i, _mm512_fnmadd_ps(x1, vs, _mm512_mul_ps(x0, vc)));
      pdserve_simd::store16(o + half + i, _mm512_fmadd_ps(x0, vs, _mm512_mul_ps(x1, vc)));
    }
#endif
  for (; i < half; ++i) {
    const float x0 = static_cast<float>(x[i]), x1 = static_cast<float>(x[half + i]);
    o[i] = static_cast<T>(x0 * c[i] - x1 * s[i]);
    o[half + i] = static_cast<T>(x1 * c[i] + x0 * s[i]);
  }
}

}  // namespace pdserve_rope
