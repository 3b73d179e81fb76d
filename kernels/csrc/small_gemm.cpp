// bf16 linear layers for decode-sized batches (1-64 rows), y = x W^T, AVX512-BF16; y bf16, or
// those bf16 values as fp32 for the LM head's logits (gemm_output.h).
//
// Why: at 1-64 rows a decode step streams every weight from DRAM once. oneDNN's bf16 kernel
// computes at 300-480 GFLOP/s per core on weights in cache but hardly overlaps that with the
// stream: on weights out of cache its time is close to compute time + transfer time (gate/up of
// SmolLM2-135M at 16 rows, one thread: 142 us hot, 220-240 us cold, 67 us to stream it).
// This kernel reads each weight byte from DRAM exactly once, keeps every row's accumulators in
// registers while it does, and asks for the next block of weights (into L2) while it computes on
// the current one, so transfer and compute overlap.
//
// Layout: the weight [N, K] is packed once at load (kernels/linear.py) into tiles of 16 output
// columns, [N/16][K/2][16][2] (the "VNNI" pair layout vdpbf16ps reads: lane j of one 64-byte line
// holds W[n0 + j, 2k], W[n0 + j, 2k + 1]); N is padded to a multiple of 16 with zero rows, K must be
// even. For each k pair a tile's line is multiplied with the pair x[m, 2k:2k+2] broadcast to all
// lanes, for every row m, into that row's 16 fp32 accumulators (vdpbf16ps: bf16 products summed
// in fp32, as oneDNN does).
//
// Register blocking: a pass takes MR <= 16 rows and NT tiles at once (MR x NT accumulators, 14-24
// for MR >= 3: enough independent chains to hide the instruction's latency at two per cycle; one
// weight line feeds MR instructions, so from 13 rows on a line per 13-16 instructions keeps the
// stream at <= 30 GB/s per core at full compute). Rows beyond 16 take further passes of equal size
// over each unit of NT tiles while it is in L1/L2 (32 rows: two passes of 16).
// Work split: units of NT tiles (output columns), contiguous ranges per thread on torch's
// intra-op threads, so each thread streams its own part of the weight.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "gemm_output.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using pdserve_gemm_out::OutRows;

#if defined(__AVX512BF16__)
constexpr int kMaxRows = 16;   // rows per pass (more rows: passes of equal size)
#ifndef PDSERVE_GEMM_PREFETCH
#define PDSERVE_GEMM_PREFETCH 16
#endif
constexpr int64_t kPrefetch = PDSERVE_GEMM_PREFETCH;   // lines ahead within a stream, into L1
#ifndef PDSERVE_GEMM_L2_ROWS
#define PDSERVE_GEMM_L2_ROWS 5
#endif
constexpr int kL2PrefetchRows = PDSERVE_GEMM_L2_ROWS;   // from these rows on, the next unit into L2

// Rows [0, MR) x tiles [0, NT): out[m, n0 + 16 t + j] = sum_k x[m, k] W[n0 + 16 t + j, k].
// xq: the pass's rows as k pairs, [k2][ldq] int32 (pair kk of row m at xq[kk * ldq + m]): one
// pointer and immediate offsets, so each broadcast folds into its vdpbf16ps (16 row pointers
// spilled out of the general registers). next: the weight of the unit after this one (prefetched
// into L2 at the pace this one is read), or nullptr (a later pass over a unit already in cache).
template <int NT, int MR>
void tile_kernel(const int32_t* xq, int64_t ldq, const at::BFloat16* w, int64_t tile_stride, int64_t k2,
                 const OutRows& out, int64_t n0, int64_t n, const at::BFloat16* next) {
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k2; ++kk) {
    __m512bh wv[NT];
    for (int t = 0; t < NT; ++t) {
      if (next != nullptr) {
        // The next lines of each tile stream into L1, and the next unit's lines into L2 one unit
        // ahead: the hardware prefetcher alone left cold weights at half the bandwidth, and a
        // few lines ahead were too few to cover DRAM latency once compute slows the stream.
        _mm_prefetch(reinterpret_cast<const char*>(w + t * tile_stride + (kk + kPrefetch) * 32), _MM_HINT_T0);
        if (MR >= kL2PrefetchRows)
          _mm_prefetch(reinterpret_cast<const char*>(next + t * tile_stride + kk * 32), _MM_HINT_T1);
      }
      wv[t] = (__m512bh)_mm512_loadu_si512(w + t * tile_stride + kk * 32);
    }
    const int32_t* xk = xq + kk * ldq;
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xk[m]);
      for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], xb, wv[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t col = n0 + 16 * t;
    if (col >= n) break;
    const __mmask16 mask = pdserve_gemm_out::columns_mask(n - col);
    for (int m = 0; m < MR; ++m) out.store(m, col, mask, acc[m][t]);
  }
}

using Kernel = void (*)(const int32_t*, int64_t, const at::BFloat16*, int64_t, int64_t, const OutRows&, int64_t,
                        int64_t, const at::BFloat16*);

