// INT8 linear layers (kernels/linear.py's Int8Linear, kernel "w8a8_vnni"): int8 weights with
// per-output-channel scales, activations quantized in the call per token and per group of G input
// channels (G = `group`, a multiple of 32 dividing K; G = K is one scale per token), bf16 in and
// out (or, with out_dtype float32, the same bf16 values as fp32: the LM head's logits, gemm_output.h),
// AVX512-VNNI and AVX512-BF16:
//
//   out[m, n] = wscale[n] * sum_g sx[m, g] * sum_{k in g} xq[m, k] q[n, k]
//   (sx[m, g] = amax |x[m, g*G .. g*G+G-1]| / 127, xq = round(x / sx))
//
// Why: a decode step at 1-32 rows streams every weight from DRAM once, so int8 weights (half of
// bf16's bytes) are the speed lever; at 16-32 rows the bf16 product is compute-bound too, and
// vpdpbusd multiplies 64 u8 x s8 pairs per instruction where vdpbf16ps multiplies 32, reading the
// int8 weight as it is (widening it to bf16 in registers first cost more than the bytes saved).
// Groups of 32 rather than one scale per token: an outlier channel coarsens only its own group
// (per-token activations cost the bundled model +4.7% perplexity, per group of 32 about as much as
// weight-only int8; engine/quantization/apply.py). Each group costs, per row and 16 output columns,
// an int32 -> fp32 conversion and an fma (plus, at 16 rows, a load and a store of the fp32 sum) on
// top of its G/4 vpdpbusd: at G = 32 that is what makes 16 rows compute-bound, so inputs that carry
// no outlier channels take wider groups (apply.py's INT8_ACT_GROUPS; 16 rows, one thread: G = K
// is 1.2-1.3x faster than G = 32 on the bundled model's shapes).
//
// Numerics: the products and their int32 sums within a group are exact; each group's sum times
// sx is accumulated in fp32 (groups in order), times wscale, rounded once to bf16. vpdpbusd
// multiplies unsigned by signed bytes: the weight is stored as q + 128 (in [1, 255]) and each
// group's int32 sum starts at -128 sum_{k in g} xq[m, k] (summed while quantizing the
// activations), which cancels the offset exactly (a correction on the weight side would be 4 more
// bytes per output column and group, 1/8 more than the weights themselves, read every step).
//
// Layout (packed once at load, kernels/linear.py pack_int8_gemm): q + 128 as bytes, [N, K] in
// tiles of 16 output columns, [N/16][K/4][16][4]: bytes 4j..4j+3 of a tile's 64-byte line hold
// column n0 + j at k = 4i..4i+3 (vpdpbusd's quad layout). N is padded to a multiple of 16 with
// zero-weight rows (bytes 128, scale 0), K must be a multiple of 32.
//
// Register blocking (the structure of kernels/csrc/small_gemm.cpp, the bf16 kernel): a pass takes
// MR <= 16 rows and NT tiles at once; MR x NT int32 accumulators for the group under way and as
// many fp32 ones across groups, in registers where both fit (2 MR NT + NT <= 30 of 32), else the
// fp32 ones in an L1 scratch block (loaded, updated and stored once per group: 1/8 of the
// vpdpbusd count). 16 rows are one pass (one weight line feeds 16 vpdpbusd; the kernel before
// this took 12 rows a pass, so 16 rows were two passes of 8, each weight line feeding 8, with 8
// extra conversions per group: half the speed, measured). The quantized activations are stored
// per pass as quads, [K/4][rows] int32, so every broadcast is one pointer plus an immediate offset
// and folds into its vpdpbusd. Work split: units of NT tiles, contiguous ranges per thread; the
// next unit's lines are asked into L2 while the current one is computed, the current one's a few
// lines ahead into L1. Rows beyond 16 take further passes of equal size over each unit while it
// is in cache. Int8Linear chooses this kernel for 1-4 rows. From 5 rows on (its 16-row bucket) it
// prefers this one too where the activations take one scale per token (group = K: the fp32 sums
// are then loaded and stored once a call; in the 16-row decode step of the rotated INT8 model,
// where qkv, o, gate/up and the LM head are per token, 2.4-4.5% faster than the blocked kernel),
// and int8_gemm_prefill.cpp's blocked kernel, the same product bit for bit with its fp32 sums in
// registers, where they take groups (Zen 4, 2 threads, the model's 121 linears cold in groups of
// 32-64: 1.07x this kernel at 16 rows, 1.1x at 32); it times the other against its preference.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "gemm_output.h"
#include "int8_activations.h"

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define PDSERVE_INT8_GEMM 1
#include <immintrin.h>
#endif

