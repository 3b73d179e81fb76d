// INT8 linear layers from 5 rows on AMX tiles (kernels/linear.py's Int8Linear, kernel
// "w8a8_amx"): the product of int8_gemm.cpp's w8a8_gemm, from the same packed weight, with the same
// activation quantization (int8_activations.h, quantize_block's values), bit for bit:
//
//   out[m, n] = wscale[n] * sum_g sx[m, g] * sum_{k in g} xq[m, k] q[n, k]
//
// Why: on a CPU with AMX-INT8 (Sapphire Rapids and later) one TDPBSUD multiplies a 16 x 64 tile of
// int8 activations by a 64 x 16 tile of weights (16K multiply-adds) in about 16 cycles, where
// w8a8_gemm's vpdpbusd loop makes 16 rows compute-bound. At 1-4 rows w8a8_gemm stays the kernel
// (its weight stream is prefetched into L1; a tile load waits for its whole kilobyte).
//
// Layout: the packed weight of w8a8_gemm, q + 128 as bytes [N/16][K/4][16][4], is AMX's B layout
// for 8-bit products: the quads k = 4i..4i+3 of 16 columns are one 64-byte line, a B tile is
// kstep/4 such lines. TDPBSUD multiplies signed A bytes (xq) by unsigned B bytes (q + 128); the
// offset is cancelled exactly in each group's int32 sum by the quantizer's corr (-128 sum xq), as
// in w8a8_gemm. The activations are quantized 4 rows at a time by quantize_block, written straight
// into rows (an A tile is up to 16 rows of kstep consecutive bytes), on every thread from 64 rows.
//
// Decode-sized calls (5-31 rows, and groups at any count): a unit is NT = 4 column tiles; C tiles
// 0-3 hold one group's int32 sums for 16 x 64 outputs, tile 4 the activations, tiles 5-7 the
// weights. kstep = 64 bytes of k (one tile's depth) where the group is a multiple of 64, else 32.
// After each group the C tiles are stored to an L1 block, offset by corr, converted and
// accumulated into fp32 sums (an fma by sx, as w8a8_gemm), so the epilogue per group costs about
// as much as the tile products: groups of 64 and wider (engine/quantization/apply.py's
// INT8_ACT_GROUPS) keep it small. With one group (one scale per token) the sums go straight to
// the output, as large_block's do (the same bits: fma(x, sx, 0) then wscale), with no fp32 block to
// zero, load and store: the 91 such calls of the rotated model's 16-row decode step (qkv, o,
// gate/up, LM head; context 128, Emerald Rapids, torch.profiler self time, least of 5 x 10 steps)
// 2.85-3.34 -> 2.50-2.65 ms; hot 16-row calls, 2 threads: 576 x 960 19 -> 15 us. Rows beyond 16
// take passes of equal size over each unit while it is in cache; the next units stream into L2
// meanwhile.
//
// One scale per token from 32 rows (a prefill, a 32-row decode): large_gemm's 32 x 32 blocks, two
// A and two B tiles feeding four products, the weight panel in L1 across every row block. At 512
// rows, 2 threads, Emerald Rapids (2026-12-07): o_proj 349 -> 95 us, qkv 426 -> 131, gate_up 816
// -> 404 (1.45x faster than bf16 through oneDNN's AMX kernel there, 544); a 512-token prefill of
// the INT8 model 78.6 -> 76.7 ms (its AMX calls 290 -> 239 us on average), the 32-row decode step
// 1.12-1.19x -> 1.23x bf16's. The quantizer in rows (before: quantize_row into the quad layout,
// then copied into rows, one thread): a 16 x 1536 call in groups of 32 13.8 -> 6.9 us on one tile.
// MX activations (group kMxGroup, int8_activations.h quantize_row_mx: the rows hold the hi digits
// and then the lo digits, 2 K bytes, with sx and sx / 128): two "groups" of K, each over the whole
// weight (unit_pass reads the weight lines again for the lo digits, from L2, and asks the next unit
// into L2 during the hi digits only), so a unit's sums leave the tiles twice, not once per group of
// 32. down_proj at 16 rows, hot, 2 threads (Emerald Rapids, 2026-12-07, a busy host): 37 us against
// 49 for groups of 32 on w8a8_vnni; at 512 rows 878 against 1,046 on w8a8_vnni_large.
// Measured and not kept (2026-12-07): groups of 32 on one column tile at a time with the fp32 sums
// in registers and the two C-tile sets of the branch below (a tile product per A and B load): at
// 16 rows 55 against 49 us for w8a8_vnni, at 512 rows 1,267 against 1,072 for w8a8_vnni_large: the
// tile loads and the per-group store, not the vector epilogue, bound it.
// Measured and not kept (branch old/int8-amx-grouped-s36): groups at 16 rows with the epilogue of
// one group overlapping the next group's products (two sets of C tiles: down_proj hot 40 -> 33
// us, the decode step unchanged), 3-tile units where they split 2 threads more evenly (noise).
// Nor (2026-12-07, Emerald Rapids, 2 threads): each thread an equal range of tiles rather than of
// whole units (o_proj's 36 tiles split 20 / 16 -> 18 / 18, qkv's 60 32 / 28 -> 30 / 30): the
// linears alone, cold, unchanged (o_proj 0.56-0.64 -> 0.56-0.59 ms, qkv 0.70-0.81 -> 0.68-0.74,
// bench quant, 3 A/B runs): they are memory-bound, and the thread with fewer tiles leaves the other
// the whole bandwidth. Nor a decode call's quantization shared by the threads of the product's
// region (4-row blocks claimed off a counter, then a wait for all): the 16-row step's median
// 6.22-6.48 -> 6.37-6.54 ms (6 A/B pairs of processes, each model alone), though the quantization
// is ~0.25 ms of it (skipped outright, a timing hack: 6.42-6.60 -> 6.05-6.36): the rows then cross
// between the cores' caches twice (x to a quantizing thread, its rows back), where the calling
// thread reads x from its own. Nor (2026-12-07) the calling thread quantizing inside the region
// while the other threads ask the first MiB of their weight range into L2 (they otherwise spin):
// the 16-row step (int8, both this kernel and w8a8_gemm for down_proj) 8.18 -> 8.28 ms, median of
// 8 rounds of 60 steps, A/B in one process: the quantization is a few us a call, too short a
// window for the prefetches to matter.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "gemm_output.h"
#include "int8_activations.h"
#include "kv_slots.h"
#include "rope.h"
#include "silu_mul.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define PDSERVE_AMX_INT8 1
#include <immintrin.h>
#include <omp.h>
#endif

