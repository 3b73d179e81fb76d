// The activation side shared by the W8A8 INT8 kernels (int8_gemm.cpp's w8a8_gemm, for 1-4 rows,
// int8_gemm_prefill.cpp's w8a8_gemm_large, from 5 rows on, int8_gemm_amx.cpp): their argument
// checks and the per-token, per-group activation quantization, row by row (quantize_row) or 4 rows
// at once (quantize_block, the same values). In one place, so the kernels quantize alike and their
// outputs stay equal bit for bit (tests/test_int8_gemm_prefill.py, tests/test_int8_gemm.py). The
// AVX2 kernel (int8_gemm_avx2.cpp) shares the weight checks (check_weight); its activation
// quantization is the same arithmetic in 8-lane AVX2 (tests/test_int8_gemm.py checks they agree).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#endif

namespace pdserve_int8 {

// The least group amax given its own scale (amax / 127): 127 x FLT_MIN, so the scale is a normal
// float and 1 / scale finite. A group below it (|x| < 1.5e-36 throughout, or all zero) takes scale
// 1 and quantizes to zeros; with a subnormal scale 1 / scale overflowed to inf and every value
// became -128 (row and block quantizers then disagreeing on the group's correction).
constexpr float kMinAmax = 127.f * std::numeric_limits<float>::min();

// The `group` argument that asks for MX activations (quantize_row_mx): one scale per token with a
// power-of-two sub-scale per block of 32 channels.
constexpr int64_t kMxGroup = -32;

// A group's scale from its amax: amax / 127, 1 below kMinAmax, NaN for a group holding an inf or
// a NaN (its amax is then inf or NaN, taken on the bits: they order above every finite value).
// Every kernel's sum is a sum of sx times the group's products, so that row's outputs are NaN,
// whatever kernel and row position: a poisoned row stays visibly poisoned (bf16's product gives
// inf or NaN there), never finite values that depend on the kernel, and the other rows are untouched.
inline float group_scale(float amax) {
  if (!(amax <= std::numeric_limits<float>::max())) return std::numeric_limits<float>::quiet_NaN();
  return amax >= kMinAmax ? amax / 127.f : 1.f;
}

// The packed-weight arguments every INT8 kernel takes (these two and int8_gemm_avx2.cpp), for
// activations of k columns: packed uint8 [N/16, K/4, 16, 4] (kernels/linear.py pack_int8_gemm),
// wscale fp32 [16 * tiles], n in the last tile, group a multiple of 32 dividing K.
inline void check_weight(int64_t k, const at::Tensor& packed, const at::Tensor& wscale, int64_t n, int64_t group) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 4 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte, "packed must be a contiguous uint8 [N/16, K/4, 16, 4]");
  const int64_t tiles = packed.size(0);
  TORCH_CHECK(k > 0 && k == 4 * packed.size(1), "x has ", k, " columns, the packed weight ", 4 * packed.size(1));
  TORCH_CHECK((group > 0 && group % 32 == 0 && k % group == 0) || (group == kMxGroup && k % 32 == 0),
              "group must be a multiple of 32 dividing K = ", k, ", got ", group, " (or ", kMxGroup,
              " for MX activations, K a multiple of 32)");
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

// MX activations' block shift: the largest e in 0..kMxMaxShift with block_amax 2^e <= amax
// (exact: a product by a power of two), for finite amaxes.
constexpr int kMxMaxShift = 7;
inline int mx_shift(float block_amax, float amax) {
  int e = 0;
  while (e < kMxMaxShift && block_amax * static_cast<float>(2 << e) <= amax) ++e;
  return e;
}