namespace {

using pdserve_gemm_out::OutRows;

#if PDSERVE_INT8_GEMM
using pdserve_int8::kChunk;
constexpr int kMaxRows = 16;       // rows per pass (more rows: passes of equal size)
constexpr int64_t kPrefetch = 8;       // lines ahead within a tile's stream, into L1
constexpr int kL2PrefetchRows = 5;     // from these rows on, the next unit into L2 as well

// One pass's quantized activations, rows [0, ldq) of the pass (written by quantize_row).
using Pass = pdserve_int8::QuantizedRows;
using pdserve_int8::quantize_row;

// Whether MR x NT int32 and fp32 accumulators and NT weight lines fit the 32 vector registers
// (with a broadcast and a scale to spare).
template <int NT, int MR>
constexpr bool regs_fit() { return 2 * MR * NT + NT <= 30; }

// Rows [0, MR) of pass p x tiles [0, NT) of the quad-layout weight w (tile t at w + t tile_stride):
// out[m, n0 + 16 t + j] for n0 + 16 t < n. next: the weight of the unit after this one
// (prefetched into L2 at the pace this one is read), or nullptr (a later pass over a unit already
// in cache, or the last unit).
template <int NT, int MR>
void tile_kernel(const Pass p, int64_t groups, int64_t quads, int64_t wquads, const uint8_t* w, int64_t tile_stride,
                 const float* wscale, const OutRows& out, int64_t n0, int64_t n, const uint8_t* next) {
  constexpr bool kReg = regs_fit<NT, MR>();
  __m512 facc[kReg ? MR : 1][NT];
  alignas(64) float fmem[kReg ? 1 : MR][NT][16];
  if constexpr (kReg) {
    for (int m = 0; m < MR; ++m)
      for (int t = 0; t < NT; ++t) facc[m][t] = _mm512_setzero_ps();
  } else {
    for (int m = 0; m < MR; ++m)
      for (int t = 0; t < NT; ++t) _mm512_store_ps(fmem[m][t], _mm512_setzero_ps());
  }
  const int32_t* xq = p.xq;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i iacc[MR][NT];
    const int32_t* cg = p.corr + g * p.ldq;
    for (int m = 0; m < MR; ++m) {
      const __m512i start = _mm512_set1_epi32(cg[m]);
      for (int t = 0; t < NT; ++t) iacc[m][t] = start;
    }
#pragma GCC unroll 8
    for (int64_t i = 0; i < quads; ++i) {
      const int64_t kq = g * quads + i, kw = kq < wquads ? kq : kq - wquads;   // (MX: the lo digits reread the weight)
      __m512i wv[NT];
      for (int t = 0; t < NT; ++t) {
        const uint8_t* line = w + t * tile_stride + kw * 64;
        if (next != nullptr && kq < wquads) {
          _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetch * 64), _MM_HINT_T0);
          if (MR >= kL2PrefetchRows) _mm_prefetch(reinterpret_cast<const char*>(next + t * tile_stride + kq * 64), _MM_HINT_T1);
        }
        wv[t] = _mm512_loadu_si512(line);
      }
      const int32_t* xk = xq + kq * p.ldq;
      for (int m = 0; m < MR; ++m) {
        const __m512i a = _mm512_set1_epi32(xk[m]);
        for (int t = 0; t < NT; ++t) iacc[m][t] = _mm512_dpbusd_epi32(iacc[m][t], wv[t], a);
      }
    }
    const float* sg = p.sx + g * p.ldq;
    for (int m = 0; m < MR; ++m) {
      const __m512 s = _mm512_set1_ps(sg[m]);
      for (int t = 0; t < NT; ++t) {
        if constexpr (kReg) {
          facc[m][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][t]), s, facc[m][t]);
        } else {
          _mm512_store_ps(fmem[m][t], _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][t]), s, _mm512_load_ps(fmem[m][t])));
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t col = n0 + 16 * t;
    if (col >= n) break;
    const __m512 s = _mm512_loadu_ps(wscale + col);
    const __mmask16 mask = pdserve_gemm_out::columns_mask(n - col);
    for (int m = 0; m < MR; ++m) {
      __m512 a;
      if constexpr (kReg) a = facc[m][t]; else a = _mm512_load_ps(fmem[m][t]);
      out.store(m, col, mask, _mm512_mul_ps(a, s));
    }
  }
}