namespace {

#if defined(PDSERVE_AMX_INT8)
constexpr int kMaxRows = 16;   // an A / C tile's rows
constexpr int kNT = 4;         // column tiles per unit: C tiles 0-3
constexpr int64_t kPrefetchUnits = 2;   // as small_gemm_amx.cpp (measured there)

// The unit to stream into L2 while unit u of a thread's range [u, u1) computes: the one
// kPrefetchUnits ahead, or the range's last, or none (-1) at the last.
inline int64_t unit_ahead(int64_t u, int64_t u1) {
  return u + kPrefetchUnits < u1 ? u + kPrefetchUnits : u + 1 < u1 ? u1 - 1 : -1;
}

// Unit `ahead` (unit_ahead's) of the units `unit_bytes` apart from base, or nullptr for -1.
inline const uint8_t* unit_at(const uint8_t* base, int64_t ahead, int64_t unit_bytes) {
  return ahead < 0 ? nullptr : base + ahead * unit_bytes;
}

using pdserve_amx::amx_permitted;
using pdserve_amx::TileConfig;

// C tiles 0-3: `rows` rows of 16 int32; the A tile 4: `rows` rows of kstep bytes; B tiles 5-7:
// kstep / 4 lines of 64 bytes.
void configure_tiles(int rows, int kstep) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = 64;
  }
  c.rows[4] = static_cast<uint8_t>(rows);
  c.colsb[4] = static_cast<uint16_t>(kstep);
  for (int t = 5; t <= 7; ++t) {
    c.rows[t] = static_cast<uint8_t>(kstep / 4);
    c.colsb[t] = 64;
  }
  pdserve_amx::load_tile_config(c);
}

// The quantized activations of one call, rows [0, ldq) (rows past M are zeros).
struct Activations {
  const int8_t* xq;    // [ldq][K] int8, row-major
  const float* sx;     // quantize_block's layout per 4 rows: sx[m / 4][g][m % 4] (at(m, g))
  const int32_t* corr;
  int64_t groups, k;
  int64_t kw;          // the weight's K: k, or k / 2 for MX digits (hi | lo, each over the whole weight)
  int64_t at(int64_t m, int64_t g) const { return (m >> 2) * groups * 4 + g * 4 + (m & 3); }
};

// out[r0 + r, col0 + 16 t ..] for r < rows, t < nt (clipped at n) from one group's int32 sums
// (isum: `ld` int32 a row, tile t's columns at 16 t): bf16(fma(float(corr + sum), sx, 0) * wscale),
// w8a8_gemm's arithmetic for one scale per token (unit_pass's and large_block's output).
inline void store_one_group(const Activations& a, const int32_t* isum, int64_t ld, int64_t r0, int rows, int nt,
                            const float* wscale, const pdserve_gemm_out::OutRows& out, int64_t col0, int64_t n) {
  for (int t = 0; t < nt; ++t) {
    const int64_t col = col0 + 16 * t;
    if (col >= n) break;
    const __m512 ws = _mm512_loadu_ps(wscale + col);
    const __mmask16 mask = pdserve_gemm_out::columns_mask(n - col);
    for (int r = 0; r < rows; ++r) {
      const __m512i v = _mm512_add_epi32(_mm512_load_si512(isum + r * ld + 16 * t), _mm512_set1_epi32(a.corr[a.at(r0 + r, 0)]));
      const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(a.sx[a.at(r0 + r, 0)]), _mm512_setzero_ps());
      out.store(r0 + r, col, mask, _mm512_mul_ps(f, ws));
    }
  }
}

// One pass of `rows` rows (from row r0) over one unit of NT column tiles: out[r0 + r, col0 + j]
// for j < 16 NT (clipped at n). w: the unit's first tile (tile_stride bytes apart); next: a unit
// after this one, prefetched into L2 at the pace this one is read (nullptr: none). isum: 16 x 64
// int32, facc: 16 x 64 fp32 (L1 scratch).
template <int NT>
void unit_pass(const Activations& a, int64_t r0, int rows, int64_t group, int64_t kstep, const uint8_t* w,
               int64_t tile_stride, const uint8_t* next, const float* wscale, int32_t* isum, float* facc,
               const pdserve_gemm_out::OutRows& out, int64_t col0, int64_t n) {
  const int8_t* x = a.xq + r0 * a.k;
  const int64_t groups = a.k / group, steps = group / kstep, lines = kstep / 4;
  if (groups > 1) std::memset(facc, 0, sizeof(float) * kMaxRows * 64);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_zero(0);
    if constexpr (NT > 1) _tile_zero(1);
    if constexpr (NT > 2) _tile_zero(2);
    if constexpr (NT > 3) _tile_zero(3);
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t k0 = (g * steps + s) * kstep, kk = k0 < a.kw ? k0 : k0 - a.kw;
      const uint8_t* wk = w + kk * 16;   // line kk / 4 of each tile
      if (next != nullptr && k0 < a.kw) {
        for (int t = 0; t < NT; ++t)
          for (int64_t line = 0; line < lines; ++line)
            _mm_prefetch(reinterpret_cast<const char*>(next + t * tile_stride + k0 * 16 + line * 64), _MM_HINT_T1);
      }
      _tile_loadd(4, x + k0, a.k);
      // (three B registers in turn: a load into one overlaps the multiply reading another)
      _tile_loadd(5, wk, 64);
      _tile_dpbsud(0, 4, 5);
      if constexpr (NT > 1) {
        _tile_loadd(6, wk + tile_stride, 64);
        _tile_dpbsud(1, 4, 6);
      }
      if constexpr (NT > 2) {
        _tile_loadd(7, wk + 2 * tile_stride, 64);
        _tile_dpbsud(2, 4, 7);
      }
      if constexpr (NT > 3) {
        _tile_loadd(5, wk + 3 * tile_stride, 64);
        _tile_dpbsud(3, 4, 5);
      }
    }
    _tile_stored(0, isum, 64 * 4);
    if constexpr (NT > 1) _tile_stored(1, isum + 16, 64 * 4);
    if constexpr (NT > 2) _tile_stored(2, isum + 32, 64 * 4);
    if constexpr (NT > 3) _tile_stored(3, isum + 48, 64 * 4);
    if (groups == 1) {   // one scale per token: straight to the output (no fp32 accumulator pass)
      store_one_group(a, isum, 64, r0, rows, NT, wscale, out, col0, n);
      return;
    }
    for (int r = 0; r < rows; ++r) {   // w8a8_gemm's arithmetic: fma(float(corr + sum), sx, acc)
      const __m512i c = _mm512_set1_epi32(a.corr[a.at(r0 + r, g)]);
      const __m512 s = _mm512_set1_ps(a.sx[a.at(r0 + r, g)]);
      for (int t = 0; t < NT; ++t) {
        const __m512i v = _mm512_add_epi32(_mm512_load_si512(isum + r * 64 + 16 * t), c);
        float* f = facc + r * 64 + 16 * t;
        _mm512_store_ps(f, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s, _mm512_load_ps(f)));
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t col = col0 + 16 * t;
    if (col >= n) break;
    const __m512 s = _mm512_loadu_ps(wscale + col);
    const __mmask16 mask = pdserve_gemm_out::columns_mask(n - col);
    for (int r = 0; r < rows; ++r) out.store(r0 + r, col, mask, _mm512_mul_ps(_mm512_load_ps(facc + r * 64 + 16 * t), s));
  }
}

