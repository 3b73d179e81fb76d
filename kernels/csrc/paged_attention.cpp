// Paged attention on CPU, reading K/V in place through the block table (no gather copy), for
// every kind of row a forward mixes: decode tokens, verification runs and prefill chunks at any
// start position (chunked prefill, prefix-cache hits), causal inside the chunk.
//
// Work items. A sequence's chunk is cut into query tiles of at most kTileRows rows per KV head
// (a row = one query token x one of the G query heads that share the KV head: decode has G rows,
// a 16-token tile 16 G). One item = one tile of one sequence over one KV head, or, for a tile
// of at least PDSERVE_ATTN_WHOLE_MIN_ROWS (16) rows per KV head when there are enough tiles for
// every thread, over all its KV heads (each cache block is then one contiguous range of memory).
// Decode and short verification tiles stay one item per KV head even at large batches: with
// K/V cold (shuffled tables) that measured 1.24-1.37x faster than one item over all heads (one
// thread, bf16: b16 ctx ~150 176 -> 137 us a layer, b32 359 -> 290, b16 ctx ~400 430 -> 315, b4
// 46 -> 39, b1 unchanged; 2026-12-02, load 5, A/B in one process through the env knob
// PDSERVE_ATTN_WHOLE_MIN_ROWS=0, which restores the earlier choice; two threads, load 2, best of
// 15: b16 ctx ~150 96 -> 82 us, b32 198 -> 165, b16 ctx ~400 258 -> 190, b4 31 -> 28, b1 equal;
// the decode step at b16 11.55 -> 11.19 ms, b32 19.33 -> 18.91; an FP8 cache, one thread, is
// bound by its conversions and gained 0-5%). Items go to torch's
// intra-op threads (at::parallel_for, OpenMP) through an atomic counter, so tiles of different
// cost balance.
//
// Inside an item the visible keys (0 .. start + last query of the tile) are taken in partitions
// of about kPartitionKeys keys (whole blocks), each in three passes over its blocks:
//   1. scores: s = scale q . k for every row and key (the K block read once per KV head, reused
//      by every row of the head from L1; with AVX512-BF16 and a bf16 query and cache, vdpbf16ps
//      on the cache's bytes; else the block converted to fp32 once);
//   2. softmax: per row, the partition's max (keys past the row's causal limit excluded), the
//      running max updated once, p = exp(s - max) vectorized over the whole partition, the running
//      sum and accumulator rescaled once;
//   3. values: acc += p V; with AVX512-BF16, a bf16 query and a bf16 or FP8 cache, as bf16 pair
//      dot products of P (split hi + lo) and V pairs read in place (pv_native); otherwise the V
//      block converted to fp32 once and streamed through register tiles of up to 6 rows x
//      head_dim accumulators.
// Each block of pass 1 asks for K of the block PDSERVE_ATTN_L2_AHEAD (4) blocks on into L2, and
// each block of pass 3 for V, each 64-byte line once; near a pass's end it asks for the first
// blocks of the pass after it (V of the partition for pass 3, K of the next partition or of the
// item its thread takes next, claimed in advance). Block tables are shuffled, so no hardware
// prefetcher finds the blocks; and split that way the requests are spread over all the work, not
// bunched in pass 1 (where K and V of a block were both asked for): Zen 4 host, K/V cold, 2
// threads, A/B in one process, median of 9, us a layer: contiguous tables bf16 b16 ctx 128 64 ->
// 57, b32 ctx 256 246 -> 207, b16 ctx 1024 708 -> 546, fp32 b16 ctx 256 320 -> 233; shuffled
// tables bf16 b16 ctx 128 106 -> 100, b32 ctx 256 265 -> 270, b16 ctx 1024 564 -> 587, fp32 b16
// ctx 256 328 -> 277; b1 equal (4 blocks ahead; 2 ahead without the split measured the same as 4).
// On the Zen 4 host of 2026-12-06 that one prefetch per line replaced five (the next K block into
// L1 and its V into L2, the far blocks into L2, the next V block into L1 again in pass 3): K/V
// cold, 2 threads, A/B in one process, best of 9: bf16 b16 ctx 256 157 -> 140 us a layer, b32 330
// -> 278, b16 ctx 1024 535 -> 461; fp32 b16 ctx 256 355 -> 279, b32 693 -> 589; b1 equal; and
// making every prefetch an asm statement (prefetch_block) 141 -> 125 more (contiguous tables
// 126 -> 107), before the split above. On that host DRAM is ~190 ns away and a core keeps ~20
// scattered lines in flight: plain reads of the b16 ctx 256 layer's 3.1 MB of K/V in this
// kernel's order (shuffled 6 KB blocks, one KV head's 128-byte rows) take ~146 us on 2 threads,
// ~106 us with this prefetch, and the kernel ~110-125 us; contiguous tables, read whole blocks in
// order, ~76 us (the hardware streamer).
// Tried and not kept (2026-12-06, the Zen 4 host, 2 threads, K/V cold, A/B in one process): one
// item over all KV heads for decode (each block one contiguous 6 KB range, which plain reads of
// contiguous tables stream at ~41 GB/s through the hardware prefetcher): b16 ctx 256 1.3-1.5x
// slower than one-head items, with or without software prefetches for blocks adjacent to the
// previous one; V also asked for in pass 1 (as well as in pass 3): equal with shuffled tables,
// 1.05-1.2x slower with contiguous ones; the prefetch 8 blocks ahead instead of 4: equal.
// Tried and not kept (2026-12-02, one thread, K/V cold, A/B in one process): reading each
// partition's K/V blocks first in one burst of plain loads (every line, nothing between them),
// then computing on them from L2: 1.1-1.18x on items over all KV heads (b16 ctx ~150 175 -> 155
// us a layer) but 1.5-1.7x slower on one-head items (strided rows: b1 ctx 1024 50 -> 96 us), and
// one-head items without it are faster still (137 us). With one-head items (the Zen 5 host of
// then; on Zen 4 see above): dropping the near prefetches (next K block into L1, its V into L2)
// 1.4-1.6x slower cold; one prefetch per 128 B (leaving the pair's other line to the hardware)
// 1.7-2x slower; the far prefetch with the T0 or T2 hint, or PDSERVE_ATTN_L2_AHEAD 2, 3, 6:
// within noise of T1 and 4 (those runs predate the asm prefetch below). With K/V in L2 the same
// kernel takes ~0.6x the time (b16 ctx ~150, one thread: ~88 of ~140 us); of those 88, skipping
// each part (timed, results discarded) saved P V ~17, scores ~12, softmax ~17: the remaining ~50
// are the prefetch instructions, the P packing and the per-block bookkeeping. Split-K in runs of
// whole blocks (so a b1 context under two partitions also splits, 3 KV heads on 2 threads):
// b1 ctx ~150 12.3 -> 12.8 us, ~700 26 -> 24, 64, 300 and 1024 equal (two threads): not kept.
// PDSERVE_ATTN_DECODE=fp32 (read at each call) restores the fp32 P V with K/V asked for one block
// ahead: the earlier kernel, kept for A/B measurements (bench/attention.py) and as a fallback.
// This is the two-pass softmax within a partition and FlashAttention's online rescaling between
// partitions (Milakov & Gimelshein 2018; Dao et al. 2022). The earlier kernel did the online step
// per 16-key block and row (max, exp, sum, rescale in one dependency chain per block), which bound
// decode on latency, not on memory or arithmetic. Accumulation is fp32 whatever the cache dtype.
//
// On CPUs with AMX-BF16, decode and short verification rows (up to 8 a KV head, bf16 queries
// over a bf16 or FP8 cache) go through attend_decode_amx: both products as tile products, and
// with enough sequences for the threads one item over every KV head (each cache block one
// contiguous range, every head's scores in one tile). Emerald Rapids, 2 threads, K/V shuffled and
// read from L3 (30 layers in turn), A/B in one process, us a layer: b16 ctx 128 79 -> 54 (one
// head an item 72), ctx 300 159 -> 107 (125); an FP8 cache 84 -> 62, 173 -> 116; in the 16-row
// decode step (SmolLM2-135M, ctx 128) attention 2.37 -> 2.02 ms (bf16), 2.32 -> 1.84 (int8).
//
// Small batches split a tile's keys over several items (split-K, as flash decoding does): each
// writes its partial (max, sum, accumulator) and a final pass merges them, so a single sequence
// still occupies every thread.
//
// Caches: fp32, bf16, fp16, or FP8 E4M3 with per-layer or per-KV-head fp32 scales (the cache holds
// x / scale, see kernels/torch_ref.py): the K scale is folded into the query, the V scale into the
// final normalization, the bytes dequantized to fp32 in the kernel.
//
// AVX-512 where the compiler targets it (-march=native), head_dim in {32, 64, 128}; AVX2 (8 lanes:
// scores 8 keys at a time reduced by a hadd tree, the softmax's max/exp/sum, P V in register tiles
// of 3 rows x 32 columns; fp32/bf16/fp16 caches) on CPUs without AVX-512; a portable
// scalar path with the same algorithm elsewhere.
// Only the headers the kernel needs (torch/extension.h takes ~15 s of the build to parse, these ~3 s);
// registered as torch operators (no pybind): torch.ops.pdserve_attn.*.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__SSE__)
#include <immintrin.h>
#endif

#include "amx_tiles.h"
#include "dtype_dispatch.h"
#include "simd_math.h"

namespace {

#if defined(__AVX512F__)
using pdserve_simd::exp_neg;
using pdserve_simd::load16;
#elif defined(__AVX2__) && defined(__FMA__)
// CPUs with AVX2 but not AVX-512: scores, softmax and P V in 8-lane vectors (the portable loops
// left the dot products scalar: gcc does not reorder a float sum), fp32 / bf16 / fp16 caches.
#define PDSERVE_ATTN_AVX2 1
using pdserve_simd::exp_neg8;
using pdserve_simd::kLoad8;
using pdserve_simd::load8;
#endif

// Tuning knobs (-D to measure variants): rows per KV head of one item (16 queries at G = 3); keys
// per partition (rounded to whole blocks; 512 measured 0-10% faster than 256 for decode at 2
// threads, 128 slower); how many blocks ahead pass 1 asks for K and V.
#ifndef PDSERVE_ATTN_TILE_ROWS
#define PDSERVE_ATTN_TILE_ROWS 48
#endif
#ifndef PDSERVE_ATTN_PARTITION
#define PDSERVE_ATTN_PARTITION 512
#endif
#ifndef PDSERVE_ATTN_L2_AHEAD
#define PDSERVE_ATTN_L2_AHEAD 4
#endif
#ifndef PDSERVE_ATTN_WHOLE_MIN_ROWS
#define PDSERVE_ATTN_WHOLE_MIN_ROWS 16
#endif
#ifndef PDSERVE_ATTN_WHOLE_MAX_ROWS
#define PDSERVE_ATTN_WHOLE_MAX_ROWS 1024
#endif
constexpr int kTileRows = PDSERVE_ATTN_TILE_ROWS;
constexpr int kPartitionKeys = PDSERVE_ATTN_PARTITION;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
inline float to_f32(T x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
inline __mmask16 tail_mask(int n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }
#endif

// dst[t * d + i] = src[t * stride + i] as fp32, t < n: one block's K (or V) rows of one KV head.
template <typename T>
inline void load_block(float* dst, const T* src, int64_t stride, int n, int d) {
  for (int t = 0; t < n; ++t) {
    const T* row = src + t * stride;
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= d; i += 16) _mm512_storeu_ps(dst + t * d + i, load16(row + i));
#elif PDSERVE_ATTN_AVX2
    if constexpr (kLoad8<T>)
      for (; i + 8 <= d; i += 8) _mm256_storeu_ps(dst + t * d + i, load8(row + i));
#endif
    for (; i < d; ++i) dst[t * d + i] = to_f32(row[i]);
  }
}

// Ask for a block's rows (span elements from each of n tokens, stride apart) into L2 before they
// are needed: the blocks of a sequence are scattered, so the hardware prefetcher cannot guess
// them. Rows that follow each other (span == stride: every KV head of the block) are one range.
// prefetcht1 as an asm statement: gcc 12 drops _mm_prefetch loops as dead code when they run
// under a run-time condition (here half the call sites: the item's next blocks vs the next
// item's first ones; the asm statement kept all four, decode 1.1-1.2x faster cold).
template <typename T>
inline void prefetch_block(const T* src, int64_t stride, int n, int64_t span) {
#if defined(__AVX512F__) || defined(__SSE__)
  const int64_t bytes = span * static_cast<int64_t>(sizeof(T));
  const int rows = span == stride ? 1 : n;
  const int64_t row_bytes = span == stride ? bytes * n : bytes;
  for (int t = 0; t < rows; ++t) {
    const char* row = reinterpret_cast<const char*>(src + t * stride);
    for (int64_t off = 0; off < row_bytes; off += 64) asm volatile("prefetcht1 %0" : : "m"(row[off]));
  }
#endif
}

#if defined(__AVX512F__)
// Lane t of the result = the sum of the 16 lanes of a[t]: 16 horizontal sums as one transpose-
// and-add tree (45 shuffles and adds instead of 16 separate reductions of ~8 each).
inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int k = 0; k < 4; ++k) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * k]), _mm512_castps_pd(b[2 * k + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * k]), _mm512_castps_pd(b[2 * k + 1]));
    c[k] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d01, d23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// s[t] = q . k_t for t < n, k_t = kf + t * ld (fp32), head_dim = 16 NC.