using Kernel = void (*)(const Pass, int64_t, int64_t, int64_t, const uint8_t*, int64_t, const float*, const OutRows&,
                        int64_t, int64_t, const uint8_t*);

// MX activations at 1-4 rows (groups == 2: the hi digits' quads, then the lo digits', each over
// the whole weight): both digits' products from one read of each weight line, in two sets of
// int32 sums, then tile_kernel's arithmetic (fma(float(sum_hi), sx, 0), then fma(float(sum_lo),
// sx / 128, acc): the same bits). Why: tile_kernel's second group rereads the unit's weight from L2
// (192 KB at 1 row): the batch-1 decode step 4.5% slower than with groups of 32 (4.43 -> 4.64 ms,
// A/B in one process, Emerald Rapids); NT here so that 3 MR NT + NT registers fit.
template <int NT, int MR>
void tile_kernel_mx(const Pass p, int64_t, int64_t quads, int64_t, const uint8_t* w, int64_t tile_stride,
                    const float* wscale, const OutRows& out, int64_t n0, int64_t n, const uint8_t* next) {
  __m512i ihi[MR][NT], ilo[MR][NT];
  for (int m = 0; m < MR; ++m) {
    const __m512i c_hi = _mm512_set1_epi32(p.corr[m]), c_lo = _mm512_set1_epi32(p.corr[p.ldq + m]);
    for (int t = 0; t < NT; ++t) {
      ihi[m][t] = c_hi;
      ilo[m][t] = c_lo;
    }
  }
  const int32_t* xhi = p.xq;
  const int32_t* xlo = p.xq + quads * p.ldq;
#pragma GCC unroll 4
  for (int64_t i = 0; i < quads; ++i) {
    __m512i wv[NT];
    for (int t = 0; t < NT; ++t) {
      const uint8_t* line = w + t * tile_stride + i * 64;
      if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetch * 64), _MM_HINT_T0);
      wv[t] = _mm512_loadu_si512(line);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512i a = _mm512_set1_epi32(xhi[i * p.ldq + m]), b = _mm512_set1_epi32(xlo[i * p.ldq + m]);
      for (int t = 0; t < NT; ++t) {
        ihi[m][t] = _mm512_dpbusd_epi32(ihi[m][t], wv[t], a);
        ilo[m][t] = _mm512_dpbusd_epi32(ilo[m][t], wv[t], b);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t col = n0 + 16 * t;
    if (col >= n) break;
    const __m512 s = _mm512_loadu_ps(wscale + col);
    const __mmask16 mask = pdserve_gemm_out::columns_mask(n - col);
    for (int m = 0; m < MR; ++m) {
      const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ihi[m][t]), _mm512_set1_ps(p.sx[m]), _mm512_setzero_ps());
      const __m512 acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ilo[m][t]), _mm512_set1_ps(p.sx[p.ldq + m]), hi);
      out.store(m, col, mask, _mm512_mul_ps(acc, s));
    }
  }
}