using UnitPass = void (*)(const Activations&, int64_t, int, int64_t, int64_t, const uint8_t*, int64_t, const uint8_t*,
                          const float*, int32_t*, float*, const pdserve_gemm_out::OutRows&, int64_t, int64_t);
constexpr UnitPass kUnitPass[kNT + 1] = {nullptr, &unit_pass<1>, &unit_pass<2>, &unit_pass<3>, &unit_pass<4>};

// One scale per token and many rows (a prefill): large_gemm. Each thread takes panels of two
// column tiles and runs every 32-row block of activations past its panel while the panel stays
// in L1: per k step two A tiles (rows 0-15, 16-31) and two B tiles feed four TDPBSUDs into C tiles
// 0-3 (a 32 x 32 block of int32 sums, tile 2 i + j: rows 16 i.., columns 16 j..), where unit_pass
// loads a B tile for each product. One epilogue per block: corr added, the fp32 product with sx,
// then wscale, as unit_pass computes them (the same bits). A tiles 4-5, B tiles 6-7.
constexpr int64_t kLargeRows = 32;         // from here on (at 16 rows the passes win: one block, half of it padding)
constexpr int64_t kQuantizeGrain = 16;     // 4-row blocks a thread quantizes (64 rows; fewer stay serial)

void configure_large(int kstep) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  for (int t = 4; t < 6; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = static_cast<uint16_t>(kstep);
  }
  for (int t = 6; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(kstep / 4);
    c.colsb[t] = 64;
  }
  pdserve_amx::load_tile_config(c);
}

// The 32-row block from row r0 times the panel of NT (1 or 2) column tiles at w (tile_stride bytes
// apart), for one scale per token: out[r0 .. min(r0 + 32, m), col0 .. col0 + 16 NT) (clipped at
// n), with unit_pass's arithmetic: bf16(fma(float(corr + sum), sx, 0) * wscale); MX's two groups
// (hi digits, then lo, each over the whole panel) through an fp32 block as unit_pass's groups, the
// same bits. isum: 32 x 32 int32, facc: 32 x 32 fp32. (Groups of 32 this way: measured at 512 rows,
// down_proj took 807 us against 730 for w8a8_vnni_large, and an fp32 accumulator for every call
// cost the one-group shapes 12-27%: one group still stores straight to the output.)
template <int NT>
void large_block(const Activations& a, int64_t r0, int64_t m, int64_t kstep, const uint8_t* w, int64_t tile_stride,
                 const float* wscale, int32_t* isum, float* facc, const pdserve_gemm_out::OutRows& out, int64_t col0,
                 int64_t n) {
  const int8_t* x = a.xq + r0 * a.k;
  const int rows = static_cast<int>(std::min<int64_t>(32, m - r0));
  const int64_t group = a.k / a.groups;
  for (int64_t g = 0; g < a.groups; ++g) {
    _tile_zero(0);
    _tile_zero(2);
    if constexpr (NT > 1) {
      _tile_zero(1);
      _tile_zero(3);
    }
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += kstep) {
      const int64_t kk = k0 < a.kw ? k0 : k0 - a.kw;   // (MX: the lo digits reread the panel, from L1)
      _tile_loadd(4, x + k0, a.k);
      _tile_loadd(5, x + 16 * a.k + k0, a.k);
      _tile_loadd(6, w + kk * 16, 64);
      _tile_dpbsud(0, 4, 6);
      _tile_dpbsud(2, 5, 6);
      if constexpr (NT > 1) {
        _tile_loadd(7, w + tile_stride + kk * 16, 64);
        _tile_dpbsud(1, 4, 7);
        _tile_dpbsud(3, 5, 7);
      }
    }
    _tile_stored(0, isum, 32 * 4);
    _tile_stored(2, isum + 16 * 32, 32 * 4);
    if constexpr (NT > 1) {
      _tile_stored(1, isum + 16, 32 * 4);
      _tile_stored(3, isum + 16 * 32 + 16, 32 * 4);
    }
    if (a.groups == 1) {
      store_one_group(a, isum, 32, r0, rows, NT, wscale, out, col0, n);
      return;
    }
    for (int r = 0; r < rows; ++r) {   // unit_pass's arithmetic: fma(float(corr + sum), sx, acc), from acc = 0
      const __m512i c = _mm512_set1_epi32(a.corr[a.at(r0 + r, g)]);
      const __m512 s = _mm512_set1_ps(a.sx[a.at(r0 + r, g)]);
      for (int t = 0; t < NT; ++t) {
        const __m512i v = _mm512_add_epi32(_mm512_load_si512(isum + r * 32 + 16 * t), c);
        float* f = facc + r * 32 + 16 * t;
        _mm512_store_ps(f, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s, g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(f)));
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t col = col0 + 16 * t;
    if (col >= n) break;
    const __m512 ws = _mm512_loadu_ps(wscale + col);
    const __mmask16 mask = pdserve_gemm_out::columns_mask(n - col);
    for (int r = 0; r < rows; ++r) out.store(r0 + r, col, mask, _mm512_mul_ps(_mm512_load_ps(facc + r * 32 + 16 * t), ws));
  }
}

// out [m, n] from the quantized rows [0, ldq) (ldq a multiple of 32) of one group, or MX's two.
void large_gemm(const Activations& a, int64_t m, int64_t ldq, int64_t kstep, const uint8_t* wp,
                int64_t tiles, const float* wscale, const pdserve_gemm_out::OutRows& out, int64_t n) {
  const int64_t tile_stride = a.kw * 16, panels = (tiles + 1) / 2;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) int32_t isum[32 * 32];
    alignas(64) float facc[32 * 32];
    configure_large(static_cast<int>(kstep));
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* w = wp + 2 * p * tile_stride;
      const bool pair = 2 * p + 1 < tiles;
      for (int64_t r0 = 0; r0 < ldq && r0 < m; r0 += 32)
        (pair ? &large_block<2> : &large_block<1>)(a, r0, m, kstep, w, tile_stride, wscale, isum, facc, out, 32 * p, n);
    }
    _tile_release();
  });
}
#endif

