// A decode step's decoder layers in one call: the same kernels, in the same order and dtypes, as the
// Python layers of the serving copy (nn/llama.py `DecoderLayer` over nn/paged_attention.py), without
// Python between them.
//
// At decode batch sizes a layer is ~15 small operations around 4 matmuls, and on this 2-core machine
// the interpreter and dispatch around them cost 6-9 ms a step (a third of the batch-1 step's
// non-matmul time: docs/serving.md). Here the loop over layers and everything in a layer is C++:
//   x = rms_norm(h); q|k|v = x·Wqkvᵀ (+ bias); (head norms;) rope(q), rope(k); write k, v into their cache slots;
//   h = h + attention(q, cache)·Woᵀ; x = rms_norm(h); h = h + (silu(x·Wgᵀ) · x·Wuᵀ)·Wdᵀ.
// The matmuls are the ones `nn.packed_linear.PackedLinear` picks for this many rows — oneDNN on the
// prepacked weight (`mkldnn::_linear_pointwise`, its `.binary` add folding the residual), ATen on the
// plain one (`addmm`), or the streamed kernel on its tiled weight (streamed_linear.cpp) — the first two
// called through the dispatcher — so the results are bit-equal to the Python path
// (tests/nn/test_fused_decode.py). Used by `nn.fused_decode`; decodes only (one new token per sequence,
// the cache in the model's dtype); prefill steps keep the Python path, where the matmuls dwarf the
// overhead.
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/linear.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <string_view>

#include "kernels.h"

namespace {

using LinearOp = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, std::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>);
using LinearAddOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                               std::string_view);

// x·Wᵀ, and residual + x·Wᵀ, as `PackedLinear.forward` and `PackedLinear.add_to` compute them; `kernel`
// is `nn.packed_linear.Kernel`'s code.
enum Kernel : int64_t { kPlain = 0, kPacked = 1, kStreamed = 2 };

struct Linear {
  const at::Tensor& weight;
  int64_t kernel, out;

  at::Tensor operator()(const at::Tensor& x) const {
    if (kernel == kPlain) return at::linear(x, weight);
    if (kernel == kStreamed) return mlsyslab::streamed_linear(x, weight, out, std::nullopt);
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<LinearOp>();
    return op.call(x, weight, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), std::string_view(""));
  }

  at::Tensor add_to(const at::Tensor& x, const at::Tensor& residual) const {
    if (kernel == kPlain) return at::addmm(residual, x, weight.t());
    if (kernel == kStreamed) return mlsyslab::streamed_linear(x, weight, out, residual);
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
                         .typed<LinearAddOp>();
    return op.call(x, residual, weight, std::nullopt, "add");
  }
};

// Each token's K (or V) heads [tokens, kv_heads, head_dim] into its slot of one layer's cache
// [kv_heads, num_blocks · block_size, head_dim] (the Python path's index_copy_).
void write_slots(at::Tensor& cache, const at::Tensor& values, const int64_t* slots) {
  const int64_t tokens = values.size(0), kv_heads = values.size(1), head_dim = values.size(2);
  const int64_t slots_per_head = cache.size(1) * cache.size(2), bytes = head_dim * values.element_size();
  char* base = static_cast<char*>(cache.data_ptr());
  const char* source = static_cast<const char*>(values.data_ptr());
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < kv_heads; ++h)
      std::memcpy(base + (h * slots_per_head + slots[t]) * bytes,
                  source + (t * values.stride(0) + h * values.stride(1)) * values.element_size(), bytes);
}

}  // namespace

namespace mlsyslab {

// The paged step's K/V write (nn.paged_attention) where the new heads are in the cache's dtype: index_copy_ of a
// 2,048-token prefill's [3, 2048, 64] bf16 heads (a transposed view of the q|k|v output) took 0.39-0.56 ms, this loop
// 0.15-0.25 (slots in blocks of 16, or scattered one by one; Sapphire Rapids VM, 2026-12-02).
void write_slots_(at::Tensor& cache, const at::Tensor& values, const at::Tensor& slots) {
  check_float_or_bf16(cache, "cache");
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() && values.dim() == 3 &&
              values.scalar_type() == cache.scalar_type() && values.size(1) == cache.size(0) &&
              values.size(2) == cache.size(3) && values.stride(2) == 1,
              "cache: contiguous [kv_heads, num_blocks, block_size, head_dim]; values: [tokens, kv_heads, head_dim] in its "
              "dtype, each head contiguous");
  check_slots(slots, values.size(0), cache.size(1) * cache.size(2));
  write_slots(cache, values, slots.data_ptr<int64_t>());
}

void check_slots(const at::Tensor& slots, int64_t tokens, int64_t cache_slots) {
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == tokens && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots: contiguous int64 [tokens]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < cache_slots, "slots[", t, "] = ", slot[t], ": not a slot of the cache (0..",
                cache_slots - 1, ")");
}

