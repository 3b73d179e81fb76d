// Paged attention on CPU, reading K/V in place through the block table (no gather copy).
//
// Decode rows and short chunks (verification runs, <= max_query_len queries per sequence):
// one work item per sequence (per (sequence, KV head) when the batch is too small for the
// threads). The G query heads that share a KV head and the Q queries of the chunk are G * Q
// rows of that head, so every K/V block is read once per KV head (converted to fp32 once, the
// next block prefetched) and reused by all those rows while it is in L1. Online softmax over the sequence's blocks
// (Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018; the running max /
// sum / rescaled accumulator of FlashAttention, Dao et al. 2022), accumulated in fp32 whatever
// the cache dtype (fp32, bf16, fp16). Items are handed to torch's intra-op threads (at::parallel_for,
// OpenMP: the threads torch.set_num_threads gives) through an atomic counter, so sequences of
// different lengths balance.
//
// AVX-512 paths where the compiler targets it (-march=native on a CPU with AVX-512F): fp32 caches
// are read in place, bf16/fp16 blocks converted to fp32 once per block and KV head; with
// AVX512-BF16 and a bf16 query, q . k runs on the bf16 cache directly (vdpbf16ps: exact bf16
// products summed in fp32). Sixteen keys' dot products are reduced together (one transpose-and-
// add tree) and the block's softmax step is one vector. Elsewhere a portable scalar path with the
// same algorithm.
// Only the headers the kernel needs (torch/extension.h takes ~15 s of the build to parse, these ~3 s);
// registered as a torch operator (no pybind): torch.ops.pdserve_attn.paged_attention_short.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__SSE__)
#include <immintrin.h>
#endif

#include "simd_math.h"

namespace {

template <typename T>
inline float to_f32(T x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
using pdserve_simd::load16;
using pdserve_simd::exp_neg;
#endif

// s[0..n) = exp(s - m); returns their sum.
inline float exp_sum(float* s, int n, float m) {
  float sum = 0.f;
  int t = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(m), vs = _mm512_setzero_ps();
  for (; t < n; t += 16) {
    __mmask16 mask = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    __m512 e = exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), vm));
    _mm512_mask_storeu_ps(s + t, mask, e);
    vs = _mm512_mask_add_ps(vs, mask, vs, e);
  }
  sum = _mm512_reduce_add_ps(vs);
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return sum;
}

// q (fp32, length d) . k (cache dtype).
template <typename T>
inline float dot(const float* q, const T* k, int d) {
  int i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  if (d % 16 == 0) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; i + 32 <= d; i += 32) {
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i + 16), load16(k + i + 16), a1);
    }
    for (; i < d; i += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), a0);
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  }
#endif
  for (; i < d; ++i) sum += q[i] * to_f32(k[i]);
  return sum;
}

// acc[0..d) = acc * corr + sum_t p[t] * v_t, v_t = v + t * v_stride.
template <typename T>
inline void rescale_accumulate(float* acc, float corr, const float* p, const T* v, int64_t v_stride, int n, int d) {
#if defined(__AVX512F__)
  if (d % 16 == 0) {
    for (int i = 0; i < d; i += 16) {
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + i), _mm512_set1_ps(corr));
      for (int t = 0; t < n; ++t) a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), load16(v + t * v_stride + i), a);
      _mm512_storeu_ps(acc + i, a);
    }
    return;
  }
#endif
  for (int i = 0; i < d; ++i) acc[i] *= corr;
  for (int t = 0; t < n; ++t) {
    const T* vt = v + t * v_stride;
    for (int i = 0; i < d; ++i) acc[i] += p[t] * to_f32(vt[i]);
  }
}

#if defined(__AVX512F__)
// Lane t of the result = the sum of the 16 lanes of a[t]: 16 horizontal sums as one transpose-
// and-add tree (45 shuffles and adds instead of 16 separate reductions of ~8 each).
inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)   // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: the lane's partial sums of tokens 4k .. 4k+3
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

