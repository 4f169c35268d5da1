// The backward of two per-token steps of the training path, one pass each (used by `nn.training_kernels`).
//
// On CPU PyTorch differentiates F.rms_norm through its composite formula — pow, mean, rsqrt and their
// backward, ten-odd kernels over the whole activation — and F.silu(gate) * up through three: an RMSNorm's
// backward over [1024, 512] fp32 took 13-17 ms on one Sapphire Rapids thread where one multiply over the same
// tensor takes 0.3 (2026-12-02). Here each is one pass over its rows, arithmetic in fp32, results rounded once:
//   rms_norm_backward:     x̂ = x·rstd, gw = g·w:  dx = rstd·(gw − x̂·mean(gw·x̂)),  dw = Σ_rows g·x̂
//                          (rstd as the forward `rms_norm_rstd`, or torch's `_fused_rms_norm`, returns it);
//   silu_and_mul_backward: s = σ(gate):  d_up = g·silu(gate) (silu rounded as the forward rounded it),
//                          d_gate = g·up·s·(1 + gate·(1 − s)).
// dw's sum runs over fixed blocks of rows, then over the blocks in order: the same bits at any thread count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <tuple>
#include <vector>

namespace {

using namespace mlsyslab;

constexpr int64_t kRowsPerBlock = 32;  // rows whose dw terms one thread sums before the blocks are summed in order
constexpr int64_t kGrain = 1 << 14;   // elements per thread below which splitting costs more than it saves

// One row of the norm's backward: dx into `dx`, g·x̂ added to the block's fp32 `dw` sums.
template <typename T>
void rms_norm_backward_row(const T* g, const T* x, float rstd, const T* w, T* dx, float* dw, int64_t hidden) {
  Floats running = {};
  int64_t i = 0;
  for (; i + kLanes <= hidden; i += kLanes)
    running = fused_multiply_add(load_lanes(g + i) * load_lanes(w + i), load_lanes(x + i), running);
  float dot = sum(running);
  for (; i < hidden; ++i) dot += widen(g[i]) * widen(w[i]) * widen(x[i]);
  const float mean = dot * rstd / hidden;  // mean(gw·x̂)
  for (i = 0; i + kLanes <= hidden; i += kLanes) {
    const Floats gv = load_lanes(g + i), normed = load_lanes(x + i) * rstd;
    store_lanes(dx + i, (gv * load_lanes(w + i) - normed * mean) * rstd);
    store_lanes(dw + i, fused_multiply_add(gv, normed, load_lanes(dw + i)));
  }
  for (; i < hidden; ++i) {
    const float normed = widen(x[i]) * rstd;
    dx[i] = narrow<T>((widen(g[i]) * widen(w[i]) - normed * mean) * rstd);
    dw[i] += widen(g[i]) * normed;
  }
}

template <typename T>
void rms_norm_backward_rows(const T* g, const T* x, const float* rstd, const T* w, T* dx, T* dw, int64_t rows,
                            int64_t hidden) {
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  std::vector<float> partial(blocks * hidden, 0.f);
  at::parallel_for(0, blocks, std::max<int64_t>(1, kGrain / (kRowsPerBlock * hidden)), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t r = b * kRowsPerBlock; r < std::min(rows, (b + 1) * kRowsPerBlock); ++r)
        rms_norm_backward_row(g + r * hidden, x + r * hidden, rstd[r], w, dx + r * hidden, &partial[b * hidden], hidden);
  });
  for (int64_t i = 0; i < hidden; ++i) {
    float total = 0.f;
    for (int64_t b = 0; b < blocks; ++b) total += partial[b * hidden + i];
    dw[i] = narrow<T>(total);
  }
}