template <int NC>
inline void scores_f32(const float* q, const float* kf, int64_t ld, int n, float* s) {
  __m512 qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  int t0 = 0;
  for (; t0 + 16 <= n; t0 += 16) {   // whole groups of 16 keys: no per-key branch
    __m512 a[16];
    const float* k = kf + t0 * ld;
    for (int t = 0; t < 16; ++t) {
      a[t] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k + t * ld));
      for (int c = 1; c < NC; ++c) a[t] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + t * ld + 16 * c), a[t]);
    }
    _mm512_storeu_ps(s + t0, reduce16(a));
  }
  if (t0 < n) {
    const int m = n - t0;
    __m512 a[16];
    for (int t = 0; t < 16; ++t) {
      if (t >= m) {
        a[t] = _mm512_setzero_ps();
        continue;
      }
      const float* k = kf + (t0 + t) * ld;
      __m512 x = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
      for (int c = 1; c < NC; ++c) x = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), x);
      a[t] = x;
    }
    _mm512_mask_storeu_ps(s + t0, tail_mask(m), reduce16(a));
  }
}

// acc[r] += sum_t p[r][t] v_t for RB rows (p rows ps apart), t < n, v_t = v + t * ld (fp32, or
// converted as it is loaded); head_dim = 16 NC. RB x NC accumulators stay in registers for the
// whole block.
template <int NC, int RB, typename V>
inline void accumulate_rows(float* acc, int64_t acc_ld, const float* p, int64_t ps, const V* v, int64_t ld, int n) {
  __m512 a[RB][NC];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = _mm512_loadu_ps(acc + r * acc_ld + 16 * c);
  for (int t = 0; t < n; ++t) {
    __m512 x[NC];
    for (int c = 0; c < NC; ++c) x[c] = load16(v + t * ld + 16 * c);
    for (int r = 0; r < RB; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * ps + t]);
      for (int c = 0; c < NC; ++c) a[r][c] = _mm512_fmadd_ps(pr, x[c], a[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + r * acc_ld + 16 * c, a[r][c]);
}

// RB = rows % (max rows per tile), as a run-time switch over the instantiated tile heights.
template <int NC, int MAXRB, typename V>
inline void accumulate_tail(int rows, float* acc, int64_t acc_ld, const float* p, int64_t ps, const V* v,
                            int64_t ld, int n) {
  if constexpr (MAXRB > 0) {
    if (rows == MAXRB) return accumulate_rows<NC, MAXRB>(acc, acc_ld, p, ps, v, ld, n);
    return accumulate_tail<NC, MAXRB - 1>(rows, acc, acc_ld, p, ps, v, ld, n);
  }
}

// dst[t * 16 NC + i] = src[t * stride + i] as fp32, t < n (head_dim = 16 NC, unrolled).
template <int NC, typename T>
inline void load_block_fixed(float* dst, const T* src, int64_t stride, int n) {
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(dst + (t * NC + c) * 16, load16(src + t * stride + 16 * c));
}
#endif

#if defined(__AVX512BF16__)
// q [d] bf16 as d / 8 vectors at qb, chunk c (4 dwords, dims 8c .. 8c + 7) in all four 128-bit
// lanes of vector c: the query side of scores_rows.
inline void broadcast_chunks(const at::BFloat16* q, int d, uint32_t* qb) {
  for (int c = 0; c < d / 8; ++c)
    _mm512_storeu_si512(qb + 16 * c, _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 8 * c))));
}

// [t0 t1 t2 t3] of 128-bit chunks: r[j] = chunks 0..3 of key j -> kt[c] = chunk c of keys 0..3.
inline void transpose_chunks(const __m512i* r, __m512i* kt) {
  const __m512i x0 = _mm512_shuffle_i64x2(r[0], r[1], 0x44), x1 = _mm512_shuffle_i64x2(r[0], r[1], 0xEE);
  const __m512i x2 = _mm512_shuffle_i64x2(r[2], r[3], 0x44), x3 = _mm512_shuffle_i64x2(r[2], r[3], 0xEE);
  kt[0] = _mm512_shuffle_i64x2(x0, x2, 0x88);
  kt[1] = _mm512_shuffle_i64x2(x0, x2, 0xDD);
  kt[2] = _mm512_shuffle_i64x2(x1, x3, 0x88);
  kt[3] = _mm512_shuffle_i64x2(x1, x3, 0xDD);
}

// s[i * ss + t] = scale * (q_i . k_t) for RB rows i and keys t < n <= 16 of one KV head: qb as
// broadcast_chunks wrote it (rows D / 8 vectors apart), k_t = k + t * ld (bf16, read in place).
// Keys g, g + 4, g + 8, g + 12 sit side by side in the 128-bit lanes of vector g (a 4 x 4
// transpose of 128-bit chunks, 8 shuffles per 4 keys x 32 dims, shared by the RB rows), so
// vdpbf16ps leaves each key 4 partial sums, and one 4-lane reduction of the 4 vectors puts key
// g + 4 j (vector g, lane j) at position 4 j + g, in order: 9 instructions per row and 16 keys
// where a 16-lane sum per row and key (a transpose-and-add tree) took 45, with K loaded once for
// every row, not once per row. Keys at or past n read as zeros (never past the block).
template <int D, int RB>
inline void scores_rows(const uint32_t* qb, const at::BFloat16* k, int64_t ld, int n, float scale, float* s, int64_t ss) {
  __m512 acc[RB][4];
  for (int i = 0; i < RB; ++i)
    for (int g = 0; g < 4; ++g) acc[i][g] = _mm512_setzero_ps();
  for (int cg = 0; cg < D / 32; ++cg) {   // 32 dims (4 chunks, one 64-byte load per key) at a time
    __m512i kt[4][4];
    for (int g = 0; g < 4; ++g) {
      __m512i r[4];
      for (int j = 0; j < 4; ++j) r[j] = g + 4 * j < n ? _mm512_loadu_si512(k + (g + 4 * j) * ld + 32 * cg) : _mm512_setzero_si512();
      transpose_chunks(r, kt[g]);
    }
    for (int i = 0; i < RB; ++i)
      for (int c = 0; c < 4; ++c) {
        const __m512bh q = (__m512bh)_mm512_loadu_si512(qb + (i * (D / 8) + 4 * cg + c) * 16);
        for (int g = 0; g < 4; ++g) acc[i][g] = _mm512_dpbf16_ps(acc[i][g], (__m512bh)kt[g][c], q);
      }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int i = 0; i < RB; ++i) {
    const __m512 b0 = _mm512_add_ps(_mm512_unpacklo_ps(acc[i][0], acc[i][1]), _mm512_unpackhi_ps(acc[i][0], acc[i][1]));
    const __m512 b1 = _mm512_add_ps(_mm512_unpacklo_ps(acc[i][2], acc[i][3]), _mm512_unpackhi_ps(acc[i][2], acc[i][3]));
    const __m512 sum = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b0), _mm512_castps_pd(b1))),
                                     _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b0), _mm512_castps_pd(b1))));
    _mm512_mask_storeu_ps(s + i * ss, tail_mask(n), _mm512_mul_ps(sum, vscale));
  }
}

// scores_rows for rows r < rows (qb rows D / 8 vectors apart, s rows ss apart) over n keys of one
// block, 16 keys and up to 4 rows (16 accumulators beside 16 transposed K vectors) at a time.
template <int D>
inline void scores_block(const uint32_t* qb, int rows, const at::BFloat16* k, int64_t ld, int n, float scale, float* s,
                         int64_t ss) {
  for (int t0 = 0; t0 < n; t0 += 16) {
    const int m = std::min(16, n - t0);
    for (int r = 0; r < rows; r += 4) {
      const uint32_t* q = qb + static_cast<size_t>(r) * (D / 8) * 16;
      const at::BFloat16* kt = k + t0 * ld;
      float* out = s + r * ss + t0;
      switch (std::min(4, rows - r)) {
        case 4: scores_rows<D, 4>(q, kt, ld, m, scale, out, ss); break;
        case 3: scores_rows<D, 3>(q, kt, ld, m, scale, out, ss); break;
        case 2: scores_rows<D, 2>(q, kt, ld, m, scale, out, ss); break;
        default: scores_rows<D, 1>(q, kt, ld, m, scale, out, ss); break;
      }
    }
  }
}

// scores_block for head_dim d in {32, 64, 128}.
inline void scores_native(const uint32_t* qb, int rows, const at::BFloat16* k, int64_t ld, int n, int d, float scale,
                          float* s, int64_t ss) {
  switch (d) {
    case 64: return scores_block<64>(qb, rows, k, ld, n, scale, s, ss);
    case 128: return scores_block<128>(qb, rows, k, ld, n, scale, s, ss);
    case 32: return scores_block<32>(qb, rows, k, ld, n, scale, s, ss);
    default: break;
  }
}
#else
// Never called without AVX512-BF16 (native_bf16 is false there).
inline void scores_native(const uint32_t*, int, const at::BFloat16*, int64_t, int, int, float, float*, int64_t) {}
#endif

// Whether the query . key products run as bf16 dot products (AVX512-BF16, d in {32, 64, 128}):
// a bf16 query over a bf16 cache (read in place) or an FP8 cache (each K block converted to bf16
// once, exactly: E4M3 values have 4 significant bits; the K scale applied to the fp32 sums).
template <typename Q, typename KV>
inline bool native_bf16(int d) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<Q, at::BFloat16> &&
                (std::is_same_v<KV, at::BFloat16> || std::is_same_v<KV, at::Float8_e4m3fn>))
    return d == 32 || d == 64 || d == 128;
#endif
  (void)d;
  return false;
}

// dst[t * d + i] = src[t * stride + i] as bf16 (exact for E4M3), t < n, d a multiple of 16.
template <typename T>
inline void load_block_bf16(at::BFloat16* dst, const T* src, int64_t stride, int n, int d) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::Float8_e4m3fn>) {
    if (d % 32 == 0) {   // 32 bytes at a time by bit moves (the fp32 round trip cost FP8 decode the most)
      for (int t = 0; t < n; ++t)
        for (int i = 0; i < d; i += 32) _mm512_storeu_si512(dst + t * d + i, pdserve_simd::e4m3_to_bf16x32(src + t * stride + i));
      return;
    }
  }
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < d; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t * d + i), (__m256i)_mm512_cvtneps_pbh(load16(src + t * stride + i)));
#else
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) dst[t * d + i] = static_cast<at::BFloat16>(to_f32(src[t * stride + i]));
#endif
}

#if PDSERVE_ATTN_AVX2
// Lane t of the result = the sum of the 8 lanes of a[t] (a hadd tree: 6 hadds, 2 permutes, 1 add).
inline __m256 reduce8(const __m256* a) {
  const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

// s[t] = q . k_t for t < n, k_t = kf + t * ld (fp32), head_dim = 8 NC: 8 keys at a time, q read
// from L1 (8 accumulators and a q vector fit AVX2's 16 registers; q in registers would not).
template <int NC>
inline void scores_avx2(const float* q, const float* kf, int64_t ld, int n, float* s) {
  for (int t0 = 0; t0 < n; t0 += 8) {
    const int m = std::min(8, n - t0);
    __m256 a[8];
    for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
    const float* k = kf + t0 * ld;
    for (int c = 0; c < NC; ++c) {
      const __m256 qc = _mm256_loadu_ps(q + 8 * c);
      for (int t = 0; t < 8; ++t)
        if (t < m) a[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + t * ld + 8 * c), a[t]);
    }
    const __m256 sums = reduce8(a);
    if (m == 8) {
      _mm256_storeu_ps(s + t0, sums);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, sums);
      std::memcpy(s + t0, tmp, m * sizeof(float));
    }
  }
}

