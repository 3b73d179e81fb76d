// The dtype dispatch shared by the attention library's kernels (paged_attention.cpp,
// kv_cache_write.cpp): a run-time ScalarType to a C++ element type, as a tag value passed to a
// generic lambda. Activations (queries, new K/V) are fp32, bf16 or fp16; a KV cache also FP8
// E4M3. One list, so both kernels take the same dtypes (a dispatch over every float type would
// double the build time); the build key (kernels/cpu_attention.py) hashes this header too.
#pragma once

#include <ATen/core/Tensor.h>

namespace pdserve_dispatch {

// f(T{}) for the activation dtype t; an unsupported t raises (c10::Error) naming `what` and t.
template <typename F>
void activation(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(at::BFloat16{});
    case at::kHalf: return f(at::Half{});
    default: TORCH_CHECK(false, "unsupported ", what, " dtype ", t);
  }
}

// f(T{}) for the KV cache dtype t (the activation dtypes and float8_e4m3fn).
template <typename F>
void kv_cache(at::ScalarType t, F&& f) {
  if (t == at::kFloat8_e4m3fn) return f(at::Float8_e4m3fn{});
  if (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf) return activation(t, "KV cache", f);
  TORCH_CHECK(false, "unsupported KV cache dtype ", t);
}

}  // namespace pdserve_dispatch