// out [M, N] of the product below from the activation rows x [M, K] bf16 (rows contiguous), or,
// with silu, from x = silu(gate) * up of gate_up [M, 2K] (silu_mul.h's values, computed a block of
// rows at a time just before they are quantized).
at::Tensor gemm(const at::Tensor& x, int64_t k, bool silu, const at::Tensor& packed, const at::Tensor& wscale,
                int64_t n, int64_t group, std::optional<at::ScalarType> out_dtype) {
  const int64_t m = x.size(0), tiles = packed.size(0);
  at::Tensor out = at::empty({m, n}, x.options().dtype(pdserve_gemm_out::out_dtype(out_dtype)));
#if defined(PDSERVE_AMX_INT8)
  TORCH_CHECK(amx_permitted(), "the OS refused this process AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)");
  if (m == 0) return out;
  const bool mx = group == pdserve_int8::kMxGroup;
  if (mx) group = k;   // two "groups": the hi digits over K, then the lo digits over K
  const int64_t ka = mx ? 2 * k : k;   // activation bytes a row
  const int64_t groups = ka / group, kstep = group % 64 == 0 ? 64 : 32;
  const bool large = (groups == 1 || mx) && m >= kLargeRows;
  const int64_t passes = (m + kMaxRows - 1) / kMaxRows;
  const int64_t per_pass = (m + passes - 1) / passes;   // 20 rows: two passes of 10, not 16 + 4
  // rows quantized: the passes' (ragged ones padded), or large_gemm's blocks of 32
  const int64_t ldq = large ? (m + 31) / 32 * 32 : passes * per_pass;
  // quantize_block's values 4 rows at a time, written row-major (AMX's A layout); rows past m are
  // zeros (every pass then has the one tile shape configured; their sums are computed, not stored)
  const int64_t blocks = (ldq + 3) / 4;
  std::vector<int8_t> rows_q(blocks * 4 * ka);
  std::vector<int32_t> corr(blocks * groups * 4);
  std::vector<float> sx(blocks * groups * 4);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const int64_t ldx = x.stride(0);
  // (a prefill's rows on every thread: 512 x 576 take ~25 us on one; with silu, a decode's too:
  // 16 x 1536 SiLU-and-multiply alone took ~9-10 us on 2 threads, more than its quantization)
  at::parallel_for(0, blocks, silu ? 1 : kQuantizeGrain, [&](int64_t b0, int64_t b1) {
    std::vector<at::BFloat16> act(silu ? 4 * k : 0);   // a block's silu(gate) * up rows
    for (int64_t b = b0; b < b1; ++b) {
      const int rows = static_cast<int>(std::clamp<int64_t>(m - 4 * b, 0, 4));
      const at::BFloat16* xb = xp + (rows > 0 ? 4 * b : 0) * ldx;   // the block's rows (ldb apart)
      int64_t ldb = ldx;
      if (silu) {
        for (int r = 0; r < rows; ++r) pdserve_silu::silu_mul_row(xb + r * ldx, xb + r * ldx + k, act.data() + r * k, k);
        xb = act.data();
        ldb = k;
      }
      if (mx) {
        for (int r = 0; r < 4; ++r) {
          int8_t* dst = rows_q.data() + (4 * b + r) * ka;
          float s2[2] = {1.f, 1.f};
          int32_t c2[2] = {0, 0};
          if (r < rows) pdserve_int8::quantize_row_mx(xb + r * ldb, k, dst, dst + k, s2, c2);
          else std::memset(dst, 0, ka);
          for (int g = 0; g < 2; ++g) {
            sx[b * 8 + g * 4 + r] = s2[g];
            corr[b * 8 + g * 4 + r] = c2[g];
          }
        }
        continue;
      }
      const pdserve_int8::QuantizedRows q{nullptr, sx.data() + b * groups * 4, corr.data() + b * groups * 4, 4};
      pdserve_int8::quantize_block(xb, ldb, rows, k, group, q, rows_q.data() + 4 * b * k, k);
    }
  });
  const Activations a{rows_q.data(), sx.data(), corr.data(), groups, ka, k};
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = wscale.data_ptr<float>();
  const pdserve_gemm_out::OutRows op = pdserve_gemm_out::out_rows(out);
  if (large) {
    large_gemm(a, m, ldq, kstep, wp, tiles, sp, op, n);
    return out;
  }
  const int64_t units = (tiles + kNT - 1) / kNT, tile_stride = k * 16;
  // Threads only with 128 KB of weight or more for each (w8a8_gemm's grain).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / (tile_stride * kNT));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    alignas(64) int32_t isum[kMaxRows * 64];
    alignas(64) float facc[kMaxRows * 64];
    configure_tiles(static_cast<int>(per_pass), static_cast<int>(kstep));
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t t0 = u * kNT;
      const int count = static_cast<int>(std::min<int64_t>(kNT, tiles - t0));
      const uint8_t* w = wp + t0 * tile_stride;
      // the unit kPrefetchUnits ahead (or the range's last) streams into L2 while this one computes
      const uint8_t* next = unit_at(wp, unit_ahead(u, u1), kNT * tile_stride);
      for (int64_t r0 = 0; r0 < m; r0 += per_pass) {
        const int rows = static_cast<int>(std::min<int64_t>(per_pass, m - r0));
        kUnitPass[count](a, r0, rows, group, kstep, w, tile_stride, r0 == 0 ? next : nullptr, sp, isum, facc, op,
                         16 * t0, n);
      }
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "w8a8_gemm_amx needs a build for a CPU with AMX-INT8, AVX512-BF16 and AVX512-VNNI");
#endif
  return out;
}

// out [M, N] bf16 = x [M, K] bf16 (rows contiguous, or copied so) times the packed int8 weight
// [N/16, K/4, 16, 4] uint8 (kernels/linear.py pack_int8_gemm) with wscale fp32 [16 * tiles] and
// activation groups of `group` channels (a multiple of 32 dividing K; kMxGroup: MX): w8a8_gemm's
// schema and result (out_dtype float32: the same bf16 values widened, the LM head's logits,
// gemm_output.h). Errors (RuntimeError, the reason): arguments that do not match
// (int8_activations.h), a build without AMX-INT8, an OS that refuses the process AMX state.
at::Tensor w8a8_gemm_amx(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& wscale, int64_t n,
                         int64_t group, std::optional<at::ScalarType> out_dtype) {
  const at::Tensor x = pdserve_int8::checked_input(x_in, packed, wscale, n, group);
  return gemm(x, x.size(1), false, packed, wscale, n, group, out_dtype);
}

