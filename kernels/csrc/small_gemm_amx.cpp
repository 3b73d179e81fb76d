// bf16 linear layers for decode-sized batches (5-128 rows), y = x W^T, on AMX tiles.
//
// Why: on a CPU with AMX-BF16 (Sapphire Rapids and later) one TDPBF16PS multiplies a 16 x 32 tile
// of activations by a 32 x 16 tile of weights (16K multiply-adds) in about 16 cycles, 16x the
// rate of AVX512-BF16's vdpbf16ps per instruction. At 16 rows small_gemm.cpp's vdpbf16ps loop is
// compute-bound (gate/up of SmolLM2-135M, weights cold, 2 threads: 302 us, about 190 GFLOP/s) and
// oneDNN's AMX kernel does not overlap its compute with the weight stream (200 us); this kernel
// streams each weight byte from DRAM once with a later unit prefetched into L2 while the tiles
// compute on the current one (118-141 us). At 1-4 rows small_gemm stays faster
// (its stream is prefetched into L1; a tile load waits for its whole kilobyte).
//
// Layout: the weight packed for small_gemm.cpp, [ceil(N/16)][K/2][16][2] bf16, is already AMX's
// B layout: the 16 k pairs [16 b, 16 b + 16) of one 16-column tile are 16 consecutive 64-byte
// lines, one B tile (rows = k pairs, 64 bytes = 16 columns x 2). A tile of activations is up to
// 16 rows of 32 consecutive bf16 of x (64 bytes; row stride = x's). K must be a multiple of 32.
//
// Blocking: a unit is NT = 4 column tiles (64 output columns); tiles 0-3 accumulate its 16 x 64
// fp32 sums, tile 4 holds the activations, tiles 5-7 the weights. Rows beyond 16 take further
// passes of equal size (rows padded with zeros to a multiple of the pass) over the unit while its
// weights are in L1/L2; the tile shapes are configured once per thread per call.
// Work split: units in contiguous ranges per thread on torch's intra-op threads (as small_gemm).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define PDSERVE_AMX 1
#include <immintrin.h>
#endif

#include "amx_tiles.h"
#include "gemm_output.h"

