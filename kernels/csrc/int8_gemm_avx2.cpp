// INT8 linear layers on CPUs with AVX2 but without AVX512-VNNI (kernels/linear.py's Int8Linear,
// kernel "w8a8_avx2"): the same product as int8_gemm.cpp's w8a8_gemm, from the same packed weight,
// for fp32 or bf16 activations (the model dtype: fp32 where the CPU has no native bf16):
//
//   out[m, n] = wscale[n] * sum_g sx[m, g] * sum_{k in g} xq[m, k] q[n, k]
//   (sx[m, g] = amax |x[m, g*G .. g*G+G-1]| / 127, xq = round(x / sx), G = `group`)
//
// Why: on an AVX2 CPU without VNNI (Zen 1, 2 cores, 2026-12-03) the four-instruction step below
// (32 MACs) retires ~0.57 G times a second per core, 18 G MAC/s; the fp32 GEMMs reach 31-39
// GFLOP/s per core at 512 rows (oneDNN), 15-19 G MAC/s: about the same arithmetic rate. int8 wins
// on bytes (a quarter of fp32's: batch 1 reads them) and on small batches, where this kernel keeps
// ~87% of its rate at 16 rows (the linears of a b16 step: 68 ms for 2.16 G MAC) and oneDNN's fp32
// kernel ~60% of its (114 ms). Before this kernel Int8Linear there widened the weight to the model
// dtype on every call (20-40x slower than fp32).
//
// The step, per 8 output columns x 4 input channels (one 32-byte half of a tile line) and row:
// AVX2 has no vpdpbusd, and vpmaddubsw multiplies unsigned by signed bytes into saturating int16
// pair sums, so the stored q + 128 (up to 255) times a signed activation could overflow (255 x 127
// x 2 > 32767). The weight bytes are flipped back to q (xor 0x80) and the sign moved onto the
// activation: |q| x sign(xq, q) = q xq, each pair sum at most 2 x 127 x 127 = 32258 (exact), then
// vpmaddwd with ones sums the pairs into int32 (Intel's AVX2 int8 dot product idiom, as llama.cpp's
// Q8_0 uses). |q| and q are computed once per weight vector and reused by every row of the pass.
// No +128 correction is needed (the kernel works on q itself).
//
// Numerics: the group sums are exact int32; each times sx is accumulated in fp32 with an fma,
// groups in order, times wscale, rounded once to the output dtype (bf16: to nearest even). The
// activations are quantized as int8_activations.h quantizes them (x * (1 / sx), rounded half to
// even, saturated), so for bf16 input the output equals w8a8_gemm's bit for bit
// (tests/test_int8_gemm.py).
//
// Layout: int8_gemm.cpp's (kernels/linear.py pack_int8_gemm): q + 128 as bytes, [N/16][K/4][16][4].
// Blocking: a pass takes MR <= 8 rows and NH halves of tiles (8 columns each) with MR x NH <= 8
// int32 accumulators in registers (AVX2 has 16), the fp32 sums across groups in an L1 block.
// 1 row takes 8 halves (4 tiles), 2 rows 4, 3-4 rows 2, 5-8 rows 1; more rows take passes of equal
// size (16 rows: 2 x 8) over each unit of tiles while it is in cache. Units go to the threads in
// contiguous ranges, as in int8_gemm.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "int8_activations.h"

#if defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_INT8_AVX2 1
#include <immintrin.h>
#endif

namespace {

#if PDSERVE_INT8_AVX2
constexpr int kMaxRows = 8;   // rows per pass

// A pass's quantized activations: the 4 bytes xq[m, 4 kq .. 4 kq + 3] at xq[kq * ldq + m], the
// scales sx[m, g] at sx[g * ldq + m].
struct Rows {
  int32_t* xq;
  float* sx;
  int64_t ldq;
};

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// The largest of 8 non-negative int32 lanes (float bits) as the float those bits are.
inline float hmax_bits(__m256i v) {
  __m128i m = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4E));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xB1));
  const int32_t bits = _mm_cvtsi128_si32(m);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Row x [K] -> row r of p, as int8_activations.h's quantize_row: sx = group_scale(amax) (amax /
// 127; 1 below kMinAmax: an all-zero or vanishingly small group; NaN with an inf or NaN in it),
// xq = round(x * (1 / sx)) half to even (the default MXCSR mode), saturated to int8.
template <typename T>
inline void quantize_row(const T* x, int64_t k, int64_t group, int64_t r, const Rows& p) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t g = 0; g < k / group; ++g) {
    const T* xg = x + g * group;
    // amax on the fp32 bits (|x| orders as bits & 0x7FFFFFFF; inf and NaN above all, as int8_activations.h)
    __m256i vmax = _mm256_setzero_si256();
    for (int64_t i = 0; i < group; i += 8)
      vmax = _mm256_max_epi32(vmax, _mm256_castps_si256(_mm256_and_ps(load8(xg + i), abs_mask)));
    const float scale = pdserve_int8::group_scale(hmax_bits(vmax));
    p.sx[g * p.ldq + r] = scale;
    const __m256 inv = _mm256_set1_ps(1.f / scale);
    for (int64_t i = 0; i < group; i += 8) {
      const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load8(xg + i), inv));
      const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      const __m128i q8 = _mm_packs_epi16(q16, q16);   // bytes 0-7: the 8 values in order, saturated
      const int64_t kq = (g * group + i) / 4;
      p.xq[kq * p.ldq + r] = _mm_cvtsi128_si32(q8);
      p.xq[(kq + 1) * p.ldq + r] = _mm_extract_epi32(q8, 1);
    }
  }
}