// Measured and not kept (2026-12-07, Emerald Rapids, a busy host): the RMSNorm (with its residual
// add) fused the same way into qkv's and gate/up's quantization (rms_norm_w8a8_gemm, the norm's
// rows computed a block at a time, the blocks over the threads): the 16-row step unchanged (ratio of
// medians 1.000, IQR 0.989-1.025 over 60 interleaved pairs of 8-step blocks, in one process). A
// norm is ~4 us of 16 rows on one thread, and splitting it sends the rows across the cores' caches.
// The SiLU below gains more (1.013, IQR 0.998-1.021, same method): its op forked the threads itself.

// w8a8_gemm_amx(silu(gate) * up) for gate_up [M, 2K] bf16 (gate | up, rows contiguous; the fused
// gate/up projection's output), bit for bit what layer_ops.cpp's silu_mul and then w8a8_gemm_amx
// give: down_proj's SiLU-and-multiply done where its rows are quantized (as vLLM fuses
// silu_and_mul with the FP8/INT8 quantization), so a decode step no longer writes and re-reads
// the [M, K] product, nor forks the threads for it (gate_up's rows copied contiguous first if they
// are not, as w8a8_gemm_amx copies x). Errors: w8a8_gemm_amx's, and gate_up not bf16 [M, 2K] for
// the weight's K.
at::Tensor silu_mul_w8a8_gemm_amx(const at::Tensor& gate_up_in, const at::Tensor& packed, const at::Tensor& wscale,
                                  int64_t n, int64_t group, std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(gate_up_in.dim() == 2 && gate_up_in.scalar_type() == at::kBFloat16,
              "gate_up must be bf16 [M, 2K] (gate | up), got ", gate_up_in.scalar_type(), " ", gate_up_in.sizes());
  const at::Tensor gate_up = gate_up_in.stride(1) == 1 ? gate_up_in : gate_up_in.contiguous();
  const int64_t k = gate_up.size(1) / 2;
  if (packed.dim() == 4)   // (check_weight names any other packed shape)
    TORCH_CHECK(gate_up.size(1) == 2 * packed.size(1) * 4, "gate_up has ", gate_up.size(1),
                " columns; the packed weight takes K = ", packed.size(1) * 4, " input channels, so gate_up must be [M, ",
                2 * packed.size(1) * 4, "] (gate | up: the fused gate/up output, not silu(gate) * up)");
  pdserve_int8::check_weight(k, packed, wscale, n, group);
  return gemm(gate_up, k, true, packed, wscale, n, group, out_dtype);
}

// The INT8 MLP of a decode step, down_proj(silu(gate) * up) of x, in one parallel region:
// gate_up's product with its SiLU-and-multiply, down_proj's MX quantization and its product, the
// same bits as w8a8_gemm_amx (gate_up) and then silu_mul_w8a8_gemm_amx (down_proj).
//
// Why: apart, gate_up's threads each write whole column ranges of [M, 2I] (thread 0 the gate
// half, thread 1 the up half), so SiLU-and-multiply and down's quantization, split by rows, read
// half their operands from the other core's cache, and the two ops fork the threads three times.
// Here thread t computes the gate and the up columns of the same channels (units of 64: gate
// tiles 4p..4p+3 with up tiles I/16 + 4p..), so silu(gate) * up of its channels is computed from
// its own L1, and down's MX digits too: the row's amax is the one value the threads exchange (a
// barrier), then each quantizes its channels (mx_digits, the digit sums added after a second
// barrier), and down_proj's units follow in the same region. Only the [M, 2I] int8 digits, which
// down_proj's product reads whole, cross between the cores.
//
// Runs for M <= 16 rows (one tile pass), gate_up at one scale per token, down_proj with MX
// activations and I a multiple of 64; otherwise the two ops, as apart. Emerald Rapids, 2 threads,
// a busy host, 2026-12-07: SmolLM2-135M's MLP at 16 rows, 30 layers' weights in turn, 117 against
// 121 us (hot: 76 against 85); the 16-row decode step 1.6% faster (median of 60 interleaved A/B
// pairs of 8-step blocks in one process, IQR 0-3.9%), 8 rows 1.1%. Per thread (us, cold): gate/up
// and SiLU 54, block maxima 2, barrier 1.3, digits 6, barrier 1.5, down_proj 35 / 29.5 (its 9
// units split 5 / 4). Not kept: down_proj's first unit asked into L2 during the digits and
// barriers (1.000); down_proj's tiles split 18 / 18 between the threads instead of its units
// (the MLP alone 1% faster, the step 0.998, noise).
#if defined(PDSERVE_AMX_INT8)
// The columns of one unit: a run of gate (or up) channels in mlp_region, one head (D = 64) in qkv_region.
constexpr int64_t kUnitColumns = 16 * kNT;

// The scratch of the fused decode ops below: the calling thread's, kept between calls and not
// zeroed (every row a tile reads, rows < M, is written first; zeroed vectors of 98 KB a call cost
// the MLP more than its fusion gained). Read through the pointers it returns: inside a parallel
// region a thread_local's name is each thread's own.
template <typename T, int Slot>
T* scratch(int64_t elements) {
  thread_local std::vector<T> buf;
  if (static_cast<int64_t>(buf.size()) < elements) buf.resize(elements);
  return buf.data();
}

// Thread tid's share [first, end) of n items among `team`, as at::parallel_for splits a range.
inline std::pair<int64_t, int64_t> thread_range(int64_t n, int tid, int team) {
  const int64_t chunk = (n + team - 1) / team, first = std::min(n, tid * chunk);
  return {first, std::min(n, first + chunk)};
}

// x [M <= 16, K] bf16 (rows contiguous) at one scale per token into xq [M][K], sx, corr [16]:
// quantize_block's values, as gemm quantizes them. Returns their Activations.
Activations quantize_per_token(const at::Tensor& x, int8_t* xq, float* sx, int32_t* corr) {
  const int64_t m = x.size(0), k = x.size(1);
  for (int64_t b = 0; b < (m + 3) / 4; ++b) {
    const int rows = static_cast<int>(std::min<int64_t>(m - 4 * b, 4));
    const pdserve_int8::QuantizedRows q{nullptr, sx + 4 * b, corr + 4 * b, 4};
    pdserve_int8::quantize_block(x.data_ptr<at::BFloat16>() + 4 * b * x.stride(0), x.stride(0), rows, k, k, q,
                                 xq + 4 * b * k, k);
  }
  return {xq, sx, corr, 1, k, k};
}