// acc[r][c0 ..] += sum_t p[r][t] v_t[c0 ..] for RB rows and 32 columns from c0 (4 vectors), t < n,
// v_t = v + t * ld: RB x 4 accumulators in registers for the whole block (decode: RB = 3, the G
// query heads of one KV head).
template <int RB, typename V>
inline void accumulate_rows_avx2(float* acc, int64_t acc_ld, const float* p, int64_t ps, const V* v, int64_t ld, int n) {
  __m256 a[RB][4];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm256_loadu_ps(acc + r * acc_ld + 8 * j);
  for (int t = 0; t < n; ++t) {
    const V* vt = v + t * ld;
    __m256 x[4];
    for (int j = 0; j < 4; ++j) x[j] = load8(vt + 8 * j);
    for (int r = 0; r < RB; ++r) {
      const __m256 pr = _mm256_broadcast_ss(p + r * ps + t);
      for (int j = 0; j < 4; ++j) a[r][j] = _mm256_fmadd_ps(pr, x[j], a[r][j]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(acc + r * acc_ld + 8 * j, a[r][j]);
}
#endif

// s[t] = q . k_t for t < n (fp32 rows of length d, k_t = kf + t * ld).
inline void scores(const float* q, const float* kf, int64_t ld, int n, int d, float* s) {
#if defined(__AVX512F__)
  switch (d) {
    case 64: return scores_f32<4>(q, kf, ld, n, s);
    case 128: return scores_f32<8>(q, kf, ld, n, s);
    case 32: return scores_f32<2>(q, kf, ld, n, s);
    default: break;
  }
#elif PDSERVE_ATTN_AVX2
  switch (d) {
    case 64: return scores_avx2<8>(q, kf, ld, n, s);
    case 128: return scores_avx2<16>(q, kf, ld, n, s);
    case 32: return scores_avx2<4>(q, kf, ld, n, s);
    default: break;
  }
#endif
  for (int t = 0; t < n; ++t) {
    float sum = 0.f;
    for (int i = 0; i < d; ++i) sum += q[i] * kf[t * ld + i];
    s[t] = sum;
  }
}

// acc[r] += sum_t p[r][t] v_t for rows r < rows (acc rows d apart, p rows ps apart), t < n,
// v_t = v + t * ld. V is converted to fp32 as it is loaded when one register tile covers every
// row (decode), else once into vf (bs x d floats) and read from L1 by every tile.
template <typename V>
inline void accumulate(float* acc, int rows, const float* p, int64_t ps, const V* v, int64_t ld, int n, int d,
                       float* vf) {
#if defined(__AVX512F__)
  auto tiles = [&](auto nc_tag, auto rb_tag) {
    constexpr int NC = decltype(nc_tag)::value, RB = decltype(rb_tag)::value;
    if (rows <= RB) {
      if (rows == RB) return accumulate_rows<NC, RB>(acc, d, p, ps, v, ld, n);
      return accumulate_tail<NC, RB - 1>(rows, acc, d, p, ps, v, ld, n);
    }
    const float* src = reinterpret_cast<const float*>(v);
    if constexpr (!std::is_same_v<V, float>) {
      load_block_fixed<NC>(vf, v, ld, n);
      src = vf;
      ld = d;
    }
    int r = 0;
    for (; r + RB <= rows; r += RB) accumulate_rows<NC, RB>(acc + r * d, d, p + r * ps, ps, src, ld, n);
    if (r < rows) accumulate_tail<NC, RB - 1>(rows - r, acc + r * d, d, p + r * ps, ps, src, ld, n);
  };
  switch (d) {  // RB x NC <= 24 accumulators, plus NC values and a broadcast, within 32 registers
    case 64: return tiles(std::integral_constant<int, 4>{}, std::integral_constant<int, 6>{});
    case 128: return tiles(std::integral_constant<int, 8>{}, std::integral_constant<int, 3>{});
    case 32: return tiles(std::integral_constant<int, 2>{}, std::integral_constant<int, 8>{});
    default: break;
  }
#elif PDSERVE_ATTN_AVX2
  if constexpr (kLoad8<V>) {
    if (d % 32 == 0) {   // 3 rows x 32 columns a register tile (12 of the 16 registers accumulate)
      for (int c0 = 0; c0 < d; c0 += 32) {
        int r = 0;
        for (; r + 3 <= rows; r += 3) accumulate_rows_avx2<3>(acc + r * d + c0, d, p + r * ps, ps, v + c0, ld, n);
        if (rows - r == 2) accumulate_rows_avx2<2>(acc + r * d + c0, d, p + r * ps, ps, v + c0, ld, n);
        if (rows - r == 1) accumulate_rows_avx2<1>(acc + r * d + c0, d, p + r * ps, ps, v + c0, ld, n);
      }
      return;
    }
  }
#endif
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t < n; ++t) {
      const float pt = p[r * ps + t];
      for (int i = 0; i < d; ++i) acc[r * d + i] += pt * to_f32(v[t * ld + i]);
    }
  (void)vf;
}

// Rows' softmax step over one partition: s[0 .. vis) -> exp(s - m_new), s[vis .. n) -> 0; m and l
// (running max and sum) updated, acc (d floats) rescaled. Returns false when the row sees no key.
inline bool softmax_row(float* s, int vis, int n, float& m, float& l, float* acc, int d) {
  for (int t = std::max(vis, 0); t < n; ++t) s[t] = 0.f;
  if (vis <= 0) return false;
  int t = 0;
  float bmax = kNegInf;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_set1_ps(kNegInf);
  for (; t + 16 <= vis; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
  if (t < vis) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail_mask(vis - t), s + t));
  bmax = _mm512_reduce_max_ps(vmax);
  t = vis;
#elif PDSERVE_ATTN_AVX2
  if (vis >= 8) {
    __m256 vmax = _mm256_set1_ps(kNegInf);
    for (; t + 8 <= vis; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + t));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    for (float x : lanes) bmax = std::max(bmax, x);
  }
#endif
  for (; t < vis; ++t) bmax = std::max(bmax, s[t]);
  const float m_new = std::max(m, bmax);
  const float corr = m == kNegInf ? 0.f : std::exp(m - m_new);
  float sum = 0.f;
  t = 0;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m_new);
  __m512 vs = _mm512_setzero_ps();
  for (; t < vis; t += 16) {
    const __mmask16 mask = tail_mask(vis - t);
    const __m512 e = _mm512_maskz_mov_ps(mask, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), vm)));
    _mm512_mask_storeu_ps(s + t, mask, e);
    vs = _mm512_add_ps(vs, e);
  }
  sum = _mm512_reduce_add_ps(vs);
#elif PDSERVE_ATTN_AVX2
  if (vis >= 8) {
    const __m256 vm = _mm256_set1_ps(m_new);
    __m256 vs = _mm256_setzero_ps();
    for (; t + 8 <= vis; t += 8) {
      const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
      _mm256_storeu_ps(s + t, e);
      vs = _mm256_add_ps(vs, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vs);
    for (float x : lanes) sum += x;
  }
#endif
  for (; t < vis; ++t) {
    s[t] = std::exp(s[t] - m_new);
    sum += s[t];
  }
  if (corr != 1.f)
    for (int i = 0; i < d; ++i) acc[i] *= corr;
  l = l * corr + sum;
  m = m_new;
  return true;
}

// One work item: sequence b, KV heads h0 .. h0 + nh - 1, queries q0 .. q1 - 1 of its chunk, keys
// k0 .. k1 - 1 (k1 = -1: every key the tile sees). slot >= 0: write a partial result there
// (split-K), else the output.
struct Item {
  int64_t b;
  int32_t h0, nh, q0, q1;
  int64_t k0, k1, slot;
};

// What every item of one call shares.
template <typename Q, typename KV>
struct Call {
  const Q* query;
  int64_t q_tok, q_head;
  const KV* key_cache;
  const KV* value_cache;
  int64_t cs[3];           // cache strides: block, token, head
  const int64_t* block_tables;
  int64_t bt_stride;
  const int64_t* seq_lens;
  const int64_t* query_start_loc;
  Q* out;
  int64_t os[2];
  int group, d, block_size, partition;
  float scale;
  const float* k_scale;    // nullptr, or [1] / [Hkv] (scale_heads)
  const float* v_scale;
  int64_t scale_heads;
  float* partial;          // [slots][rows_max][d + 2]: acc, m, l
  int64_t partial_rows;
  bool fp32_pv;            // PDSERVE_ATTN_DECODE=fp32: decode P V in fp32 as before the bf16 pairs (A/B, fallback)
  int l2_ahead;            // how many blocks ahead pass 1 asks for K and V into L2 (>= 1)
  bool amx;                // prefill tiles' QK^T on AMX where the CPU has it (PDSERVE_ATTN_AMX=0: not, for A/B and tests)
  bool amx_decode;         // decode rows on AMX tiles (attend_decode_amx; PDSERVE_ATTN_AMX_DECODE=0: not)
};

// Head h's scale of an FP8 cache (1 without one).
inline float head_scale(const float* scale, int64_t n, int64_t h) { return scale == nullptr ? 1.f : scale[n == 1 ? 0 : h]; }

struct Scratch {
  std::vector<float> q, acc, m, l, s, kf, vf;
  std::vector<at::BFloat16> kb, vb;   // an FP8 K / V block as bf16
  std::vector<uint32_t> p2;           // P rows as bf16 pairs of keys (the native P V)
  std::vector<uint32_t> qb;           // the native rows' queries as broadcast_chunks writes them
  std::vector<int64_t> row_off;   // offset of each row's query (and output) vector, per head and row
  std::vector<int64_t> limit;     // each row's causal limit: keys < limit are visible
};

#if defined(__AVX512BF16__)
// ---- The tile path: a prefill tile (bf16 queries, bf16 or FP8 cache) as two small GEMMs ----
//
// Lanes are query rows: the tile's rows (up to 48 = 3 vectors of 16) stay in registers as bf16
// pairs, and each key's pairs are broadcast from the cache in place (no transposition of K):
//   S^T[t][r] = scale q_r . k_t   (vdpbf16ps, D/2 pair steps, 8 keys x RV row vectors of fp32 sums)
// The online softmax then runs per lane (a row's max is an elementwise max over keys, no
// horizontal reductions), P is rounded to bf16 pairs of consecutive keys, V is interleaved in
// pairs of keys ((v_2u[i], v_2u+1[i]) per column i), and
//   O^T[i][r] += sum_u p_r,2u v_2u[i] + p_r,2u+1 v_2u+1[i]   (vdpbf16ps, 8 columns x RV at a time)
// with fp32 accumulation, the running max/sum in fp32 (FlashAttention-2's order: Dao 2023). Keys
// go in steps of kTileKeys (the scores of a step stay in L1). P in bf16 is what GPU flash kernels
// and torch's CPU flash kernel do for bf16 inputs: each p loses ~2^-9 relative.
// On CPUs with AMX-BF16 both products go through tiles (qk_amx, pv_amx: the same operands, qp and
// p2 already in AMX's B layout, V transposed per 16 key pairs); the softmax stays as it is. A
// 512-token prompt (SmolLM2-135M, 2 threads, Sapphire Rapids): 1.79 -> 0.70 ms a layer, 208 tokens
// 347 -> 158 us; prefill 512 tokens 4119 -> 5221 tok/s. PDSERVE_ATTN_AMX=0 keeps vdpbf16ps (A/B, tests).
#ifndef PDSERVE_ATTN_TILE_MIN_ROWS
#define PDSERVE_ATTN_TILE_MIN_ROWS 16
#endif
#ifndef PDSERVE_ATTN_TILE_KEYS
#define PDSERVE_ATTN_TILE_KEYS 64
#endif
constexpr int kTileKeys = PDSERVE_ATTN_TILE_KEYS;   // even
constexpr float kLog2e = 1.44269504088896341f, kLn2 = 0.693147180559945309f;
using pdserve_simd::exp2_neg;
static_assert(kTileKeys % 2 == 0, "the tile path takes keys in pairs");

inline __m512bh broadcast_pair(const void* p) {
  int32_t x;
  std::memcpy(&x, p, sizeof(x));
  return (__m512bh)_mm512_set1_epi32(x);
}

// s[t * 16 RV + r] = scale * (q_r . k_t), t < NK: qp [D/2][16 RV] dwords (lane r of vector (j, v):
// q_{16 v + r}[2j .. 2j + 1]); k_t = k + t * ld, bf16, read in place.
template <int D, int RV, int NK>
inline void qk_tile(const uint32_t* qp, const at::BFloat16* k, int64_t ld, float scale, float* s) {
  __m512 acc[NK][RV];
  for (int t = 0; t < NK; ++t)
    for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int j = 0; j < D / 2; ++j) {
    __m512bh q[RV];
    for (int v = 0; v < RV; ++v) q[v] = (__m512bh)_mm512_loadu_si512(qp + (j * RV + v) * 16);
    for (int t = 0; t < NK; ++t) {
      const __m512bh kk = broadcast_pair(k + t * ld + 2 * j);
      for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], q[v], kk);
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
  for (int t = 0; t < NK; ++t)
    for (int v = 0; v < RV; ++v) _mm512_storeu_ps(s + (t * RV + v) * 16, _mm512_mul_ps(acc[t][v], vs));
}

// qk_tile over n consecutive keys (8 at a time, then the rest).
template <int D, int RV>
inline void qk_run(const uint32_t* qp, const at::BFloat16* k, int64_t ld, int n, float scale, float* s) {
  constexpr int L = 16 * RV;
  int t = 0;
  for (; t + 8 <= n; t += 8) qk_tile<D, RV, 8>(qp, k + t * ld, ld, scale, s + t * L);
  if (t + 4 <= n) {
    qk_tile<D, RV, 4>(qp, k + t * ld, ld, scale, s + t * L);
    t += 4;
  }
  for (; t < n; ++t) qk_tile<D, RV, 1>(qp, k + t * ld, ld, scale, s + t * L);
}

