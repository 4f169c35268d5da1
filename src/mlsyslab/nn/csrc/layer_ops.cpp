// The small per-token steps of a decoder layer, one pass each instead of four to eight PyTorch kernels
// (vLLM keeps the same three as custom ops: rms_norm, silu_and_mul, rotary_embedding).
//
// At decode batch sizes a layer's matmuls stream weights while these steps touch a few kilobytes; in
// PyTorch each is several kernels (RMSNorm: upcast, square, mean, add, rsqrt, two multiplies, downcast),
// each paying dispatch and a trip through caches the matmul just flushed (docs/serving.md profile).
// Arithmetic is fp32; bf16 results round where PyTorch's (and HF's) bf16 code rounds, so outputs
// stay bit-comparable with the reference (tests/nn/test_cpu_kernels.py):
//   rms_norm:     x · rsqrt(mean(x²) + eps) · w, rounded once (as torch's fused F.rms_norm); `rms_norm_rstd` also
//                 returns each row's rsqrt in fp32, what the training path's backward takes (nn.training_kernels);
//   silu_and_mul: silu(gate) rounded, times up, rounded (as F.silu(gate) * up);
//   rope_:        x·cos and rotate_half(x)·sin rounded, then their sum (as HF's apply_rotary_pos_emb).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using namespace mlsyslab;

constexpr int64_t kGrain = 1 << 14;  // elements per thread below which splitting costs more than it saves

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, float* rstd, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float inverse = rms_norm_row(x + r * hidden, w, out + r * hidden, hidden, eps);
      if (rstd != nullptr) rstd[r] = inverse;
    }
  });
}

template <typename T>
void silu_and_mul_rows(const T* gates, const T* ups, T* out, int64_t rows, int64_t width, int64_t row_stride) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      silu_and_mul_span(gates + r * row_stride, ups + r * row_stride, out + r * width, width);
  });
}

template <typename T>
void rope_rows(T* x, const T* cos, const T* sin, int64_t tokens, int64_t token_stride, int64_t heads, int64_t dim) {
  at::parallel_for(0, tokens, std::max<int64_t>(1, kGrain / (heads * dim)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) rope_head(x + t * token_stride + h * dim, cos + t * dim, sin + t * dim, dim);
  });
}

}  // namespace

namespace mlsyslab {

// A vector at a time (the squares summed in kLanes running sums, then across them), the rest a value at a time.
// `out` may be `x` (the q/k norms of Qwen3 normalise in place): each value is read before it is written. Over a
// 2,048-token prefill's [2048, 576] bf16 on 2 threads, 0.34-0.36 against 0.37-0.41 ms for the loop a value at a time
// (Sapphire Rapids VM, 2026-12-02, alternating processes: the rows stream from L3 at ~14 GB/s either way); the sum's
// order changed, so bf16 results moved by a rounding here and there (greedy bf16 tokens of 2 in 10 prompts parted
// after 8 and 11 tokens; neither order is HF's, whose bf16 norm rounds before the weight: `nn.llama.RMSNorm`).
template <typename T>
float rms_norm_row(const T* x, const T* w, T* out, int64_t hidden, float eps) {
  Floats running = {};
  int64_t i = 0;
  for (; i + kLanes <= hidden; i += kLanes) {
    const Floats v = load_lanes(x + i);
    running = fused_multiply_add(v, v, running);
  }
  float squares = sum(running);
  for (; i < hidden; ++i) squares += widen(x[i]) * widen(x[i]);
  const float inverse = static_cast<float>(1.0 / std::sqrt(double(squares / hidden + eps)));
  for (i = 0; i + kLanes <= hidden; i += kLanes) store_lanes(out + i, load_lanes(x + i) * inverse * load_lanes(w + i));
  for (; i < hidden; ++i) out[i] = narrow<T>(widen(x[i]) * inverse * widen(w[i]));
  return inverse;
}

// A vector at a time, in vec.h's lanes and exp. Left to the compiler, the scalar loop came out in 8-lane halves on
// AVX-512 with a libmvec call and bf16 conversions through a permute: 0.72 G elements/s on 2 threads over a 2,048-token
// prefill's [2048, 1536] (SmolLM2), 6.5% of the prefill's time on a Sapphire Rapids VM. This way, alternating with
// that loop in one process (2026-12-02): 1.37-1.49x as fast at 64, 256 and 2,048 rows on 1 and 2 threads, and in bf16
// bit-equal to torch's F.silu(gate) * up on those gates (randn · 3), which that loop was not; the engine's steps
// moved within the host's noise (1.01x and 1.02x at 16 and 32 in flight, 64 tokens each). The last width % kLanes
// elements go through the same vector code from a padded copy, so every element is computed by the same instructions
// wherever a span starts (spans start at multiples of kLanes). A gate under -80 gives 0 (torch: -0 under -88.7, under
// 1e-33 in magnitude between), where vec.h's exp stops at e^80.
template <typename T>
void silu_and_mul_span(const T* __restrict gate, const T* __restrict up, T* __restrict out, int64_t width) {
  const auto lanes = [](const T* __restrict g, const T* __restrict u, T* __restrict o) {
    const Floats gates = load_lanes(g);
    const Floats silu = gates < -80.f ? broadcast(0.f) : gates / (1.f + exp(-gates));
    store_lanes(o, rounded_lanes<T>(silu) * load_lanes(u));
  };
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) lanes(gate + i, up + i, out + i);
  if (i < width) {
    T g[kLanes] = {}, u[kLanes] = {}, o[kLanes];
    std::copy(gate + i, gate + width, g);
    std::copy(up + i, up + width, u);
    lanes(g, u, o);
    std::copy(o, o + (width - i), out + i);
  }
}