// hidden [tokens, hidden] after the embedding -> after the last layer (before the final norm).
// norms: 2 per layer (input, post-attention); weights: 4 per layer (qkv, o, gate|up, down), each the
// weight of the kernel `kernels` names, with `out_features` outputs; qkv_biases: none, or one per layer, added to
// the q|k|v product (Qwen2; as nn.packed_linear.FusedPackedLinear adds it); qk_norms: none, or the q and k head
// norms' weights of each layer (Qwen3), applied before rope as the Python layers apply them; caches [layers, kv_heads,
// num_blocks, block_size, head_dim].
at::Tensor decode_layers(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin, at::TensorList norms,
                         at::TensorList weights, c10::List<int64_t> kernels, c10::List<int64_t> out_features,
                         at::TensorList qkv_biases, at::TensorList qk_norms,
                         at::Tensor k_cache, at::Tensor v_cache,
                         const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lengths, int64_t heads,
                         double eps) {
  const int64_t layers = k_cache.size(0), kv_heads = k_cache.size(1), head_dim = k_cache.size(-1);
  const int64_t tokens = hidden_in.size(0);
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.is_contiguous(), "hidden: contiguous [tokens, hidden]");
  TORCH_CHECK(int64_t(norms.size()) == 2 * layers && int64_t(weights.size()) == 4 * layers &&
              int64_t(kernels.size()) == 4 * layers && int64_t(out_features.size()) == 4 * layers,
              "norms: 2 per layer, weights, kernels and out_features: 4 per layer, for ", layers, " layers");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.scalar_type() == hidden_in.scalar_type() && v_cache.scalar_type() == hidden_in.scalar_type(),
              "k_cache, v_cache: contiguous [layers, kv_heads, num_blocks, block_size, head_dim] in hidden's dtype");
  TORCH_CHECK(qkv_biases.empty() || int64_t(qkv_biases.size()) == layers, "qkv_biases: none, or one per layer");
  TORCH_CHECK(qk_norms.empty() || int64_t(qk_norms.size()) == 2 * layers, "qk_norms: none, or 2 per layer");
  TORCH_CHECK(heads % kv_heads == 0, "heads (", heads, ") must be a multiple of kv_heads (", kv_heads, ")");
  check_slots(slots, tokens, k_cache.size(2) * k_cache.size(3));
  const int64_t* slot = slots.data_ptr<int64_t>();
  const double scale = 1.0 / std::sqrt(double(head_dim));
  at::Tensor hidden = hidden_in;
  for (int64_t l = 0; l < layers; ++l) {
    const auto linear = [&](int64_t i) {
      return Linear{weights[4 * l + i], kernels[4 * l + i], out_features[4 * l + i]};
    };
    const Linear qkv = linear(0), o = linear(1), gate_up = linear(2), down = linear(3);
    at::Tensor k_layer = k_cache[l], v_layer = v_cache[l];
    at::Tensor fused = qkv(rms_norm(hidden, norms[2 * l], eps));
    if (!qkv_biases.empty()) fused.add_(qkv_biases[l]);
    at::Tensor q = fused.narrow(1, 0, heads * head_dim).view({tokens, heads, head_dim});
    at::Tensor k = fused.narrow(1, heads * head_dim, kv_heads * head_dim).view({tokens, kv_heads, head_dim});
    const at::Tensor v = fused.narrow(1, (heads + kv_heads) * head_dim, kv_heads * head_dim)
                             .view({tokens, kv_heads, head_dim});
    if (!qk_norms.empty()) {
      q = rms_norm(q.contiguous(), qk_norms[2 * l], eps);
      k = rms_norm(k.contiguous(), qk_norms[2 * l + 1], eps);
    }
    rope_(q, cos, sin);
    rope_(k, cos, sin);
    write_slots(k_layer, k, slot);
    write_slots(v_layer, v, slot);
    const at::Tensor attended = paged_decode_attention(q.to(at::kFloat).contiguous(), k_layer, v_layer, tables,
                                                       lengths, scale).to(hidden.scalar_type());
    hidden = o.add_to(attended.view({tokens, heads * head_dim}), hidden);
    const at::Tensor gates = gate_up(rms_norm(hidden, norms[2 * l + 1], eps));
    const int64_t ffn = gates.size(1) / 2;
    hidden = down.add_to(silu_and_mul(gates.narrow(1, 0, ffn), gates.narrow(1, ffn, ffn)), hidden);
  }
  return hidden;
}

}  // namespace mlsyslab

TORCH_LIBRARY_FRAGMENT(mlsyslab, m) {
  m.def("write_slots_(Tensor(a!) cache, Tensor values, Tensor slots) -> ()", &mlsyslab::write_slots_);
  m.def("decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] weights, int[] kernels, "
        "int[] out_features, Tensor[] qkv_biases, Tensor[] qk_norms, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor tables, Tensor lengths, "
        "int heads, float eps) "
        "-> Tensor", &mlsyslab::decode_layers);
}
