// INT8 linear layers for decode-sized batches (5-128 rows) on AMX tiles (kernels/linear.py's
// Int8Linear, kernel "w8a8_amx"): the product of int8_gemm.cpp's w8a8_gemm, from the same packed
// weight, with the same activation quantization (int8_activations.h quantize_row), bit for bit:
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
// offset is cancelled exactly in each group's int32 sum by quantize_row's corr (-128 sum xq), as in
// w8a8_gemm. The quantized activations are copied from quantize_row's quad-transposed layout into
// rows (an A tile is up to 16 rows of kstep consecutive bytes).
//
// Blocking: a unit is NT = 4 column tiles; C tiles 0-3 hold one group's int32 sums for 16 x 64
// outputs, tile 4 the activations, tiles 5-7 the weights. kstep = 64 bytes of k (one tile's depth)
// where the group is a multiple of 64, else 32. After each group the C tiles are stored to an L1
// block, offset by corr, converted and accumulated into fp32 sums (an fma by sx, as w8a8_gemm), so
// the epilogue per group costs about as much as the tile products: groups of 64 and wider
// (engine/quantization/apply.py's INT8_ACT_GROUPS) keep it small. Rows beyond 16 take passes of
// equal size over each unit while it is in cache; the next units stream into L2 meanwhile.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "int8_activations.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define PDSERVE_AMX_INT8 1
#include <immintrin.h>
#endif

namespace {

#if defined(PDSERVE_AMX_INT8)
constexpr int kMaxRows = 16;   // an A / C tile's rows
constexpr int kNT = 4;         // column tiles per unit: C tiles 0-3
constexpr int64_t kPrefetchUnits = 2;   // as small_gemm_amx.cpp (measured there)

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
  const float* sx;     // sx[g * ldq + m] (quantize_row's layout)
  const int32_t* corr;
  int64_t ldq, k;
};

// One pass of `rows` rows (from row r0) over one unit of NT column tiles: out[r0 + r, col0 + j]
// for j < 16 NT (clipped at n). w: the unit's first tile (tile_stride bytes apart); next: a unit
// after this one, prefetched into L2 at the pace this one is read (nullptr: none). isum: 16 x 64
// int32, facc: 16 x 64 fp32 (L1 scratch).
template <int NT>
void unit_pass(const Activations& a, int64_t r0, int rows, int64_t group, int64_t kstep, const uint8_t* w,
               int64_t tile_stride, const uint8_t* next, const float* wscale, int32_t* isum, float* facc,
               at::BFloat16* out, int64_t ldo, int64_t col0, int64_t n) {
  std::memset(facc, 0, sizeof(float) * kMaxRows * 64);
  const int8_t* x = a.xq + r0 * a.k;
  const int64_t groups = a.k / group, steps = group / kstep, lines = kstep / 4;
  for (int64_t g = 0; g < groups; ++g) {
    _tile_zero(0);
    if constexpr (NT > 1) _tile_zero(1);
    if constexpr (NT > 2) _tile_zero(2);
    if constexpr (NT > 3) _tile_zero(3);
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t k0 = (g * steps + s) * kstep;
      const uint8_t* wk = w + k0 * 16;   // line k0 / 4 of each tile
      if (next != nullptr) {
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
    for (int r = 0; r < rows; ++r) {   // w8a8_gemm's arithmetic: fma(float(corr + sum), sx, acc)
      const __m512i c = _mm512_set1_epi32(a.corr[g * a.ldq + r0 + r]);
      const __m512 s = _mm512_set1_ps(a.sx[g * a.ldq + r0 + r]);
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
    const __mmask16 mask = n - col >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - col)) - 1);
    for (int r = 0; r < rows; ++r) {
      const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(facc + r * 64 + 16 * t), s));
      _mm256_mask_storeu_epi16(out + (r0 + r) * ldo + col, mask, v);
    }
  }
}

