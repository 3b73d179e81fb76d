// INT8 linear layers from 5 rows on (kernels/linear.py's Int8Linear, kernel "w8a8_vnni_large": the
// 16-row decode bucket where the activations take groups, and prefill): the same product, packed weight and numerics as
// kernels/csrc/int8_gemm.cpp's w8a8_gemm (read its header: q + 128 uint8 tiles [N/16][K/4][16][4],
// per-output-channel fp32 scales, activations quantized in the call per token and group of G
// channels, the -128 sum(xq) start of each group's int32 sum, fp32 across groups in order, one
// rounding to bf16), register-blocked for many rows:
//
//   out[m, n] = wscale[n] * sum_g sx[m, g] * sum_{k in g} xq[m, k] q[n, k]
//
// Why a second kernel: w8a8_gemm is built for 1-4 rows. At 16 rows a pass, one weight line feeds
// 16 vpdpbusd whose broadcasts each read memory (17 loads per 16 vpdpbusd), and its fp32 sums
// across groups live in an L1 block (a load and a store per row, tile and group); at 512+ rows
// that made it only as fast as bf16's GEMM. Here a micro-kernel takes 4 rows x 3 tiles (48 output
// columns): 12 int32 sums for the group under way, 12 fp32 sums across groups, all in registers
// (27 of 32 zmm with the 3 weight lines), 3 weight loads and 4 broadcasts per 12 vpdpbusd. The one
// fma per row, tile and group that the numerics need shares vpdpbusd's pipes (Zen 4: 12 vpdpbusd
// + 2 fma take 14 cycles): groups of 32 cap the kernel at 8/9 of vpdpbusd's rate, 64 at 16/17.
//
// Blocking: a panel is 3 tiles x all K (27 KB at K = 576, 72 KB at K = 1536: L1 or L2) and every
// 4-row block of the call runs over it, so each weight byte is read from DRAM once per call; the
// threads take disjoint ranges of panels (at::parallel_for; at decode sizes only with 128 KB of
// weight or more each, as w8a8_gemm). While the first 4 blocks run over a panel they ask the
// thread's next panel into L2 (each block all of it: a decode step finds every weight in DRAM,
// and with the prefetches in the first block only the 16-row step was 4-9% slower, Zen 4; one
// panel ahead, not two). The activations are quantized once per call, 4 rows at a time
// (int8_activations.h quantize_block; in parallel over the blocks from 64 rows), into a 4-row quad
// layout [M/4][K/4][4] int32 (a block's broadcasts are one pointer plus an immediate offset);
// rows past M in the last block are zero rows, and a last block of 1-3 rows computes only those.
// Measured and not kept (2 threads, M = 512 and 2048, load 3.6): the rows in chunks of 64 or 256
// (each thread's panels over one chunk of rows at a time, so the chunk's activations and outputs
// stay in L2): within noise (1-3%) on the model's four shapes. At decode sizes (Zen 4, the model's
// 121 linears in sequence, cold, 16 rows, A/B in one process): the prefetch two panels ahead
// (+3%), with a T0 or NTA hint (+15%), in the first block only (+17%) or the first two (+1.5%), or
// spread over the blocks (each a quarter of the lines; noise), the whole first panel asked at the
// call's start or before the quantization (noise), the next linear's first panels asked before
// each call (slower); the two threads taking panels from the two ends of the range until they meet
// (+4.5%); each thread quantizing the rows itself after asking its first panel into L2, or a share
// of them behind a barrier (1% faster: not worth a second code path); the micro-kernel with the
// -128 sum(xq) start added at the group's end (no start registers, no fp32 spills) and the
// prefetch branch hoisted (same speed). Where 16 rows go now (2 threads, per call, decode order):
// compute at 92-94% of vpdpbusd's rate with the fma (hot, per thread), ~3 us of fixed cost (the
// output and buffers, the serial quantization, the fork), and weights from DRAM: at 16 rows the
// kernel at full speed reads ~29 GB/s of weight, ~3/4 of what the two cores read streaming (~40),
// and the calls of the small linears (o_proj, qkv_proj) run ~30-50% slower cold than hot.
// Measured on 2026-12-06 (the same host; the 120 decoder linears at 16 rows in sequence, random
// weights on 4 KiB pages, A/B in one process; timestamps inside the call): per call ~2.1 us of
// serial quantization, ~1.1 us until both threads start and ~0.3 us of join, ~4.7 us in all with
// the threads' imbalance (the fixed cost above, measured inside the call: ~0.57 ms a step); whole
// calls, hot, one thread (quantization and call overhead included, unlike the 92-94% above of the
// micro-kernel alone) run at 77-84% of vpdpbusd's rate (one a cycle per core, 467 Gop/s at 3.65
// GHz); the model's linears called in sequence, cold, at 67% of torch._int_mm's 853 Gop/s on both
// cores (bench quant's floor columns; bf16's small_gemm reaches 88% of torch.mm's), while the two
// cores' streaming reads measured 25-35 GB/s that day (bench/floors.py; the ~40 above is an
// earlier day's). Not kept: each thread asking its first panel of the next call into L2 during
// its last panel (3.5% slower, also with 20 us between the calls), prefetcht0 4-16 lines ahead in
// the first block (noise); and one scale per token everywhere (no per-group int32 -> fp32
// conversion and fma) saves only 6.5% of the 120 calls (6.56 -> 6.13 ms): it is not the groups
// that hold 16 rows back.
// Where the rest goes, measured the next session (2026-12-06, same host, the 121 linears of a step
// at 16 rows in sequence from Python, A/B in one process, best of 8-10): cold (every weight from
// DRAM) 7.3-8.5 ms against 5.3-6.7 hot (one layer's weights over and over), i.e. 13-40% lost to
// memory, varying with the host's load. Not kept: the panel in K chunks of 64-384 channels (each
// chunk L1-resident across the 4 row blocks, fp32 sums spilled between chunks): hot 5.30 -> 5.67-6.37
// ms, the smaller chunks the slower; the 3 tiles of a panel interleaved line by line (one
// contiguous stream per thread): cold 8.47 -> 8.59 ms, and with no software prefetch 9.74 (the
// hardware prefetcher alone is 15% slower); the whole next linear asked into L2/L3 (T0, T1, T2,
// NTA) spread over the call: 8.5 -> 9.7-11.9 ms; the next call's first 1-4 panels asked during the
// last 1-2 panels: within 2%; the weights in one arena faulted in on huge pages: same as torch's
// tensors collapsed (7.33 vs 7.37 ms); nor is it the kernel's other parts: without the activation
// quantization, with one group, without the output stores or with a preallocated output, cold
// still loses 13-20% against hot (measured together, one minute). A synthetic replica in C (the
// same call sequence and sizes, 48-column panels read 4 times with 4 vpdpbusd a line, the next
// panel asked into L2, an OpenMP region a call) loses 7-16% cold, depending on the minute: the
// loss is the host's DRAM under this compute density, not this kernel's layout or prefetches. (The
// host's speed itself moves: the same hot run took 6.4 ms and, a minute before, 9.3.)
// The cold loss is int8's more than bf16's (a later session, same host: the 121 linears at 16 rows
// from Python, each call timed cold in step order and again at once, its weight then in L2/L3; best
// of 8): bf16 (small_gemm) 12.39 ms cold, 11.94 hot (4%); int8 8.21 cold, 7.04 hot (17%): o_proj
// 0.89 / 0.60, qkv 1.14 / 0.92, down 1.81 / 1.49, gate_up 2.79 / 2.46, the LM head 1.58 / 1.56 (its
// 28 MB is cold either way; on weights in cache it would take ~1.3). Both kernels need ~4 bytes of
// weight a cycle per core at full speed (a 64-byte line feeds 16 vpdpbusd, or 16 vdpbf16ps); bf16
// computes slower and so hides its stream better. Hot, the int8 linears would be 1.70x bf16's; cold
// they are 1.51x. Inside the decode step it is otherwise (the next session, same host, 16 rows, one
// process, profiler self-times, A/B): with every layer reading layer 0's weights (all in cache) the
// int8 GEMMs of a step went 8.18 -> 7.64 ms and bf16's 11.19 -> 10.48, so in the step the misses
// cost both alike; there int8's GEMMs run ~1.56x bf16's (1.52x called alone), and what keeps the
// step near 1.4x is the rest of it (attention, small ops, Python: ~2-3 ms, the same for both).
// In the model (bf16, int8, 2 threads, fused decoder loop, A/B alternating in one process, logits
// equal bit for bit): a 2048-token prefill forward 746 -> 648 ms (1.15x; quiet lock, load 2.5), a
// 1024-token one 978 -> 802 ms (heavy lock, load 3.8) against w8a8_gemm. At 1 row its panels make
// a weight load per vpdpbusd: Int8Linear offers it from the 16-row bucket on.
//
// Numerics: the same operations in the same order as w8a8_gemm (the quantization: amax, scale =
// amax / 127, x * (1 / scale) rounded half to even; the int32 group sums are exact; each group's
// sum converted to fp32 and fma'd with sx into the row's fp32 sum, groups in order; times wscale;
// one round to bf16), so the output equals w8a8_gemm's bit for bit (tests/test_int8_gemm_prefill.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "gemm_output.h"
#include "int8_activations.h"

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define PDSERVE_INT8P_GEMM 1
#include <immintrin.h>
#endif

