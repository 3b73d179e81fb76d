// The whole decoder-layer stack of one forward in one call: for every layer, RMSNorm (with the
// residual add), the fused QKV linear, RoPE and the Q/K/V split, the KV-cache write, paged
// attention, o_proj, the add-norm, the fused gate/up linear, SiLU-and-multiply and down_proj. Where
// down_proj runs the AMX INT8 kernel, one op computes the SiLU-and-multiply rows as it quantizes
// them (silu_mul_w8a8_gemm, the same bits; the 16-row step 1.3% faster, median of 60 interleaved
// A/B pairs in one process, IQR 0-2.1%, Emerald Rapids, a busy host, 2026-12-07); where gate/up
// does too, one op runs the whole MLP in one parallel region (mlp_w8a8_gemm, the same bits; 1.6%
// more, IQR 0-3.9%, same method). Where the QKV linear runs it (a bf16 cache, no FP8 scales or
// offsets), RoPE and the KV-cache write are its epilogue (qkv_rope_w8a8_gemm, the same bits; the
// 16-row step 4.3-5.0% faster, IQR 2.8-6.1%, two runs of the same method; 8 rows 2.0%).
//
// Why: at decode batch sizes the Python loop over 30 layers made ~3,000 Python calls a step
// (module attribute lookups, the linear and layer-op wrappers, torch.ops overload resolution,
// argument checks): 2-3.4 ms of an 8-14 ms step of SmolLM2-135M (torch.profiler op self-times
// against the step's wall clock, 2 threads). Here the same kernels run in the same order with
// the same arguments, so the result is the Python loop's bit for bit; only the Python between
// them is gone (one Python -> C++ crossing a forward instead of ~300).
//
// Every kernel is called through c10's dispatcher with a typed handle looked up once (the ops of
// layer_ops.cpp, kv_cache_write.cpp, paged_attention.cpp, small_gemm.cpp, small_gemm_amx.cpp,
// int8_gemm.cpp, int8_gemm_prefill.cpp, int8_gemm_amx.cpp, int8_gemm_avx2.cpp and aten's linear;
// oneDNN's and MKL's prepacked linears boxed, as their schemas have no fixed C++ signature here), so
// this file depends on those ops' schemas only, never on their code. Which kernel each linear runs
// (for this forward's row count) is decided in Python (kernels/decoder_loop.py) and handed over
// as a descriptor list; the layer's tensors come as one flat list:
//
//   layer_tensors, per layer (TENSORS_PER_LAYER): input_layernorm.weight, post_attention_layernorm
//     .weight, k_scale, v_scale (FP8 cache; placeholders otherwise), k_offset, v_offset ([Hkv, D]
//     in the compute dtype, an FP8 cache's calibrated offsets; placeholders otherwise), then per linear (qkv, o,
//     gate_up, down) three: operand a (packed weight / weight), operand b (int8 weight scales or a
//     placeholder), bias (or a placeholder).
//   linear_desc, per layer and linear: kind (LinearKind), n (output features), group (int8
//     activation group), has_bias.
//   dims: num_heads, num_kv_heads, head_dim, has_kv_scales.
//
// residual: None for the whole stack from the embeddings x (which become the residual stream);
// else the stream before x, so the stack can be run a layer at a time (a layer hook between).
// Returns (the last layer's MLP output, the residual stream before it), as the Python loop.
//
// Tried and not kept (2026-12-06, Zen 4, 2 threads, 16 rows of 128 context, A/B in one process,
// best of 25): the attention threads asking the next linear's weight into L2 between their items
// (each its share of o_proj's, or o_proj's and gate_up's: attention is latency-bound and leaves
// DRAM bandwidth over): bf16 step 14.37 -> 14.57 / 15.29 ms, int8 10.49 -> 10.61 / 10.93. The extra
// stream slows attention more than the warm weight speeds the linear.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "dtype_dispatch.h"