// o[i * 16 RV + r] += sum_u p2[u][r] . vp[u][i] (bf16 pair dot products), u < U: p2 [U][16 RV]
// dwords (p of keys 2u, 2u + 1 for row r), vp [U][D] dwords (v_2u[i], v_2u+1[i]).
template <int D, int RV>
inline void pv_tile(const uint32_t* p2, const uint32_t* vp, int U, float* o) {
  constexpr int L = 16 * RV, NC = RV == 1 ? 16 : 8;   // NC x RV accumulators
  for (int c0 = 0; c0 < D; c0 += NC) {
    __m512 acc[NC][RV];
    for (int c = 0; c < NC; ++c)
      for (int v = 0; v < RV; ++v) acc[c][v] = _mm512_loadu_ps(o + (c0 + c) * L + v * 16);
    for (int u = 0; u < U; ++u) {
      __m512bh p[RV];
      for (int v = 0; v < RV; ++v) p[v] = (__m512bh)_mm512_loadu_si512(p2 + u * L + v * 16);
      for (int c = 0; c < NC; ++c) {
        const __m512bh b = broadcast_pair(vp + u * D + c0 + c);
        for (int v = 0; v < RV; ++v) acc[c][v] = _mm512_dpbf16_ps(acc[c][v], p[v], b);
      }
    }
    for (int c = 0; c < NC; ++c)
      for (int v = 0; v < RV; ++v) _mm512_storeu_ps(o + (c0 + c) * L + v * 16, acc[c][v]);
  }
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
// qk_run's scores for the whole groups of 16 keys of n on AMX tiles (CPUs with AMX-BF16), returning
// how many keys it scored (a multiple of 16; the rest go through qk_run). The tile product is
// S^T = K Q^T: A = 16 keys x 32 dims of K, read in place (row stride ld), B = 16 pair steps of qp
// for one row vector (qp's [D/2][RV][16] dwords are AMX's B layout, RV x 64 bytes apart), C = the
// 16 keys x 16 rows of s (L floats apart), then scaled. 16 x 16 x 32 multiply-adds an instruction
// where qk_tile's vdpbf16ps does 16 x 2; the sums are in another order (within the tests' bf16 rule).
// Tiles: A 1-4 (D / 32 of them), B 5-6 in turn, C 0 and 7 in turn; all 16 rows x 64 bytes.
template <int D, int RV>
inline int qk_amx(const uint32_t* qp, const at::BFloat16* k, int64_t ld, int n, float scale, float* s) {
  static_assert(D % 32 == 0 && D <= 128, "one A tile per 32 dimensions, at most 4");
  constexpr int L = 16 * RV;
  const int whole = n / 16 * 16;
  const __m512 vs = _mm512_set1_ps(scale);
  for (int t = 0; t < whole; t += 16) {
    _tile_loadd(1, k + t * ld, ld * 2);
    if constexpr (D > 32) _tile_loadd(2, k + t * ld + 32, ld * 2);
    if constexpr (D > 64) _tile_loadd(3, k + t * ld + 64, ld * 2);
    if constexpr (D > 96) _tile_loadd(4, k + t * ld + 96, ld * 2);
    for (int v = 0; v < RV; ++v) {
      float* out = s + t * L + v * 16;
      const uint32_t* b = qp + v * 16;
      // (two C and two B registers in turn: a vector's product overlaps the previous one's store)
      if (v % 2 == 0) {
        _tile_zero(0);
        _tile_loadd(5, b, RV * 64);
        _tile_dpbf16ps(0, 1, 5);
        if constexpr (D > 32) { _tile_loadd(6, b + 16 * L, RV * 64); _tile_dpbf16ps(0, 2, 6); }
        if constexpr (D > 64) { _tile_loadd(5, b + 32 * L, RV * 64); _tile_dpbf16ps(0, 3, 5); }
        if constexpr (D > 96) { _tile_loadd(6, b + 48 * L, RV * 64); _tile_dpbf16ps(0, 4, 6); }
        _tile_stored(0, out, L * 4);
      } else {
        _tile_zero(7);
        _tile_loadd(6, b, RV * 64);
        _tile_dpbf16ps(7, 1, 6);
        if constexpr (D > 32) { _tile_loadd(5, b + 16 * L, RV * 64); _tile_dpbf16ps(7, 2, 5); }
        if constexpr (D > 64) { _tile_loadd(6, b + 32 * L, RV * 64); _tile_dpbf16ps(7, 3, 6); }
        if constexpr (D > 96) { _tile_loadd(5, b + 48 * L, RV * 64); _tile_dpbf16ps(7, 4, 5); }
        _tile_stored(7, out, L * 4);
      }
    }
    for (int i = 0; i < 16 * RV; ++i) _mm512_storeu_ps(s + t * L + i * 16, _mm512_mul_ps(_mm512_loadu_ps(s + t * L + i * 16), vs));
  }
  return whole;
}

// out[c][0..16) = column c of rows[0..16) (16 x 16 dwords; rows `ld` dwords apart, out rows 16 apart):
// unpack 32- then 64-bit halves within 128-bit lanes, then 128-bit lanes across.
inline void transpose16_dwords(const uint32_t* rows, int64_t ld, uint32_t* out) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows + i * ld);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {   // r[i + m]: rows i .. i + 3 at column 4 j + m of lane j
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i x0 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x44), x1 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x44), y1 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xEE);
    _mm512_storeu_si512(out + m * 16, _mm512_shuffle_i32x4(x0, y0, 0x88));
    _mm512_storeu_si512(out + (4 + m) * 16, _mm512_shuffle_i32x4(x0, y0, 0xDD));
    _mm512_storeu_si512(out + (8 + m) * 16, _mm512_shuffle_i32x4(x1, y1, 0x88));
    _mm512_storeu_si512(out + (12 + m) * 16, _mm512_shuffle_i32x4(x1, y1, 0xDD));
  }
}

// pv_tile on AMX tiles: O^T += V^T P^T, 16 key pairs a tile product. A = V^T (rows i, 16 dwords of
// key pairs: vp transposed into vt, [D][16] dwords per 16 pairs), B = p2 for one row vector (p2's
// [U][RV][16] dwords are AMX's B layout, L dwords apart), C = 16 columns x 16 rows of o (L floats
// apart), loaded, multiplied into and stored. Pairs past U (the step's last, partial 16) are zeros in
// both vp and p2 (written here). vt: D x 16 dwords of scratch. Tiles: C 0, A 1, B 5.
template <int D, int RV>
inline void pv_amx(uint32_t* p2, uint32_t* vp, int U, float* o, uint32_t* vt) {
  constexpr int L = 16 * RV;
  const int padded = (U + 15) / 16 * 16;
  for (int u = U; u < padded; ++u) {
    std::memset(vp + static_cast<size_t>(u) * D, 0, D * sizeof(uint32_t));
    std::memset(p2 + static_cast<size_t>(u) * L, 0, L * sizeof(uint32_t));
  }
  for (int u0 = 0; u0 < padded; u0 += 16) {
    for (int i0 = 0; i0 < D; i0 += 16) transpose16_dwords(vp + static_cast<size_t>(u0) * D + i0, D, vt + i0 * 16);
    for (int v = 0; v < RV; ++v) {
      _tile_loadd(5, p2 + static_cast<size_t>(u0) * L + v * 16, L * 4);
      for (int i0 = 0; i0 < D; i0 += 16) {
        float* c = o + i0 * L + v * 16;
        _tile_loadd(0, c, L * 4);
        _tile_loadd(1, vt + i0 * 16, 64);
        _tile_dpbf16ps(0, 1, 5);
        _tile_stored(0, c, L * 4);
      }
    }
  }
}

// Every tile 16 rows x 64 bytes (qk_amx's shapes), for this thread; false where the OS refuses AMX.
inline bool configure_attention_tiles() {
  if (!pdserve_amx::amx_permitted()) return false;
  pdserve_amx::TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  pdserve_amx::load_tile_config(cfg);
  return true;
}
#define PDSERVE_ATTN_AMX 1
#endif

// qk_run through qk_amx where the tiles are configured (amx), else qk_run alone.
template <int D, int RV>
inline void qk_keys(bool amx, const uint32_t* qp, const at::BFloat16* k, int64_t ld, int n, float scale, float* s) {
  int done = 0;
#if defined(PDSERVE_ATTN_AMX)
  if (amx && D % 32 == 0) done = qk_amx<D, RV>(qp, k, ld, n, scale, s);
#else
  (void)amx;
#endif
  if (done < n) qk_run<D, RV>(qp, k + done * ld, ld, n - done, scale, s + done * 16 * RV);
}

// dst[i] = (a[i], b[i]) as one dword of two bf16, i < D (b = nullptr: zeros).
template <int D>
inline void pack_value_pair(uint32_t* dst, const at::BFloat16* a, const at::BFloat16* b) {
  alignas(64) static const uint16_t lo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                              8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                              24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i ilo = _mm512_load_si512(lo), ihi = _mm512_load_si512(hi);
  for (int i = 0; i < D; i += 32) {
    const __m512i va = _mm512_loadu_si512(a + i);
    const __m512i vb = b == nullptr ? _mm512_setzero_si512() : _mm512_loadu_si512(b + i);
    _mm512_storeu_si512(dst + i, _mm512_permutex2var_epi16(va, ilo, vb));
    _mm512_storeu_si512(dst + i + 16, _mm512_permutex2var_epi16(va, ihi, vb));
  }
}

// 16 fp32 -> 16 bf16 (round to nearest even) in the low halves of 16 dwords.
inline __m512i bf16_low(__m512 x) { return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)); }

// One step's online softmax for RV row vectors over nk keys at positions c0 ..: s [nk][16 RV]
// scores in log2 units (scale x log2(e) folded in, so p = 2^(s - m)), the rows' running max m and
// sum l [16 RV] and o [D][16 RV] rescaled when a max moves; keys at or past a row's limit (causal)
// get p = 0 (causal = false: every key is visible). P goes out as bf16 pairs of keys, p2
// [(nk + 1) / 2][16 RV]; l sums the fp32 p.
template <int RV>
inline void softmax_tile(const float* s, int nk, int64_t c0, const __m512i* limit, bool causal, float* m, float* l,
                         float* o, int D, uint32_t* p2) {
  constexpr int L = 16 * RV;
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  for (int v = 0; v < RV; ++v) {
    auto visible = [&](int t) -> __mmask16 {
      return causal ? _mm512_cmpgt_epi32_mask(limit[v], _mm512_set1_epi32(static_cast<int>(c0 + t))) : 0xFFFF;
    };
    const __m512 m_old = _mm512_loadu_ps(m + v * 16);
    __m512 mx = m_old;
    for (int t = 0; t < nk; ++t) mx = _mm512_mask_max_ps(mx, visible(t), mx, _mm512_loadu_ps(s + t * L + v * 16));
    const __mmask16 valid = _mm512_cmp_ps_mask(mx, neg_inf, _CMP_NEQ_OQ);   // the row has seen a key
    const __m512 msub = _mm512_maskz_mov_ps(valid, mx);
    __m512 sum = _mm512_loadu_ps(l + v * 16);
    if (_mm512_cmp_ps_mask(mx, m_old, _CMP_NEQ_OQ) != 0) {   // some row's max moved: rescale
      const __m512 corr = _mm512_maskz_mov_ps(valid, exp2_neg(_mm512_sub_ps(m_old, msub)));
      sum = _mm512_mul_ps(sum, corr);
      for (int i = 0; i < D; ++i) _mm512_storeu_ps(o + i * L + v * 16, _mm512_mul_ps(_mm512_loadu_ps(o + i * L + v * 16), corr));
    }
    auto p_of = [&](int t) {
      return _mm512_maskz_mov_ps(visible(t) & valid, exp2_neg(_mm512_sub_ps(_mm512_loadu_ps(s + t * L + v * 16), msub)));
    };
    for (int u = 0; 2 * u < nk; ++u) {
      const __m512 pa = p_of(2 * u);
      const __m512 pb = 2 * u + 1 < nk ? p_of(2 * u + 1) : _mm512_setzero_ps();
      sum = _mm512_add_ps(sum, _mm512_add_ps(pa, pb));
      _mm512_storeu_si512(p2 + u * L + v * 16, _mm512_or_si512(bf16_low(pa), _mm512_slli_epi32(bf16_low(pb), 16)));
    }
    _mm512_storeu_ps(m + v * 16, mx);
    _mm512_storeu_ps(l + v * 16, sum);
  }
}

// ---- Decode and short rows: P V as bf16 pair dot products ----
//
// Rows of one KV head (decode: its G query heads; a verification run: G per token, at most 15)
// keep head_dim in the vector lanes, as the fp32 path does, but P and V go through vdpbf16ps:
// each row's p is split once per partition into hi = bf16(p) and lo = bf16(p - hi) (hi + lo
// carries p to ~2^-17; consecutive keys are then already pairs, (p_2u, p_2u+1) = one dword), and
// V is interleaved two keys at a time in registers ((v_2u[i], v_2u+1[i]) per column i, two
// permutes per 32 columns, read in place from a bf16 cache), so
//   acc_r[i] += hi_r,2u v_2u[i] + hi_r,2u+1 v_2u+1[i]   (and the same with lo)
// is two instructions per 16 columns, pair of keys and row, fp32 accumulation, where the fp32
// path spent two conversions per 16 values and two FMAs. P as hi alone (one instruction, as the
// prefill tiles do) measured no faster and missed the tests' rule "no worse than the bf16
// reference" at head_dim 128 (max error 0.0085 against the reference's 0.0079).

// p2[r * p2s + u] = (bf16(p_r[2u]), bf16(p_r[2u + 1])), u < ceil(n / 2), r < rows: p rows ps apart;
// an odd n's last pair has a zero second half. lo (or nullptr): the same of p - hi.
// What rounding x to bf16 (hi, as vcvtneps2bf16 rounds it) left, rounded to bf16 in turn: hi + lo
// carries ~16 significant bits of x (P's split, in pack_p_pairs and attend_decode_amx).
inline __m256i bf16_remainder(__m512 x, __m256i hi) {
  return (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16))));
}