at::Tensor mlp_region(const at::Tensor& x, const at::Tensor& gu_packed, const at::Tensor& gu_wscale,
                      const at::Tensor& down_packed, const at::Tensor& down_wscale, int64_t n) {
  const int64_t m = x.size(0), h = x.size(1), inter = down_packed.size(1) * 4;
  at::Tensor out = at::empty({m, n}, x.options());
  const pdserve_gemm_out::OutRows op = pdserve_gemm_out::out_rows(out);
  int8_t* const digits = scratch<int8_t, 1>(kMaxRows * 2 * inter);
  at::BFloat16* const act = scratch<at::BFloat16, 0>(kMaxRows * inter);
  int32_t xcorr[kMaxRows];
  float xsx[kMaxRows];
  const Activations ax = quantize_per_token(x, scratch<int8_t, 0>(kMaxRows * h), xsx, xcorr);
  // what the threads share: silu(gate) * up [M, I] bf16, down's digits [M, 2I] (hi | lo), and per
  // thread and row the amax bits of its channels, then its digit sums (hi, lo)
  const int64_t kstep_gu = h % 64 == 0 ? 64 : 32, kstep_down = 64;   // (down: I a multiple of 64)
  const int64_t pairs = inter / kUnitColumns, down_units = (down_packed.size(0) + kNT - 1) / kNT;
  const int threads = at::in_parallel_region() ? 1 : static_cast<int>(std::min<int64_t>(at::get_num_threads(), pairs));
  std::vector<uint32_t> part_max(threads * kMaxRows);
  std::vector<int32_t> part_sums(threads * kMaxRows * 2, 0);
  const uint8_t* gu = gu_packed.data_ptr<uint8_t>();
  const uint8_t* down = down_packed.data_ptr<uint8_t>();
  const float* gu_s = gu_wscale.data_ptr<float>();
  const float* down_s = down_wscale.data_ptr<float>();
  const int64_t gu_stride = h * 16, down_stride = inter * 16, up_tiles = inter / 16;
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    alignas(64) int32_t isum[kMaxRows * 64];
    alignas(64) float facc[kMaxRows * 64];
    alignas(64) at::BFloat16 gate[kMaxRows * kUnitColumns], up[kMaxRows * kUnitColumns];
    // 1. gate and up of this thread's channels [c0, c1), silu(gate) * up into act
    const auto [p0, p1] = thread_range(pairs, tid, team);
    configure_tiles(static_cast<int>(m), static_cast<int>(kstep_gu));
    for (int64_t p = p0; p < p1; ++p) {
      for (int half = 0; half < 2; ++half) {   // gate tiles 4p.., then up tiles I/16 + 4p..
        const int64_t t0 = half * up_tiles + kNT * p;
        const uint8_t* next = unit_at(gu + half * up_tiles * gu_stride, unit_ahead(p, p1), kNT * gu_stride);
        unit_pass<kNT>(ax, 0, static_cast<int>(m), h, kstep_gu, gu + t0 * gu_stride, gu_stride, next, gu_s + 16 * t0,
                       isum, facc, {half ? up : gate, kUnitColumns, false}, 0, kUnitColumns);
      }
      for (int64_t r = 0; r < m; ++r)
        pdserve_silu::silu_mul_row(gate + r * kUnitColumns, up + r * kUnitColumns, act + r * inter + p * kUnitColumns,
                                   kUnitColumns);
    }
    // 2. the MX block maxima of those channels, their maximum a row for the others; then the digits
    const int64_t c0 = p0 * kUnitColumns, nblocks = (p1 - p0) * kUnitColumns / pdserve_int8::kChunk;
    const int64_t sets = std::max<int64_t>(1, (nblocks + 15) / 16);   // bmax vectors a row
    std::vector<__m512i> bmax(m * sets);
    for (int64_t r = 0; r < m; ++r)
      part_max[tid * kMaxRows + r] = nblocks == 0 ? 0 : pdserve_int8::mx_block_maxes(
          reinterpret_cast<const uint16_t*>(act + r * inter + c0), nblocks, bmax.data() + r * sets);
#pragma omp barrier
    float row_sx[kMaxRows];   // each row's sx (quantize_row_mx's), from every thread's block maxima
    for (int64_t r = 0; r < m; ++r) {
      uint32_t rmax = 0;
      for (int t = 0; t < team; ++t) rmax = std::max(rmax, part_max[t * kMaxRows + r]);
      const float sx = row_sx[r] = pdserve_int8::mx_scale(rmax);
      int8_t* hi = digits + r * 2 * inter + c0;
      if (std::isnan(sx) || nblocks == 0) {   // (a poisoned row: digits 0, quantize_row_mx's)
        std::memset(hi, 0, nblocks * pdserve_int8::kChunk);
        std::memset(hi + inter, 0, nblocks * pdserve_int8::kChunk);
        continue;
      }
      pdserve_int8::mx_shifts(bmax.data() + r * sets, nblocks, rmax);
      pdserve_int8::mx_digits(reinterpret_cast<const uint16_t*>(act + r * inter + c0), nblocks,
                              bmax.data() + r * sets, sx, hi, hi + inter, part_sums.data() + (tid * kMaxRows + r) * 2);
    }
#pragma omp barrier
    // 3. down_proj's activations (every thread the same: quantize_row_mx's sx and corr, the
    // slices' sums added), then its units, split as gemm's parallel_for splits them (a unit's
    // weights streamed into L2 during the barriers and the digits measured no faster)
    float sx[kMaxRows * 2];
    int32_t corr[kMaxRows * 2];
    const Activations ad{digits, sx, corr, 2, 2 * inter, inter};
    for (int64_t r = 0; r < m; ++r) {
      int32_t hi = 0, lo = 0;   // (a poisoned row's sums stay 0: no thread added to them)
      for (int t = 0; t < team; ++t) {
        hi += part_sums[(t * kMaxRows + r) * 2];
        lo += part_sums[(t * kMaxRows + r) * 2 + 1];
      }
      sx[ad.at(r, 0)] = row_sx[r];
      sx[ad.at(r, 1)] = row_sx[r] * (1.f / 128.f);
      corr[ad.at(r, 0)] = -128 * hi;
      corr[ad.at(r, 1)] = -128 * lo;
    }
    if (kstep_down != kstep_gu) configure_tiles(static_cast<int>(m), static_cast<int>(kstep_down));
    const auto [u0, u1] = thread_range(down_units, tid, team);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t t0 = u * kNT;
      const int count = static_cast<int>(std::min<int64_t>(kNT, down_packed.size(0) - t0));
      const uint8_t* w = down + t0 * down_stride;
      const uint8_t* next = unit_at(down, unit_ahead(u, u1), kNT * down_stride);
      kUnitPass[count](ad, 0, static_cast<int>(m), inter, kstep_down, w, down_stride, next, down_s, isum, facc, op,
                       16 * t0, n);
    }
    _tile_release();
  }
  return out;
}
#endif