namespace {

enum LinearKind : int64_t { kSmallGemm = 0, kW8A8 = 1, kDense = 2, kOneDnnPacked = 3, kW8A8Large = 4, kMklPacked = 5,
                   kW8A8Avx2 = 6, kAmxGemm = 7, kW8A8Amx = 8 };
constexpr int64_t kLinears = 4;                 // qkv, o, gate_up, down
constexpr int64_t kTensorsPerLayer = 6 + 3 * kLinears;
constexpr int64_t kDescPerLinear = 4;

using OptTensor = std::optional<at::Tensor>;

c10::OperatorHandle find(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

struct Ops {
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, double)> rms_norm =
      find("pdserve_ops::rms_norm").typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&, double)> add_rms_norm =
      find("pdserve_ops::add_rms_norm")
          .typed<void(at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&, double)>();
  c10::TypedOperatorHandle<void(at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&)>
      rope_split = find("pdserve_ops::rope_split")
                       .typed<void(at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&)>();
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&)> silu_mul =
      find("pdserve_ops::silu_mul").typed<void(at::Tensor&, const at::Tensor&)>();
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                                const OptTensor&, const OptTensor&)>
      write_kv = find("pdserve_attn::write_kv_cache")
                     .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                                 const OptTensor&, const OptTensor&)>();
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&, double, const OptTensor&,
                                const OptTensor&, int64_t)>
      attention = find("pdserve_attn::paged_attention")
                      .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&, double, const OptTensor&,
                                  const OptTensor&, int64_t)>();
};

// x[t][h][r][:] += sign * offset[h][:] for a contiguous x [T, Hkv, rep, D] and offset [Hkv, D] of
// x's dtype, rounded as torch rounds x + y (in fp32, then to the dtype): an FP8 cache's K/V offsets
// (rep 1) and the V offset added back to the attention output (rep: query heads per KV head). A
// loop of its own: two aten broadcast ops and an add a layer cost ~0.5 ms of a 16-row decode step
// here (TensorIterator set-up, 90 calls a step).
void add_offset(at::Tensor& x, const at::Tensor& offset, int64_t rep, float sign) {
  const int64_t hkv = offset.size(0), d = offset.size(1), tokens = x.numel() / (hkv * rep * d);
  TORCH_CHECK(x.is_contiguous() && offset.is_contiguous() && offset.dim() == 2 &&
                  x.scalar_type() == offset.scalar_type() && x.numel() == tokens * hkv * rep * d,
              "decoder_loop: an FP8 cache's offsets must be contiguous [Hkv, D] in the compute dtype");
  pdserve_dispatch::activation(x.scalar_type(), "KV offset", [&](auto tag) {
    using T = decltype(tag);
    T* p = x.data_ptr<T>();
    const T* off = offset.data_ptr<T>();
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < hkv; ++h)
        for (int64_t r = 0; r < rep; ++r, p += d)
          for (int64_t j = 0; j < d; ++j)
            p[j] = static_cast<T>(static_cast<float>(p[j]) + sign * static_cast<float>(off[h * d + j]));
  });
}

const Ops& ops() {
  static const Ops o;   // looked up on first use: every library has registered its ops by then
  return o;
}

// The kernels that need only their schema at first use (a CPU without AVX512-BF16/VNNI/AMX never
// picks them, and the int8/bf16 GEMM libraries always register, so the lookups cannot fail).
const c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>& small_gemm() {
  static const auto h =
      find("pdserve_gemm::small_gemm_bf16").typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
  return h;
}

const c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>& amx_gemm() {
  static const auto h = find("pdserve_amx::small_gemm_bf16_amx")   // small_gemm_amx.cpp: small_gemm's schema
                            .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
  return h;
}

// The INT8 kernels' schema: (x, packed, wscale, n, group) -> out; the AVX-512 VNNI and AMX ones also take
// out_dtype (float32 for the LM head's logits; the decoder's linears keep bf16, the default).
using Int8Gemm = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using Int8GemmOut = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                               std::optional<at::ScalarType>);