inline void pack_p_pairs(const float* p, int64_t ps, int rows, int n, uint32_t* p2, uint32_t* lo, int64_t p2s) {
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t < n; t += 16) {
      const __mmask16 mask = tail_mask(n - t);
      const __mmask8 pairs = static_cast<__mmask8>((1u << ((std::min(n - t, 16) + 1) / 2)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(mask, p + r * ps + t);
      const __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
      _mm256_mask_storeu_epi32(p2 + r * p2s + t / 2, pairs, b);
      if (lo == nullptr) continue;
      _mm256_mask_storeu_epi32(lo + r * p2s + t / 2, pairs, bf16_remainder(x, b));
    }
}

// acc[r] += sum_t p[r][t] v_t for RB rows, t < n: p2 as pack_p_pairs wrote it (rows p2s dwords
// apart), v_t = v + t * ld (bf16), head_dim = 16 NC (NC even). RB x NC accumulators in registers.
template <int NC, int RB>
inline void pv_rows(float* acc, int64_t acc_ld, const uint32_t* p2, const uint32_t* lo, int64_t p2s, const at::BFloat16* v,
                    int64_t ld, int n) {
  static_assert(NC % 2 == 0, "head_dim must be a multiple of 32");
  alignas(64) static const uint16_t first[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                              8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t second[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i ilo = _mm512_load_si512(first), ihi = _mm512_load_si512(second);
  __m512 a[RB][NC];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = _mm512_loadu_ps(acc + r * acc_ld + 16 * c);
  for (int u = 0; 2 * u < n; ++u) {
    const at::BFloat16* va = v + 2 * u * ld;
    const bool pair = 2 * u + 1 < n;   // never read past the last key (the cache beyond may hold NaN)
    __m512i x[NC];
    for (int c2 = 0; c2 < NC / 2; ++c2) {
      const __m512i ra = _mm512_loadu_si512(va + 32 * c2);
      const __m512i rb = pair ? _mm512_loadu_si512(va + ld + 32 * c2) : _mm512_setzero_si512();
      x[2 * c2] = _mm512_permutex2var_epi16(ra, ilo, rb);
      x[2 * c2 + 1] = _mm512_permutex2var_epi16(ra, ihi, rb);
    }
    for (int r = 0; r < RB; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int>(p2[r * p2s + u]));
      for (int c = 0; c < NC; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], pr, (__m512bh)x[c]);
      if (lo == nullptr) continue;
      const __m512bh pl = (__m512bh)_mm512_set1_epi32(static_cast<int>(lo[r * p2s + u]));
      for (int c = 0; c < NC; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], pl, (__m512bh)x[c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + r * acc_ld + 16 * c, a[r][c]);
}

template <int NC, int MAXRB>
inline void pv_tail(int rows, float* acc, int64_t acc_ld, const uint32_t* p2, const uint32_t* lo, int64_t p2s,
                    const at::BFloat16* v, int64_t ld, int n) {
  if constexpr (MAXRB > 0) {
    if (rows == MAXRB) return pv_rows<NC, MAXRB>(acc, acc_ld, p2, lo, p2s, v, ld, n);
    return pv_tail<NC, MAXRB - 1>(rows, acc, acc_ld, p2, lo, p2s, v, ld, n);
  }
}

// acc[r] (rows d apart) += P V for rows r < rows over n keys of one block (see pv_rows), d in
// {32, 64, 128}: register tiles of 8, 5 or 2 rows (RB x NC <= 20 accumulators beside NC values).
inline void pv_native(float* acc, int rows, const uint32_t* p2, const uint32_t* lo, int64_t p2s, const at::BFloat16* v,
                      int64_t ld, int n, int d) {
  auto tiles = [&](auto nc_tag, auto rb_tag) {
    constexpr int NC = decltype(nc_tag)::value, RB = decltype(rb_tag)::value;
    int r = 0;
    auto at = [&](const uint32_t* x) { return x == nullptr ? nullptr : x + r * p2s; };
    for (; r + RB <= rows; r += RB) pv_rows<NC, RB>(acc + r * d, d, p2 + r * p2s, at(lo), p2s, v, ld, n);
    if (r < rows) pv_tail<NC, RB - 1>(rows - r, acc + r * d, d, p2 + r * p2s, at(lo), p2s, v, ld, n);
  };
  switch (d) {
    case 64: return tiles(std::integral_constant<int, 4>{}, std::integral_constant<int, 5>{});
    case 128: return tiles(std::integral_constant<int, 8>{}, std::integral_constant<int, 2>{});
    case 32: return tiles(std::integral_constant<int, 2>{}, std::integral_constant<int, 8>{});
    default: break;
  }
}

struct TileScratch {
  std::vector<uint32_t> qp, p2, vp, vt;
  std::vector<float> s, o, m, l;
  std::vector<at::BFloat16> kb, vrow;   // an FP8 cache's K run / two V rows as bf16
};

// One item through the tile path: rows <= 16 RV per KV head (see above). Same results contract as
// attend_item (output rows, or a split-K partial: unnormalized acc x V scale, max, sum).
template <int D, int RV, typename Q, typename KV>
void attend_tile(const Item& it, const Call<Q, KV>& c, TileScratch& w) {
  constexpr int L = 16 * RV;
  const int group = c.group, bs = c.block_size;
  const int64_t first = c.query_start_loc[it.b];
  const int64_t qlen = c.query_start_loc[it.b + 1] - first;
  const int64_t start = c.seq_lens[it.b] - qlen;
  const int rows = (it.q1 - it.q0) * group;
  const int64_t k_end = it.k1 >= 0 ? it.k1 : start + it.q1;
  const int64_t min_limit = start + it.q0 + 1;   // every row sees the keys below this
  const int64_t* table = c.block_tables + it.b * c.bt_stride;
  w.qp.resize(static_cast<size_t>(D / 2) * L);
  w.s.resize(static_cast<size_t>(kTileKeys) * L);
  w.p2.resize(static_cast<size_t>(kTileKeys / 2) * L);
  w.vp.resize(static_cast<size_t>(kTileKeys / 2) * D);
  w.vt.resize(static_cast<size_t>(16) * D);
  w.o.resize(static_cast<size_t>(D) * L);
  w.m.resize(L);
  w.l.resize(L);
  if constexpr (!std::is_same_v<KV, at::BFloat16>) {
    w.kb.resize(static_cast<size_t>(bs) * D);
    w.vrow.resize(2 * D);
  }
  alignas(64) int32_t lim[L];
  for (int r = 0; r < L; ++r) lim[r] = r < rows ? static_cast<int32_t>(start + it.q0 + r / group + 1) : 0;
  __m512i limit[RV];
  for (int v = 0; v < RV; ++v) limit[v] = _mm512_load_si512(lim + 16 * v);
#if defined(PDSERVE_ATTN_AMX)
  // (per item: a GEMM kernel run on this thread between two items releases the tiles)
  const bool amx = c.amx && configure_attention_tiles();
#else
  const bool amx = false;
#endif
  // a V row of key pos as bf16 (an FP8 cache's converted into buf)
  auto value_row = [&](int64_t pos, int h, at::BFloat16* buf) -> const at::BFloat16* {
    const KV* src = c.value_cache + table[pos / bs] * c.cs[0] + (pos % bs) * c.cs[1] + static_cast<int64_t>(h) * c.cs[2];
    if constexpr (std::is_same_v<KV, at::BFloat16>) {
      (void)buf;
      return src;
    } else {
      load_block_bf16(buf, src, 0, 1, D);
      return buf;
    }
  };
  for (int hh = 0; hh < it.nh; ++hh) {
    const int h = it.h0 + hh;
    for (int r = 0; r < L; ++r) {
      uint32_t* dst = w.qp.data() + r;
      if (r >= rows) {
        for (int j = 0; j < D / 2; ++j) dst[j * L] = 0;
        continue;
      }
      const Q* q = c.query + (first + it.q0 + r / group) * c.q_tok + (static_cast<int64_t>(h) * group + r % group) * c.q_head;
      for (int j = 0; j < D / 2; ++j) std::memcpy(dst + j * L, q + 2 * j, sizeof(uint32_t));
    }
    std::fill(w.o.begin(), w.o.end(), 0.f);
    std::fill(w.m.begin(), w.m.end(), kNegInf);
    std::fill(w.l.begin(), w.l.end(), 0.f);
    const float ks = c.scale * head_scale(c.k_scale, c.scale_heads, h) * kLog2e;   // scores in log2 units
    for (int64_t c0 = it.k0; c0 < k_end; c0 += kTileKeys) {
      const int nk = static_cast<int>(std::min<int64_t>(kTileKeys, k_end - c0));
      for (int64_t t = c0; t < c0 + nk;) {   // scores, one block's run of keys at a time
        const int in = static_cast<int>(t % bs);
        const int run = static_cast<int>(std::min<int64_t>(bs - in, c0 + nk - t));
        const KV* src = c.key_cache + table[t / bs] * c.cs[0] + in * c.cs[1] + static_cast<int64_t>(h) * c.cs[2];
        if constexpr (std::is_same_v<KV, at::BFloat16>) {
          qk_keys<D, RV>(amx, w.qp.data(), src, c.cs[1], run, ks, w.s.data() + (t - c0) * L);
        } else {
          load_block_bf16(w.kb.data(), src, c.cs[1], run, D);
          qk_keys<D, RV>(amx, w.qp.data(), w.kb.data(), D, run, ks, w.s.data() + (t - c0) * L);
        }
        t += run;
      }
      softmax_tile<RV>(w.s.data(), nk, c0, limit, c0 + nk > min_limit, w.m.data(), w.l.data(), w.o.data(), D,
                       w.p2.data());
      const int U = (nk + 1) / 2;
      for (int u = 0; u < U; ++u) {
        const at::BFloat16* a = value_row(c0 + 2 * u, h, w.vrow.data());
        const at::BFloat16* b = 2 * u + 1 < nk ? value_row(c0 + 2 * u + 1, h, w.vrow.data() + D) : nullptr;
        pack_value_pair<D>(w.vp.data() + static_cast<size_t>(u) * D, a, b);
      }
#if defined(PDSERVE_ATTN_AMX)
      if (amx && D % 16 == 0) {
        pv_amx<D, RV>(w.p2.data(), w.vp.data(), U, w.o.data(), w.vt.data());
        continue;
      }
#endif
      pv_tile<D, RV>(w.p2.data(), w.vp.data(), U, w.o.data());
    }
#if defined(PDSERVE_ATTN_AMX)
    if (amx && hh + 1 == it.nh) _tile_release();
#endif
    const float vs = c.v_scale == nullptr ? 1.f : c.v_scale[c.scale_heads == 1 ? 0 : h];
    // O^T back to rows: row r's 16 columns i .. i + 15 gathered from o (L floats apart)
    const __m512i cols = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(L));
    for (int r = 0; r < rows; ++r) {
      const float* src = w.o.data() + r;
      if (it.slot >= 0) {
        float* dst = c.partial + (it.slot * c.partial_rows + static_cast<int64_t>(hh) * rows + r) * (D + 2);
        for (int i = 0; i < D; i += 16)
          _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_i32gather_ps(cols, src + i * L, 4), _mm512_set1_ps(vs)));
        dst[D] = w.m[r] * kLn2;   // natural units, as attend_item's partials
        dst[D + 1] = w.l[r];
        continue;
      }
      Q* dst = c.out + (first + it.q0 + r / group) * c.os[0] + (static_cast<int64_t>(h) * group + r % group) * c.os[1];
      const __m512 inv = _mm512_set1_ps(vs / w.l[r]);
      for (int i = 0; i < D; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_i32gather_ps(cols, src + i * L, 4), inv)));
    }
  }
}

// Whether an item goes through the tile path, and then it does: bf16 queries over a bf16 or FP8
// cache, D in {32, 64, 128}, 16 .. 48 rows per KV head.
template <typename Q, typename KV>
bool try_tile(const Item& it, const Call<Q, KV>& c, TileScratch& w) {
  if constexpr (std::is_same_v<Q, at::BFloat16> &&
                (std::is_same_v<KV, at::BFloat16> || std::is_same_v<KV, at::Float8_e4m3fn>)) {
    const int rows = (it.q1 - it.q0) * c.group;
    if (rows < PDSERVE_ATTN_TILE_MIN_ROWS || rows > 48) return false;
    auto go = [&](auto d_tag) {
      constexpr int D = decltype(d_tag)::value;
      if (rows <= 16) attend_tile<D, 1>(it, c, w);
      else if (rows <= 32) attend_tile<D, 2>(it, c, w);
      else attend_tile<D, 3>(it, c, w);
      return true;
    };
    switch (c.d) {
      case 64: return go(std::integral_constant<int, 64>{});
      case 128: return go(std::integral_constant<int, 128>{});
      case 32: return go(std::integral_constant<int, 32>{});
      default: return false;
    }
  }
  (void)it, (void)c, (void)w;
  return false;
}
#else
struct TileScratch {};
template <typename Q, typename KV>
bool try_tile(const Item&, const Call<Q, KV>&, TileScratch&) { return false; }
#endif

// K of block j (counted from its first key) of item f, its KV heads, into L2; nothing past its
// keys. The block tables are shuffled: without this every item started on a DRAM miss.
template <typename Q, typename KV>
void prefetch_first_blocks(const Item& f, int64_t j, const Call<Q, KV>& c) {
  const int bs = c.block_size;
  const int64_t qlen = c.query_start_loc[f.b + 1] - c.query_start_loc[f.b];
  const int64_t k_end = f.k1 >= 0 ? f.k1 : c.seq_lens[f.b] - qlen + f.q1;
  const int64_t kb = f.k0 / bs + j;
  if (kb * bs >= k_end) return;
  const int64_t at = c.block_tables[f.b * c.bt_stride + kb] * c.cs[0] + static_cast<int64_t>(f.h0) * c.cs[2];
  const int n = static_cast<int>(std::min<int64_t>(bs, k_end - kb * bs));
  const int64_t span = (f.nh - 1) * c.cs[2] + c.d;
  prefetch_block(c.key_cache + at, c.cs[1], n, span);
}

#if defined(PDSERVE_ATTN_AMX)
// ---- The decode path on AMX: up to 16 rows of up to 3 KV heads (decode's G query heads of
// each head, short verification runs), bf16 queries over a bf16 or FP8 cache, D in {32, 64} ----
//
// Both products on tiles, neither operand transposed, every head of the item in one C tile:
//   S^T = sum_h K_h Q_h^T: A = 16 K rows of head h of a block, read in place (the cache's token
//     stride is the tile's row stride), B = head h's query rows as bf16 pairs of dimensions in
//     their own columns (zeros in the other heads': AMX's B layout, packed once an item), C = 16
//     keys x 16 columns, one per row of the item;
//   O = sum_h P_h V_h: A = head h's rows of P in bf16 (zeros in the others'), B = V of head h
//     interleaved in pairs of keys (pack_value_pair: AMX's B layout), 32 keys a step in L1, C =
//     D / 16 tiles of 16 rows x 16 columns, held for a partition. Each row has two rows of A: p
//     rounded to bf16 and what the rounding left, so P keeps ~16 significant bits as pv_native's
//     hi/lo split does (P in bf16 alone, as attend_tile's, was one output ulp further from fp32
//     than torch's bf16 attention in the tests' rule); so the heads go through P V in groups of
//     up to 16 / (2 rows per head), each group's C tiles stored once a partition.
// An FP8 cache's K rows and V rows are converted to bf16 (exactly: E4M3 has 4 significant bits)
// before their tile loads and pairing, its K scale applied to the scores, its V scale to the output.
// The softmax runs per row (its scores gathered out of S^T), two passes a partition with
// FlashAttention's rescaling between partitions, as attend_item; the prefetches are attend_item's.
// Items over every KV head (where there are enough sequences for the threads) read each cache
// block as one contiguous range. (Their heads share C: a NaN or inf in one head's live K row
// reaches the other heads' scores as 0 x inf, where attend_item keeps it to its own head; only a
// sequence whose keys are already non-finite is affected, never another sequence.) attend_tile
// does the same products for 16-48 rows but as O^T, which needs V transposed: decode rows through
// it ran 1.3x slower than attend_item (stop 36).
// Tiles, all 16 rows x 64 bytes: QK C 0, A 1, B 2 .. 2 + nh D / 32 - 1 (the queries, loaded at
// each partition); PV C 0 .. D / 16 - 1, A 4, B 5-7 in turn. Up to 8 rows a KV head.
// PDSERVE_ATTN_AMX_DECODE=0 (read at each call) keeps attend_item (A/B, tests).
// Measured and not kept (2026-12-07, Emerald Rapids, 16 x 128-context calls, 2 threads): S^T of
// four 16-key tiles at once, one C tile each (the query B tiles loaded from L1 per window, two A
// tiles in turn), so that a key tile's products are no longer one dependency chain: the same bits
// (144 shapes), hot 49.9 -> 50.8 us, with its cache from L3 69 -> 73 us: the products wait on the
// K rows' tile loads, not on each other.
constexpr int kDecodeAmxMaxHeads = 3;