namespace {

using pdserve_gemm_out::OutRows;

#if PDSERVE_INT8P_GEMM
constexpr int kRows = 4;         // rows per micro-kernel call
constexpr int kTiles = 3;        // tiles of 16 output columns per panel
constexpr int64_t kPrefetchBlocks = 4;   // the first blocks over a panel ask the next panel into L2

// The quantized activations of a call, in blocks of kRows rows.
struct Blocks {
  int32_t* xq;     // [M/4][K/4][4]: the 4 bytes xq[4 b + r, 4 kq .. 4 kq + 3] at xq[(b K/4 + kq) 4 + r]
  float* sx;       // [M/4][K/group][4]: sx[4 b + r, g] at sx[(b groups + g) 4 + r]
  int32_t* corr;   // [M/4][K/group][4]: -128 sum_{k in g} xq[4 b + r, k], same indexing
  int64_t k4, groups;
  int64_t wk4;     // the weight's K/4: k4, or k4 / 2 for MX digits (hi | lo, each over the whole weight)
};

// Rows [4 b, 4 b + R) x tiles [0, NT) of the panel at w (tile t at w + t tile_stride, output
// columns n0 + 16 t ..): out[m, col] for col < n. next: the next panel (same tile stride), asked
// into L2 line by line as this one is read, or nullptr.
template <int NT, int R>
void micro_kernel(const Blocks& q, int64_t b, int64_t quads, const uint8_t* w, int64_t tile_stride, const float* wscale,
                  const OutRows& out, int64_t n0, int64_t n, const uint8_t* next) {
  __m512 facc[R][NT];
  for (int m = 0; m < R; ++m)
    for (int t = 0; t < NT; ++t) facc[m][t] = _mm512_setzero_ps();
  const int32_t* xq = q.xq + b * q.k4 * kRows;
  const float* sx = q.sx + b * q.groups * kRows;
  const int32_t* corr = q.corr + b * q.groups * kRows;
  for (int64_t g = 0; g < q.groups; ++g) {
    __m512i iacc[R][NT];
    for (int m = 0; m < R; ++m) {
      const __m512i start = _mm512_set1_epi32(corr[g * kRows + m]);
      for (int t = 0; t < NT; ++t) iacc[m][t] = start;
    }
    const int32_t* xk = xq + g * quads * kRows;
    const bool first = g * quads < q.wk4;   // (MX: the lo digits reread the weight)
    const uint8_t* wk = w + (first ? g * quads : g * quads - q.wk4) * 64;
#pragma GCC unroll 4
    for (int64_t i = 0; i < quads; ++i) {
      __m512i wv[NT];
      for (int t = 0; t < NT; ++t) {
        if (next != nullptr && first) _mm_prefetch(reinterpret_cast<const char*>(next + t * tile_stride + (g * quads + i) * 64), _MM_HINT_T1);
        wv[t] = _mm512_loadu_si512(wk + t * tile_stride + i * 64);
      }
      for (int m = 0; m < R; ++m) {
        const __m512i a = _mm512_set1_epi32(xk[i * kRows + m]);
        for (int t = 0; t < NT; ++t) iacc[m][t] = _mm512_dpbusd_epi32(iacc[m][t], wv[t], a);
      }
    }
    for (int m = 0; m < R; ++m) {
      const __m512 s = _mm512_set1_ps(sx[g * kRows + m]);
      for (int t = 0; t < NT; ++t) facc[m][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][t]), s, facc[m][t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t col = n0 + 16 * t;
    if (col >= n) break;
    const __m512 s = _mm512_loadu_ps(wscale + col);
    const __mmask16 mask = pdserve_gemm_out::columns_mask(n - col);
    for (int m = 0; m < R; ++m) out.store(b * kRows + m, col, mask, _mm512_mul_ps(facc[m][t], s));
  }
}

// MX rows (int8_activations.h quantize_row_mx) -> block b of q (rows past `rows` all zero): the
// hi digits' quads, then the lo digits'; sx and corr per "group" 0 (hi) and 1 (lo).
void quantize_block_mx(const at::BFloat16* x, int64_t ldx, int rows, int64_t k, const Blocks& q, int64_t b) {
  std::vector<int8_t> digits(2 * k);
  for (int r = 0; r < kRows; ++r) {
    float s2[2] = {1.f, 1.f};
    int32_t c2[2] = {0, 0};
    if (r < rows) {
      pdserve_int8::quantize_row_mx(x + r * ldx, k, digits.data(), digits.data() + k, s2, c2);
    } else {
      std::fill(digits.begin(), digits.end(), int8_t{0});
    }
    for (int64_t kq = 0; kq < q.k4; ++kq) std::memcpy(q.xq + (b * q.k4 + kq) * kRows + r, digits.data() + 4 * kq, 4);
    for (int g = 0; g < 2; ++g) {
      q.sx[(b * 2 + g) * kRows + r] = s2[g];
      q.corr[(b * 2 + g) * kRows + r] = c2[g];
    }
  }
}

using MicroKernel = void (*)(const Blocks&, int64_t, int64_t, const uint8_t*, int64_t, const float*, const OutRows&,
                             int64_t, int64_t, const uint8_t*);

// micro_kernel<NT, R> for a panel of nt tiles (1-3) and a block of rows rows (1-4): a last block
// of fewer rows computes only those (5 rows: 4 + 1, not 8).
template <int NT>
constexpr MicroKernel for_rows(int rows) {
  return rows == 1 ? &micro_kernel<NT, 1> : rows == 2 ? &micro_kernel<NT, 2> : rows == 3 ? &micro_kernel<NT, 3> : &micro_kernel<NT, 4>;
}
MicroKernel pick(int nt, int rows) { return nt == 3 ? for_rows<3>(rows) : nt == 2 ? for_rows<2>(rows) : for_rows<1>(rows); }
#endif

// out [M, N] (out_dtype: bf16 when None, or float32 holding the bf16 values) = x [M, K] bf16 (rows
// contiguous, or copied so) times the packed weight, as pdserve_int8::w8a8_gemm (same arguments,
// same checks, same result).
at::Tensor w8a8_gemm_large(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& wscale, int64_t n,
                           int64_t group, std::optional<at::ScalarType> out_dtype) {
  const at::Tensor x = pdserve_int8::checked_input(x_in, packed, wscale, n, group);
  const int64_t m = x.size(0), k = x.size(1), tiles = packed.size(0);
  at::Tensor out = at::empty({m, n}, x.options().dtype(pdserve_gemm_out::out_dtype(out_dtype)));
#if PDSERVE_INT8P_GEMM
  if (m == 0) return out;
  // MX activations (int8_activations.h quantize_row_mx): two "groups" over the whole weight
  const bool mx = group == pdserve_int8::kMxGroup;
  const int64_t groups = mx ? 2 : k / group, quads = mx ? k / 4 : group / 4, k4 = groups * quads;
  const int64_t blocks = (m + kRows - 1) / kRows;
  // (every entry written by quantize_block, the last block's padding rows as zero rows)
  const std::unique_ptr<int32_t[]> xq(new int32_t[blocks * k4 * kRows]);
  const std::unique_ptr<float[]> sx(new float[blocks * groups * kRows]);
  const std::unique_ptr<int32_t[]> corr(new int32_t[blocks * groups * kRows]);
  const Blocks q{xq.get(), sx.get(), corr.get(), k4, groups, k / 4};
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {   // (16 blocks: decode's rows quantized inline)
    for (int64_t b = b0; b < b1; ++b) {
      if (mx) {
        quantize_block_mx(xp + b * kRows * ldx, ldx, static_cast<int>(std::min<int64_t>(kRows, m - b * kRows)), k, q, b);
        continue;
      }
      pdserve_int8::quantize_block(xp + b * kRows * ldx, ldx, static_cast<int>(std::min<int64_t>(kRows, m - b * kRows)), k,
                                   group, pdserve_int8::QuantizedRows{q.xq + b * k4 * kRows, q.sx + b * groups * kRows,
                                                                      q.corr + b * groups * kRows, kRows});
    }
  });
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = wscale.data_ptr<float>();
  const OutRows rows_out = pdserve_gemm_out::out_rows(out);
  const int64_t tile_stride = k * 16;
  const int64_t panels = (tiles + kTiles - 1) / kTiles;
  // Threads only with 128 KB of weight or more for each (as w8a8_gemm: a hand-off costs more than that much work).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / (tile_stride * kTiles));
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t t0 = p * kTiles;
      const int count = static_cast<int>(std::min<int64_t>(kTiles, tiles - t0));
      const uint8_t* w = wp + t0 * tile_stride;
      // the next panel of this thread, if whole (a partial one is the last and small)
      const uint8_t* next = p + 1 < p1 && tiles - t0 >= 2 * kTiles ? w + kTiles * tile_stride : nullptr;
      for (int64_t b = 0; b < blocks; ++b) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, m - b * kRows));
        pick(count, rows)(q, b, quads, w, tile_stride, sp, rows_out, 16 * t0, n, b < kPrefetchBlocks ? next : nullptr);
      }
    }
  });
#else
  TORCH_CHECK(false, "w8a8_gemm_large needs a build for a CPU with AVX512-BF16 and AVX512-VNNI");
#endif
  return out;
}

bool available() {
#if PDSERVE_INT8P_GEMM
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(pdserve_int8p, m) {
  m.def("w8a8_gemm_large(Tensor x, Tensor packed, Tensor wscale, int n, int group=32, ScalarType? out_dtype=None) -> Tensor");
  m.def("available() -> bool", &available);
}

TORCH_LIBRARY_IMPL(pdserve_int8p, CPU, m) { m.impl("w8a8_gemm_large", &w8a8_gemm_large); }
