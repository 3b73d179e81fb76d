// INT8 linear layers (kernels/linear.py's Int8Linear, kernel "w8a8_vnni"): int8 weights with
// per-output-channel scales, activations quantized in the call per token and per group of 32 input
// channels, bf16 in and out, AVX512-VNNI and AVX512-BF16:
//
//   out[m, n] = wscale[n] * sum_g sx[m, g] * sum_{k in g} xq[m, k] q[n, k]
//   (sx[m, g] = amax |x[m, g*32 .. g*32+31]| / 127, xq = round(x / sx))
//
// Why: a decode step at 1-32 rows streams every weight from DRAM once, so int8 weights (half of
// bf16's bytes) are the speed lever; at 16-32 rows the bf16 product is compute-bound too, and
// vpdpbusd multiplies 64 u8 x s8 pairs per instruction where vdpbf16ps multiplies 32, reading the
// int8 weight as it is (widening it to bf16 in registers first cost more than the bytes saved).
// Groups of 32 rather than one scale per token: an outlier channel coarsens only its own group
// (per-token activations cost the bundled model +4.7% perplexity, per group of 32 about as much as
// weight-only int8; engine/quantization/apply.py).
//
// Numerics: the products and their int32 sums within a group are exact; each group's sum times
// sx is accumulated in fp32, times wscale, rounded once to bf16. vpdpbusd multiplies unsigned by
// signed bytes: the weight is stored as q + 128 (in [1, 255]) and each group's int32 sum starts at
// -128 sum_{k in g} xq[m, k] (summed while quantizing the activations), which cancels the offset
// exactly (a correction on the weight side would be 4 more bytes per output column and group,
// 1/8 more than the weights themselves, read every step).
//
// Layout (packed once at load, kernels/linear.py pack_int8_gemm): q + 128 as bytes, [N, K] in
// tiles of 16 output columns, [N/16][K/4][16][4]: bytes 4j..4j+3 of a tile's 64-byte line hold
// column n0 + j at k = 4i..4i+3 (vpdpbusd's quad layout). N is padded to a multiple of 16 with
// zero-weight rows (bytes 128, scale 0), K must be a multiple of 32. Work items are groups of 8 tiles on torch's intra-op threads; rows are taken
// in passes of up to 12 (after the first pass a group's weights are in L1/L2).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define PDSERVE_INT8_GEMM 1
#include <immintrin.h>
#endif

namespace {

#if PDSERVE_INT8_GEMM
constexpr int64_t kGroup = 32;     // input channels per activation scale
constexpr int kMaxRows = 12;       // rows per pass
constexpr int kGroupTiles = 8;     // tiles per work item: every tiles_for divides it
constexpr int64_t kPrefetch = 8;   // lines ahead in each tile's stream

// x [M, K] bf16 -> xq [M, K] s8 = round(x / sx), sx [M, K / 32] fp32 and corr [M, K / 32] int32 =
// -128 x the group's sum of xq, rows [r0, r1).
void quantize_groups(const at::BFloat16* x, int64_t ldx, int64_t k, int8_t* xq, float* sx, int32_t* corr, int64_t r0,
                     int64_t r1) {
  const int64_t groups = k / kGroup;
  for (int64_t m = r0; m < r1; ++m) {
    const uint16_t* row = reinterpret_cast<const uint16_t*>(x + m * ldx);
    for (int64_t g = 0; g < groups; ++g) {
      const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * kGroup)));
      const __m512i bits2 =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * kGroup + 16)));
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(bits2, 16));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float scale = amax > 0.f ? amax / 127.f : 1.f;
      sx[m * groups + g] = scale;
      const __m512 inv = _mm512_set1_ps(1.f / scale);
      // Round to nearest, half to even (the default MXCSR mode), |q| <= 127, narrow to bytes.
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      corr[m * groups + g] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + m * k + g * kGroup), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + m * k + g * kGroup + 16), _mm512_cvtsepi32_epi8(qhi));
    }
  }
}

// Rows [0, MR) x tiles [0, NT) of the quad-layout weight w.
template <int NT, int MR>
void tile_kernel(const int8_t* xq, int64_t k, const float* sx, const int32_t* corr, int64_t groups, const uint8_t* w,
                 int64_t tile_stride, const float* wscale, at::BFloat16* out, int64_t ldo, int64_t n0, int64_t n) {
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i iacc[MR][NT];
    for (int m = 0; m < MR; ++m) {
      const __m512i start = _mm512_set1_epi32(corr[m * groups + g]);
      for (int t = 0; t < NT; ++t) iacc[m][t] = start;
    }
    for (int64_t kq = g * (kGroup / 4); kq < (g + 1) * (kGroup / 4); ++kq) {
      __m512i wv[NT];
      for (int t = 0; t < NT; ++t) {
        const uint8_t* line = w + t * tile_stride + kq * 64;
        _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetch * 64), _MM_HINT_T0);
        wv[t] = _mm512_loadu_si512(line);
      }
      for (int m = 0; m < MR; ++m) {
        const __m512i a = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xq + m * k + kq * 4));
        for (int t = 0; t < NT; ++t) iacc[m][t] = _mm512_dpbusd_epi32(iacc[m][t], wv[t], a);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 s = _mm512_set1_ps(sx[m * groups + g]);
      for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][t]), s, acc[m][t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t col = n0 + 16 * t;
    if (col >= n) break;
    const __m512 s = _mm512_loadu_ps(wscale + col);
    const __mmask16 mask = n - col >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - col)) - 1);
    for (int m = 0; m < MR; ++m)
      _mm256_mask_storeu_epi16(out + m * ldo + col, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[m][t], s)));
  }
}