constexpr int kMxMaxRows = 4;   // tile_kernel_mx's rows; more: tile_kernel's two groups in turn
constexpr int mx_tiles_for(int mr) { return mr <= 2 ? 4 : 2; }
// tile_kernel_mx<NT, MR> for NT in {1, 2, 4} (index 0-2) and MR in 1-4 (NT <= mx_tiles_for(MR), else nullptr)
template <int NT, int MR>
constexpr Kernel pick_mx() {
  if constexpr (NT <= mx_tiles_for(MR)) return &tile_kernel_mx<NT, MR>; else return nullptr;
}
template <int NT>
constexpr std::array<Kernel, kMxMaxRows + 1> mx_rows() {
  return {nullptr, pick_mx<NT, 1>(), pick_mx<NT, 2>(), pick_mx<NT, 3>(), pick_mx<NT, 4>()};
}
constexpr std::array<Kernel, kMxMaxRows + 1> kMxKernels[3] = {mx_rows<1>(), mx_rows<2>(), mx_rows<4>()};

// Tiles at once for MR rows (regs_fit decides where the fp32 sums live: registers for 1-3, 5-7
// and 9-14 rows): 4 rows take 4 tiles with the fp32 sums in L1 rather than 2 with them in
// registers (1 thread, cold weights: 1.1-1.2x), 9-16 rows one tile (16: a weight line per 16
// vpdpbusd).
constexpr int tiles_for(int mr) { return mr <= 1 ? 8 : mr <= 4 ? 4 : mr <= 8 ? 2 : 1; }

// tile_kernel<NT, MR> for NT in {1, 2, 4, 8} (index 0-3) and MR in 1-16 where NT <= tiles_for(MR),
// nullptr elsewhere: every pass of a call uses the unit's NT, and its rows are at most the first
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

// Rows x[0 .. m) (row r at x + r ldx, bf16 [K]) -> the passes' quantized activations (row r is
// row r % per_pass of pass r / per_pass). Four rows at a time where a pass has them
// (int8_activations.h quantize_block, the values quantize_row writes, bit for bit), moved into the
// pass's [K/4][ldq] layout; the 1-3 rows left over in a pass row by row. Why: quantize_row costs
// each row a shuffle-tree reduction per group and a scalar store per quad, which adds up with many
// groups: a 16-row call on a one-tile weight from Python (Zen 4, best of 2,000) took 15.5 -> 10.9
// us at K = 1536 in groups of 32, 9.7 -> 9.2 at K = 1536 in one group, 6.4 -> 6.2 at K = 576 in one.
void quantize_passes(const at::BFloat16* x, int64_t ldx, int64_t m, int64_t k, int64_t group, int64_t per_pass,
                     Pass* pass) {
  const int64_t groups = k / group, k4 = k / 4;
  alignas(64) int8_t tmp[kChunk];
  std::vector<int32_t> bxq(k4 * 4);
  std::vector<float> bsx(groups * 4);
  std::vector<int32_t> bcorr(groups * 4);
  const pdserve_int8::QuantizedRows block{bxq.data(), bsx.data(), bcorr.data(), 4};
  for (int64_t r0 = 0; r0 < m; r0 += per_pass) {
    const int64_t rows = std::min<int64_t>(per_pass, m - r0);
    const Pass& p = pass[r0 / per_pass];
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      pdserve_int8::quantize_block(x + (r0 + r) * ldx, ldx, 4, k, group, block);
      for (int64_t kq = 0; kq < k4; ++kq)   // quad kq of the 4 rows: 16 contiguous bytes both sides
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p.xq + kq * p.ldq + r),
                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.xq + kq * 4)));
      for (int64_t g = 0; g < groups; ++g)
        for (int j = 0; j < 4; ++j) {
          p.sx[g * p.ldq + r + j] = block.sx[g * 4 + j];
          p.corr[g * p.ldq + r + j] = block.corr[g * 4 + j];
        }
    }
    for (; r < rows; ++r) quantize_row(x + (r0 + r) * ldx, k, group, r, p, tmp);
  }
}