// (One a call and thread. Kept across calls as the thread's own, thread_local, it did not change
// the 16 x 128-context call: 44.6 against 44.5 us hot, Emerald Rapids, 2026-12-07.)
struct DecodeScratch {
  std::vector<float> st;       // S^T of a partition: [keys][16]
  std::vector<float> sr;       // one row's scores
  std::vector<uint16_t> pa;    // P as bf16 bits, per head: [nh][16][pa_ld]
  std::vector<uint32_t> qp;    // per head and 32 dimensions: [nh][D / 32][16 pairs][16]
  std::vector<uint32_t> vp;    // two steps' V of one head: [2][16 key pairs][D]
  std::vector<at::BFloat16> kb, vb;   // an FP8 cache's 16 K rows of each head [nh][16][D] / 16 V rows, as bf16
  int pa_layout = -1;          // (heads, rows per head) pa was zeroed for
  bool configured = false;     // this thread's tiles configured by this call (released at its end)
};

// C tiles 0 .. D / 16 - 1 += P (A, tile 4) x V pairs (B, tiles 5-7 in turn): one 32-key step of one head.
template <int D>
inline void pv_step_amx(const uint16_t* pa, int64_t pa_ld, const uint32_t* vp) {
  _tile_loadd(4, pa, pa_ld * 2);
  _tile_loadd(5, vp, D * 4);
  _tile_loadd(6, vp + 16, D * 4);
  _tile_dpbf16ps(0, 4, 5);
  _tile_dpbf16ps(1, 4, 6);
  if constexpr (D > 32) {
    _tile_loadd(7, vp + 32, D * 4);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, vp + 48, D * 4);
    _tile_dpbf16ps(3, 4, 5);
  }
}

template <int D, typename KV>
void attend_decode_amx(const Item& it, const Call<at::BFloat16, KV>& c, DecodeScratch& w, const Item* following) {
  constexpr bool fp8 = std::is_same_v<KV, at::Float8_e4m3fn>;
  static_assert(D == 32 || D == 64, "C tiles 0 .. D / 16 - 1 hold the output");
  const int group = c.group, bs = c.block_size, nh = it.nh;
  const int64_t first = c.query_start_loc[it.b];
  const int64_t qlen = c.query_start_loc[it.b + 1] - first;
  const int64_t start = c.seq_lens[it.b] - qlen;
  const int rph = (it.q1 - it.q0) * group;   // rows per head; row (hh, r) is column hh * rph + r
  const int rows = nh * rph;
  const int hpg = 8 / rph;   // heads per P V group: 2 rows each of A and C per row
  const int64_t k_end = it.k1 >= 0 ? it.k1 : start + it.q1;
  const int64_t* table = c.block_tables + it.b * c.bt_stride;
  const int64_t pa_ld = (c.partition + 31) / 32 * 32;
  const size_t pa_head = 16 * pa_ld;
  w.st.resize(static_cast<size_t>(c.partition) * 16);
  w.sr.resize(pa_ld);
  // pa rows no head's P is written to must be zeros: zeroed when the layout changes
  const int layout = nh * 64 + rph;
  if (w.pa_layout != layout) {
    w.pa.assign(kDecodeAmxMaxHeads * pa_head, 0);
    w.pa_layout = layout;
  }
  w.qp.assign(static_cast<size_t>(nh) * (D / 2) * 16, 0);
  w.vp.resize(2 * 16 * D);
  // per row (at most 16): accumulator, running max and sum, a partition's rescaling; C tiles stored
  alignas(64) float acc[16 * D], o[16 * D];
  float m[16], l[16], corr[16];
  std::fill_n(acc, rows * D, 0.f);
  std::fill_n(m, rows, kNegInf);
  std::fill_n(l, rows, 0.f);
  for (int hh = 0; hh < nh; ++hh)
    for (int r = 0; r < rph; ++r) {
      const at::BFloat16* q = c.query + (first + it.q0 + r / group) * c.q_tok +
                              (static_cast<int64_t>(it.h0 + hh) * group + r % group) * c.q_head;
      uint32_t* dst = w.qp.data() + static_cast<size_t>(hh) * (D / 2) * 16 + hh * rph + r;
      for (int j = 0; j < D / 2; ++j) std::memcpy(dst + j * 16, q + 2 * j, sizeof(uint32_t));
    }
  const int64_t kv_h = static_cast<int64_t>(it.h0) * c.cs[2];
  const int64_t span = (nh - 1) * c.cs[2] + D;   // the item's heads of one token
  if constexpr (fp8) {
    w.kb.resize(static_cast<size_t>(nh) * 16 * D);
    w.vb.resize(16 * D);
  }
  float row_scale[16], row_vscale[16];   // per row: the score scale (an FP8 K scale folded in), V's
  for (int r = 0; r < rows; ++r) {
    row_scale[r] = c.scale * head_scale(c.k_scale, c.scale_heads, it.h0 + r / rph);
    row_vscale[r] = head_scale(c.v_scale, c.scale_heads, it.h0 + r / rph);
  }
  const int64_t kb_end = (k_end + bs - 1) / bs;
  const auto ask = [&](const KV* cache, int64_t kb) {
    prefetch_block(cache + table[kb] * c.cs[0] + kv_h, c.cs[1], static_cast<int>(std::min<int64_t>(bs, k_end - kb * bs)), span);
  };
  const __m512i gather16 = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
  // bytes between the K rows a tile reads and elements between its heads: the cache's, or the
  // bf16 copy's (each head converted alone: the heads' span need not be whole vectors)
  const int64_t ld2 = fp8 ? D * 2 : c.cs[1] * 2, head_ld = fp8 ? 16 * D : c.cs[2];
  for (int64_t p0 = it.k0; p0 < k_end; p0 += c.partition) {
    const int64_t p1 = std::min<int64_t>(p0 + c.partition, k_end);
    const int plen = static_cast<int>(p1 - p0);
    const int64_t kb0 = p0 / bs, kb1 = (p1 + bs - 1) / bs;
    // 1. S^T, 16 keys a tile (a partial block's last rows are read, never used)
    for (int hh = 0; hh < nh; ++hh)   // B tiles 2 + (D / 32) hh ..: tile numbers are immediates
      for (int j = 0; j < D / 32; ++j) {
        const uint32_t* b = w.qp.data() + (static_cast<size_t>(hh) * (D / 2) + j * 16) * 16;
        switch (hh * (D / 32) + j) {
          case 0: _tile_loadd(2, b, 64); break;
          case 1: _tile_loadd(3, b, 64); break;
          case 2: _tile_loadd(4, b, 64); break;
          case 3: _tile_loadd(5, b, 64); break;
          case 4: _tile_loadd(6, b, 64); break;
          default: _tile_loadd(7, b, 64); break;
        }
      }
    for (int64_t kb = kb0; kb < kb1; ++kb) {
      for (int64_t far = kb == it.k0 / bs ? kb + 1 : kb + c.l2_ahead; far <= kb + c.l2_ahead; ++far) {
        if (far < kb1) ask(c.key_cache, far);
        else if (kb0 + far - kb1 < kb1) ask(c.value_cache, kb0 + far - kb1);
      }
      const KV* k = c.key_cache + table[kb] * c.cs[0] + kv_h;
      const int n = static_cast<int>(std::min<int64_t>(bs, p1 - kb * bs));
      for (int t0 = 0; t0 < n; t0 += 16) {
        const at::BFloat16* kt;
        if constexpr (fp8) {   // (rows past n keep what they held: read, never used)
          for (int hh = 0; hh < nh; ++hh)
            load_block_bf16(w.kb.data() + hh * 16 * D, k + t0 * c.cs[1] + hh * c.cs[2], c.cs[1], std::min(16, n - t0), D);
          kt = w.kb.data();
        } else {
          kt = k + t0 * c.cs[1];
        }
        _tile_zero(0);
        for (int j = 0; j < nh * (D / 32); ++j) {
          _tile_loadd(1, kt + (j / (D / 32)) * head_ld + (j % (D / 32)) * 32, ld2);
          switch (j) {
            case 0: _tile_dpbf16ps(0, 1, 2); break;
            case 1: _tile_dpbf16ps(0, 1, 3); break;
            case 2: _tile_dpbf16ps(0, 1, 4); break;
            case 3: _tile_dpbf16ps(0, 1, 5); break;
            case 4: _tile_dpbf16ps(0, 1, 6); break;
            default: _tile_dpbf16ps(0, 1, 7); break;
          }
        }
        _tile_stored(0, w.st.data() + (kb * bs + t0 - p0) * 16, 64);
      }
    }
    // 2. softmax per row into its head's P: p rounded to bf16 and its remainder, its group's rows
    // apart; keys the row does not see, and the last 32-key step past plen, are zeros
    const int plen32 = (plen + 31) / 32 * 32;
    for (int r = 0; r < rows; ++r) {
      // row r's P at row r - g0 rph of its head's A (g0: its group's first head), the remainder
      // that group's rows further on
      const int hh = r / rph, g0 = hh / hpg * hpg, g_rows = (std::min(nh, g0 + hpg) - g0) * rph;
      uint16_t* hi = w.pa.data() + hh * pa_head + (r - g0 * rph) * pa_ld;
      uint16_t* lo = hi + g_rows * pa_ld;
      const int vis = static_cast<int>(std::clamp<int64_t>(start + it.q0 + r % rph / group + 1 - p0, 0, plen));
      if (vis == 0) {
        std::memset(hi, 0, plen32 * sizeof(uint16_t));
        std::memset(lo, 0, plen32 * sizeof(uint16_t));
        corr[r] = 1.f;
        continue;
      }
      float* s = w.sr.data();
      const __m512 vscale = _mm512_set1_ps(row_scale[r]);
      __m512 vmax = _mm512_set1_ps(kNegInf);
      for (int t = 0; t < vis; t += 16) {
        const __mmask16 mask = tail_mask(vis - t);
        const __m512 x = _mm512_mul_ps(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, gather16, w.st.data() + t * 16 + r, 4), vscale);
        _mm512_storeu_ps(s + t, x);
        vmax = _mm512_mask_max_ps(vmax, mask, vmax, x);
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(vmax));
      corr[r] = m[r] == kNegInf ? 0.f : std::exp(m[r] - m_new);
      const __m512 vm = _mm512_set1_ps(m_new);
      __m512 vsum = _mm512_setzero_ps();
      for (int t = 0; t < plen32; t += 16) {
        const __mmask16 mask = t < vis ? tail_mask(vis - t) : 0;
        const __m512 e = _mm512_maskz_mov_ps(mask, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), vm)));
        vsum = _mm512_add_ps(vsum, e);
        const __m256i eh = (__m256i)_mm512_cvtneps_pbh(e);
        const __m256i el = bf16_remainder(e, eh);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + t), eh);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + t), el);
      }
      l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(vsum);
      m[r] = m_new;
    }
    // 3. O = sum_h P_h V_h per group of heads, 32 keys (16 pairs) a step; V pairs past the
    // partition's keys are zeros (P is zero there, and 0 x the bytes past a block's last written
    // token could be NaN)
    int turn = 0;
    for (int g0 = 0; g0 < nh; g0 += hpg) {
      const int g1 = std::min(nh, g0 + hpg), g_rows = (g1 - g0) * rph;
      _tile_zero(0);
      _tile_zero(1);
      if constexpr (D > 32) {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int c0 = 0; c0 < plen; c0 += 32) {
        for (int hh = g0; hh < g1; ++hh, turn ^= 1) {
          uint32_t* vp = w.vp.data() + turn * 16 * D;   // two buffers in turn: packing the next
          for (int half = 0; half < 2; ++half) {        // head or step does not wait on these loads
            const int t0 = c0 + 16 * half;
            uint32_t* dst = vp + 8 * half * D;
            const int nv = std::min(16, plen - t0);
            if (nv <= 0) {
              std::memset(dst, 0, 8 * D * sizeof(uint32_t));
              continue;
            }
            const int64_t pos = p0 + t0, kb = pos / bs, row0 = pos % bs;
            if (row0 == 0 && hh == 0) {   // a block's first keys: V l2_ahead blocks on, then what follows
              const int64_t far = kb + c.l2_ahead;
              if (far < kb1) ask(c.value_cache, far);
              else if (far < kb_end) ask(c.key_cache, far);
              else if (following != nullptr) prefetch_first_blocks(*following, far - kb_end, c);
            }
            const KV* src = c.value_cache + table[kb] * c.cs[0] + row0 * c.cs[1] + kv_h + hh * c.cs[2];
            const at::BFloat16* v;
            int64_t vld;
            if constexpr (fp8) {
              load_block_bf16(w.vb.data(), src, c.cs[1], nv, D);
              v = w.vb.data();
              vld = D;
            } else {
              v = src;
              vld = c.cs[1];
            }
            for (int u = 0; u < 8; ++u) {
              if (2 * u >= nv) std::memset(dst + u * D, 0, D * sizeof(uint32_t));
              else pack_value_pair<D>(dst + u * D, v + 2 * u * vld, 2 * u + 1 < nv ? v + (2 * u + 1) * vld : nullptr);
            }
          }
          pv_step_amx<D>(w.pa.data() + hh * pa_head + c0, pa_ld, vp);
        }
      }
      _tile_stored(0, o, D * 4);
      _tile_stored(1, o + 16, D * 4);
      if constexpr (D > 32) {
        _tile_stored(2, o + 32, D * 4);
        _tile_stored(3, o + 48, D * 4);
      }
      for (int r = 0; r < g_rows; ++r) {
        const int gr = g0 * rph + r;   // the item's row
        const __m512 rescale = _mm512_set1_ps(corr[gr]);
        float* a = acc + gr * D;
        const float* hi = o + r * D;
        const float* lo = o + (g_rows + r) * D;
        for (int i = 0; i < D; i += 16)
          _mm512_storeu_ps(a + i, _mm512_fmadd_ps(_mm512_loadu_ps(a + i), rescale,
                                                  _mm512_add_ps(_mm512_loadu_ps(hi + i), _mm512_loadu_ps(lo + i))));
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int hh = r / rph, rr = r % rph;
    const float* a = acc + r * D;
    if (it.slot >= 0) {   // partial: unnormalized acc x V scale, max (natural units), sum, as attend_item's
      float* dst = c.partial + (it.slot * c.partial_rows + r) * (D + 2);
      for (int i = 0; i < D; ++i) dst[i] = a[i] * row_vscale[r];
      dst[D] = m[r];
      dst[D + 1] = l[r];
      continue;
    }
    at::BFloat16* dst = c.out + (first + it.q0 + rr / group) * c.os[0] + (static_cast<int64_t>(it.h0 + hh) * group + rr % group) * c.os[1];
    const __m512 inv = _mm512_set1_ps(l[r] > 0.f ? row_vscale[r] / l[r] : 0.f);
    for (int i = 0; i < D; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(a + i), inv)));
  }
}