const c10::TypedOperatorHandle<Int8GemmOut>& w8a8_gemm() {
  static const auto h = find("pdserve_int8::w8a8_gemm").typed<Int8GemmOut>();
  return h;
}

const c10::TypedOperatorHandle<Int8GemmOut>& w8a8_gemm_large() {   // int8_gemm_prefill.cpp, for prefill row counts
  static const auto h = find("pdserve_int8p::w8a8_gemm_large").typed<Int8GemmOut>();
  return h;
}

const c10::TypedOperatorHandle<Int8Gemm>& w8a8_gemm_avx2() {   // int8_gemm_avx2.cpp, for CPUs with AVX2 but no AVX512-VNNI
  static const auto h = find("pdserve_int8_avx2::w8a8_gemm").typed<Int8Gemm>();
  return h;
}

const c10::TypedOperatorHandle<Int8GemmOut>& w8a8_gemm_amx() {   // int8_gemm_amx.cpp, for CPUs with AMX-INT8
  static const auto h = find("pdserve_int8_amx::w8a8_gemm").typed<Int8GemmOut>();
  return h;
}

// w8a8_gemm_amx of silu(gate) * up from the fused gate/up output (int8_gemm_amx.cpp): down_proj's
// SiLU-and-multiply done where its rows are quantized, the same bits as silu_mul and then the linear.
const c10::TypedOperatorHandle<Int8GemmOut>& silu_mul_w8a8_gemm_amx() {
  static const auto h = find("pdserve_int8_amx::silu_mul_w8a8_gemm").typed<Int8GemmOut>();
  return h;
}

// down_proj(silu(gate) * up) of the add-norm's output where both linears run the AMX INT8 kernel
// (int8_gemm_amx.cpp): gate_up, the SiLU-and-multiply, down's quantization and product in one
// parallel region, the same bits as gate_up's linear and then silu_mul_w8a8_gemm.
using Int8Mlp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, const at::Tensor&,
                           const at::Tensor&, int64_t, int64_t);
const c10::TypedOperatorHandle<Int8Mlp>& mlp_w8a8_gemm_amx() {
  static const auto h = find("pdserve_int8_amx::mlp_w8a8_gemm").typed<Int8Mlp>();
  return h;
}

// The QKV linear where it runs the AMX INT8 kernel, with rope_split and write_kv_cache in its
// epilogue (int8_gemm_amx.cpp): q rotated into q, k and v into the caches, the same bits.
using Int8QkvRope = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, const at::Tensor&,
                         const at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&);
const c10::TypedOperatorHandle<Int8QkvRope>& qkv_rope_w8a8_gemm_amx() {
  static const auto h = find("pdserve_int8_amx::qkv_rope_w8a8_gemm").typed<Int8QkvRope>();
  return h;
}

const c10::OperatorHandle& onednn_linear() {
  static const auto h = find("mkldnn::_linear_pointwise");
  return h;
}

const c10::OperatorHandle& mkl_linear() {   // fp32: MKL's prepacked weight (and the plain one)
  static const auto h = find("mkl::_mkl_linear");
  return h;
}

// y + the linear's bias where it has one (descriptor d, tensors t), added after the product as
// kernels/linear.py adds it.
at::Tensor with_bias(const at::Tensor& y, const at::Tensor* t, const int64_t* d) { return d[3] ? y + t[2] : y; }

