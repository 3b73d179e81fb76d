// The small per-layer ops of a decoder forward on CPU, one pass over memory each instead of the
// 4-8 torch ops (and their dispatch, temporaries and dtype round trips) each one takes in eager
// mode: at decode batch sizes those ops, not their FLOPs, cost ~200 us a layer (torch.profiler,
// SmolLM2-135M, bf16, one thread).
//
// - rms_norm / add_rms_norm: out = w * round(x * rsqrt(mean(x^2) + eps)) (Zhang & Sennrich 2019),
//   the mean and the product in fp32, rounded to the dtype where the torch reference rounds (the
//   normalized row, then the product with the weight), so bf16 results match it bit for bit up
//   to the order of the sum; add_rms_norm first adds x into the residual stream in place.
// - rope_split: the fused QKV projection's output [T, (Hq + 2 Hkv) D] -> rotated q [T, Hq, D],
//   rotated k and plain v [T, Hkv, D], rotate-half RoPE (Su et al. 2021, as HF checkpoints use),
//   computed in fp32 from fp32 cos/sin tables [T, D/2], rounded once.
// - silu_mul: the fused gate/up output [T, 2I] -> silu(gate) * up [T, I], silu in fp32 rounded to
//   the dtype, then the product rounded, as the reference rounds (rounding once instead put the
//   bf16 model measurably further from fp32: teacher-forced top-1 log-prob error 0.034 vs 0.028
//   nats on average over 4 ShareGPT prompts, and one clear argmax flipped in test_bf16).
//
// - argmax_rows: greedy sampling's argmax of each logits row [N, V] (fp32 or the model dtype) ->
//   [N] int64, torch.argmax's answer (the first maximum; the first NaN when a row has one), in one
//   pass of 16-lane running maxima and their indices: torch's own CPU argmax read 49,152 fp32
//   logits at ~7 GB/s (27 us a row on one thread) and bf16 ones 5x slower.
//
// Rows are split over torch's intra-op threads only when there is enough work (>= 32K elements
// per thread; silu_mul from 6K elements in all, 3K per thread): at decode sizes a thread hand-off
// costs more than the op. AVX-512 where the compiler targets it (-march=native), rows of a
// multiple of 16 elements (and AVX2 for silu_mul of fp32 rows: 8 lanes); a scalar path otherwise.
// Registered as torch operators in the same library as paged_attention.cpp: torch.ops.pdserve_ops.*.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "rope.h"
#include "silu_mul.h"
#include "simd_math.h"

namespace {

constexpr int64_t kGrainElements = 32768;
// silu_mul's exp and division make it far more work per element than a norm (~0.5 ns an element
// on one Zen 4 core), so it pays to split from far fewer elements: rows of 1536 (the model's
// intermediate size), 1 vs 2 threads, us: 3 rows 3.5 / 3.8, 4 rows 4.3 / 3.9, 16 rows
// 12.9 / 9.0, 32 rows 24.5 / 15.2. From kSiluSplitElements in all, each thread takes at least
// half of that (so many threads do not split 4 rows into 1-row hand-offs).
constexpr int64_t kSiluSplitElements = 6144;

template <typename T>
inline float f32(T x) { return static_cast<float>(x); }
template <typename T>
inline T from_f32(float x) { return static_cast<T>(x); }   // c10 types round to nearest even

#if defined(__AVX512F__)
template <typename T>
inline __m512 ld(const T* p) { return pdserve_simd::load16(p); }
template <typename T>
inline void st(T* p, __m512 v) { pdserve_simd::store16(p, v); }
template <typename T>
inline __m512 round_to(__m512 v) { return pdserve_simd::round16<T>(v); }
#endif

template <typename T>
inline T round_scalar(float v) { return from_f32<T>(v); }

// Rows [begin, end) of x [T, H]: out = w * round(x * inv_rms); with residual, x is first added
// into residual (rounded) and the sum normalized.
template <typename T>
void norm_rows(T* out, const T* x, int64_t x_stride, T* residual, const T* w, int64_t h, float eps,
               int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const T* xr = x + t * x_stride;
    T* o = out + t * h;
    const T* src = xr;
    if (residual != nullptr) {   // residual += x, in the dtype
      T* r = residual + t * h;
      int64_t i = 0;
#if defined(__AVX512F__)
      if (h % 16 == 0)
        for (; i < h; i += 16) st(r + i, _mm512_add_ps(ld(r + i), ld(xr + i)));
#endif
      for (; i < h; ++i) r[i] = from_f32<T>(f32(r[i]) + f32(xr[i]));
      src = r;
    }
    float ss = 0.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    if (h % 16 == 0) {
      __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
      for (; i + 32 <= h; i += 32) {
        const __m512 v0 = ld(src + i), v1 = ld(src + i + 16);
        a = _mm512_fmadd_ps(v0, v0, a);
        b = _mm512_fmadd_ps(v1, v1, b);
      }
      for (; i < h; i += 16) {
        const __m512 v = ld(src + i);
        a = _mm512_fmadd_ps(v, v, a);
      }
      ss = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
#endif
    for (; i < h; ++i) ss += f32(src[i]) * f32(src[i]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
    i = 0;
#if defined(__AVX512F__)
    if (h % 16 == 0) {
      const __m512 vi = _mm512_set1_ps(inv);
      for (; i < h; i += 16) st(o + i, _mm512_mul_ps(ld(w + i), round_to<T>(_mm512_mul_ps(ld(src + i), vi))));
    }
#endif
    for (; i < h; ++i) o[i] = from_f32<T>(f32(w[i]) * f32(from_f32<T>(f32(src[i]) * inv)));
  }
}

template <typename T>
void norm_impl(at::Tensor& out, const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), h = x.size(1);
  T* o = out.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  T* rp = residual != nullptr ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / h), [&](int64_t b, int64_t e) {
    norm_rows<T>(o, xp, xs, rp, wp, h, static_cast<float>(eps), b, e);
  });
}