// down_proj(silu(gate) * up) for x [M, H] bf16: w8a8_gemm_amx of x by gate_up's packed weight
// [2I/16, H/4, 16, 4] (gate | up, gu_n = 2I outputs, activation group gu_group), then
// silu_mul_w8a8_gemm_amx by down_proj's [N/16, I/4, 16, 4] (n outputs, group down_group), bit for
// bit: one parallel region (mlp_region) where the shapes allow, else those two ops. Returns
// [M, n] bf16. Errors (RuntimeError, the reason): either op's, and the two weights not chained
// (gate_up's 2I outputs against down_proj's I inputs).
at::Tensor mlp_w8a8_gemm_amx(const at::Tensor& x_in, const at::Tensor& gu_packed, const at::Tensor& gu_wscale,
                             int64_t gu_n, int64_t gu_group, const at::Tensor& down_packed,
                             const at::Tensor& down_wscale, int64_t n, int64_t down_group) {
  const at::Tensor x = pdserve_int8::checked_input(x_in, gu_packed, gu_wscale, gu_n, gu_group);
  TORCH_CHECK(down_packed.dim() == 4 && gu_n == 2 * down_packed.size(1) * 4, "gate_up has ", gu_n,
              " outputs; down_proj's packed weight takes I = ", down_packed.dim() == 4 ? down_packed.size(1) * 4 : -1,
              " input channels, so gate_up must have 2I (gate | up)");
  const int64_t inter = gu_n / 2;
  pdserve_int8::check_weight(inter, down_packed, down_wscale, n, down_group);
#if defined(PDSERVE_AMX_INT8)
  TORCH_CHECK(amx_permitted(), "the OS refused this process AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)");
  if (x.size(0) > 0 && x.size(0) <= kMaxRows && gu_group == x.size(1) && down_group == pdserve_int8::kMxGroup &&
      inter % kUnitColumns == 0 && gu_packed.size(0) * 16 == gu_n)
    return mlp_region(x, gu_packed, gu_wscale, down_packed, down_wscale, n);
#endif
  // (through the dispatcher, so a profile shows which way a call went)
  using Op = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                        std::optional<at::ScalarType>);
  static const auto linear = c10::Dispatcher::singleton().findSchemaOrThrow("pdserve_int8_amx::w8a8_gemm", "").typed<Op>();
  static const auto silu_linear =
      c10::Dispatcher::singleton().findSchemaOrThrow("pdserve_int8_amx::silu_mul_w8a8_gemm", "").typed<Op>();
  const at::Tensor gate_up = linear.call(x, gu_packed, gu_wscale, gu_n, gu_group, std::nullopt);
  return silu_linear.call(gate_up, down_packed, down_wscale, n, down_group, std::nullopt);
}

// The fused QKV projection of a decode step with RoPE and the KV-cache write in its epilogue:
// w8a8_gemm_amx of x by the qkv weight, then what layer_ops.cpp's rope_split and
// kv_cache_write.cpp's write_kv_cache do with its output, the same bits: q rotated into q, k
// rotated and v copied into the caches at the tokens' slots.
//
// Why: at 16 rows rope_split (~3.5 us) and write_kv_cache (~2.3 us) run on one thread while the
// other waits, a layer, and the [M, (Hq + 2 Hkv) D] output is written and read back between them.
// Here a unit of the product is 64 columns, one head when D = 64: the thread that computes a head
// rotates it (q, k) or copies it (v) from its L1 into place, so RoPE and the cache write are split
// over the threads, and no qkv tensor exists.
//
// Runs for M <= 16 rows at one scale per token, D = 64, bf16 caches [num_blocks, block_size, Hkv,
// D] with each token's row contiguous; otherwise the three ops, as apart. Emerald Rapids, 2
// threads, 2026-12-07: SmolLM2-135M's 16-row decode step 4.3-5.0% faster (two runs of 60
// interleaved A/B pairs of 8-step blocks in one process, IQR 2.8-6.1%), 8 rows 2.0% (IQR 1.3-3.2%):
// more than the two ops' own ~6 us a layer, as neither the qkv output nor k and v are written,
// allocated and read back.
#if defined(PDSERVE_AMX_INT8)
void qkv_region(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& wscale, const float* cos,
                const float* sin, at::Tensor& q, at::Tensor& key_cache, at::Tensor& value_cache, const int64_t* slots) {
  const int64_t m = x.size(0), h = x.size(1), hq = q.size(1), hkv = key_cache.size(2), d = kUnitColumns, half = d / 2;
  int32_t xcorr[kMaxRows];
  float xsx[kMaxRows];
  const Activations ax = quantize_per_token(x, scratch<int8_t, 0>(kMaxRows * h), xsx, xcorr);
  const int64_t kstep = h % 64 == 0 ? 64 : 32, heads = hq + 2 * hkv, tile_stride = h * 16;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = wscale.data_ptr<float>();
  at::BFloat16* qp = q.data_ptr<at::BFloat16>();
  at::BFloat16 *kc = key_cache.data_ptr<at::BFloat16>(), *vc = value_cache.data_ptr<at::BFloat16>();
  const int64_t bs = key_cache.size(1), ks0 = key_cache.stride(0), ks1 = key_cache.stride(1),
                vs0 = value_cache.stride(0), vs1 = value_cache.stride(1);
  // (gemm's split: threads only with 128 KB of weight or more for each)
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / (tile_stride * kNT));
  at::parallel_for(0, heads, grain, [&](int64_t u0, int64_t u1) {
    alignas(64) int32_t isum[kMaxRows * 64];
    alignas(64) float facc[kMaxRows * 64];
    alignas(64) at::BFloat16 head[kMaxRows * kUnitColumns];
    configure_tiles(static_cast<int>(m), static_cast<int>(kstep));
    for (int64_t u = u0; u < u1; ++u) {
      const uint8_t* w = wp + u * kNT * tile_stride;
      const uint8_t* next = unit_at(wp, unit_ahead(u, u1), kNT * tile_stride);
      unit_pass<kNT>(ax, 0, static_cast<int>(m), h, kstep, w, tile_stride, next, sp + u * d, isum, facc,
                     {head, d, false}, 0, d);
      for (int64_t t = 0; t < m; ++t) {
        const at::BFloat16* row = head + t * d;
        const float *c = cos + t * half, *sn = sin + t * half;
        if (u < hq) {
          pdserve_rope::rotate(qp + (t * hq + u) * d, row, c, sn, half);
        } else if (u < hq + hkv) {
          pdserve_rope::rotate(kc + (slots[t] / bs) * ks0 + (slots[t] % bs) * ks1 + (u - hq) * d, row, c, sn, half);
        } else {
          std::memcpy(vc + (slots[t] / bs) * vs0 + (slots[t] % bs) * vs1 + (u - hq - hkv) * d, row, sizeof(*row) * d);
        }
      }
    }
    _tile_release();
  });
}
#endif