// quantize_row_mx's values without vector instructions (int8_gemm_avx2.cpp; any input dtype T that
// converts to float exactly), the same arithmetic: v = nearbyint((x * (1 / sx)) * 2^e) in the
// default rounding mode (to nearest even), hi = v >> e, lo = (v mod 2^e) 2^(7 - e).
template <typename T>
inline void quantize_row_mx_scalar(const T* x, int64_t k, int8_t* hi, int8_t* lo, float* sx2, int32_t* corr2) {
  float amax = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < k; ++i) {
    const float v = static_cast<float>(x[i]);
    finite = finite && std::isfinite(v);
    amax = std::max(amax, std::fabs(v));
  }
  const float sx = finite ? group_scale(amax) : std::numeric_limits<float>::quiet_NaN();
  sx2[0] = sx;
  sx2[1] = sx * (1.f / 128.f);
  corr2[0] = corr2[1] = 0;
  if (!finite) {
    std::memset(hi, 0, k);
    std::memset(lo, 0, k);
    return;
  }
  const float inv = 1.f / sx;
  int32_t sum_hi = 0, sum_lo = 0;
  for (int64_t c = 0; c < k; c += 32) {
    float block_amax = 0.f;
    for (int64_t i = c; i < c + 32; ++i) block_amax = std::max(block_amax, std::fabs(static_cast<float>(x[i])));
    const int e = mx_shift(block_amax, amax);
    const float pow2 = static_cast<float>(1 << e);
    for (int64_t i = c; i < c + 32; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(static_cast<float>(x[i]) * inv * pow2));
      const int32_t h = v >> e, l = (v & ((1 << e) - 1)) << (kMxMaxShift - e);
      hi[i] = static_cast<int8_t>(h);
      lo[i] = static_cast<int8_t>(l);
      sum_hi += h;
      sum_lo += l;
    }
  }
  corr2[0] = -128 * sum_hi;
  corr2[1] = -128 * sum_lo;
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
    // amax on the bf16 bits, as quantize_block takes it (|x| orders as bits & 0x7FFF; inf and NaN above all)
    __m512i vmax = _mm512_setzero_si512();
    for (int64_t c = g * chunks; c < (g + 1) * chunks; ++c)
      vmax = _mm512_max_epu16(vmax, _mm512_and_si512(_mm512_loadu_si512(row + c * kChunk), _mm512_set1_epi16(0x7FFF)));
    vmax = _mm512_max_epu32(_mm512_and_si512(vmax, _mm512_set1_epi32(0xFFFF)), _mm512_srli_epi32(vmax, 16));
    const uint32_t amax_bits = _mm512_reduce_max_epu32(vmax) << 16;
    float amax;
    std::memcpy(&amax, &amax_bits, sizeof amax);
    const float scale = group_scale(amax);
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