// Whether attend_decode_amx reads Q over a KV cache: bf16 queries over a bf16 or FP8 cache.
template <typename Q, typename KV>
constexpr bool decode_amx_types() {
  return std::is_same_v<Q, at::BFloat16> && (std::is_same_v<KV, at::BFloat16> || std::is_same_v<KV, at::Float8_e4m3fn>);
}

// Whether attend_decode_amx takes items of `rows` rows a KV head over nh heads.
inline bool decode_amx_fits(int d, int block_size, int rows, int nh) {
  return pdserve_amx::amx_permitted() && (d == 32 || d == 64) && block_size % 16 == 0 && nh <= kDecodeAmxMaxHeads &&
         rows <= 8 && rows * nh <= 16;
}

// Whether an item goes through attend_decode_amx, and then it does.
template <typename Q, typename KV>
bool try_decode_amx(const Item& it, const Call<Q, KV>& c, DecodeScratch& w, const Item* following) {
  if constexpr (decode_amx_types<Q, KV>()) {
    if (!c.amx_decode || !decode_amx_fits(c.d, c.block_size, (it.q1 - it.q0) * c.group, it.nh)) return false;
    if (!w.configured && !(w.configured = configure_attention_tiles())) return false;
    if (c.d == 64) attend_decode_amx<64, KV>(it, c, w, following);
    else attend_decode_amx<32, KV>(it, c, w, following);
    return true;
  }
  (void)it, (void)c, (void)w, (void)following;
  return false;
}

// The end of a thread's items: its tiles back to the OS's init state (attend_tile configures its own).
inline void release_decode_tiles(DecodeScratch& w) {
  if (w.configured) _tile_release();
  w.configured = false;
}
#else
struct DecodeScratch {};
template <typename Q, typename KV>
constexpr bool decode_amx_types() { return false; }
inline bool decode_amx_fits(int, int, int, int) { return false; }
inline void release_decode_tiles(DecodeScratch&) {}
template <typename Q, typename KV>
bool try_decode_amx(const Item&, const Call<Q, KV>&, DecodeScratch&, const Item*) { return false; }
#endif

template <typename Q, typename KV>
void attend_item(const Item& it, const Call<Q, KV>& c, Scratch& w, const Item* following = nullptr) {
  const int d = c.d, group = c.group, bs = c.block_size;
  const int64_t first = c.query_start_loc[it.b];
  const int64_t qlen = c.query_start_loc[it.b + 1] - first;
  const int64_t start = c.seq_lens[it.b] - qlen;    // position of the chunk's first query
  const int rows = (it.q1 - it.q0) * group;          // per KV head
  const int nh = it.nh;
  const size_t all_rows = static_cast<size_t>(rows) * nh;
  const int64_t k_end = it.k1 >= 0 ? it.k1 : start + it.q1;
  const bool native = native_bf16<Q, KV>(d);
  // P V as bf16 pair dot products (pv_native): the native rows, keys in pairs inside a block
  const bool native_pv = native && bs % 2 == 0 && !c.fp32_pv;
  const int64_t p2s = c.partition / 2;   // dwords per row of w.p2
  if (native_pv) {
    w.p2.resize(2 * all_rows * p2s);   // hi, then lo
    if constexpr (!std::is_same_v<KV, at::BFloat16>) w.vb.resize(static_cast<size_t>(bs) * d);
  }
  w.acc.assign(all_rows * d, 0.f);
  w.m.assign(all_rows, kNegInf);
  w.l.assign(all_rows, 0.f);
  w.s.resize(all_rows * c.partition);
  w.kf.resize(static_cast<size_t>(bs) * d);
  if constexpr (!std::is_same_v<KV, at::BFloat16>) if (native) w.kb.resize(static_cast<size_t>(bs) * d);
  w.vf.resize(static_cast<size_t>(bs) * d);
  // Row r of head h: query token q0 + r / group, query head h * group + r % group (divisions
  // once per item, not per block).
  w.row_off.resize(all_rows);
  w.limit.resize(rows);
  for (int r = 0; r < rows; ++r) w.limit[r] = start + it.q0 + r / group + 1;
  for (int hh = 0; hh < nh; ++hh)
    for (int r = 0; r < rows; ++r)
      w.row_off[static_cast<size_t>(hh) * rows + r] =
          (first + it.q0 + r / group) * c.q_tok + (static_cast<int64_t>(it.h0 + hh) * group + r % group) * c.q_head;
  auto q_row = [&](int hh, int r) { return c.query + w.row_off[static_cast<size_t>(hh) * rows + r]; };
  const int64_t qbs = static_cast<int64_t>(rows) * (d / 8) * 16;   // dwords of w.qb per head
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<Q, at::BFloat16>) {
    if (native) {
      w.qb.resize(nh * qbs);
      for (int hh = 0; hh < nh; ++hh)
        for (int r = 0; r < rows; ++r) broadcast_chunks(q_row(hh, r), d, w.qb.data() + hh * qbs + r * (d / 8) * 16);
    }
  }
#endif
  if (!native) {   // fp32 rows, scale (and an FP8 cache's K scale) folded in
    w.q.resize(all_rows * d);
    for (int hh = 0; hh < nh; ++hh) {
      const int h = it.h0 + hh;
      const float ks = c.k_scale == nullptr ? 1.f : c.k_scale[c.scale_heads == 1 ? 0 : h];
      for (int r = 0; r < rows; ++r) {
        const Q* src = q_row(hh, r);
        float* dst = w.q.data() + (static_cast<size_t>(hh) * rows + r) * d;
        for (int i = 0; i < d; ++i) dst[i] = to_f32(src[i]) * c.scale * ks;
      }
    }
  }
  const int64_t* table = c.block_tables + it.b * c.bt_stride;
  // The item's heads of one token are contiguous: (nh - 1) * head stride + d elements.
  const int64_t span = (nh - 1) * c.cs[2] + d;
  const int64_t ps = c.partition;   // scores row stride
  const int64_t kb_end = (k_end + bs - 1) / bs;   // the item's blocks: kb < kb_end
  // Block kb of the item's heads of one cache (K or V) into L2, each line once. The K and V reads
  // of a partition are apart (pass 1, pass 3), so each pass asks for what the next blocks of its
  // own kind need and, near its end, for the first blocks of the pass after it: the requests are
  // spread over all the item's work, not bunched in pass 1.
  const auto ask = [&](const KV* cache, int64_t kb) {
    const int64_t at = table[kb] * c.cs[0] + static_cast<int64_t>(it.h0) * c.cs[2];
    prefetch_block(cache + at, c.cs[1], static_cast<int>(std::min<int64_t>(bs, k_end - kb * bs)), span);
  };
  for (int64_t p0 = it.k0; p0 < k_end; p0 += c.partition) {
    const int64_t p1 = std::min<int64_t>(p0 + c.partition, k_end);
    const int64_t kb0 = p0 / bs, kb1 = (p1 + bs - 1) / bs;
    // 1. scores
    for (int64_t kb = kb0; kb < kb1; ++kb) {
      const int64_t base = kb * bs;
      const int n = static_cast<int>(std::min<int64_t>(bs, p1 - base));
      // K l2_ahead blocks on (at the item's first block: the ones before too); past the
      // partition's last block, V of its first blocks, for pass 3
      for (int64_t far = kb == it.k0 / bs ? kb + 1 : kb + c.l2_ahead; far <= kb + c.l2_ahead; ++far) {
        if (far < kb1) ask(c.key_cache, far);
        else if (kb0 + far - kb1 < kb1) ask(c.value_cache, kb0 + far - kb1);
      }
      for (int hh = 0; hh < nh; ++hh) {
        const int64_t off = table[kb] * c.cs[0] + static_cast<int64_t>(it.h0 + hh) * c.cs[2];
        const float* kf = nullptr;
        const at::BFloat16* kb = nullptr;   // the bf16 K rows of the native path
        int64_t ld = d;
        if constexpr (std::is_same_v<KV, float>) {
          kf = c.key_cache + off;
          ld = c.cs[1];
        } else if (native) {
          if constexpr (std::is_same_v<KV, at::BFloat16>) {
            kb = c.key_cache + off;
            ld = c.cs[1];
          } else {
            load_block_bf16(w.kb.data(), c.key_cache + off, c.cs[1], n, d);
            kb = w.kb.data();
          }
        } else {
          load_block(w.kf.data(), c.key_cache + off, c.cs[1], n, d);
          kf = w.kf.data();
        }
        const float ks = native ? c.scale * head_scale(c.k_scale, c.scale_heads, it.h0 + hh) : 1.f;
        float* s = w.s.data() + static_cast<size_t>(hh) * rows * ps + (base - p0);
        if (native) scores_native(w.qb.data() + hh * qbs, rows, kb, ld, n, d, ks, s, ps);
        else
          for (int r = 0; r < rows; ++r) scores(w.q.data() + (static_cast<size_t>(hh) * rows + r) * d, kf, ld, n, d, s + r * ps);
      }
    }
    // 2. softmax; rows of a tile past the partition's keys (causal) are skipped in pass 3
    const int plen = static_cast<int>(p1 - p0);
    int live_rows = 0;   // rows 0 .. live_rows - 1 see a key of this partition (visibility grows with r)
    for (int hh = 0; hh < nh; ++hh)
      for (int r = 0; r < rows; ++r) {
        const size_t hr = static_cast<size_t>(hh) * rows + r;
        const int vis = static_cast<int>(std::clamp<int64_t>(w.limit[r] - p0, 0, plen));
        if (softmax_row(w.s.data() + hr * ps, vis, plen, w.m[hr], w.l[hr], w.acc.data() + hr * d, d) && hh == 0)
          live_rows = r + 1;
      }
    if (live_rows == 0) continue;
    // 3. values. Each block asks for V l2_ahead blocks on; past the partition's last block, K of
    // the next partition's first blocks, or of the item this thread takes next.
    const auto ask_ahead = [&](int64_t kb) {
      const int64_t far = kb + c.l2_ahead;
      if (far < kb1) ask(c.value_cache, far);
      else if (far < kb_end) ask(c.key_cache, far);
      else if (following != nullptr) prefetch_first_blocks(*following, far - kb_end, c);
    };
#if defined(__AVX512BF16__)
    if (native_pv) {
      for (int hh = 0; hh < nh; ++hh) {
        const size_t hr0 = static_cast<size_t>(hh) * rows;
        pack_p_pairs(w.s.data() + hr0 * ps, ps, live_rows, plen, w.p2.data() + hr0 * p2s,
                     w.p2.data() + (all_rows + hr0) * p2s, p2s);
      }
      for (int64_t kb = kb0; kb < kb1; ++kb) {
        const int64_t base = kb * bs;
        const int n = static_cast<int>(std::min<int64_t>(bs, p1 - base));
        ask_ahead(kb);
        for (int hh = 0; hh < nh; ++hh) {
          const int64_t off = table[kb] * c.cs[0] + static_cast<int64_t>(it.h0 + hh) * c.cs[2];
          const size_t hr0 = static_cast<size_t>(hh) * rows;
          const at::BFloat16* v = nullptr;
          int64_t ld = d;
          if constexpr (std::is_same_v<KV, at::BFloat16>) {
            v = c.value_cache + off;
            ld = c.cs[1];
          } else {   // FP8: exactly bf16 (4 significant bits), the V scale applied at the end
            load_block_bf16(w.vb.data(), c.value_cache + off, c.cs[1], n, d);
            v = w.vb.data();
          }
          const size_t at = hr0 * p2s + (base - p0) / 2;
          pv_native(w.acc.data() + hr0 * d, live_rows, w.p2.data() + at,
                    w.p2.data() + all_rows * p2s + at, p2s, v, ld, n, d);
        }
      }
      continue;
    }
#endif
    for (int64_t kb = kb0; kb < kb1; ++kb) {
      const int64_t base = kb * bs;
      const int n = static_cast<int>(std::min<int64_t>(bs, p1 - base));
      ask_ahead(kb);
      for (int hh = 0; hh < nh; ++hh) {
        const int64_t off = table[kb] * c.cs[0] + static_cast<int64_t>(it.h0 + hh) * c.cs[2];
        const size_t hr0 = static_cast<size_t>(hh) * rows;
        accumulate(w.acc.data() + hr0 * d, live_rows, w.s.data() + hr0 * ps + (base - p0), ps, c.value_cache + off,
                   c.cs[1], n, d, w.vf.data());
      }
    }
  }
  for (int hh = 0; hh < nh; ++hh) {
    const int h = it.h0 + hh;
    const float vs = c.v_scale == nullptr ? 1.f : c.v_scale[c.scale_heads == 1 ? 0 : h];
    for (int r = 0; r < rows; ++r) {
      const size_t hr = static_cast<size_t>(hh) * rows + r;
      const float* acc = w.acc.data() + hr * d;
      if (it.slot >= 0) {   // partial: unnormalized acc (V scale applied), max, sum
        float* dst = c.partial + (it.slot * c.partial_rows + hr) * (d + 2);
        for (int i = 0; i < d; ++i) dst[i] = acc[i] * vs;
        dst[d] = w.m[hr];
        dst[d + 1] = w.l[hr];
        continue;
      }
      Q* dst = c.out + (first + it.q0 + r / group) * c.os[0] + (static_cast<int64_t>(h) * group + r % group) * c.os[1];
      const float inv = vs / w.l[hr];
      for (int i = 0; i < d; ++i) dst[i] = static_cast<Q>(acc[i] * inv);
    }
  }
}