// x [M, K] -> [M, n], as kernels/linear.py's chosen kernel computes it (bias added after, as there).
at::Tensor linear(const at::Tensor& x_in, const at::Tensor* t, const int64_t* d) {
  const int64_t kind = d[0], n = d[1], group = d[2];
  at::Tensor y;
  switch (kind) {
    case kSmallGemm:
    case kAmxGemm: {   // (one schema, one packed weight)
      const at::Tensor x = x_in.stride(-1) == 1 ? x_in : x_in.contiguous();
      y = at::empty({x.size(0), n}, x.options());
      (kind == kSmallGemm ? small_gemm() : amx_gemm()).call(y, x, t[0], n);
      break;
    }
    case kW8A8:
      y = w8a8_gemm().call(x_in, t[0], t[1], n, group, std::nullopt);
      break;
    case kW8A8Large:
      y = w8a8_gemm_large().call(x_in, t[0], t[1], n, group, std::nullopt);
      break;
    case kW8A8Amx:
      y = w8a8_gemm_amx().call(x_in, t[0], t[1], n, group, std::nullopt);
      break;
    case kW8A8Avx2:
      y = w8a8_gemm_avx2().call(x_in, t[0], t[1], n, group);
      break;
    case kDense:
      y = at::linear(x_in, t[0]);
      break;
    case kOneDnnPacked: {
      torch::jit::Stack stack{x_in, t[0], c10::IValue(), c10::IValue("none"),
                              c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue("")};
      onednn_linear().callBoxed(stack);
      y = std::move(stack[0]).toTensor();
      break;
    }
    case kMklPacked: {
      torch::jit::Stack stack{x_in, t[0], t[1], c10::IValue(), c10::IValue(x_in.size(0))};
      mkl_linear().callBoxed(stack);
      y = std::move(stack[0]).toTensor();
      break;
    }
    default:
      TORCH_CHECK(false, "decoder_loop: unknown linear kind ", kind);
  }
  return with_bias(y, t, d);
}