using Kernel = void (*)(const int8_t*, int64_t, const float*, const int32_t*, int64_t, const uint8_t*, int64_t,
                        const float*, at::BFloat16*, int64_t, int64_t, int64_t);
// Tiles at once for MR rows: 2 MR NT accumulators (int32 and fp32) and NT weights, of 32 registers.
constexpr int tiles_for(int mr) { return mr <= 1 ? 8 : mr <= 2 ? 4 : mr <= 4 ? 2 : 1; }
template <int... MR>
struct Table {  // index: rows per pass
  static constexpr Kernel wide[] = {nullptr, &tile_kernel<tiles_for(MR), MR>...};
  static constexpr Kernel narrow[] = {nullptr, &tile_kernel<1, MR>...};
  static constexpr int tiles[] = {1, tiles_for(MR)...};
};
using Kernels = Table<1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>;
#endif

// out [M, N] bf16 <- x [M, K] bf16 (rows contiguous, K a multiple of 32) times the quad-layout
// weight q + 128 [ceil(N/16), K/4, 16, 4] uint8, each column times wscale [16 ceil(N/16)] fp32.
void w8a8_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& wscale, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16, "x must be bf16 [M, K], rows contiguous");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 4 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte, "packed must be a contiguous uint8 [N/16, K/4, 16, 4]");
  const int64_t m = x.size(0), k = x.size(1), tiles = packed.size(0);
  TORCH_CHECK(k == 4 * packed.size(1) && k % 32 == 0, "x has ", k, " columns, the packed weight ", 4 * packed.size(1),
              " (a multiple of 32 is needed)");
  TORCH_CHECK(n > 16 * (tiles - 1) && n <= 16 * tiles, "n does not match the packed weight's tiles");
  TORCH_CHECK(wscale.dim() == 1 && wscale.size(0) == 16 * tiles && wscale.is_contiguous() &&
                  wscale.scalar_type() == at::kFloat, "wscale must be a contiguous fp32 [16 * tiles]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.stride(1) == 1 &&
                  out.scalar_type() == at::kBFloat16, "out must be bf16 [M, N], rows contiguous");
#if PDSERVE_INT8_GEMM
  if (m == 0) return;
  const int64_t groups = k / kGroup;
  std::vector<int8_t> xq(m * k);
  std::vector<float> sx(m * groups);
  std::vector<int32_t> corr(m * groups);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  int8_t* xqp = xq.data();
  float* sxp = sx.data();
  int32_t* cp = corr.data();
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / k), [&](int64_t r0, int64_t r1) {
    quantize_groups(xp, x.stride(0), k, xqp, sxp, cp, r0, r1);
  });
  const int64_t passes = (m + kMaxRows - 1) / kMaxRows;
  const int64_t per_pass = (m + passes - 1) / passes;
  const int64_t ngroups = (tiles + kGroupTiles - 1) / kGroupTiles;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = wscale.data_ptr<float>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t ldo = out.stride(0), tile_stride = k * 16;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / (tile_stride * kGroupTiles));
  at::parallel_for(0, ngroups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t t0 = g * kGroupTiles, count = std::min<int64_t>(kGroupTiles, tiles - t0);
      for (int64_t r0 = 0; r0 < m; r0 += per_pass) {
        const int rows = static_cast<int>(std::min<int64_t>(per_pass, m - r0));
        const int nt = count == kGroupTiles ? Kernels::tiles[rows] : 1;
        const Kernel kernel = nt == 1 ? Kernels::narrow[rows] : Kernels::wide[rows];
        for (int64_t t = t0; t < t0 + count; t += nt)
          kernel(xqp + r0 * k, k, sxp + r0 * groups, cp + r0 * groups, groups, wp + t * tile_stride, tile_stride, sp,
                 op + r0 * ldo, ldo, 16 * t, n);
      }
    }
  });
#else
  TORCH_CHECK(false, "w8a8_gemm needs a build for a CPU with AVX512-BF16 and AVX512-VNNI");
#endif
}

bool available() {
#if PDSERVE_INT8_GEMM
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(pdserve_int8, m) {
  m.def("w8a8_gemm(Tensor(a!) out, Tensor x, Tensor packed, Tensor wscale, int n) -> ()");
  m.def("available() -> bool", &available);
}

TORCH_LIBRARY_IMPL(pdserve_int8, CPU, m) { m.impl("w8a8_gemm", &w8a8_gemm); }
