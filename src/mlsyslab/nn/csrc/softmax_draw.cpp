// One token per row drawn from softmax(logits / temperature) by inverse CDF with the row's uniform: the first
// token whose running sum of e^((logit - max) / T) exceeds uniform · their total — the draw of
// serve.sampling's PyTorch path (softmax, cumsum, searchsorted), in one vector pass over the row (the weights,
// by vec.h's exp, into a buffer the thread keeps) and two sequential ones (the total, then the walk, both in
// double, the same additions in the same order: the walk ends at the total, so a uniform below 1 always finds
// its token; one that rounding carries past it picks the last token of nonzero weight). Tokens of zero weight
// (underflow) are never drawn. Where it runs: the rows of a step that sample without top-k, top-p or min-p.
// Why: those ~8 ATen ops over a 49k vocabulary took 0.82 ms for one row on Zen 3 after a decode step had
// flushed the caches (0.46 ms in cache), a 6% longer bf16 step at batch 1. Tested against the PyTorch path in
// tests/serve/test_sampling.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace mlsyslab {

// Below e^-80 of the most likely token's weight a token's is 0 (vec.h's exp clamps there instead: a -inf
// logit, a token ruled out, must never be drawn).
constexpr float kNegligible = 80.f;

template <typename T>
int64_t draw_row(const T* logits, int64_t vocab, float temperature, double uniform) {
  thread_local std::vector<float> weights;
  weights.resize(vocab);
  float top = -std::numeric_limits<float>::max();  // finite: compiled with -ffast-math
  for (int64_t i = 0; i < vocab; ++i) top = std::max(top, widen(logits[i]));
  const float inverse = 1.f / temperature;
  int64_t i = 0;
  for (; i + kLanes <= vocab; i += kLanes) {
    Floats x;
    for (int lane = 0; lane < kLanes; ++lane) x[lane] = widen(logits[i + lane]);
    const Floats z = (x - top) * inverse;
    const Floats e = z < -kNegligible ? Floats{} : exp(z);
    std::memcpy(weights.data() + i, &e, sizeof e);
  }
  for (; i < vocab; ++i) {
    const float z = (widen(logits[i]) - top) * inverse;
    weights[i] = z < -kNegligible ? 0.f : std::exp(z);
  }
  double total = 0.0;
  for (int64_t j = 0; j < vocab; ++j) total += weights[j];
  const double threshold = uniform * total;
  double running = 0.0;
  int64_t last_possible = 0;
  for (int64_t j = 0; j < vocab; ++j) {
    if (weights[j] == 0.f) continue;
    running += weights[j];
    last_possible = j;
    if (running > threshold) return j;
  }
  return last_possible;
}

template int64_t draw_row(const float*, int64_t, float, double);
template int64_t draw_row(const c10::BFloat16*, int64_t, float, double);

at::Tensor softmax_draw(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& uniform) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous() &&
              (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "logits: a contiguous fp32 or bf16 CPU tensor [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == rows && temperature.scalar_type() == at::kFloat &&
              temperature.is_contiguous(), "temperature: contiguous fp32 [rows]");
  TORCH_CHECK(uniform.dim() == 1 && uniform.size(0) == rows && uniform.scalar_type() == at::kDouble &&
              uniform.is_contiguous(), "uniform: contiguous float64 [rows]");
  const float* t = temperature.data_ptr<float>();
  const double* u = uniform.data_ptr<double>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(t[r] > 0.f && std::isfinite(t[r]), "temperature[", r, "] = ", t[r], ": must be > 0 (0 is greedy)");
    TORCH_CHECK(u[r] >= 0.0 && u[r] < 1.0, "uniform[", r, "] = ", u[r], ": must be in [0, 1)");
  }
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      out[r] = logits.scalar_type() == at::kFloat
                   ? draw_row(logits.data_ptr<float>() + r * vocab, vocab, t[r], u[r])
                   : draw_row(logits.data_ptr<c10::BFloat16>() + r * vocab, vocab, t[r], u[r]);
  });
  return tokens;
}

}  // namespace mlsyslab

TORCH_LIBRARY_FRAGMENT(mlsyslab, m) {
  m.def("softmax_draw(Tensor logits, Tensor temperature, Tensor uniform) -> Tensor", &mlsyslab::softmax_draw);
}
