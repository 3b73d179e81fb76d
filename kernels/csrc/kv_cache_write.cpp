// Writing a forward's new K/V into the paged cache through the slot mapping, in one pass (the
// torch reference, kernels/torch_ref.py:write_kv_cache, takes two index_copy_ calls, and for an
// FP8 cache a float copy, a division, a clamp and a cast first: ~30 us a layer at decode batch
// sizes on these machines, about 1 ms of a 30-layer decode step).
//
// Token t's row (Hkv x D elements) goes to slot s = slot_mapping[t]: block s / block_size, row
// s % block_size. A cache in the K/V's dtype gets a copy; another float dtype a conversion (round
// to nearest even, as torch's cast); an FP8 E4M3 cache x / scale (per layer or per KV head, fp32),
// clamped to +-448 and rounded to nearest even, bit for bit what the reference stores (the same
// steps as c10's fp8e4m3fn_from_fp32_value, sixteen values at a time with AVX-512).
// Registered as torch.ops.pdserve_attn.write_kv_cache (a fragment of paged_attention.cpp's library).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#include "dtype_dispatch.h"
#include "kv_slots.h"
#include "simd_math.h"

namespace {

constexpr float kE4M3Max = 448.f;

#if defined(__AVX512F__)
// 16 fp32 (already clamped to +-448) -> 16 E4M3 bytes, round to nearest even.
inline __m128i to_e4m3(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i a = _mm512_xor_si512(u, sign);
  // normal (|x| >= 2^-6): rebias the exponent and round the mantissa to 3 bits
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  const __m512i nrm = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(static_cast<int>((7u - 127u) << 23) + 0x7FFFF)), odd), 20);
  // subnormal: adding 2^(141 - 127) leaves the rounded result in the low bits (the FPU rounds)
  const __m512i denorm = _mm512_set1_epi32(141 << 23);
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(denorm))), denorm);
  const __mmask16 small = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(121 << 23));
  const __m512i r = _mm512_or_si512(_mm512_mask_mov_epi32(nrm, small, sub), _mm512_srli_epi32(sign, 24));
  return _mm512_cvtepi32_epi8(r);
}
#endif

// One token's row of n elements (n = Hkv x D), head h's scale at inv[h] (elements d per head).
template <typename X>
void quantize_row(uint8_t* dst, const X* src, int64_t n, int64_t d, const float* scale, int64_t scale_n) {
  for (int64_t h0 = 0; h0 < n; h0 += d) {
    const float s = scale[scale_n == 1 ? 0 : h0 / d];
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps(kE4M3Max), lo = _mm512_set1_ps(-kE4M3Max);
    for (; i + 16 <= d; i += 16) {
      const __m512 x = _mm512_max_ps(_mm512_min_ps(_mm512_div_ps(pdserve_simd::load16(src + h0 + i), vs), hi), lo);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + h0 + i), to_e4m3(x));
    }
#endif
    for (; i < d; ++i) {
      const float x = std::clamp(static_cast<float>(src[h0 + i]) / s, -kE4M3Max, kE4M3Max);
      dst[h0 + i] = c10::Float8_e4m3fn(x).x;
    }
  }
}

template <typename X, typename C>
void write_one(const at::Tensor& x, at::Tensor& cache, const int64_t* slots, const float* scale, int64_t scale_n) {
  const int64_t tokens = x.size(0), hkv = x.size(1), d = x.size(2), n = hkv * d;
  const int64_t bs = cache.size(1);
  const int64_t xs0 = x.stride(0), cs0 = cache.stride(0), cs1 = cache.stride(1);
  const X* src = x.data_ptr<X>();
  C* dst = reinterpret_cast<C*>(cache.data_ptr());
  at::parallel_for(0, tokens, std::max<int64_t>(1, 32768 / n), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const X* row = src + t * xs0;
      C* out = dst + (slots[t] / bs) * cs0 + (slots[t] % bs) * cs1;
      if constexpr (std::is_same_v<C, at::Float8_e4m3fn>) {
        quantize_row(reinterpret_cast<uint8_t*>(out), row, n, d, scale, scale_n);
      } else if constexpr (std::is_same_v<C, X>) {
        std::memcpy(out, row, sizeof(X) * n);
      } else {
        for (int64_t i = 0; i < n; ++i) out[i] = static_cast<C>(static_cast<float>(row[i]));
      }
    }
  });
}

void check_one(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(x.dim() == 3 && cache.dim() == 4 && x.size(1) == cache.size(2) && x.size(2) == cache.size(3),
              "key/value must be [T, Hkv, D] and the caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(x.size(0) == slot_mapping.size(0), "slot_mapping must have one slot per token");
  // A token's Hkv x D elements are one contiguous row on both sides.
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2) && cache.stride(3) == 1 && cache.stride(2) == cache.size(3),
              "each token's [Hkv, D] must be contiguous in key/value and in the caches");
}

// key/value [T, Hkv, D] -> key_cache/value_cache [num_blocks, block_size, Hkv, D] at slot_mapping [T]
// (int64); an FP8 E4M3 cache stores x / scale (k_scale/v_scale fp32 [1] or [Hkv]) saturated at +-448.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                    const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
                    const std::optional<at::Tensor>& v_scale) {
  check_one(key, key_cache, slot_mapping);
  check_one(value, value_cache, slot_mapping);
  TORCH_CHECK(key.scalar_type() == value.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "key and value, and the two caches, must have one dtype each");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping must be contiguous int64");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  pdserve_kv::check_slots(slots, slot_mapping.size(0), key_cache, value_cache);
  const bool fp8 = key_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 == k_scale.has_value() && fp8 == v_scale.has_value(),
              fp8 ? "an FP8 E4M3 KV cache needs k_scale and v_scale" : "KV scales are for an FP8 E4M3 cache only");
  const float *ks = nullptr, *vs = nullptr;
  int64_t scale_n = 1;
  if (fp8) {
    for (const auto* s : {&*k_scale, &*v_scale})
      TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() &&
                      (s->numel() == 1 || s->numel() == key.size(1)) && s->numel() == k_scale->numel(),
                  "k_scale/v_scale must be contiguous float32 of 1 or num_kv_heads elements");
    ks = k_scale->data_ptr<float>();
    vs = v_scale->data_ptr<float>();
    scale_n = k_scale->numel();
  }
  pdserve_dispatch::activation(key.scalar_type(), "K/V", [&](auto x_tag) {
    pdserve_dispatch::kv_cache(key_cache.scalar_type(), [&](auto c_tag) {
      using X = decltype(x_tag);
      using C = decltype(c_tag);
      write_one<X, C>(key, key_cache, slots, ks, scale_n);
      write_one<X, C>(value, value_cache, slots, vs, scale_n);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_attn, m) {
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, Tensor? k_scale, Tensor? v_scale) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_attn, CPU, m) { m.impl("write_kv_cache", &write_kv_cache); }