// head_dim = 16 * NC, known at compile time: the loops unroll and the accumulators stay in
// registers. s[t] = q . k_t for t < n, k_t = kf + t * ld (fp32).
template <int NC>
inline void scores_fixed(const float* q, const float* kf, int64_t ld, int n, float* s) {
  __m512 qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int t0 = 0; t0 < n; t0 += 16) {
    const int m = std::min(16, n - t0);
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
    _mm512_mask_storeu_ps(s + t0, m >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << m) - 1), reduce16(a));
  }
}

// acc = acc * corr + sum_t p[t] v_t for t < n, v_t = vf + t * ld (fp32).
template <int NC>
inline void accumulate_fixed(float* acc, float corr, const float* p, const float* vf, int64_t ld, int n) {
  __m512 a[NC], b[NC];   // even and odd tokens: two independent FMA chains per chunk
  const __m512 vc = _mm512_set1_ps(corr);
  for (int c = 0; c < NC; ++c) {
    a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), vc);
    b[c] = _mm512_setzero_ps();
  }
  int t = 0;
  for (; t + 2 <= n; t += 2) {
    const __m512 p0 = _mm512_set1_ps(p[t]), p1 = _mm512_set1_ps(p[t + 1]);
    const float* v0 = vf + t * ld;
    const float* v1 = v0 + ld;
    for (int c = 0; c < NC; ++c) {
      a[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), a[c]);
      b[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * c), b[c]);
    }
  }
  if (t < n) {
    const __m512 p0 = _mm512_set1_ps(p[t]);
    for (int c = 0; c < NC; ++c) a[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vf + t * ld + 16 * c), a[c]);
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + 16 * c, _mm512_add_ps(a[c], b[c]));
}
#endif

#if defined(__AVX512BF16__)
// bf16 query and bf16 keys: s[t] = scale * (q . k_t) with the AVX512-BF16 dot product (bf16 pairs
// multiplied exactly, summed in fp32), read from the cache without conversion. NC2 = d / 32.
template <int NC2>
inline void scores_bf16(const at::BFloat16* q, const at::BFloat16* kc, int64_t ld, int n, float scale, float* s) {
  __m512bh qv[NC2];
  for (int c = 0; c < NC2; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int t0 = 0; t0 < n; t0 += 16) {
    const int m = std::min(16, n - t0);
    __m512 a[16];
    for (int t = 0; t < 16; ++t) {
      a[t] = _mm512_setzero_ps();
      if (t >= m) continue;
      const at::BFloat16* k = kc + (t0 + t) * ld;
      for (int c = 0; c < NC2; ++c) a[t] = _mm512_dpbf16_ps(a[t], qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
    }
    _mm512_mask_storeu_ps(s + t0, m >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << m) - 1),
                          _mm512_mul_ps(reduce16(a), vscale));
  }
}
#endif

// True (and s filled) when the bf16 dot-product path applies: bf16 query and cache, d in {32, 64, 128}.
template <typename Q, typename KV>
inline bool block_scores_native(const Q* q, const KV* kc, int64_t ld, int n, int d, float scale, float* s) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<Q, at::BFloat16> && std::is_same_v<KV, at::BFloat16>) {
    switch (d) {
      case 64: scores_bf16<2>(q, kc, ld, n, scale, s); return true;
      case 128: scores_bf16<4>(q, kc, ld, n, scale, s); return true;
      case 32: scores_bf16<1>(q, kc, ld, n, scale, s); return true;
      default: return false;
    }
  }
#endif
  return false;
}

// s[t] = q . k_t for t < n, k_t = kf + t * ld (rows of length d, fp32).
inline void block_scores(const float* q, const float* kf, int64_t ld, int n, int d, float* s) {
#if defined(__AVX512F__)
  switch (d) {
    case 64: return scores_fixed<4>(q, kf, ld, n, s);
    case 128: return scores_fixed<8>(q, kf, ld, n, s);
    case 32: return scores_fixed<2>(q, kf, ld, n, s);
    default: break;
  }
#endif
  for (int t = 0; t < n; ++t) s[t] = dot(q, kf + t * ld, d);
}