namespace {

#if defined(PDSERVE_AMX)
constexpr int kMaxRows = 16;   // an A / C tile's rows
constexpr int kNT = 4;         // column tiles per unit: C tiles 0-3
// Units ahead that the L2 prefetch reads: 2 ran the LM head (49152 x 576, 16 rows, 2 threads, cold)
// in 1.65-1.8 ms against 1.9 ms at 1 and 3, down in 62-90 us against 88 at 1.
constexpr int64_t kPrefetchUnits = 2;

using pdserve_amx::amx_permitted;
using pdserve_amx::TileConfig;

// C tiles 0-3 and the A tile 4: `rows` rows of 64 bytes; B tiles 5-7: 16 k pairs of 64 bytes.
void configure_tiles(int rows) {
  TileConfig c;
  for (int t = 0; t <= 4; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = 64;
  }
  for (int t = 5; t <= 7; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  pdserve_amx::load_tile_config(c);
}

// One pass of `rows` rows over one unit of NT column tiles: out[r, col0 + j] for j < 16 NT
// (clipped at n). x: the pass's first row, row stride ldx (elements); w: the unit's first tile;
// next: a unit after this one, prefetched into L2 at the pace this one is read (nullptr: none,
// or a later pass reading this unit from cache). scratch: 16 x 64 fp32.
template <int NT>
void unit_pass(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t tile_stride, int64_t kblocks,
               const at::BFloat16* next, float* scratch, const pdserve_gemm_out::OutRows& out, int64_t col0, int64_t n,
               int rows) {
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (NT > 2) _tile_zero(2);
  if constexpr (NT > 3) _tile_zero(3);
  for (int64_t b = 0; b < kblocks; ++b) {
    const at::BFloat16* wb = w + b * 512;   // 16 k pairs x 16 columns x 2
    if (next != nullptr) {
      for (int t = 0; t < NT; ++t)
        for (int line = 0; line < 16; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(next + t * tile_stride + b * 512 + line * 32), _MM_HINT_T1);
    }
    _tile_loadd(4, x + b * 32, ldx * 2);
    // (three B registers in turn: a load into one overlaps the multiply reading another)
    _tile_loadd(5, wb, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NT > 1) {
      _tile_loadd(6, wb + tile_stride, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NT > 2) {
      _tile_loadd(7, wb + 2 * tile_stride, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (NT > 3) {
      _tile_loadd(5, wb + 3 * tile_stride, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, scratch, 64 * 4);
  if constexpr (NT > 1) _tile_stored(1, scratch + 16, 64 * 4);
  if constexpr (NT > 2) _tile_stored(2, scratch + 32, 64 * 4);
  if constexpr (NT > 3) _tile_stored(3, scratch + 48, 64 * 4);
  const int64_t cols = std::min<int64_t>(16 * NT, n - col0);
  for (int r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; c += 16) {
      out.store(r, col0 + c, pdserve_gemm_out::columns_mask(cols - c), _mm512_loadu_ps(scratch + r * 64 + c));
    }
  }
}

using UnitPass = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, int64_t, const at::BFloat16*,
                          float*, const pdserve_gemm_out::OutRows&, int64_t, int64_t, int);
constexpr UnitPass kUnitPass[kNT + 1] = {nullptr, &unit_pass<1>, &unit_pass<2>, &unit_pass<3>, &unit_pass<4>};
#endif

// out [M, N] bf16 <- x [M, K] bf16 (rows contiguous) times the packed weight [ceil(N/16), K/2, 16, 2]
// (kernels/linear.py pack_small_gemm). K % 32 == 0. An fp32 out takes the same bf16 values widened
// (the LM head's logits in one pass: gemm_output.h). Errors: a shape or dtype that does not match,
// a build without AMX, or an OS that refuses the process AMX state (RuntimeError, the reason).
void small_gemm_bf16_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "x must be bf16 [M, K], rows contiguous");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16, "packed must be a contiguous bf16 [N/16, K/2, 16, 2]");
  const int64_t m = x.size(0), k = x.size(1), tiles = packed.size(0), k2 = packed.size(1);
  TORCH_CHECK(k == 2 * k2, "x has ", k, " columns, the packed weight ", 2 * k2);
  TORCH_CHECK(k % 32 == 0, "the AMX kernel needs K a multiple of 32, got K = ", k);
  TORCH_CHECK(n > 16 * (tiles - 1) && n <= 16 * tiles, "n does not match the packed weight's tiles");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n, "out must be [M, N]");
  const pdserve_gemm_out::OutRows rows_out = pdserve_gemm_out::out_rows(out);
#if defined(PDSERVE_AMX)
  TORCH_CHECK(amx_permitted(), "the OS refused this process AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)");
  if (m == 0) return;
  const int64_t passes = (m + kMaxRows - 1) / kMaxRows;
  const int64_t per_pass = (m + passes - 1) / passes;   // 20 rows: two passes of 10, not 16 + 4
  // Ragged rows (m not a multiple of the pass): x copied into a zero-padded buffer, so that every
  // pass has the one tile shape configured (the padded rows' sums are computed and not stored).
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  int64_t ldx = x.stride(0);
  std::vector<at::BFloat16> padded;
  if (passes * per_pass != m) {
    padded.assign(passes * per_pass * k, at::BFloat16(0.0f));
    for (int64_t r = 0; r < m; ++r) std::memcpy(padded.data() + r * k, xp + r * ldx, k * sizeof(at::BFloat16));
    xp = padded.data();
    ldx = k;
  }
  const int64_t units = (tiles + kNT - 1) / kNT, tile_stride = k2 * 32, kblocks = k / 32;
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  // Threads only with enough weight for each (a hand-off costs more than a 100 KB matmul).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (tile_stride * 2 * kNT));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    alignas(64) float scratch[kMaxRows * 16 * kNT];
    configure_tiles(static_cast<int>(per_pass));
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t t0 = u * kNT;
      const int count = static_cast<int>(std::min<int64_t>(kNT, tiles - t0));
      const at::BFloat16* w = wp + t0 * tile_stride;
      // the unit kPrefetchUnits ahead (or the range's last) streams into L2 while this one computes
      const at::BFloat16* next = u + kPrefetchUnits < u1 ? w + kPrefetchUnits * kNT * tile_stride
                                 : u + 1 < u1          ? wp + (u1 - 1) * kNT * tile_stride
                                                       : nullptr;
      for (int64_t r0 = 0; r0 < m; r0 += per_pass) {
        const int rows = static_cast<int>(std::min<int64_t>(per_pass, m - r0));
        kUnitPass[count](xp + r0 * ldx, ldx, w, tile_stride, kblocks, r0 == 0 ? next : nullptr, scratch,
                         rows_out.from_row(r0), 16 * t0, n, rows);
      }
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "small_gemm_bf16_amx needs a build for a CPU with AMX-BF16");
#endif
}

// Whether this build has the kernel and the OS grants this process AMX state.
bool amx_available() {
#if defined(PDSERVE_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(pdserve_amx, m) {
  m.def("small_gemm_bf16_amx(Tensor(a!) out, Tensor x, Tensor packed, int n) -> ()");
  m.def("available() -> bool", &amx_available);
}

TORCH_LIBRARY_IMPL(pdserve_amx, CPU, m) { m.impl("small_gemm_bf16_amx", &small_gemm_bf16_amx); }
