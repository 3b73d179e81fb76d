// SIMD helpers shared by the CPU kernels (paged_attention.cpp, layer_ops.cpp): fp32 loads of
// 16 (AVX-512) or 8 (AVX2) cache/activation elements and exp / exp2 for non-positive arguments. One copy, so a fix or a
// change of precision reaches every kernel; the build key (kernels/cpu_attention.py) hashes this
// header with the sources.
#pragma once

#include <ATen/core/Tensor.h>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace pdserve_simd {

// 16 consecutive elements as fp32 (bf16: the 16 bits shifted into the high half, exact; fp16: F16C).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 E4M3 bytes (sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinity) as fp32,
// exactly: the 7 magnitude bits moved into fp16's exponent/mantissa fields give an fp16 of the
// same mantissa whose exponent bias is 15 instead of 7 (subnormals included, F16C converts them
// exactly), so the value is that fp16 times 2^8. NaN (0x7F/0xFF) reads as 480; the writers
// saturate at 448 and never store it.
inline __m512 load16(const at::Float8_e4m3fn* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
  const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, mag)), _mm512_set1_ps(256.0f));
}

#if defined(__AVX512BW__)
// 32 E4M3 bytes as 32 bf16, exactly (E4M3's 4 significant bits fit bf16's 8), without going
// through fp32: a normal value's exponent and mantissa fields move into bf16's with the bias
// changed from 7 to 127 (+ 120 << 7); a subnormal (exponent field 0: m x 2^-9) comes from an
// 8-entry table. NaN (0x7F/0xFF) reads as 480, as load16 reads it.
inline __m512i e4m3_to_bf16x32(const at::Float8_e4m3fn* p) {
  alignas(64) static const uint16_t subnormal[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7F));
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8);
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3C00));
  const __m512i small = _mm512_permutexvar_epi16(mag, _mm512_load_si512(subnormal));   // index: mag's low 5 bits
  const __mmask32 is_small = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
  return _mm512_or_si512(sign, _mm512_mask_blend_epi16(is_small, normal, small));
}
#endif

// 16 fp32 lanes stored as T, rounded to nearest even as c10's types round (bf16 NaN stays NaN, its
// payload kept); round16<T>: v rounded to T's precision and back (a torch reference's intermediate rounding).
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
}
inline void store16(at::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(64) T tmp[16];
    store16(tmp, v);
    return load16(tmp);
  }
}

// exp(x) for x <= 0 (softmax scores minus their running max, -|x| of a sigmoid):
// 2^n * P(r), n = round(x / ln2), r = x - n ln2 (ln2 split in two parts, Cody-Waite),
// |r| <= ln2/2, P the degree-6 Taylor polynomial (relative error ~2e-7); x below -87 gives ~0.
inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 2^x for x <= 0 (softmax scores in log2 units minus their running max): 2^n * 2^f, n = round(x),
// f = x - n in [-1/2, 1/2] (exact), 2^f = e^(f ln2) as its degree-5 Taylor polynomial (relative
// error ~3e-6, far below the bf16 rounding of P that follows); x below -126 gives ~0, -inf 0.
inline __m512 exp2_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);   // ln2^k / k!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace pdserve_simd
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace pdserve_simd {

// The AVX2 versions, for CPUs without AVX-512 (Zen 1/2, older Intel): 8 lanes.
// 8 consecutive elements as fp32 (bf16 shifted into the high half, exact; fp16 through F16C).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Whether load8 reads T (an FP8 cache takes the scalar path).
template <typename T>
constexpr bool kLoad8 = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;

// exp(x) for x <= 0, as exp_neg above (Cody-Waite reduction, degree-6 Taylor polynomial, relative
// error ~2e-7; x below -87 gives ~0), 2^n built in the exponent field (n >= -126 there).
inline __m256 exp_neg8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
}

}  // namespace pdserve_simd
#endif