// acc = acc * corr + sum_t p[t] v_t, v_t = vf + t * ld (rows of length d, fp32).
inline void block_accumulate(float* acc, float corr, const float* p, const float* vf, int64_t ld, int n, int d) {
#if defined(__AVX512F__)
  switch (d) {
    case 64: return accumulate_fixed<4>(acc, corr, p, vf, ld, n);
    case 128: return accumulate_fixed<8>(acc, corr, p, vf, ld, n);
    case 32: return accumulate_fixed<2>(acc, corr, p, vf, ld, n);
    default: break;
  }
#endif
  rescale_accumulate(acc, corr, p, vf, ld, n, d);
}

// One block's online-softmax step for one row: m_new = max(m_old, max_t s[t]); s[t] becomes
// exp(s[t] - m_new) and sum their sum (t < n).
inline void softmax_block(float* s, int n, float m_old, float& m_new, float& sum) {
#if defined(__AVX512F__)
  if (n <= 16) {   // one vector: no scalar max chain, no store/reload
    const __mmask16 mask = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), mask, s);
    m_new = std::max(m_old, _mm512_reduce_max_ps(sv));
    const __m512 e = _mm512_maskz_mov_ps(mask, exp_neg(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
    _mm512_mask_storeu_ps(s, mask, e);
    sum = _mm512_reduce_add_ps(e);
    return;
  }
#endif
  float bmax = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < n; ++t) bmax = std::max(bmax, s[t]);
  m_new = std::max(m_old, bmax);
  sum = exp_sum(s, n, m_new);
}

struct Scratch {
  std::vector<float> q, acc, m, l, s, kf, vf;
};

// dst[t * d + i] = src[t * stride + i] as fp32, t < n: one block's K (or V) rows of one KV head,
// converted once and then read by every query row of the item from L1.
template <typename T>
inline void load_block(float* dst, const T* src, int64_t stride, int n, int d) {
  for (int t = 0; t < n; ++t) {
    const T* row = src + t * stride;
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= d; i += 16) _mm512_storeu_ps(dst + t * d + i, load16(row + i));
#endif
    for (; i < d; ++i) dst[t * d + i] = to_f32(row[i]);
  }
}

// Ask for the next block's rows while this one is computed: the blocks of a sequence are
// scattered, so the hardware prefetcher cannot guess them.
template <typename T>
inline void prefetch_block(const T* src, int64_t stride, int n, int d) {
#if defined(__AVX512F__) || defined(__SSE__)
  const int64_t bytes = static_cast<int64_t>(d) * sizeof(T);
  for (int t = 0; t < n; ++t)
    for (int64_t off = 0; off < bytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(src + t * stride) + off, _MM_HINT_T0);
#endif
}

// One item: sequence b, KV heads h0 .. h0 + nh - 1. Row r of head h: query token r / group,
// query head h * group + r % group.
struct Item {
  int64_t b;
  int64_t h0, nh;
};