template <typename T>
void silu_and_mul_backward_span(const T* __restrict g, const T* __restrict gate, const T* __restrict up,
                                T* __restrict d_gate, T* __restrict d_up, int64_t width) {
  const auto lanes = [](const T* gs, const T* gates, const T* ups, T* dg, T* du) {
    const Floats gv = load_lanes(gs), x = load_lanes(gates);
    const Floats sigmoid = x < -80.f ? broadcast(0.f) : 1.f / (1.f + exp(-x));
    store_lanes(du, gv * rounded_lanes<T>(x * sigmoid));
    store_lanes(dg, gv * load_lanes(ups) * sigmoid * (1.f + x * (1.f - sigmoid)));
  };
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) lanes(g + i, gate + i, up + i, d_gate + i, d_up + i);
  if (i < width) {  // the tail through the same vector code, from padded copies
    T gs[kLanes] = {}, gates[kLanes] = {}, ups[kLanes] = {}, dg[kLanes], du[kLanes];
    std::copy(g + i, g + width, gs);
    std::copy(gate + i, gate + width, gates);
    std::copy(up + i, up + width, ups);
    lanes(gs, gates, ups, dg, du);
    std::copy(dg, dg + (width - i), d_gate + i);
    std::copy(du, du + (width - i), d_up + i);
  }
}

void check_like(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
              t.scalar_type() == like.scalar_type() && t.sizes() == like.sizes() && t.is_contiguous(),
              name, ": a contiguous fp32 or bf16 CPU tensor of shape ", like.sizes(), " in ", like.scalar_type(),
              ", got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

}  // namespace

namespace mlsyslab {

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& x,
                                                     const at::Tensor& rstd, const at::Tensor& weight) {
  check_like(x, x, "x");
  check_like(grad, x, "grad");
  const int64_t hidden = x.size(-1), rows = x.numel() / std::max<int64_t>(hidden, 1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type(), "weight: contiguous [", hidden, "] in x's dtype");
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.is_contiguous() && rstd.numel() == rows,
              "rstd: contiguous fp32, one value a row of x (", rows, ")");
  auto dx = at::empty_like(x), dw = at::empty_like(weight);
  if (x.scalar_type() == at::kFloat)
    rms_norm_backward_rows(grad.data_ptr<float>(), x.data_ptr<float>(), rstd.data_ptr<float>(),
                           weight.data_ptr<float>(), dx.data_ptr<float>(), dw.data_ptr<float>(), rows, hidden);
  else
    rms_norm_backward_rows(grad.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), rstd.data_ptr<float>(),
                           weight.data_ptr<c10::BFloat16>(), dx.data_ptr<c10::BFloat16>(),
                           dw.data_ptr<c10::BFloat16>(), rows, hidden);
  return {dx, dw};
}

std::tuple<at::Tensor, at::Tensor> silu_and_mul_backward(const at::Tensor& grad, const at::Tensor& gate,
                                                         const at::Tensor& up) {
  check_like(gate, gate, "gate");
  check_like(up, gate, "up");
  check_like(grad, gate, "grad");
  auto d_gate = at::empty_like(gate), d_up = at::empty_like(up);
  const int64_t width = gate.size(-1), rows = gate.numel() / std::max<int64_t>(width, 1);
  const auto run = [&](auto* g, auto* gates, auto* ups, auto* dg, auto* du) {
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        silu_and_mul_backward_span(g + r * width, gates + r * width, ups + r * width, dg + r * width, du + r * width,
                                   width);
    });
  };
  if (gate.scalar_type() == at::kFloat)
    run(grad.data_ptr<float>(), gate.data_ptr<float>(), up.data_ptr<float>(), d_gate.data_ptr<float>(),
        d_up.data_ptr<float>());
  else
    run(grad.data_ptr<c10::BFloat16>(), gate.data_ptr<c10::BFloat16>(), up.data_ptr<c10::BFloat16>(),
        d_gate.data_ptr<c10::BFloat16>(), d_up.data_ptr<c10::BFloat16>());
  return {d_gate, d_up};
}

}  // namespace mlsyslab

TORCH_LIBRARY_FRAGMENT(mlsyslab, m) {
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor rstd, Tensor weight) -> (Tensor, Tensor)",
        &mlsyslab::rms_norm_backward);
  m.def("silu_and_mul_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)",
        &mlsyslab::silu_and_mul_backward);
}