// The merge of split-K partials of one tile (slots first .. first + n - 1): out = sum_j e^(m_j - M) acc_j
// / sum_j e^(m_j - M) l_j, M = max_j m_j (a partial whose keys the row does not see has m = -inf).
template <typename Q, typename KV>
void merge_partials(const Item& it, int64_t first_slot, int n_slots, const Call<Q, KV>& c) {
  const int d = c.d, group = c.group;
  const int rows = (it.q1 - it.q0) * c.group;
  const int64_t first = c.query_start_loc[it.b];
  for (int hh = 0; hh < it.nh; ++hh)
    for (int r = 0; r < rows; ++r) {
      const size_t hr = static_cast<size_t>(hh) * rows + r;
      float mx = kNegInf;
      for (int j = 0; j < n_slots; ++j) mx = std::max(mx, c.partial[((first_slot + j) * c.partial_rows + hr) * (d + 2) + d]);
      float l = 0.f;
      float acc[256] = {0.f};
      for (int j = 0; j < n_slots; ++j) {
        const float* src = c.partial + ((first_slot + j) * c.partial_rows + hr) * (d + 2);
        if (src[d] == kNegInf) continue;
        const float f = std::exp(src[d] - mx);
        l += f * src[d + 1];
        for (int i = 0; i < d; ++i) acc[i] += f * src[i];
      }
      Q* dst = c.out + (first + it.q0 + r / group) * c.os[0] + (static_cast<int64_t>(it.h0 + hh) * group + r % group) * c.os[1];
      for (int i = 0; i < d; ++i) dst[i] = static_cast<Q>(acc[i] / l);
    }
}

template <typename Q, typename KV>
void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
         const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale, int64_t skip_prefill_from) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t num_kv_heads = key_cache.size(2);
  Call<Q, KV> c;
  c.group = static_cast<int>(query.size(1) / num_kv_heads);
  c.d = static_cast<int>(query.size(2));
  c.block_size = static_cast<int>(key_cache.size(1));
  c.partition = std::max(1, kPartitionKeys / c.block_size) * c.block_size;
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  // Tiles: (sequence, queries q0 .. q1) of the sequences this call attends.
  const int tile_q = std::max(1, kTileRows / c.group);
  struct Tile { int64_t b; int32_t q0, q1; };
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q = qsl[b + 1] - qsl[b];
    if (q < 1 || (skip_prefill_from > 0 && q >= skip_prefill_from && sl[b] == q)) continue;
    for (int64_t q0 = 0; q0 < q; q0 += tile_q) {
      tiles.push_back({b, static_cast<int32_t>(q0), static_cast<int32_t>(std::min<int64_t>(q, q0 + tile_q))});
    }
  }
  if (tiles.empty()) return;
  const int64_t threads = at::get_num_threads();
  // With enough tiles for every thread, one item reads all KV heads of a tile (each block one
  // contiguous range); otherwise one item per KV head, and a long sequence's keys split over
  // several items (split-K) until every thread has about two items.
  int max_tile_q = 0;
  for (const Tile& t : tiles) max_tile_q = std::max(max_tile_q, t.q1 - t.q0);
  const bool enough = static_cast<int64_t>(tiles.size()) >= 2 * threads && max_tile_q * c.group <= PDSERVE_ATTN_WHOLE_MAX_ROWS;
  const char* min_rows_env = std::getenv("PDSERVE_ATTN_WHOLE_MIN_ROWS");   // A/B knob: 0 = every tile whole
  const int whole_min_rows = min_rows_env != nullptr ? std::atoi(min_rows_env) : PDSERVE_ATTN_WHOLE_MIN_ROWS;
  // Decode rows on AMX (attend_decode_amx) take every KV head in one item too: each cache block
  // then one contiguous range, one C tile for all heads' scores.
  const char* amx_env = std::getenv("PDSERVE_ATTN_AMX");
  c.amx = amx_env == nullptr || std::strcmp(amx_env, "0") != 0;
  const char* decode_mode = std::getenv("PDSERVE_ATTN_DECODE");
  c.fp32_pv = decode_mode != nullptr && std::strcmp(decode_mode, "fp32") == 0;
  const char* amx_decode = std::getenv("PDSERVE_ATTN_AMX_DECODE");   // 0: off; heads: one KV head an item
  c.amx_decode = c.amx && !c.fp32_pv && (amx_decode == nullptr || std::strcmp(amx_decode, "0") != 0);
  const bool amx_whole = c.amx_decode && decode_amx_types<Q, KV>() &&
                         (amx_decode == nullptr || std::strcmp(amx_decode, "heads") != 0);
  auto whole_tile = [&](const Tile& t) {
    const int rows = (t.q1 - t.q0) * c.group;
    return enough && (rows >= whole_min_rows ||
                      (amx_whole && decode_amx_fits(c.d, c.block_size, rows, static_cast<int>(num_kv_heads))));
  };
  int64_t base_items = 0;
  for (const Tile& t : tiles) base_items += whole_tile(t) ? 1 : num_kv_heads;
  const int64_t want = 2 * threads;
  std::vector<Item> items;
  struct Split { Item tile; int64_t first_slot; int n; };
  std::vector<Split> splits;
  int64_t slots = 0;
  int rows_max = 0;
  for (const Tile& t : tiles) {
    const int64_t k_end = sl[t.b] - (qsl[t.b + 1] - qsl[t.b]) + t.q1;
    const int64_t parts = (k_end + c.partition - 1) / c.partition;
    int n_split = 1;
    if (base_items < want && parts > 1)
      n_split = static_cast<int>(std::min<int64_t>(parts, (want + base_items - 1) / base_items));
    const bool whole = whole_tile(t);
    for (int64_t h = 0; h < num_kv_heads; h += whole ? num_kv_heads : 1) {
      Item it{t.b, static_cast<int32_t>(h), static_cast<int32_t>(whole ? num_kv_heads : 1), t.q0, t.q1, 0, -1, -1};
      if (n_split == 1) {
        items.push_back(it);
        continue;
      }
      const int64_t per = (parts + n_split - 1) / n_split * c.partition;   // whole partitions per split
      int n = 0;
      for (int64_t k0 = 0; k0 < k_end; k0 += per, ++n) {
        Item part = it;
        part.k0 = k0;
        part.k1 = std::min(k_end, k0 + per);
        part.slot = slots + n;
        items.push_back(part);
      }
      splits.push_back({it, slots, n});
      slots += n;
      rows_max = std::max(rows_max, (t.q1 - t.q0) * c.group * it.nh);
    }
  }
  std::vector<float> partial(static_cast<size_t>(slots) * rows_max * (c.d + 2));
  c.partial = partial.data();
  c.partial_rows = rows_max;
  c.query = query.data_ptr<Q>();
  c.q_tok = query.stride(0);
  c.q_head = query.stride(1);
  c.key_cache = reinterpret_cast<const KV*>(key_cache.data_ptr());
  c.value_cache = reinterpret_cast<const KV*>(value_cache.data_ptr());
  for (int i = 0; i < 3; ++i) c.cs[i] = key_cache.stride(i);
  c.block_tables = block_tables.data_ptr<int64_t>();
  c.bt_stride = block_tables.stride(0);
  c.seq_lens = sl;
  c.query_start_loc = qsl;
  c.out = out.data_ptr<Q>();
  c.os[0] = out.stride(0);
  c.os[1] = out.stride(1);
  c.scale = static_cast<float>(scale);
  c.k_scale = k_scale ? k_scale->data_ptr<float>() : nullptr;
  c.v_scale = v_scale ? v_scale->data_ptr<float>() : nullptr;
  c.scale_heads = k_scale ? k_scale->numel() : 1;
  // a tuning knob for A/B runs: 2 and 8 measured as 4; 12 too in the 16-row decode step after
  // another model's step, its KV from DRAM (bench quant, Emerald Rapids, 2026-12-07)
  const char* l2 = std::getenv("PDSERVE_ATTN_L2_AHEAD");
  c.l2_ahead = c.fp32_pv ? 1 : std::max(1, l2 != nullptr ? std::atoi(l2) : PDSERVE_ATTN_L2_AHEAD);
  const int64_t n_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, n_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch w;
    TileScratch tw;
    DecodeScratch dw;
    // from the last item: a chunk's later tiles see more keys, and the costliest first balances best
    // Each thread claims its next item before it starts the current one, so the current one's
    // last blocks can ask for the next one's first (prefetch_first_blocks).
    for (int64_t i = next.fetch_add(1); i < n_items;) {
      const int64_t j = c.l2_ahead > 1 ? next.fetch_add(1) : -1;
      const Item& it = items[n_items - 1 - i];
      const Item* following = j >= 0 && j < n_items ? &items[n_items - 1 - j] : nullptr;
      if (!try_decode_amx<Q, KV>(it, c, dw, following)) {
        // (attend_tile configures the tiles its own way and releases them)
        if (try_tile<Q, KV>(it, c, tw)) release_decode_tiles(dw);
        else attend_item<Q, KV>(it, c, w, following);
      }
      i = j >= 0 ? j : next.fetch_add(1);
    }
    release_decode_tiles(dw);
  });
  for (const Split& s : splits) merge_partials<Q, KV>(s.tile, s.first_slot, s.n, c);
}

void check(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
           const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [T, Hq, D] of one shape");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.strides() == value_cache.strides(),
              "key_cache/value_cache must be [num_blocks, block_size, Hkv, D] with equal strides");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(2) == 0,
              "head_dim must match and num_heads be a multiple of num_kv_heads");
  TORCH_CHECK(query.size(2) <= 256, "head_dim must be at most 256");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1,
              "the head_dim axis must be contiguous");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "out must have query's dtype, value_cache key_cache's");
  for (const auto* t : {&block_tables, &seq_lens, &query_start_loc})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "metadata must be contiguous int64");
  TORCH_CHECK(block_tables.stride(1) == 1, "block_tables rows must be contiguous");
  TORCH_CHECK(query_start_loc.numel() == seq_lens.numel() + 1 && block_tables.size(0) == seq_lens.numel(),
              "query_start_loc must be [B + 1] and block_tables [B, max_blocks] for seq_lens [B]");
  const bool fp8 = key_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 == (k_scale.has_value() && v_scale.has_value()) && k_scale.has_value() == v_scale.has_value(),
              fp8 ? "an FP8 E4M3 cache needs k_scale and v_scale" : "k_scale/v_scale are for an FP8 E4M3 cache only");
  if (fp8) {
    const int64_t hkv = key_cache.size(2);
    for (const auto* s : {&*k_scale, &*v_scale})
      TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && (s->numel() == 1 || s->numel() == hkv),
                  "k_scale/v_scale must be contiguous float32 of 1 or num_kv_heads elements");
    TORCH_CHECK(k_scale->numel() == v_scale->numel(), "k_scale and v_scale must have one shape");
  }
}

// out [T, Hq, D] (query's dtype) <- attention of every sequence's new tokens, each query over its
// sequence's keys up to its own position (causal); skip_prefill_from > 0: a chunk that starts at
// position 0 with at least that many tokens is left to the caller (its rows of out untouched). query [T, Hq, D] (last dim contiguous); key_cache/value_cache
// [num_blocks, block_size, Hkv, D] (last dim contiguous, same strides) in fp32, bf16, fp16 or
// float8_e4m3fn (then k_scale/v_scale: fp32 [1] or [Hkv], the cache holding x / scale);
// block_tables [B, max_blocks] int64, seq_lens [B] int64 (context after this forward),
// query_start_loc [B + 1] int64.
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale, int64_t skip_prefill_from) {
  check(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale);
  pdserve_dispatch::activation(query.scalar_type(), "query", [&](auto q_tag) {
    pdserve_dispatch::kv_cache(key_cache.scalar_type(), [&](auto kv_tag) {
      run<decltype(q_tag), decltype(kv_tag)>(out, query, key_cache, value_cache, block_tables, seq_lens,
                                             query_start_loc, scale, k_scale, v_scale, skip_prefill_from);
    });
  });
}

}  // namespace

TORCH_LIBRARY(pdserve_attn, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, Tensor? k_scale, "
        "Tensor? v_scale, int skip_prefill_from) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_attn, CPU, m) { m.impl("paged_attention", &paged_attention); }