inline void store8(float* dst, __m256 v, int count) {
  if (count >= 8) { _mm256_storeu_ps(dst, v); return; }
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  std::memcpy(dst, tmp, count * sizeof(float));
}
inline void store8(at::BFloat16* dst, __m256 v, int count) {   // round to nearest even, as c10::BFloat16
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  if (count >= 8) { _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed); return; }
  alignas(16) uint16_t tmp[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), packed);
  std::memcpy(dst, tmp, count * sizeof(uint16_t));
}

// Rows [0, MR) of pass p x halves [h0, h0 + NH) of the tiles at w (half h: tile h / 2 at
// w + (h / 2) tile_stride, bytes 32 (h % 2) .. of each 64-byte line): out[m, 8 h ..] for 8 h < n - n0
// (n0: the first column of w's first tile).
template <typename T, int MR, int NH>
void pass_kernel(const Rows p, int64_t groups, int64_t quads, int64_t wquads, const uint8_t* w, int64_t tile_stride,
                 int h0, const float* wscale, T* out, int64_t ldo, int64_t n0, int64_t n) {
  alignas(32) float facc[MR][NH][8];
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < NH; ++h) _mm256_store_ps(facc[m][h], _mm256_setzero_ps());
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const uint8_t* half[NH];
  for (int h = 0; h < NH; ++h) half[h] = w + ((h0 + h) / 2) * tile_stride + 32 * ((h0 + h) % 2);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i iacc[MR][NH];
    for (int m = 0; m < MR; ++m)
      for (int h = 0; h < NH; ++h) iacc[m][h] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int64_t i = 0; i < quads; ++i) {
      const int64_t kq = g * quads + i, kw = kq < wquads ? kq : kq - wquads;   // (MX: the lo digits reread the weight)
      __m256i wq[NH], wa[NH];
      for (int h = 0; h < NH; ++h) {
        _mm_prefetch(reinterpret_cast<const char*>(half[h] + (kw + 8) * 64), _MM_HINT_T0);
        wq[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half[h] + kw * 64)), flip);
        wa[h] = _mm256_abs_epi8(wq[h]);
      }
      const int32_t* xk = p.xq + kq * p.ldq;
      for (int m = 0; m < MR; ++m) {
        const __m256i a = _mm256_set1_epi32(xk[m]);
        for (int h = 0; h < NH; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(wa[h], _mm256_sign_epi8(a, wq[h]));
          iacc[m][h] = _mm256_add_epi32(iacc[m][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    const float* sg = p.sx + g * p.ldq;
    for (int m = 0; m < MR; ++m) {
      const __m256 s = _mm256_set1_ps(sg[m]);
      for (int h = 0; h < NH; ++h)
        _mm256_store_ps(facc[m][h], _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[m][h]), s, _mm256_load_ps(facc[m][h])));
    }
  }
  for (int h = 0; h < NH; ++h) {
    const int64_t col = n0 + 8 * (h0 + h);
    if (col >= n) break;
    const __m256 s = _mm256_loadu_ps(wscale + col);   // wscale is padded to whole tiles
    const int count = static_cast<int>(std::min<int64_t>(8, n - col));
    for (int m = 0; m < MR; ++m) store8(out + m * ldo + col, _mm256_mul_ps(_mm256_load_ps(facc[m][h]), s), count);
  }
}

template <typename T>
using PassFn = void (*)(const Rows, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int, const float*, T*, int64_t,
                        int64_t, int64_t);

// Halves at once for MR rows: MR x NH <= 8 accumulators.
constexpr int halves_for(int mr) { return mr <= 1 ? 8 : mr <= 2 ? 4 : mr <= 4 ? 2 : 1; }

// pass_kernel<T, MR, NH> for NH in {1, 2, 4, 8} (index 0-3) and MR in 1-8 where NH <= halves_for(MR),
// nullptr elsewhere.
template <typename T, int NH, int MR>
constexpr PassFn<T> pick() {
  if constexpr (NH <= halves_for(MR)) return &pass_kernel<T, MR, NH>; else return nullptr;
}
template <typename T, int NH, int... R>
constexpr std::array<PassFn<T>, kMaxRows + 1> rows_of(std::integer_sequence<int, R...>) {
  return {nullptr, pick<T, NH, R + 1>()...};
}
template <typename T>
using Table = std::array<std::array<PassFn<T>, kMaxRows + 1>, 4>;
template <typename T>
constexpr Table<T> kTable = {rows_of<T, 1>(std::make_integer_sequence<int, kMaxRows>{}),
                             rows_of<T, 2>(std::make_integer_sequence<int, kMaxRows>{}),
                             rows_of<T, 4>(std::make_integer_sequence<int, kMaxRows>{}),
                             rows_of<T, 8>(std::make_integer_sequence<int, kMaxRows>{})};

