// The slot check of the ops that write a forward's K/V into the paged cache (kv_cache_write.cpp's
// write_kv_cache, int8_gemm_amx.cpp's qkv_rope_w8a8_gemm), in one place so they refuse alike.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

namespace pdserve_kv {

// Every slot of slots [n] within both caches ([num_blocks, block_size, ...]), each bounded by its
// own capacity (a value cache of fewer blocks than the key cache was once written past its end).
// Errors: RuntimeError naming the first slot outside.
inline void check_slots(const int64_t* slots, int64_t n, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  const int64_t keys = key_cache.size(0) * key_cache.size(1), values = value_cache.size(0) * value_cache.size(1);
  const int64_t capacity = std::min(keys, values);
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < capacity, "slot ", slots[t], " outside the cache's ", capacity, " slots",
                keys == values ? "" : " (the key and value caches hold different numbers of slots)");
}

}  // namespace pdserve_kv