// Tiles taken at once for MR rows: MR x NT accumulators (<= 24) plus NT weight registers (of 32).
constexpr int tiles_for(int mr) { return mr <= 2 ? 8 : mr <= 4 ? 4 : mr <= 6 ? 4 : mr <= 12 ? 2 : 1; }

// tile_kernel<NT, MR> for NT in {1, 2, 4, 8} (index 0-3) and MR in 1-16, where NT <= tiles_for(MR)
// (nullptr elsewhere): every pass of a call uses the unit's NT, and its rows are at most the first
// pass's, whose tiles_for is NT or more.
template <int NT, int MR>
constexpr Kernel pick() {
  if constexpr (tiles_for(MR) >= NT) return &tile_kernel<NT, MR>; else return nullptr;
}
template <int NT, int... R>
constexpr std::array<Kernel, kMaxRows + 1> rows_of(std::integer_sequence<int, R...>) {
  return {nullptr, pick<NT, R + 1>()...};
}
using Rows = std::make_integer_sequence<int, kMaxRows>;
constexpr std::array<Kernel, kMaxRows + 1> kKernels[4] = {rows_of<1>(Rows{}), rows_of<2>(Rows{}), rows_of<4>(Rows{}),
                                                          rows_of<8>(Rows{})};
constexpr int nt_index(int nt) { return nt == 1 ? 0 : nt == 2 ? 1 : nt == 4 ? 2 : 3; }
#endif

// out [M, N] bf16, or fp32 holding the same bf16 values (gemm_output.h: the LM head's logits) <-
// x [M, K] bf16 (rows contiguous) times the packed weight [ceil(N/16), K/2, 16, 2].
void small_gemm_bf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16, "x must be bf16 [M, K], rows contiguous");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16, "packed must be a contiguous bf16 [N/16, K/2, 16, 2]");
  const int64_t m = x.size(0), k = x.size(1), tiles = packed.size(0), k2 = packed.size(1);
  TORCH_CHECK(k == 2 * k2, "x has ", k, " columns, the packed weight ", 2 * k2);
  TORCH_CHECK(n > 16 * (tiles - 1) && n <= 16 * tiles, "n does not match the packed weight's tiles");
  const OutRows rows_out = pdserve_gemm_out::out_rows(out);
  TORCH_CHECK(out.size(0) == m && out.size(1) == n, "out must be [M, N] = [", m, ", ", n, "], got ", out.sizes());
#if defined(__AVX512BF16__)
  if (m == 0) return;
  const int64_t passes = (m + kMaxRows - 1) / kMaxRows;
  const int64_t per_pass = (m + passes - 1) / passes;   // 20 rows: two passes of 10, not 16 + 4
  // Fewer tiles at once where wide units would split unevenly over the threads (576 columns =
  // 36 tiles at 8 a unit: 5 units, 3 + 2 on two threads); any NT below tiles_for(rows) is valid.
  int nt = tiles_for(static_cast<int>(per_pass));
  const int64_t threads = at::get_num_threads();
  while (nt > 1 && threads > 1 && (tiles + nt - 1) / nt < 4 * threads) nt /= 2;
  const int64_t units = (tiles + nt - 1) / nt;
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  const int64_t tile_stride = k2 * 32;
  // x as k pairs per pass, [passes][k2][per_pass] (a copy of M x K bf16: a few KB).
  std::vector<int32_t> xq_buf(passes * k2 * per_pass);
  for (int64_t r = 0; r < m; ++r) {
    const int32_t* row = reinterpret_cast<const int32_t*>(x.data_ptr<at::BFloat16>() + r * x.stride(0));
    int32_t* dst = xq_buf.data() + (r / per_pass) * k2 * per_pass + r % per_pass;
    for (int64_t kk = 0; kk < k2; ++kk) dst[kk * per_pass] = row[kk];
  }
  const int32_t* xq = xq_buf.data();
  // Threads only with enough weight for each (a hand-off costs more than a 100 KB matmul).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (tile_stride * 2 * nt));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t t0 = u * nt;
      const int64_t count = std::min<int64_t>(nt, tiles - t0);
      const at::BFloat16* next = u + 1 < u1 ? wp + (t0 + nt) * tile_stride : nullptr;
      for (int64_t r0 = 0, p = 0; r0 < m; r0 += per_pass, ++p) {
        const int rows = static_cast<int>(std::min<int64_t>(per_pass, m - r0));
        const int32_t* xr = xq + p * k2 * per_pass;
        const OutRows orow = rows_out.from_row(r0);
        const at::BFloat16* pf = r0 == 0 ? next : nullptr;   // later passes read the unit from cache
        if (count == nt) {
          kKernels[nt_index(nt)][rows](xr, per_pass, wp + t0 * tile_stride, tile_stride, k2, orow, 16 * t0, n, pf);
        } else {   // the last, partial unit: one tile at a time
          for (int64_t t = t0; t < t0 + count; ++t)
            kKernels[0][rows](xr, per_pass, wp + t * tile_stride, tile_stride, k2, orow, 16 * t, n, nullptr);
        }
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