std::tuple<at::Tensor, at::Tensor> decoder_loop(at::Tensor& x_in, const std::optional<at::Tensor>& residual_in,
                                                const at::Tensor& cos, const at::Tensor& sin,
                                                at::TensorList key_caches, at::TensorList value_caches,
                                                const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                                const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                                at::TensorList layer_tensors, at::IntArrayRef linear_desc,
                                                at::IntArrayRef dims, double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(dims.size() == 4, "decoder_loop: dims must be [num_heads, num_kv_heads, head_dim, has_kv_scales]");
  TORCH_CHECK(static_cast<int64_t>(value_caches.size()) == layers &&
                  static_cast<int64_t>(layer_tensors.size()) == layers * kTensorsPerLayer &&
                  static_cast<int64_t>(linear_desc.size()) == layers * kLinears * kDescPerLinear,
              "decoder_loop: ", layers, " key caches need as many value caches, ", layers * kTensorsPerLayer,
              " layer tensors and ", layers * kLinears * kDescPerLinear, " descriptor entries; got ",
              value_caches.size(), ", ", layer_tensors.size(), ", ", linear_desc.size());
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous(), "decoder_loop: x must be a contiguous [T, H] tensor");
  const int64_t hq = dims[0], hkv = dims[1], hd = dims[2], t = x_in.size(0);
  const bool kv_scales = dims[3] != 0;
  const Ops& o = ops();
  const auto opts = x_in.options();

  // Without a residual, x is the embeddings and becomes the residual stream (updated in place);
  // with one (a call per layer, a layer hook between), x is the previous layer's MLP output.
  at::Tensor x = x_in, residual = residual_in.has_value() ? *residual_in : x_in;
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous(), "decoder_loop: residual must be contiguous, as x");
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* lt = layer_tensors.data() + l * kTensorsPerLayer;
    const int64_t* ld = linear_desc.data() + l * kLinears * kDescPerLinear;
    const OptTensor k_scale = kv_scales ? OptTensor(lt[2]) : std::nullopt;
    const OptTensor v_scale = kv_scales ? OptTensor(lt[3]) : std::nullopt;

    at::Tensor h = at::empty_like(x);
    if (l == 0 && !residual_in.has_value()) {
      o.rms_norm.call(h, x, lt[0], eps);
    } else {
      o.add_rms_norm.call(h, x, residual, lt[0], eps);
    }
    const bool offsets = lt[4].numel() != 0;   // the FP8 cache's K/V offsets (engine/models/llama.py)
    at::Tensor kc = key_caches[l], vc = value_caches[l], q;
    if (ld[0] == kW8A8Amx && !ld[3] && !offsets && !kv_scales) {   // RoPE and the cache write in the linear
      q = at::empty({t, hq, hd}, opts);
      qkv_rope_w8a8_gemm_amx().call(h, lt[6], lt[7], ld[1], ld[2], cos, sin, q, kc, vc, slot_mapping);
    } else {
      at::Tensor qkv = linear(h, lt + 6, ld);
      if (qkv.stride(-1) != 1) qkv = qkv.contiguous();
      // One allocation for q | k | v, each contiguous (as CppLayerOps.rope_split).
      at::Tensor flat = at::empty({t * (hq + 2 * hkv) * hd}, qkv.options());
      q = flat.narrow(0, 0, t * hq * hd).view({t, hq, hd});
      at::Tensor k = flat.narrow(0, t * hq * hd, t * hkv * hd).view({t, hkv, hd});
      at::Tensor v = flat.narrow(0, t * (hq + hkv) * hd, t * hkv * hd).view({t, hkv, hd});
      o.rope_split.call(q, k, v, qkv, cos, sin);
      if (offsets) {
        add_offset(k, lt[4], 1, -1.f);
        add_offset(v, lt[5], 1, -1.f);
      }
      o.write_kv.call(k, v, kc, vc, slot_mapping, k_scale, v_scale);
    }
    at::Tensor attn = at::empty_like(q);
    o.attention.call(attn, q, kc, vc, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale, 0);
    if (offsets) add_offset(attn, lt[5], hq / hkv, 1.f);   // each query head gets its KV head's V offset back
    at::Tensor out = linear(attn.view({t, hq * hd}), lt + 9, ld + kDescPerLinear);
    h = at::empty(out.sizes(), opts);
    o.add_rms_norm.call(h, out, residual, lt[1], eps);
    const int64_t *gu = ld + 2 * kDescPerLinear, *down = ld + 3 * kDescPerLinear;
    if (gu[0] == kW8A8Amx && down[0] == kW8A8Amx && !gu[3]) {   // the whole MLP in one op
      x = with_bias(mlp_w8a8_gemm_amx().call(h, lt[12], lt[13], gu[1], gu[2], lt[15], lt[16], down[1], down[2]), lt + 15,
                    down);
      continue;
    }
    at::Tensor gate_up = linear(h, lt + 12, gu);
    if (down[0] == kW8A8Amx) {   // SiLU-and-multiply fused into down's quantization
      x = with_bias(silu_mul_w8a8_gemm_amx().call(gate_up, lt[15], lt[16], down[1], down[2], std::nullopt), lt + 15,
                    down);
    } else {
      at::Tensor act = at::empty({t, gate_up.size(1) / 2}, opts);
      o.silu_mul.call(act, gate_up);
      x = linear(act, lt + 15, down);
    }
  }
  return {x, residual};
}

}  // namespace

TORCH_LIBRARY(pdserve_loop, m) {
  m.def("decoder_loop(Tensor(a!) x, Tensor(b!)? residual, Tensor cos, Tensor sin, Tensor[] key_caches, Tensor[] value_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
        "Tensor[] layer_tensors, int[] linear_desc, int[] dims, float eps, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pdserve_loop, CPU, m) { m.impl("decoder_loop", &decoder_loop); }
// oneDNN's (bf16) and MKL's (fp32) prepacked weights are MkldnnCPU tensors: a forward whose linears read them
// dispatches on that key.
TORCH_LIBRARY_IMPL(pdserve_loop, MkldnnCPU, m) { m.impl("decoder_loop", &decoder_loop); }