// Rows x[0 .. rows) (rows <= 4, row r at x + r ldx, bf16 [K]) -> a block of 4 rows, p.ldq == 4,
// rows past `rows` as all-zero rows (sx 1, xq 0, corr 0): the values quantize_row writes row by row
// (the same amax, scale = amax / 127, 1 / scale and rounding), 4 rows at once. Why: quantize_row
// reduces each row's amax and sum across its vector (a chain of shuffles per row and group), widens
// every value to fp32 twice and writes the quad layout one int32 at a time. Here the amax is taken
// on the bf16 bits (for finite values |x| orders as bits & 0x7FFF do), the 4 rows' reductions share
// one shuffle tree, the scales of 16 groups are one vector division, and each 32 channels of the 4
// rows are packed and interleaved in registers into two 64-byte lines. 16 rows, one thread (Zen 4):
// K = 1536 in groups of 32 9.0 -> 2.65 us, K = 576 in groups of 64 3.0 -> 0.8 us; at decode sizes
// this runs serially before the call's parallel part. (Rows past `rows` are masked loads, and the
// 4 rows' maxima named registers: with an array and a branch per load the compiler kept the
// maxima on the stack, and the amax pass alone took 2.8 us at K = 1536.)
//
// rows_out (int8_gemm_amx.cpp): xq written instead row-major, row r's K bytes at rows_out + r ldr
// (all 4 rows: zeros past `rows`), the AMX A-tile layout; sx and corr as above (p.xq unused).
inline void quantize_block(const at::BFloat16* x, int64_t ldx, int rows, int64_t k, int64_t group,
                           const QuantizedRows& p, int8_t* rows_out = nullptr, int64_t ldr = 0) {
  const uint16_t* row[4];
  __mmask32 live[4];   // all 32 lanes of row r's loads, or none past `rows` (masked loads: no branches)
  for (int r = 0; r < 4; ++r) {
    row[r] = reinterpret_cast<const uint16_t*>(x + (r < rows ? r : 0) * ldx);
    live[r] = r < rows ? ~__mmask32{0} : __mmask32{0};
  }
  auto bits = [&](int r, int64_t c) {   // the 32 bf16 of row r's chunk c (zero past `rows`)
    return _mm512_maskz_loadu_epi16(live[r], row[r] + c * kChunk);
  };
  const int64_t groups = k / group, chunks = group / kChunk;
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF), high_words = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i lanes0 = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  // after packing, per 128-bit lane: a row's channels 8L, 8L+2, .., 8L+6, 8L+1, .., 8L+7 -> in order
  const __m512i order = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15));
  // dword 4 i + r of a chunk's first line: row r's quad i, from the packed rows A B (dwords 0-15:
  // lane L holds A's quads 2L, 2L+1, B's 2L, 2L+1) and C D (16-31); the second line's quads 4-7: + 8
  const __m512i lo_idx = _mm512_set_epi32(23, 21, 7, 5, 22, 20, 6, 4, 19, 17, 3, 1, 18, 16, 2, 0);
  const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
  const __m512i ones = _mm512_set1_epi8(1);
  // rows_out: dwords (lo 0-15, hi 16-31) of rows 0 and 1 (then 2 and 3), each row's 8 quads in order
  const __m512i rows01 = _mm512_set_epi32(29, 25, 21, 17, 13, 9, 5, 1, 28, 24, 20, 16, 12, 8, 4, 0);
  const __m512i rows23 = _mm512_add_epi32(rows01, _mm512_set1_epi32(2));
  constexpr int64_t kBatch = 16;   // groups whose 4 rows' scales are one vector division
  alignas(64) float inv[kBatch * 4];
  int32_t* const xq = p.xq;   // (locals: stores through the int32 pointers could alias p's fields)
  int32_t* const corr = p.corr;
  float* const sx = p.sx;
  for (int64_t g0 = 0; g0 < groups; g0 += kBatch) {
    const int64_t gn = std::min<int64_t>(kBatch, groups - g0);
    for (int64_t g = 0; g < gn; ++g) {   // amax of each row in each group, into inv[4 g + r]
      __m512i v0 = _mm512_setzero_si512(), v1 = v0, v2 = v0, v3 = v0;
      for (int64_t c = (g0 + g) * chunks; c < (g0 + g + 1) * chunks; ++c) {
        v0 = _mm512_max_epu16(v0, _mm512_and_si512(bits(0, c), magnitude));
        v1 = _mm512_max_epu16(v1, _mm512_and_si512(bits(1, c), magnitude));
        v2 = _mm512_max_epu16(v2, _mm512_and_si512(bits(2, c), magnitude));
        v3 = _mm512_max_epu16(v3, _mm512_and_si512(bits(3, c), magnitude));
      }
      // halves, then 128-bit lanes (lane r: row r), then within lanes: word 0 of dword 4 r = row r's amax
      const __m512i m01 = _mm512_max_epu16(_mm512_shuffle_i32x4(v0, v1, 0x44), _mm512_shuffle_i32x4(v0, v1, 0xEE));
      const __m512i m23 = _mm512_max_epu16(_mm512_shuffle_i32x4(v2, v3, 0x44), _mm512_shuffle_i32x4(v2, v3, 0xEE));
      __m512i a = _mm512_max_epu16(_mm512_shuffle_i32x4(m01, m23, 0x88), _mm512_shuffle_i32x4(m01, m23, 0xDD));
      a = _mm512_max_epu16(a, _mm512_shuffle_epi32(a, _MM_PERM_BADC));
      a = _mm512_max_epu16(a, _mm512_shuffle_epi32(a, _MM_PERM_CDAB));
      a = _mm512_max_epu16(a, _mm512_srli_epi32(a, 16));
      _mm_store_ps(inv + 4 * g, _mm512_castps512_ps128(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_permutexvar_epi32(lanes0, a), 16))));
    }
    for (int64_t i = 0; i < 4 * gn; i += 16) {   // scale = group_scale(amax), inv = 1 / scale
      const __mmask16 mask = 4 * gn - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (4 * gn - i)) - 1);
      const __m512 amax = _mm512_maskz_loadu_ps(mask, inv + i);
      __m512 scale = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(amax, _mm512_set1_ps(kMinAmax), _CMP_GE_OQ), _mm512_set1_ps(1.f),
                                          _mm512_div_ps(amax, _mm512_set1_ps(127.f)));
      const __mmask16 finite = _mm512_cmp_ps_mask(amax, _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_LE_OQ);
      scale = _mm512_mask_blend_ps(finite, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()), scale);
      _mm512_mask_storeu_ps(sx + 4 * g0 + i, mask, scale);
      _mm512_mask_storeu_ps(inv + i, mask, _mm512_div_ps(_mm512_set1_ps(1.f), scale));
    }
    for (int64_t g = 0; g < gn; ++g) {
      __m512i sum = _mm512_setzero_si512();
      for (int64_t c = (g0 + g) * chunks; c < (g0 + g + 1) * chunks; ++c) {
        __m512i w[4];   // row r's 32 channels as int16: per lane L, channels 8L, 8L+2, .., 8L+6, 8L+1, .., 8L+7
        for (int r = 0; r < 4; ++r) {
          const __m512 s = _mm512_set1_ps(inv[4 * g + r]);
          const __m512i b = bits(r, c);   // fp32 of the even channels: each dword's low word << 16; odd: the high word
          const __m512i even = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), s));
          const __m512i odd = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(b, high_words)), s));
          w[r] = _mm512_packs_epi32(even, odd);   // (|xq| <= 127: the packs never saturate)
        }
        const __m512i ab = _mm512_shuffle_epi8(_mm512_packs_epi16(w[0], w[1]), order);
        const __m512i cd = _mm512_shuffle_epi8(_mm512_packs_epi16(w[2], w[3]), order);
        const __m512i lo = _mm512_permutex2var_epi32(ab, lo_idx, cd), hi = _mm512_permutex2var_epi32(ab, hi_idx, cd);
        if (rows_out == nullptr) {
          _mm512_storeu_si512(xq + c * kChunk, lo);   // quads 8c .. 8c+3 of the 4 rows, then 8c+4 .. 8c+7
          _mm512_storeu_si512(xq + c * kChunk + 16, hi);
        } else {   // row r's 32 bytes: its quads 0-3 (dwords r, 4 + r, .. of lo), then 4-7 (of hi)
          const __m512i r01 = _mm512_permutex2var_epi32(lo, rows01, hi), r23 = _mm512_permutex2var_epi32(lo, rows23, hi);
          int8_t* dst = rows_out + c * kChunk;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_castsi512_si256(r01));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + ldr), _mm512_extracti64x4_epi64(r01, 1));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * ldr), _mm512_castsi512_si256(r23));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 3 * ldr), _mm512_extracti64x4_epi64(r23, 1));
        }
        sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum, ones, lo), ones, hi);   // dword 4 i + r: 4 of row r's values
      }
      sum = _mm512_add_epi32(sum, _mm512_shuffle_i32x4(sum, sum, 0x4E));
      sum = _mm512_add_epi32(sum, _mm512_shuffle_i32x4(sum, sum, 0xB1));   // dwords 0-3: rows 0-3
      _mm_storeu_si128(reinterpret_cast<__m128i*>(corr + 4 * (g0 + g)),
                       _mm_mullo_epi32(_mm512_castsi512_si128(sum), _mm_set1_epi32(-128)));
    }
  }
}
// MX activations (the shared power-of-two block scales of the OCP Microscaling formats, Rouhani et
// al. 2023, under a per-token fp32 scale): row x [K] bf16 (K a multiple of 32) -> two int8 digit
// rows hi, lo [K], sx2 = {sx, sx / 128}, corr2 = {-128 sum hi, -128 sum lo}, such that
//
//   x[k] ~ sx 2^-e(b) v[k],  v[k] = round(x[k] / sx * 2^e(b)) (|v| <= 127),  v[k] 2^(7 - e(b)) = 128 hi[k] + lo[k]
//
// with sx = amax(|x|) / 127 (group_scale) and, per block b of 32 channels, e(b) the largest
// e in 0..7 with amax_b 2^e <= amax (a block 2^e times smaller than the row's largest keeps its
// 7 bits; the digits: hi = v >> e, lo = (v mod 2^e) 2^(7 - e), 0 <= lo < 128). A product is then
// sx sum_k hi q + sx / 128 sum_k lo q: two per-token products over the same weight, where groups of
// 32 with their own scales need an fp32 step per group (int8_gemm_amx.cpp). A row holding an inf
// or a NaN: sx NaN, digits 0 (as group_scale's poisoned groups).
//
// In three passes, each over any run of whole blocks, so a row split by channels between threads
// (int8_gemm_amx.cpp's mlp_w8a8_gemm) is quantized slice by slice with the same bits: mx_block_maxes
// (each block's amax, and the slice's), then, with the row's amax from every slice, mx_scale and
// mx_shifts, and mx_digits (the digits and their sums; corr2 from the slices' sums added).