using UnitPass = void (*)(const Activations&, int64_t, int, int64_t, int64_t, const uint8_t*, int64_t, const uint8_t*,
                          const float*, int32_t*, float*, at::BFloat16*, int64_t, int64_t, int64_t);
constexpr UnitPass kUnitPass[kNT + 1] = {nullptr, &unit_pass<1>, &unit_pass<2>, &unit_pass<3>, &unit_pass<4>};
#endif

// out [M, N] bf16 = x [M, K] bf16 (rows contiguous, or copied so) times the packed int8 weight
// [N/16, K/4, 16, 4] uint8 (kernels/linear.py pack_int8_gemm) with wscale fp32 [16 * tiles] and
// activation groups of `group` channels (a multiple of 32 dividing K): w8a8_gemm's schema and
// result. Errors (RuntimeError, the reason): arguments that do not match (int8_activations.h), a
// build without AMX-INT8, an OS that refuses the process AMX state.
at::Tensor w8a8_gemm_amx(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& wscale, int64_t n,
                         int64_t group) {
  const at::Tensor x = pdserve_int8::checked_input(x_in, packed, wscale, n, group);
  const int64_t m = x.size(0), k = x.size(1), tiles = packed.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
#if defined(PDSERVE_AMX_INT8)
  TORCH_CHECK(amx_permitted(), "the OS refused this process AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)");
  if (m == 0) return out;
  const int64_t passes = (m + kMaxRows - 1) / kMaxRows;
  const int64_t per_pass = (m + passes - 1) / passes;   // 20 rows: two passes of 10, not 16 + 4
  const int64_t ldq = passes * per_pass, groups = k / group, k4 = k / 4;
  // quantize_row's layout ([K/4][ldq] quads), then rows; rows past m stay zero so that every pass
  // has the one tile shape configured (their sums are computed and not stored)
  std::vector<int32_t> quads(k4 * ldq, 0), rows_q(ldq * k4, 0), corr(groups * ldq, 0);
  std::vector<float> sx(groups * ldq, 0.f);
  {
    const pdserve_int8::QuantizedRows q{quads.data(), sx.data(), corr.data(), ldq};
    alignas(64) int8_t tmp[pdserve_int8::kChunk];
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    for (int64_t r = 0; r < m; ++r) pdserve_int8::quantize_row(xp + r * x.stride(0), k, group, r, q, tmp);
    for (int64_t kq = 0; kq < k4; ++kq)
      for (int64_t r = 0; r < m; ++r) rows_q[r * k4 + kq] = quads[kq * ldq + r];
  }
  const Activations a{reinterpret_cast<const int8_t*>(rows_q.data()), sx.data(), corr.data(), ldq, k};
  const int64_t kstep = group % 64 == 0 ? 64 : 32;
  const int64_t units = (tiles + kNT - 1) / kNT, tile_stride = k * 16;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = wscale.data_ptr<float>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t ldo = out.stride(0);
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
      const uint8_t* next = u + kPrefetchUnits < u1 ? w + kPrefetchUnits * kNT * tile_stride
                            : u + 1 < u1          ? wp + (u1 - 1) * kNT * tile_stride
                                                  : nullptr;
      for (int64_t r0 = 0; r0 < m; r0 += per_pass) {
        const int rows = static_cast<int>(std::min<int64_t>(per_pass, m - r0));
        kUnitPass[count](a, r0, rows, group, kstep, w, tile_stride, r0 == 0 ? next : nullptr, sp, isum, facc, op,
                         ldo, 16 * t0, n);
      }
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "w8a8_gemm_amx needs a build for a CPU with AMX-INT8, AVX512-BF16 and AVX512-VNNI");
#endif
  return out;
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
  m.def("w8a8_gemm(Tensor x, Tensor packed, Tensor wscale, int n, int group=32) -> Tensor");
  m.def("available() -> bool", &available);
}

TORCH_LIBRARY_IMPL(pdserve_int8_amx, CPU, m) { m.impl("w8a8_gemm", &w8a8_gemm_amx); }