// x·cos + rotate_half(x)·sin, rotate_half(x) = (x₂, x₁) for x = (x₁, x₂) (the sign is in `s`): value i of each half
// and its partner in the other, a vector of each at a time (the rest a pair at a time), both read before either is
// written, in the same operations and roundings whichever way. A prefill's q (2,048 tokens × 9 heads, bf16, 2 threads):
// 0.45-0.49 against 0.59-0.69 ms for the loop a value at a time through a scratch copy (same host and day).
template <typename T>
void rope_head(T* __restrict v, const T* __restrict c, const T* __restrict s, int64_t dim) {
  const int64_t half = dim / 2;
  int64_t i = 0;
  for (; i + kLanes <= half; i += kLanes) {
    const Floats first = load_lanes(v + i), second = load_lanes(v + i + half);
    store_lanes(v + i, rounded_lanes<T>(first * load_lanes(c + i)) + rounded_lanes<T>(second * load_lanes(s + i)));
    store_lanes(v + i + half, rounded_lanes<T>(second * load_lanes(c + i + half)) +
                                  rounded_lanes<T>(first * load_lanes(s + i + half)));
  }
  for (; i < half; ++i) {
    const float first = widen(v[i]), second = widen(v[i + half]);
    v[i] = narrow<T>(rounded<T>(first * widen(c[i])) + rounded<T>(second * widen(s[i])));
    v[i + half] = narrow<T>(rounded<T>(second * widen(c[i + half])) + rounded<T>(first * widen(s[i + half])));
  }
}

template float rms_norm_row(const float*, const float*, float*, int64_t, float);
template float rms_norm_row(const c10::BFloat16*, const c10::BFloat16*, c10::BFloat16*, int64_t, float);
template void silu_and_mul_span(const float*, const float*, float*, int64_t);
template void silu_and_mul_span(const c10::BFloat16*, const c10::BFloat16*, c10::BFloat16*, int64_t);
template void rope_head(float*, const float*, const float*, int64_t);
template void rope_head(c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, int64_t);

void check_float_or_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              name, ": an fp32 or bf16 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

// out (and with `rstd`, each row's rsqrt(mean(x²) + eps) in fp32 [..., 1], as torch's _fused_rms_norm returns it).
at::Tensor rms_norm_into(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor* rstd) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 && x.size(-1) == weight.size(0) &&
              weight.scalar_type() == x.scalar_type(), "x [..., hidden] and weight [hidden]: contiguous, one dtype");
  auto out = at::empty_like(x);
  const int64_t hidden = weight.size(0), rows = x.numel() / std::max<int64_t>(hidden, 1);
  float* inverses = nullptr;
  if (rstd != nullptr) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = 1;
    *rstd = at::empty(shape, x.options().dtype(at::kFloat));
    inverses = rstd->data_ptr<float>();
  }
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), inverses, rows, hidden,
                  float(eps));
  else
    rms_norm_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(),
                  inverses, rows, hidden, float(eps));
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_into(x, weight, eps, nullptr);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_rstd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor rstd;
  auto out = rms_norm_into(x, weight, eps, &rstd);
  return {out, rstd};
}

at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_float_or_bf16(gate, "gate");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.strides() == up.strides() && gate.stride(1) == 1 &&
              gate.scalar_type() == up.scalar_type(), "gate, up: [rows, ffn] with the same row stride, one dtype");
  auto out = at::empty(gate.sizes(), gate.options());
  const int64_t rows = gate.size(0), width = gate.size(1), stride = gate.stride(0);
  if (gate.scalar_type() == at::kFloat)
    silu_and_mul_rows(gate.data_ptr<float>(), up.data_ptr<float>(), out.data_ptr<float>(), rows, width, stride);
  else
    silu_and_mul_rows(gate.data_ptr<c10::BFloat16>(), up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(),
                      rows, width, stride);
  return out;
}

void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
              "x: [tokens, heads, head_dim], each token's heads contiguous, even head_dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
              cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && cos.scalar_type() == x.scalar_type() &&
              sin.scalar_type() == x.scalar_type(), "cos, sin: contiguous [tokens, head_dim] in x's dtype");
  if (x.scalar_type() == at::kFloat)
    rope_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(0), x.stride(0), x.size(1), x.size(2));
  else
    rope_rows(x.data_ptr<c10::BFloat16>(), cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(), x.size(0),
              x.stride(0), x.size(1), x.size(2));
}

}  // namespace mlsyslab

TORCH_LIBRARY_FRAGMENT(mlsyslab, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &mlsyslab::rms_norm);
  m.def("rms_norm_rstd(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)", &mlsyslab::rms_norm_rstd);
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor", &mlsyslab::silu_and_mul);
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()", &mlsyslab::rope_);
}