// Pass 1 over `blocks` blocks of 32 channels from row (bf16 bits): bmax[s] holds blocks 16 s ..
// 16 s + 15 (one dword each, as the bits of |x|'s maximum: |x| orders as bits & 0x7FFF, inf and
// NaN above every finite value), computed 16 blocks at once by a transpose tree (lanes of 256,
// 128, 64 and 32 bits, then the two halves of a dword; each block's maximum ends in one dword, in
// the order kTree, put back in block order). Returns the maximum over the run.
inline uint32_t mx_block_maxes(const uint16_t* row, int64_t blocks, __m512i* bmax) {
  const __m512i abs_mask = _mm512_set1_epi16(0x7FFF), low16 = _mm512_set1_epi32(0xFFFF);
  const __m512i tree_order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
  __m512i rowmax = _mm512_setzero_si512();
  for (int64_t s = 0; s < (blocks + 15) / 16; ++s) {
    __m512i v[16];
    for (int j = 0; j < 16; ++j) {
      const int64_t c = 16 * s + j;
      v[j] = c < blocks ? _mm512_and_si512(_mm512_loadu_si512(row + c * kChunk), abs_mask) : _mm512_setzero_si512();
    }
    for (int j = 0; j < 8; ++j)   // 256-bit halves: block 2j in lanes 0-1, 2j+1 in lanes 2-3
      v[j] = _mm512_max_epu16(_mm512_shuffle_i64x2(v[2 * j], v[2 * j + 1], 0x44), _mm512_shuffle_i64x2(v[2 * j], v[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; ++j)   // 128-bit lanes: one block each
      v[j] = _mm512_max_epu16(_mm512_shuffle_i64x2(v[2 * j], v[2 * j + 1], 0x88), _mm512_shuffle_i64x2(v[2 * j], v[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; ++j)   // 64-bit halves of a lane: two blocks a lane
      v[j] = _mm512_max_epu16(_mm512_unpacklo_epi64(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_epi64(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 2; ++j)   // dword pairs: each dword twice
      v[j] = _mm512_max_epu16(v[j], _mm512_shuffle_epi32(v[j], _MM_PERM_CDAB));
    const __m512i z = _mm512_mask_blend_epi32(0xAAAA, v[0], v[1]);
    const __m512i m = _mm512_max_epu32(_mm512_and_si512(z, low16), _mm512_srli_epi32(z, 16));
    bmax[s] = _mm512_permutexvar_epi32(tree_order, m);
    rowmax = _mm512_max_epu32(rowmax, bmax[s]);
  }
  return _mm512_reduce_max_epu32(rowmax);
}

// sx from the row's amax bits (the maximum of mx_block_maxes over its slices): group_scale's.
inline float mx_scale(uint32_t rmax) {
  const uint32_t rbits = rmax << 16;
  float amax;
  std::memcpy(&amax, &rbits, sizeof amax);
  return group_scale(amax);
}

// Each block's shift in place of its maximum (bmax, `blocks` blocks), from the row's amax bits:
// the exponents' difference, one less where the block's mantissa is the larger (mx_shift's e for
// normal block maxima), 7 for a block whose maximum is zero or subnormal (exponent field 0): under
// a row at or above kMinAmax (127 x 2^-126) such a block is at least 2^7 below it (exactly 2^7 for
// 0x007F under 0x03FE, where the mantissa rule would give 6), and under a smaller row sx is 1 and
// every digit 0 whatever e.
inline void mx_shifts(__m512i* bmax, int64_t blocks, uint32_t rmax) {
  const __m512i rv = _mm512_set1_epi32(static_cast<int>(rmax));
  const __m512i rexp = _mm512_srli_epi32(rv, 7), rman = _mm512_and_si512(rv, _mm512_set1_epi32(0x7F));
  const __m512i one = _mm512_set1_epi32(1), seven = _mm512_set1_epi32(kMxMaxShift);
  for (int64_t s = 0; s < (blocks + 15) / 16; ++s) {
    const __m512i b = bmax[s];
    __m512i e = _mm512_sub_epi32(rexp, _mm512_srli_epi32(b, 7));
    e = _mm512_mask_sub_epi32(e, _mm512_cmpgt_epi32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7F)), rman), e, one);
    e = _mm512_min_epi32(_mm512_max_epi32(e, _mm512_setzero_si512()), seven);
    bmax[s] = _mm512_mask_mov_epi32(e, _mm512_cmplt_epu32_mask(b, _mm512_set1_epi32(0x80)), seven);
  }
}

// Pass 2 over `blocks` blocks from row, with their shifts (mx_shifts) and the row's sx (not NaN):
// v = round((x / sx) 2^e), hi = v >> e, lo = (v mod 2^e) 2^(7 - e) into hi, lo [32 blocks]; the
// digits' sums added to sums[0] (hi) and sums[1] (lo).
inline void mx_digits(const uint16_t* row, int64_t blocks, const __m512i* shifts, float sx, int8_t* hi, int8_t* lo,
                      int32_t* sums) {
  const __m512 inv = _mm512_set1_ps(1.f / sx);
  const __m512i one = _mm512_set1_epi32(1), seven = _mm512_set1_epi32(kMxMaxShift);
  __m512i sum_hi = _mm512_setzero_si512(), sum_lo = _mm512_setzero_si512();
  for (int64_t c = 0; c < blocks; ++c) {
    const __m512i shift = _mm512_permutexvar_epi32(_mm512_set1_epi32(static_cast<int>(c & 15)), shifts[c >> 4]);
    const __m512 pow2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(shift, _mm512_set1_epi32(127)), 23));
    const __m512i up = _mm512_sub_epi32(seven, shift), low = _mm512_sub_epi32(_mm512_sllv_epi32(one, shift), one);
    for (int half = 0; half < 2; ++half) {
      const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * kChunk + 16 * half)));
      const __m512 xf = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(xf, inv), pow2));   // (x / sx) exact times 2^e
      const __m512i h = _mm512_srav_epi32(v, shift);
      const __m512i l = _mm512_sllv_epi32(_mm512_and_si512(v, low), up);
      sum_hi = _mm512_add_epi32(sum_hi, h);
      sum_lo = _mm512_add_epi32(sum_lo, l);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + c * kChunk + 16 * half), _mm512_cvtepi32_epi8(h));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + c * kChunk + 16 * half), _mm512_cvtepi32_epi8(l));
    }
  }
  sums[0] += _mm512_reduce_add_epi32(sum_hi);
  sums[1] += _mm512_reduce_add_epi32(sum_lo);
}

inline void quantize_row_mx(const at::BFloat16* x, int64_t k, int8_t* hi, int8_t* lo, float* sx2, int32_t* corr2) {
  const uint16_t* row = reinterpret_cast<const uint16_t*>(x);
  const int64_t blocks = k / kChunk, sets = (blocks + 15) / 16;
  __m512i bmax_stack[16];
  std::vector<__m512i> bmax_heap(sets > 16 ? sets : 0);
  __m512i* bmax = sets > 16 ? bmax_heap.data() : bmax_stack;
  const uint32_t rmax = mx_block_maxes(row, blocks, bmax);
  const float sx = mx_scale(rmax);
  sx2[0] = sx;
  sx2[1] = sx * (1.f / 128.f);
  if (std::isnan(sx)) {
    std::memset(hi, 0, k);
    std::memset(lo, 0, k);
    corr2[0] = corr2[1] = 0;
    return;
  }
  mx_shifts(bmax, blocks, rmax);
  int32_t sums[2] = {0, 0};
  mx_digits(row, blocks, bmax, sx, hi, lo, sums);
  corr2[0] = -128 * sums[0];
  corr2[1] = -128 * sums[1];
}
#endif

}  // namespace pdserve_int8
