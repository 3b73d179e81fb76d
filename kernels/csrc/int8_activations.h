// The activation side shared by the two W8A8 INT8 kernels (int8_gemm.cpp's w8a8_gemm, for decode,
// and int8_gemm_prefill.cpp's w8a8_gemm_large, for prefill): their argument checks and the one
// per-token, per-group activation quantization. One copy, so prefill and decode quantize alike and
// the two kernels' outputs stay equal bit for bit (tests/test_int8_gemm_prefill.py). The AVX2
// kernel (int8_gemm_avx2.cpp) shares the weight checks (check_weight); its activation quantization
// is the same arithmetic in 8-lane AVX2 (tests/test_int8_gemm.py checks the two kernels agree).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#endif

namespace pdserve_int8 {

// The packed-weight arguments every INT8 kernel takes (these two and int8_gemm_avx2.cpp), for
// activations of k columns: packed uint8 [N/16, K/4, 16, 4] (kernels/linear.py pack_int8_gemm),
// wscale fp32 [16 * tiles], n in the last tile, group a multiple of 32 dividing K.
inline void check_weight(int64_t k, const at::Tensor& packed, const at::Tensor& wscale, int64_t n, int64_t group) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 4 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte, "packed must be a contiguous uint8 [N/16, K/4, 16, 4]");
  const int64_t tiles = packed.size(0);
  TORCH_CHECK(k == 4 * packed.size(1), "x has ", k, " columns, the packed weight ", 4 * packed.size(1));
  TORCH_CHECK(group > 0 && group % 32 == 0 && k % group == 0, "group must be a multiple of 32 dividing K = ", k,
              ", got ", group);
  TORCH_CHECK(n > 16 * (tiles - 1) && n <= 16 * tiles, "n does not match the packed weight's tiles");
  TORCH_CHECK(wscale.dim() == 1 && wscale.size(0) == 16 * tiles && wscale.is_contiguous() &&
                  wscale.scalar_type() == at::kFloat, "wscale must be a contiguous fp32 [16 * tiles]");
}

// x [M, K] bf16 with contiguous rows (copied so if they are not), after checking the kernels'
// arguments (check_weight).
inline at::Tensor checked_input(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& wscale, int64_t n,
                                int64_t group) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x must be bf16 [M, K]");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  check_weight(x.size(1), packed, wscale, n, group);
  return x;
}

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
constexpr int64_t kChunk = 32;   // the activation group is a multiple of these input channels

// Quantized activations of rows [0, ldq) (a decode pass, a prefill block), written by quantize_row.
struct QuantizedRows {
  int32_t* xq;     // [K/4][ldq]: the 4 bytes xq[m, 4 kq .. 4 kq + 3] at xq[kq * ldq + m]
  float* sx;       // [K/group][ldq]: sx[m, g] at sx[g * ldq + m]
  int32_t* corr;   // [K/group][ldq]: -128 sum_{k in g} xq[m, k] at corr[g * ldq + m]
  int64_t ldq;
};

// Row x [K] bf16 -> row r of p: xq = round(x / sx) (half to even, the default MXCSR mode,
// |xq| <= 127), sx and corr per group of `group` channels (a multiple of 32). tmp: 32 bytes of scratch.
inline void quantize_row(const at::BFloat16* x, int64_t k, int64_t group, int64_t r, const QuantizedRows& p,
                         int8_t* tmp) {
  const uint16_t* row = reinterpret_cast<const uint16_t*>(x);
  const int64_t groups = k / group, chunks = group / kChunk;
  auto load = [&](int64_t c, int half) {   // 16 values of chunk c (channels 32 c + 16 half ..) as fp32
    const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * kChunk + 16 * half)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
  };
  for (int64_t g = 0; g < groups; ++g) {
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t c = g * chunks; c < (g + 1) * chunks; ++c)
      vmax = _mm512_max_ps(vmax, _mm512_max_ps(_mm512_abs_ps(load(c, 0)), _mm512_abs_ps(load(c, 1))));
    const float amax = _mm512_reduce_max_ps(vmax);
    const float scale = amax > 0.f ? amax / 127.f : 1.f;
    p.sx[g * p.ldq + r] = scale;
    const __m512 inv = _mm512_set1_ps(1.f / scale);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t c = g * chunks; c < (g + 1) * chunks; ++c) {
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(load(c, 0), inv));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(load(c, 1), inv));
      sum = _mm512_add_epi32(sum, _mm512_add_epi32(qlo, qhi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp + 16), _mm512_cvtsepi32_epi8(qhi));
      const int32_t* t32 = reinterpret_cast<const int32_t*>(tmp);
      for (int64_t i = 0; i < kChunk / 4; ++i) p.xq[(c * kChunk / 4 + i) * p.ldq + r] = t32[i];
    }
    p.corr[g * p.ldq + r] = -128 * _mm512_reduce_add_epi32(sum);
  }
}
#endif

}  // namespace pdserve_int8
