// bf16 linear layers for decode-sized batches (M <= 16 rows per pass), y = x W^T, AVX512-BF16.
//
// Why: at 1-32 rows a decode step streams every weight from DRAM once. oneDNN's bf16 kernel
// computes at 300-420 GFLOP/s on weights in cache but hardly overlaps that with the stream:
// on weights out of cache its time is close to compute time + transfer time (gate/up of
// SmolLM2-135M at 16 rows, one thread: 142 us hot, 241 us cold, 124 us to stream it at one row).
// This kernel reads each weight byte exactly once, in address order (the hardware prefetcher
// follows it), and keeps every row's accumulators in registers while it does.
//
// Layout: the weight [N, K] is packed once at load (kernels/linear.py) into tiles of 16 output
// columns, [N/16][K/2][16][2] (the "VNNI" pair layout vdpbf16ps reads: lane j of one 64-byte line
// holds W[n0 + j, 2k], W[n0 + j, 2k + 1]); N is padded to a multiple of 16 with zero rows, K must be
// even. For each k pair a tile's line is multiplied with the pair x[m, 2k:2k+2] broadcast to all
// lanes, for every row m, into that row's 16 fp32 accumulators (vdpbf16ps: bf16 products summed
// in fp32, as oneDNN does). Small M takes several tiles at once (NT tiles x MR rows <= 16-24
// accumulators) so that enough independent chains hide the instruction's latency.
// Tiles are split over torch's intra-op threads; rows beyond 16 take further passes over each
// group of tiles while it is in L1/L2.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)
constexpr int kMaxRows = 12;   // rows per pass (more rows: passes of equal size)
#ifndef PDSERVE_GEMM_PREFETCH
#define PDSERVE_GEMM_PREFETCH 16
#endif
constexpr int64_t kPrefetch = PDSERVE_GEMM_PREFETCH;

// Rows [0, MR) x tiles [0, NT): out[m, n0 + 16 t + j] = sum_k x[m, k] W[n0 + 16 t + j, k].
template <int NT, int MR>
void tile_kernel(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t tile_stride, int64_t k2,
                 at::BFloat16* out, int64_t ldo, int64_t n0, int64_t n) {
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  const int32_t* xp[MR];
  for (int m = 0; m < MR; ++m) xp[m] = reinterpret_cast<const int32_t*>(x + m * ldx);
  for (int64_t kk = 0; kk < k2; ++kk) {
    __m512bh wv[NT];
    for (int t = 0; t < NT; ++t) {
      // The next lines of each tile stream, kPrefetch lines ahead (the hardware prefetcher alone
      // left cold weights at half the bandwidth).
      _mm_prefetch(reinterpret_cast<const char*>(w + t * tile_stride + (kk + kPrefetch) * 32), _MM_HINT_T0);
      wv[t] = (__m512bh)_mm512_loadu_si512(w + t * tile_stride + kk * 32);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[m][kk]);
      for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], xb, wv[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t col = n0 + 16 * t;
    if (col >= n) break;
    const __mmask16 mask = n - col >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - col)) - 1);
    for (int m = 0; m < MR; ++m)
      _mm256_mask_storeu_epi16(out + m * ldo + col, mask, (__m256i)_mm512_cvtneps_pbh(acc[m][t]));
  }
}

using Kernel = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, int64_t, at::BFloat16*,
                        int64_t, int64_t, int64_t);

// Tiles taken at once for MR rows: 16-24 accumulators and NT weight registers (of 32), so each
// broadcast x pair feeds NT instructions and each weight line MR.
constexpr int tiles_for(int mr) { return mr <= 2 ? 8 : mr <= 4 ? 4 : mr <= 12 ? 2 : 1; }
constexpr int kGroupTiles = 8;   // tiles per work item: every tiles_for divides it

template <int MR>
constexpr Kernel wide() { return &tile_kernel<tiles_for(MR), MR>; }
template <int MR>
constexpr Kernel narrow() { return &tile_kernel<1, MR>; }

constexpr Kernel kWide[kMaxRows + 1] = {nullptr, wide<1>(), wide<2>(), wide<3>(), wide<4>(), wide<5>(), wide<6>(),
                                        wide<7>(), wide<8>(), wide<9>(), wide<10>(), wide<11>(), wide<12>()};
constexpr Kernel kNarrow[kMaxRows + 1] = {nullptr, narrow<1>(), narrow<2>(), narrow<3>(), narrow<4>(), narrow<5>(),
                                          narrow<6>(), narrow<7>(), narrow<8>(), narrow<9>(), narrow<10>(),
                                          narrow<11>(), narrow<12>()};
constexpr int kTiles[kMaxRows + 1] = {1, tiles_for(1), tiles_for(2), tiles_for(3), tiles_for(4), tiles_for(5),
                                      tiles_for(6), tiles_for(7), tiles_for(8), tiles_for(9), tiles_for(10),
                                      tiles_for(11), tiles_for(12)};
#endif

// out [M, N] bf16 <- x [M, K] bf16 (rows contiguous) times the packed weight [ceil(N/16), K/2, 16, 2].
void small_gemm_bf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16, "x must be bf16 [M, K], rows contiguous");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16, "packed must be a contiguous bf16 [N/16, K/2, 16, 2]");
  const int64_t m = x.size(0), k = x.size(1), tiles = packed.size(0), k2 = packed.size(1);
  TORCH_CHECK(k == 2 * k2, "x has ", k, " columns, the packed weight ", 2 * k2);
  TORCH_CHECK(n > 16 * (tiles - 1) && n <= 16 * tiles, "n does not match the packed weight's tiles");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.stride(1) == 1 &&
                  out.scalar_type() == at::kBFloat16, "out must be bf16 [M, N], rows contiguous");
#if defined(__AVX512BF16__)
  if (m == 0) return;
  const int64_t passes = (m + kMaxRows - 1) / kMaxRows;
  const int64_t per_pass = (m + passes - 1) / passes;   // 16 rows: two passes of 8, not 12 + 4
  const int64_t groups = (tiles + kGroupTiles - 1) / kGroupTiles;
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0), tile_stride = k2 * 32;
  // Threads only with enough weight for each (a hand-off costs more than a 100 KB matmul).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (tile_stride * 2 * kGroupTiles));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t t0 = g * kGroupTiles;
      const int64_t count = std::min<int64_t>(kGroupTiles, tiles - t0);
      // Each pass of rows over the group's tiles; after the first they are in L1/L2.
      for (int64_t r0 = 0; r0 < m; r0 += per_pass) {
        const int rows = static_cast<int>(std::min<int64_t>(per_pass, m - r0));
        const at::BFloat16* xr = xp + r0 * ldx;
        at::BFloat16* orow = op + r0 * ldo;
        const int nt = count == kGroupTiles ? kTiles[rows] : 1;   // the last, partial group: one tile at a time
        const Kernel kernel = nt == 1 ? kNarrow[rows] : kWide[rows];
        for (int64_t t = t0; t < t0 + count; t += nt)
          kernel(xr, ldx, wp + t * tile_stride, tile_stride, k2, orow, ldo, 16 * t, n);
      }
    }
  });
#else
  TORCH_CHECK(false, "small_gemm_bf16 needs a build for a CPU with AVX512-BF16");
#endif
}

bool small_gemm_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(pdserve_gemm, m) {
  m.def("small_gemm_bf16(Tensor(a!) out, Tensor x, Tensor packed, int n) -> ()");
  m.def("available() -> bool", &small_gemm_available);
}

TORCH_LIBRARY_IMPL(pdserve_gemm, CPU, m) { m.impl("small_gemm_bf16", &small_gemm_bf16); }