// MX rows (int8_activations.h quantize_row_mx) -> the passes' [2 K/4][ldq] quad layout: the hi
// digits' quads, then the lo digits'; sx and corr per "group" 0 (hi) and 1 (lo).
void quantize_passes_mx(const at::BFloat16* x, int64_t ldx, int64_t m, int64_t k, int64_t per_pass, Pass* pass) {
  std::vector<int8_t> digits(2 * k);
  const int64_t k4 = k / 4;
  for (int64_t r = 0; r < m; ++r) {
    const Pass& p = pass[r / per_pass];
    const int64_t row = r % per_pass;
    float s2[2];
    int32_t c2[2];
    pdserve_int8::quantize_row_mx(x + r * ldx, k, digits.data(), digits.data() + k, s2, c2);
    for (int64_t kq = 0; kq < 2 * k4; ++kq) std::memcpy(p.xq + kq * p.ldq + row, digits.data() + 4 * kq, 4);
    for (int g = 0; g < 2; ++g) {
      p.sx[g * p.ldq + row] = s2[g];
      p.corr[g * p.ldq + row] = c2[g];
    }
  }
}
#endif

// out [M, N] = the product of x [M, K] bf16 (rows contiguous, or copied so) with the packed
// weight, in out_dtype (bf16 when None; float32: the bf16 values widened, for logits); the output
// is allocated here (one Python-level call per linear fewer: decode calls 121 linears a step, each
// a few us of overhead at batch 1).
at::Tensor w8a8_gemm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& wscale, int64_t n,
                     int64_t group, std::optional<at::ScalarType> out_dtype) {
  const at::Tensor x = pdserve_int8::checked_input(x_in, packed, wscale, n, group);
  const int64_t m = x.size(0), k = x.size(1), tiles = packed.size(0);
  at::Tensor out = at::empty({m, n}, x.options().dtype(pdserve_gemm_out::out_dtype(out_dtype)));
#if PDSERVE_INT8_GEMM
  if (m == 0) return out;
  // MX activations (int8_activations.h quantize_row_mx): two "groups" over the whole weight, the
  // hi digits' quads then the lo digits'
  const bool mx = group == pdserve_int8::kMxGroup;
  const int64_t groups = mx ? 2 : k / group, quads = mx ? k / 4 : group / 4, k4 = groups * quads;
  const int64_t passes = (m + kMaxRows - 1) / kMaxRows;
  const int64_t per_pass = (m + passes - 1) / passes;   // 20 rows: two passes of 10, not 16 + 4
  std::vector<int32_t> xq(passes * k4 * per_pass);
  std::vector<float> sx(passes * groups * per_pass);
  std::vector<int32_t> corr(passes * groups * per_pass);
  std::vector<Pass> pass(passes);
  for (int64_t p = 0; p < passes; ++p)
    pass[p] = Pass{xq.data() + p * k4 * per_pass, sx.data() + p * groups * per_pass, corr.data() + p * groups * per_pass,
                   per_pass};
  if (mx) {
    quantize_passes_mx(x.data_ptr<at::BFloat16>(), x.stride(0), m, k, per_pass, pass.data());
  } else {
    quantize_passes(x.data_ptr<at::BFloat16>(), x.stride(0), m, k, group, per_pass, pass.data());
  }
  // Fewer tiles at once where wide units would split unevenly over the threads.
  const bool mx_fused = mx && per_pass <= kMxMaxRows;
  int nt = mx_fused ? mx_tiles_for(static_cast<int>(per_pass)) : tiles_for(static_cast<int>(per_pass));
  const int64_t threads = at::get_num_threads();
  while (nt > 1 && threads > 1 && (tiles + nt - 1) / nt < 4 * threads) nt /= 2;
  const int64_t units = (tiles + nt - 1) / nt;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = wscale.data_ptr<float>();
  const OutRows rows_out = pdserve_gemm_out::out_rows(out);
  const int64_t tile_stride = k * 16;
  // Threads only with 128 KB of weight or more for each (a hand-off costs more than that much work).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / (tile_stride * nt));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t t0 = u * nt;
      const int64_t count = std::min<int64_t>(nt, tiles - t0);
      const uint8_t* next = u + 1 < u1 ? wp + (t0 + nt) * tile_stride : nullptr;
      for (int64_t r0 = 0, p = 0; r0 < m; r0 += per_pass, ++p) {
        const int rows = static_cast<int>(std::min<int64_t>(per_pass, m - r0));
        const OutRows orow = rows_out.from_row(r0);
        const uint8_t* pf = r0 == 0 ? next : nullptr;   // later passes read the unit from cache
        const Kernel unit = mx_fused ? kMxKernels[nt_index(nt)][rows] : kKernels[nt_index(nt)][rows];
        const Kernel one = mx_fused ? kMxKernels[0][rows] : kKernels[0][rows];
        if (count == nt) {
          unit(pass[p], groups, quads, k / 4, wp + t0 * tile_stride, tile_stride, sp, orow, 16 * t0, n, pf);
        } else {   // the last, partial unit: one tile at a time
          for (int64_t t = t0; t < t0 + count; ++t)
            one(pass[p], groups, quads, k / 4, wp + t * tile_stride, tile_stride, sp, orow, 16 * t, n, nullptr);
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "w8a8_gemm needs a build for a CPU with AVX512-BF16 and AVX512-VNNI");
#endif
  return out;
}

// x [M, K] bf16 -> (hi int8 [M, K], lo int8 [M, K], sx float32 [M]): the kernels' MX activations
// (int8_activations.h quantize_row_mx; portable: quantize_row_mx_scalar, int8_gemm_avx2.cpp's), for
// tests against kernels/linear.py's quantize_int8_mx.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_mx(const at::Tensor& x_in, bool portable) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.size(1) % 32 == 0,
              "x must be bf16 [M, K], K a multiple of 32");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor hi = at::empty({m, k}, x.options().dtype(at::kChar)), lo = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor sx = at::empty({m}, x.options().dtype(at::kFloat));
  for (int64_t r = 0; r < m; ++r) {
    float s2[2];
    int32_t c2[2];
    int8_t* h = hi.data_ptr<int8_t>() + r * k;
    int8_t* l = lo.data_ptr<int8_t>() + r * k;
    const at::BFloat16* row = x.data_ptr<at::BFloat16>() + r * k;
#if PDSERVE_INT8_GEMM
    if (!portable) {
      pdserve_int8::quantize_row_mx(row, k, h, l, s2, c2);
    } else {
      pdserve_int8::quantize_row_mx_scalar(row, k, h, l, s2, c2);
    }
#else
    pdserve_int8::quantize_row_mx_scalar(row, k, h, l, s2, c2);
#endif
    sx.data_ptr<float>()[r] = s2[0];
  }
  return {hi, lo, sx};
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
  m.def("w8a8_gemm(Tensor x, Tensor packed, Tensor wscale, int n, int group=32, ScalarType? out_dtype=None) -> Tensor");
  m.def("available() -> bool", &available);
  m.def("quantize_mx(Tensor x, bool portable=False) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pdserve_int8, CPU, m) {
  m.impl("w8a8_gemm", &w8a8_gemm);
  m.impl("quantize_mx", &quantize_mx);
}