// Whether two tensors' element ranges overlap in memory (the model's K and V caches are views of
// one allocation, side by side: they do not).
bool overlap(const at::Tensor& a, const at::Tensor& b) {
  auto range = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t i = 0; i < t.dim(); ++i) last += (t.size(i) - 1) * t.stride(i);
    const auto* p = static_cast<const char*>(t.data_ptr());
    return std::pair{p, p + (last + 1) * t.element_size()};
  };
  const auto [a0, a1] = range(a);
  const auto [b0, b1] = range(b);
  return a.numel() > 0 && b.numel() > 0 && a0 < b1 && b0 < a1;
}

// x [M, H] bf16 by the packed qkv weight (n = (Hq + 2 Hkv) D outputs, activation group `group`),
// then rope_split's q into q [M, Hq, D] (contiguous, bf16) and its k and v into key_cache and
// value_cache ([num_blocks, block_size, Hkv, D]) at slot_mapping [M] (int64), as write_kv_cache
// stores them: bit for bit w8a8_gemm_amx, rope_split and write_kv_cache; one parallel region
// (qkv_region) where the shapes allow, else those three ops. cos, sin: fp32 [M, D/2]. Errors
// (RuntimeError, the reason): w8a8_gemm_amx's, rope_split's, write_kv_cache's, and n not (Hq + 2
// Hkv) D for q's and the caches' heads.
void qkv_rope_w8a8_gemm_amx(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& wscale, int64_t n,
                            int64_t group, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& q,
                            at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const at::Tensor x = pdserve_int8::checked_input(x_in, packed, wscale, n, group);
  const int64_t m = x.size(0);
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4 && q.size(0) == m &&
                  key_cache.size(3) == q.size(2) && value_cache.sizes().slice(1) == key_cache.sizes().slice(1) &&
                  n == (q.size(1) + 2 * key_cache.size(2)) * q.size(2),
              "q must be [M, Hq, D] and the caches [num_blocks, block_size, Hkv, D] (one block_size, Hkv and D) with (Hq + "
              "2 Hkv) D = n = ", n, " outputs; got q ", q.sizes(), ", key_cache ", key_cache.sizes(), ", value_cache ",
              value_cache.sizes());
#if defined(PDSERVE_AMX_INT8)
  TORCH_CHECK(amx_permitted(), "the OS refused this process AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)");
  const auto bf16 = at::kBFloat16;
  const bool rows_contiguous = key_cache.stride(3) == 1 && key_cache.stride(2) == key_cache.size(3) &&
                               value_cache.stride(3) == 1 && value_cache.stride(2) == value_cache.size(3);
  if (m > 0 && m <= kMaxRows && group == x.size(1) && q.size(2) == kUnitColumns && q.is_contiguous() &&
      q.scalar_type() == bf16 && key_cache.scalar_type() == bf16 && value_cache.scalar_type() == bf16 &&
      value_cache.sizes() == key_cache.sizes() && rows_contiguous && packed.size(0) * 16 == n &&
      !overlap(key_cache, value_cache) &&   // (one tensor for both: V written last, as apart)
      cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
      sin.is_contiguous() && cos.numel() == m * kUnitColumns / 2 && sin.numel() == cos.numel() &&
      slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == m) {
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    pdserve_kv::check_slots(slots, m, key_cache, value_cache);   // (write_kv_cache's)
    qkv_region(x, packed, wscale, cos.data_ptr<float>(), sin.data_ptr<float>(), q, key_cache, value_cache, slots);
    return;
  }
#endif
  // (through the dispatcher, as mlp_w8a8_gemm's other way)
  using Gemm = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                          std::optional<at::ScalarType>);
  using Rope = void(at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
  using WriteKv = void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                       const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);
  auto& d = c10::Dispatcher::singleton();
  static const auto linear = d.findSchemaOrThrow("pdserve_int8_amx::w8a8_gemm", "").typed<Gemm>();
  static const auto rope = d.findSchemaOrThrow("pdserve_ops::rope_split", "").typed<Rope>();
  static const auto write_kv = d.findSchemaOrThrow("pdserve_attn::write_kv_cache", "").typed<WriteKv>();
  const at::Tensor qkv = linear.call(x, packed, wscale, n, group, std::nullopt);
  at::Tensor k = at::empty({m, key_cache.size(2), q.size(2)}, qkv.options()), v = at::empty(k.sizes(), qkv.options());
  rope.call(q, k, v, qkv, cos, sin);
  write_kv.call(k, v, key_cache, value_cache, slot_mapping, std::nullopt, std::nullopt);
}

// Whether this build has the kernel and the OS grants this process AMX state.
bool available() {
#if defined(PDSERVE_AMX_INT8)
  return amx_permitted();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(pdserve_int8_amx, m) {
  m.def("w8a8_gemm(Tensor x, Tensor packed, Tensor wscale, int n, int group=32, ScalarType? out_dtype=None) -> Tensor");
  m.def("silu_mul_w8a8_gemm(Tensor gate_up, Tensor packed, Tensor wscale, int n, int group=32, "
        "ScalarType? out_dtype=None) -> Tensor");
  m.def("mlp_w8a8_gemm(Tensor x, Tensor gu_packed, Tensor gu_wscale, int gu_n, int gu_group, Tensor down_packed, "
        "Tensor down_wscale, int n, int down_group) -> Tensor");
  m.def("qkv_rope_w8a8_gemm(Tensor x, Tensor packed, Tensor wscale, int n, int group, Tensor cos, Tensor sin, "
        "Tensor(a!) q, Tensor(b!) key_cache, Tensor(c!) value_cache, Tensor slot_mapping) -> ()");
  m.def("available() -> bool", &available);
}

TORCH_LIBRARY_IMPL(pdserve_int8_amx, CPU, m) {
  m.impl("w8a8_gemm", &w8a8_gemm_amx);
  m.impl("silu_mul_w8a8_gemm", &silu_mul_w8a8_gemm_amx);
  m.impl("mlp_w8a8_gemm", &mlp_w8a8_gemm_amx);
  m.impl("qkv_rope_w8a8_gemm", &qkv_rope_w8a8_gemm_amx);
}