template <typename Q, typename KV>
void attend_item(const Item& it, const Q* query, int64_t q_tok_stride, int64_t q_head_stride,
                 const KV* key_cache, const KV* value_cache, const int64_t* cs, const int64_t* block_tables,
                 int64_t bt_stride, const int64_t* seq_lens, const int64_t* query_start_loc, Q* out,
                 const int64_t* os, int group, int d, int block_size, float scale, Scratch& w) {
  const int64_t b = it.b, h0 = it.h0, nh = it.nh;
  const int64_t first = query_start_loc[b];
  const int qlen = static_cast<int>(query_start_loc[b + 1] - first);
  const int64_t seq_len = seq_lens[b];
  const int64_t start = seq_len - qlen;
  const int rows = qlen * group;
  const size_t all_rows = static_cast<size_t>(rows * nh);
  w.q.resize(all_rows * d);
  w.acc.assign(all_rows * d, 0.f);
  w.m.assign(all_rows, -std::numeric_limits<float>::infinity());
  w.l.assign(all_rows, 0.f);
  w.s.resize(block_size);
  w.kf.resize(static_cast<size_t>(block_size) * d);
  w.vf.resize(static_cast<size_t>(block_size) * d);
  for (int64_t h = h0; h < h0 + nh; ++h)
    for (int r = 0; r < rows; ++r) {
      const Q* src = query + (first + r / group) * q_tok_stride + (h * group + r % group) * q_head_stride;
      float* dst = w.q.data() + ((h - h0) * rows + r) * d;
      for (int i = 0; i < d; ++i) dst[i] = to_f32(src[i]) * scale;
    }
  const int64_t* table = block_tables + b * bt_stride;
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  float probe;
  const bool native = block_scores_native(query, key_cache, 0, 0, d, 1.f, &probe);  // n = 0: only asks
  // The item's heads of one token are contiguous: (nh - 1) * cs[2] + d elements.
  const int span = static_cast<int>((nh - 1) * cs[2] + d);
  for (int64_t kb = 0; kb < num_blocks; ++kb) {
    const int64_t base = kb * block_size;
    const int n_block = static_cast<int>(std::min<int64_t>(block_size, seq_len - base));
    if (kb + 1 < num_blocks) {   // (2 or 4 blocks ahead, or into L2 only, measured no better)
      const int64_t next = table[kb + 1] * cs[0] + h0 * cs[2];
      const int n_next = static_cast<int>(std::min<int64_t>(block_size, seq_len - base - block_size));
      prefetch_block(key_cache + next, cs[1], n_next, span);
      prefetch_block(value_cache + next, cs[1], n_next, span);
    }
    for (int64_t h = h0; h < h0 + nh; ++h) {
      const int64_t off = table[kb] * cs[0] + h * cs[2];
      const float *kf, *vf;
      int64_t ld;
      if constexpr (std::is_same_v<KV, float>) {   // read in place
        kf = key_cache + off;
        vf = value_cache + off;
        ld = cs[1];
      } else {                                     // converted once, read by every row from L1
        if (!native) load_block(w.kf.data(), key_cache + off, cs[1], n_block, d);
        load_block(w.vf.data(), value_cache + off, cs[1], n_block, d);
        kf = w.kf.data();
        vf = w.vf.data();
        ld = d;
      }
      for (int r = 0; r < rows; ++r) {
        // causal: query i (position start + i) sees keys 0 .. start + i
        const int64_t visible = start + r / group + 1 - base;
        const int n = static_cast<int>(std::min<int64_t>(n_block, visible));
        if (n <= 0) continue;
        const size_t hr = static_cast<size_t>((h - h0) * rows + r);
        float* s = w.s.data();
        if (!native || !block_scores_native(query + (first + r / group) * q_tok_stride + (h * group + r % group) * q_head_stride,
                                            key_cache + off, cs[1], n, d, scale, s))
          block_scores(w.q.data() + hr * d, kf, ld, n, d, s);
        const float m_old = w.m[hr];
        float m_new, sum;
        softmax_block(s, n, m_old, m_new, sum);
        // 0 on the first block (m_old = -inf); 1, without a call, while the running max holds
        const float corr = m_new == m_old ? 1.f : std::exp(m_old - m_new);
        w.l[hr] = w.l[hr] * corr + sum;
        w.m[hr] = m_new;
        block_accumulate(w.acc.data() + hr * d, corr, s, vf, ld, n, d);
      }
    }
  }
  for (int64_t h = h0; h < h0 + nh; ++h)
    for (int r = 0; r < rows; ++r) {
      const size_t hr = static_cast<size_t>((h - h0) * rows + r);
      Q* dst = out + (first + r / group) * os[0] + (h * group + r % group) * os[1];
      const float inv = 1.f / w.l[hr];
      for (int i = 0; i < d; ++i) dst[i] = static_cast<Q>(w.acc[hr * d + i] * inv);
    }
}