void check_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, H] with contiguous rows");
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous(), "out must be a contiguous [T, H]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "weight must be [H]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "out, x and weight must have one dtype");
}

template <typename F>
void dispatch(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(at::BFloat16{});
    case at::kHalf: return f(at::Half{});
    default: TORCH_CHECK(false, "unsupported dtype ", t, " (float32, bfloat16, float16)");
  }
}

// out [T, H] <- rms_norm(x) * weight.
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(out, x, weight);
  dispatch(x.scalar_type(), [&](auto tag) { norm_impl<decltype(tag)>(out, x, nullptr, weight, eps); });
}

// residual [T, H] += x; out [T, H] <- rms_norm(residual) * weight.
void add_rms_norm(at::Tensor& out, const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_norm(out, x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "residual must be a contiguous [T, H] of x's dtype");
  dispatch(x.scalar_type(), [&](auto tag) { norm_impl<decltype(tag)>(out, x, &residual, weight, eps); });
}

template <typename T>
void rope_impl(at::Tensor& q, at::Tensor& k, at::Tensor& v, const at::Tensor& qkv, const at::Tensor& cos,
               const at::Tensor& sin) {
  const int64_t rows = qkv.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2), half = d / 2;
  const T* src = qkv.data_ptr<T>();
  const int64_t ss = qkv.stride(0);
  T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t width = (hq + 2 * hkv) * d;
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / width), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* row = src + t * ss;
      const float *c = cp + t * half, *s = sp + t * half;
      for (int64_t h = 0; h < hq; ++h) pdserve_rope::rotate(qp + (t * hq + h) * d, row + h * d, c, s, half);
      for (int64_t h = 0; h < hkv; ++h) pdserve_rope::rotate(kp + (t * hkv + h) * d, row + (hq + h) * d, c, s, half);
      std::memcpy(vp + t * hkv * d, row + (hq + hkv) * d, sizeof(T) * hkv * d);
    }
  });
}