template <typename T>
void run(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& wscale, int64_t n, int64_t group,
         at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), tiles = packed.size(0);
  // MX activations (int8_activations.h quantize_row_mx_scalar): two "groups" over the whole
  // weight, the hi digits' quads then the lo digits' (the sign trick needs no corr)
  const bool mx = group == pdserve_int8::kMxGroup;
  const int64_t groups = mx ? 2 : k / group, quads = mx ? k / 4 : group / 4, k4 = groups * quads;
  const int64_t passes = (m + kMaxRows - 1) / kMaxRows;
  const int64_t per_pass = (m + passes - 1) / passes;   // 12 rows: two passes of 6, not 8 + 4
  std::vector<int32_t> xq(passes * k4 * per_pass);
  std::vector<float> sx(passes * groups * per_pass);
  std::vector<Rows> rows(passes);
  for (int64_t q = 0; q < passes; ++q)
    rows[q] = Rows{xq.data() + q * k4 * per_pass, sx.data() + q * groups * per_pass, per_pass};
  const T* xp = x.data_ptr<T>();
  if (mx) {
    std::vector<int8_t> digits(2 * k);
    for (int64_t r = 0; r < m; ++r) {
      const Rows& p = rows[r / per_pass];
      float s2[2];
      int32_t c2[2];
      pdserve_int8::quantize_row_mx_scalar(xp + r * x.stride(0), k, digits.data(), digits.data() + k, s2, c2);
      for (int64_t kq = 0; kq < k4; ++kq) std::memcpy(p.xq + kq * p.ldq + r % per_pass, digits.data() + 4 * kq, 4);
      for (int g = 0; g < 2; ++g) p.sx[g * p.ldq + r % per_pass] = s2[g];
    }
  } else {
    for (int64_t r = 0; r < m; ++r) quantize_row(xp + r * x.stride(0), k, group, r % per_pass, rows[r / per_pass]);
  }
  // Tiles per unit: the first pass's halves (at least one tile), fewer where units would split
  // unevenly over the threads.
  int64_t nt = std::max(1, halves_for(static_cast<int>(per_pass)) / 2);
  const int64_t threads = at::get_num_threads();
  while (nt > 1 && threads > 1 && (tiles + nt - 1) / nt < 4 * threads) nt /= 2;
  const int64_t units = (tiles + nt - 1) / nt;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = wscale.data_ptr<float>();
  T* op = out.data_ptr<T>();
  const int64_t ldo = out.stride(0), tile_stride = k * 16;
  // Threads only with 128 KB of weight or more for each (a hand-off costs more than that much work).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / (tile_stride * nt));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t t0 = u * nt, count = std::min<int64_t>(nt, tiles - t0);
      const uint8_t* wt = wp + t0 * tile_stride;
      for (int64_t r0 = 0, q = 0; r0 < m; r0 += per_pass, ++q) {
        const int mr = static_cast<int>(std::min<int64_t>(per_pass, m - r0));
        T* orow = op + r0 * ldo;
        // the unit's halves in calls of as many as the pass takes (powers of two: a partial last unit
        // of 3 tiles is 4 + 2 halves)
        for (int h = 0, left = static_cast<int>(2 * count); left > 0;) {
          int nh = std::min(halves_for(mr), left), index = 0;
          while ((2 << index) <= nh) ++index;
          nh = 1 << index;
          kTable<T>[index][mr](rows[q], groups, quads, k / 4, wt, tile_stride, h, sp, orow, ldo, 16 * t0, n);
          h += nh;
          left -= nh;
        }
      }
    }
  });
}
#endif

// out [M, N] (x's dtype: fp32 or bf16) = the product of x [M, K] (rows contiguous, or copied so)
// with the packed weight (arguments as int8_gemm.cpp's w8a8_gemm).
at::Tensor w8a8_gemm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& wscale, int64_t n,
                     int64_t group) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "x must be fp32 or bf16 [M, K]");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  pdserve_int8::check_weight(x.size(1), packed, wscale, n, group);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
#if PDSERVE_INT8_AVX2
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == at::kFloat) run<float>(x, packed, wscale, n, group, out);
  else run<at::BFloat16>(x, packed, wscale, n, group, out);
#else
  TORCH_CHECK(false, "w8a8_gemm (avx2) needs a build for a CPU with AVX2 and FMA");
#endif
  return out;
}

bool available() {
#if PDSERVE_INT8_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(pdserve_int8_avx2, m) {
  m.def("w8a8_gemm(Tensor x, Tensor packed, Tensor wscale, int n, int group=32) -> Tensor");
  m.def("available() -> bool", &available);
}

TORCH_LIBRARY_IMPL(pdserve_int8_avx2, CPU, m) { m.impl("w8a8_gemm", &w8a8_gemm); }