template <typename Q, typename KV>
void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
         const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
         const at::Tensor& query_start_loc, double scale, int64_t max_query_len) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t num_kv_heads = key_cache.size(2);
  const int group = static_cast<int>(query.size(1) / num_kv_heads);
  const int d = static_cast<int>(query.size(2));
  const int block_size = static_cast<int>(key_cache.size(1));
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  // The items this call owns: sequences with 1 .. max_query_len new tokens. With enough of them
  // for every thread, one item reads all KV heads of a sequence (each block one contiguous
  // range of memory); otherwise one item per KV head, so a small batch still uses every thread.
  std::vector<int64_t> seqs;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q = qsl[b + 1] - qsl[b];
    if (q >= 1 && q <= max_query_len) seqs.push_back(b);
  }
  const int64_t threads = at::get_num_threads();
  const bool whole = static_cast<int64_t>(seqs.size()) >= 2 * threads;
  std::vector<Item> items;
  items.reserve(seqs.size() * num_kv_heads);
  for (int64_t b : seqs) {
    if (whole) items.push_back({b, 0, num_kv_heads});
    else
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({b, h, 1});
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  if (n_items == 0) return;
  const int64_t cs[3] = {key_cache.stride(0), key_cache.stride(1), key_cache.stride(2)};
  const int64_t os[2] = {out.stride(0), out.stride(1)};
  const Q* qp = query.data_ptr<Q>();
  const KV* kp = key_cache.data_ptr<KV>();
  const KV* vp = value_cache.data_ptr<KV>();
  Q* op = out.data_ptr<Q>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t q_tok = query.stride(0), q_head = query.stride(1);
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, n_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch w;
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1))
      attend_item<Q, KV>(items[i], qp, q_tok, q_head, kp, vp, cs, bt, block_tables.stride(0), sl, qsl, op, os,
                         group, d, block_size, static_cast<float>(scale), w);
  });
}

// out [T, Hq, D] (query's dtype) <- attention of the rows of every sequence with 1..max_query_len new
// tokens; other rows of out are left untouched. query [T, Hq, D] (last dim contiguous),
// key_cache/value_cache [num_blocks, block_size, Hkv, D] (last dim contiguous, same strides),
// block_tables [B, max_blocks] int64, seq_lens [B] int64 (context after this forward),
// query_start_loc [B + 1] int64.
void paged_attention_short(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t max_query_len) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [T, Hq, D] of one shape");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.strides() == value_cache.strides(),
              "key_cache/value_cache must be [num_blocks, block_size, Hkv, D] with equal strides");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(2) == 0,
              "head_dim must match and num_heads be a multiple of num_kv_heads");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1,
              "the head_dim axis must be contiguous");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "out must have query's dtype, value_cache key_cache's");
  for (const auto* t : {&block_tables, &seq_lens, &query_start_loc})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "metadata must be contiguous int64");
  TORCH_CHECK(block_tables.stride(1) == 1, "block_tables rows must be contiguous");
  // fp32, bf16, fp16 only (a double dispatch over every float type doubles the build time).
  auto with_kv = [&](auto q_tag) {
    using Q = decltype(q_tag);
    switch (key_cache.scalar_type()) {
      case at::kFloat: return run<Q, float>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len);
      case at::kBFloat16: return run<Q, at::BFloat16>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len);
      case at::kHalf: return run<Q, at::Half>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len);
      default: TORCH_CHECK(false, "unsupported KV cache dtype ", key_cache.scalar_type());
    }
  };
  switch (query.scalar_type()) {
    case at::kFloat: return with_kv(float{});
    case at::kBFloat16: return with_kv(at::BFloat16{});
    case at::kHalf: return with_kv(at::Half{});
    default: TORCH_CHECK(false, "unsupported query dtype ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(pdserve_attn, m) {
  m.def("paged_attention_short(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int max_query_len) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_attn, CPU, m) { m.impl("paged_attention_short", &paged_attention_short); }