// qkv [T, (Hq + 2 Hkv) D] (rows contiguous), cos/sin fp32 [T, D/2] -> q [T, Hq, D], k, v [T, Hkv, D].
void rope_split(at::Tensor& q, at::Tensor& k, at::Tensor& v, const at::Tensor& qkv, const at::Tensor& cos,
                const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes(), "q must be [T, Hq, D], k and v [T, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "q, k, v must be contiguous");
  const int64_t rows = q.size(0), d = q.size(2);
  TORCH_CHECK(d % 2 == 0 && k.size(0) == rows && k.size(2) == d, "q, k, v: one T and one even D");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(0) == rows && qkv.size(1) == (q.size(1) + 2 * k.size(1)) * d &&
                  qkv.stride(1) == 1, "qkv must be [T, (Hq + 2 Hkv) D] with contiguous rows");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == rows * d / 2 && sin.numel() == rows * d / 2,
              "cos and sin must be contiguous float32 [T, D/2]");
  TORCH_CHECK(q.scalar_type() == qkv.scalar_type() && k.scalar_type() == qkv.scalar_type() &&
                  v.scalar_type() == qkv.scalar_type(), "q, k, v must have qkv's dtype");
  dispatch(qkv.scalar_type(), [&](auto tag) { rope_impl<decltype(tag)>(q, k, v, qkv, cos, sin); });
}

template <typename T>
void silu_mul_impl(at::Tensor& out, const at::Tensor& gu) {
  const int64_t rows = out.size(0), n = out.size(1);
  const T* src = gu.data_ptr<T>();
  const int64_t ss = gu.stride(0);
  T* op = out.data_ptr<T>();
  const int64_t grain = rows * n >= kSiluSplitElements ? std::max<int64_t>(1, kSiluSplitElements / 2 / std::max<int64_t>(1, n)) : rows;
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) pdserve_silu::silu_mul_row(src + t * ss, src + t * ss + n, op + t * n, n);
  });
}

// gu [T, 2N] (gate | up, rows contiguous) -> out [T, N] = silu(gate) * up.
void silu_mul(at::Tensor& out, const at::Tensor& gu) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), "out must be a contiguous [T, N]");
  TORCH_CHECK(gu.dim() == 2 && gu.size(0) == out.size(0) && gu.size(1) == 2 * out.size(1) && gu.stride(1) == 1,
              "gu must be [T, 2N] with contiguous rows");
  TORCH_CHECK(gu.scalar_type() == out.scalar_type(), "out must have gu's dtype");
  dispatch(gu.scalar_type(), [&](auto tag) { silu_mul_impl<decltype(tag)>(out, gu); });
}


// One row's argmax: the first index of the largest value; the first NaN if there is one.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  int64_t i = 0, best_i = 0;
  float best = -std::numeric_limits<float>::infinity();
  bool has_nan = false;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vmax = ld(x);
    __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i cur = vidx;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      cur = _mm512_add_epi32(cur, step);
      const __m512 v = ld(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);   // strictly greater: lanes keep their first maximum
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
    }
    has_nan = nan != 0;
    best = _mm512_reduce_max_ps(vmax);
    const __mmask16 at_best = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(best), _CMP_EQ_OQ);
    best_i = _mm512_mask_reduce_min_epi32(at_best, vidx);   // the first of the lanes holding the maximum
  }
#endif
  if (i == 0) {   // no vector pass: start from the first element
    best = f32(x[0]);
    has_nan = best != best;
    i = 1;
  }
  for (; i < n; ++i) {
    const float v = f32(x[i]);
    if (v != v) has_nan = true;
    if (v > best) { best = v; best_i = i; }
  }
  if (has_nan)
    for (i = 0; i < n; ++i)
      if (f32(x[i]) != f32(x[i])) return i;
  return best_i;
}

// out [N] int64 <- argmax of each row of logits [N, V] (rows contiguous), one row per work item.
void argmax_rows(at::Tensor& out, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be [N, V] with V > 0 and contiguous rows");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "V must be below 2^31");
  TORCH_CHECK(out.dim() == 1 && out.size(0) == logits.size(0) && out.is_contiguous() &&
                  out.scalar_type() == at::kLong, "out must be a contiguous int64 [N]");
  const int64_t rows = logits.size(0), v = logits.size(1), ls = logits.stride(0);
  int64_t* op = out.data_ptr<int64_t>();
  dispatch(logits.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* lp = logits.data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / v), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) op[r] = argmax_row(lp + r * ls, v);
    });
  });
}

}  // namespace

TORCH_LIBRARY(pdserve_ops, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rope_split(Tensor(a!) q, Tensor(b!) k, Tensor(c!) v, Tensor qkv, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor(a!) out, Tensor gu) -> ()");
  m.def("argmax_rows(Tensor(a!) out, Tensor logits) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_ops, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_split", &rope_split);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
}
