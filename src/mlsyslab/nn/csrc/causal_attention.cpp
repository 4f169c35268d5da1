// Causal self-attention of the training model, forward and backward, fp32 and bf16 on the CPU's vectors (used by
// `nn.training_kernels.causal_attention`).
//
// For one (sequence, KV head) — a thread's unit — K and V are widened to fp32 once (and transposed where a product
// reads them so) for all the query heads of its group (grouped-query attention). Then for each query head and block of 64 queries, over the
// keys up to the block's last query (causal: later keys are skipped a block at a time, the rest masked per row):
//   forward:  S = (q/√d)·Kᵀ, P = exp(S − the row's max), lse = max + log Σ P, O = P·V / Σ P;
//   backward (FlashAttention-2, Dao 2023, recomputing P from the saved lse): D = rowsum(dO ∘ O), P = exp(S − lse),
//             dV += Pᵀ·dO, dP = dO·Vᵀ, dS = P ∘ (dP − D), dQ = dS·K/√d, dK += dSᵀ·q/√d.
// The block's whole row of scores is held at once (64 × the keys it sees, in fp32), so the forward's softmax needs no
// running rescale. Each product is one register-blocked loop (`product`: 4 rows × 64 columns of fp32 sums, a row of
// the right operand a vector load, the left operand's element a broadcast, either operand transposed by its strides).
// The output is written [batch, tokens, heads, head_dim], so o_proj's input is a view of it, as torch's CPU flash
// attention lays its output out. bf16 inputs are widened, every sum is fp32, results rounded once. The backward's
// `tiles` form (bf16 where the CPU has AMX: csrc/causal_attention_tiles.cpp) runs the same formulas on tiles.
//
// Why: torch's CPU flash attention computes each block as oneDNN/MKL small-matrix calls; a 4-layer TP rank's causal
// attention of 4 × 256 tokens (4 query heads of 64, 2 KV heads) took 4.0 ms forward and 8.4 ms backward a layer on one
// Sapphire Rapids thread (~40 GFLOP/s of the causal work, 2026-12-02), 9% of the rank's training step.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using namespace mlsyslab;

constexpr int64_t kQueryBlock = 64;
constexpr int kTileRows = 4, kTileVectors = 4;  // a product's register tile: 4 rows × 4 vectors of sums

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// c[r][0, vectors·kLanes) = (c +) Σ_k a[r·a_row + k·a_col] · b[k·b_row, ...) for r < rows.
template <int kRows, int kVectors>
void tile(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t b_row, int64_t depth, float* c,
          int64_t c_row, bool accumulate) {
  Floats sums[kRows][kVectors];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kVectors; ++v) sums[r][v] = accumulate ? load_lanes(c + r * c_row + v * kLanes) : Floats{};
  for (int64_t k = 0; k < depth; ++k) {
    Floats row[kVectors];
    for (int v = 0; v < kVectors; ++v) row[v] = load_lanes(b + k * b_row + v * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const Floats value = broadcast(a[r * a_row + k * a_col]);
      for (int v = 0; v < kVectors; ++v) sums[r][v] = fused_multiply_add(value, row[v], sums[r][v]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kVectors; ++v) store_lanes(c + r * c_row + v * kLanes, sums[r][v]);
}

template <int kRows>
void row_tile(int vectors, const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t b_row, int64_t depth,
              float* c, int64_t c_row, bool accumulate) {
  switch (vectors) {
    case 1: return tile<kRows, 1>(a, a_row, a_col, b, b_row, depth, c, c_row, accumulate);
    case 2: return tile<kRows, 2>(a, a_row, a_col, b, b_row, depth, c, c_row, accumulate);
    case 3: return tile<kRows, 3>(a, a_row, a_col, b, b_row, depth, c, c_row, accumulate);
    default: return tile<kRows, 4>(a, a_row, a_col, b, b_row, depth, c, c_row, accumulate);
  }
}

// C[rows × columns] (=, or += with `accumulate`) A[rows × depth] · B[depth × columns]; A's element (r, k) at
// a[r·a_row + k·a_col] (a transposed A is a_row = 1), B's rows b_row apart, columns a multiple of kLanes.
void product(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t b_row, int64_t rows,
             int64_t columns, int64_t depth, float* c, int64_t c_row, bool accumulate) {
  for (int64_t n = 0; n < columns; n += kTileVectors * kLanes) {
    const int vectors = int(std::min<int64_t>(kTileVectors, (columns - n) / kLanes));
    for (int64_t r = 0; r < rows; r += kTileRows) {
      const float* a_rows = a + r * a_row;
      float* c_rows = c + r * c_row + n;
      switch (std::min<int64_t>(kTileRows, rows - r)) {
        case 1: row_tile<1>(vectors, a_rows, a_row, a_col, b + n, b_row, depth, c_rows, c_row, accumulate); break;
        case 2: row_tile<2>(vectors, a_rows, a_row, a_col, b + n, b_row, depth, c_rows, c_row, accumulate); break;
        case 3: row_tile<3>(vectors, a_rows, a_row, a_col, b + n, b_row, depth, c_rows, c_row, accumulate); break;
        default: row_tile<4>(vectors, a_rows, a_row, a_col, b + n, b_row, depth, c_rows, c_row, accumulate);
      }
    }
  }
}

// to = from · scale over a row of `dim` values: widened to fp32 (From a T) or rounded once into a T (To a T).
template <typename From, typename To>
void scaled_row(const From* from, To* to, int64_t dim, float scale = 1.f) {
  for (int64_t i = 0; i < dim; i += kLanes) store_lanes(to + i, load_lanes(from + i) * scale);
}

// One (sequence, KV head)'s keys or values in fp32, rows [token][dim], tokens padded to `padded` with zeros.
template <typename T>
std::vector<float> widened(const Heads<T>& heads, int64_t b, int64_t g, int64_t tokens, int64_t padded, int64_t dim) {
  std::vector<float> rows(padded * dim);
  for (int64_t t = 0; t < tokens; ++t) scaled_row(heads.row(b, t, g), rows.data() + t * dim, dim);
  return rows;
}

// rows [padded][dim] as [dim][padded], a kLanes × kLanes block at a time (each read row and written row a vector).
std::vector<float> transposed(const std::vector<float>& rows, int64_t padded, int64_t dim) {
  std::vector<float> columns(dim * padded);
  for (int64_t t = 0; t < padded; t += kLanes)
    for (int64_t i = 0; i < dim; i += kLanes)
      for (int64_t a = 0; a < kLanes; ++a)
        for (int64_t c = 0; c < kLanes; ++c) columns[(i + a) * padded + t + c] = rows[(t + c) * dim + i + a];
  return columns;
}

// The lanes of the keys [j, j + kLanes) a query at `query` sees.
inline Floats visible(Floats x, int64_t j, int64_t query, float otherwise) {
  return (kLaneIndex + Ints{} + int32_t(j)) <= int32_t(query) ? x : broadcast(otherwise);
}

template <typename T>
struct Problem {
  Heads<T> q, k, v;
  int64_t batch, tokens, heads, kv_heads, dim;
  float scale;
  int64_t group() const { return heads / kv_heads; }
  int64_t padded() const { return round_up(tokens, kLanes); }
};

template <typename T>
void forward_unit(const Problem<T>& p, Heads<T> out, float* lse, int64_t b, int64_t g) {
  const int64_t padded = p.padded(), d = p.dim;
  const std::vector<float> keys_t = transposed(widened(p.k, b, g, p.tokens, padded, d), padded, d),
                           values = widened(p.v, b, g, p.tokens, padded, d);
  std::vector<float> queries(kQueryBlock * d), scores(kQueryBlock * padded), outputs(kQueryBlock * d);
  for (int64_t h = g * p.group(); h < (g + 1) * p.group(); ++h) {
    for (int64_t first = 0; first < p.tokens; first += kQueryBlock) {
      const int64_t rows = std::min(kQueryBlock, p.tokens - first), seen = round_up(first + rows, kLanes);
      for (int64_t r = 0; r < rows; ++r) scaled_row(p.q.row(b, first + r, h), queries.data() + r * d, d, p.scale);
      product(queries.data(), d, 1, keys_t.data(), padded, rows, seen, d, scores.data(), padded, false);
      std::vector<float> inverse(rows);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t query = first + r;
        float* s = scores.data() + r * padded;
        Floats running = broadcast(-INFINITY);
        for (int64_t j = 0; j < seen; j += kLanes) {
          const Floats x = visible(load_lanes(s + j), j, query, -INFINITY);
          running = running > x ? running : x;
        }
        const float highest = max(running);
        Floats total = {};
        for (int64_t j = 0; j < seen; j += kLanes) {
          const Floats e = visible(exp(load_lanes(s + j) - highest), j, query, 0.f);
          store_lanes(s + j, e);
          total += e;
        }
        const float sum_exp = sum(total);
        lse[(b * p.heads + h) * p.tokens + query] = highest + std::log(sum_exp);
        inverse[r] = 1.f / sum_exp;
      }
      product(scores.data(), padded, 1, values.data(), d, rows, d, seen, outputs.data(), d, false);
      for (int64_t r = 0; r < rows; ++r) scaled_row(outputs.data() + r * d, out.row(b, first + r, h), d, inverse[r]);
    }
  }
}

template <typename T>
void backward_unit(const Problem<T>& p, const Heads<T> grad, const Heads<T> out, const float* lse, Heads<T> dq,
                   Heads<T> dk, Heads<T> dv, int64_t b, int64_t g) {
  const int64_t padded = p.padded(), d = p.dim;
  const std::vector<float> keys = widened(p.k, b, g, p.tokens, padded, d), keys_t = transposed(keys, padded, d),
                           values_t = transposed(widened(p.v, b, g, p.tokens, padded, d), padded, d);
  std::vector<float> queries(kQueryBlock * d), grads(kQueryBlock * d), probabilities(kQueryBlock * padded),
      dscores(kQueryBlock * padded), dqueries(kQueryBlock * d), dkeys(padded * d), dvalues(padded * d);
  for (int64_t h = g * p.group(); h < (g + 1) * p.group(); ++h) {
    for (int64_t first = 0; first < p.tokens; first += kQueryBlock) {
      const int64_t rows = std::min(kQueryBlock, p.tokens - first), seen = round_up(first + rows, kLanes);
      std::vector<float> deltas(rows);
      for (int64_t r = 0; r < rows; ++r) {
        scaled_row(p.q.row(b, first + r, h), queries.data() + r * d, d, p.scale);
        scaled_row(grad.row(b, first + r, h), grads.data() + r * d, d);
        const T* output = out.row(b, first + r, h);
        Floats dot = {};
        for (int64_t i = 0; i < d; i += kLanes)
          dot = fused_multiply_add(load_lanes(grads.data() + r * d + i), load_lanes(output + i), dot);
        deltas[r] = sum(dot);
      }
      product(queries.data(), d, 1, keys_t.data(), padded, rows, seen, d, probabilities.data(), padded, false);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t query = first + r;
        const float log_sum = lse[(b * p.heads + h) * p.tokens + query];
        float* s = probabilities.data() + r * padded;
        for (int64_t j = 0; j < seen; j += kLanes)
          store_lanes(s + j, visible(exp(load_lanes(s + j) - log_sum), j, query, 0.f));
      }
      // dV[0, seen) += Pᵀ·dO (the unit's sums start at zero; keys past `seen` get no term from this block)
      product(probabilities.data(), 1, padded, grads.data(), d, seen, d, rows, dvalues.data(), d, true);
      product(grads.data(), d, 1, values_t.data(), padded, rows, seen, d, dscores.data(), padded, false);
      for (int64_t r = 0; r < rows; ++r) {
        const float* pr = probabilities.data() + r * padded;
        float* ds = dscores.data() + r * padded;
        for (int64_t j = 0; j < seen; j += kLanes)
          store_lanes(ds + j, load_lanes(pr + j) * (load_lanes(ds + j) - deltas[r]));
      }
      product(dscores.data(), padded, 1, keys.data(), d, rows, d, seen, dqueries.data(), d, false);
      for (int64_t r = 0; r < rows; ++r) scaled_row(dqueries.data() + r * d, dq.row(b, first + r, h), d, p.scale);
      product(dscores.data(), 1, padded, queries.data(), d, seen, d, rows, dkeys.data(), d, true);
    }
  }
  for (int64_t t = 0; t < p.tokens; ++t) {
    scaled_row(dkeys.data() + t * d, dk.row(b, t, g), d);
    scaled_row(dvalues.data() + t * d, dv.row(b, t, g), d);
  }
}

void check_heads(const at::Tensor& t, const char* name, const at::Tensor& like, int64_t heads) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
              t.scalar_type() == like.scalar_type() && t.dim() == 4 && t.size(0) == like.size(0) &&
              t.size(1) == like.size(1) && t.size(2) == heads && t.size(3) == like.size(3) && t.stride(3) == 1,
              name, ": [batch, tokens, ", heads, ", ", like.size(3), "] ", like.scalar_type(),
              " on the CPU, head_dim contiguous; got ", t.scalar_type(), " ", t.sizes(), " strides ", t.strides());
}

// The problem of q [B, T, H, d] and k, v [B, T, KV, d], checked: KV divides H, d a multiple of the vector width.
template <typename T>
Problem<T> problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.size(2) > 0 && q.size(2) % k.size(2) == 0,
              "q [batch, tokens, heads, head_dim], k and v [batch, tokens, kv_heads, head_dim], kv_heads dividing "
              "heads; got ", q.sizes(), " and ", k.sizes());
  check_heads(q, "q", q, q.size(2));
  check_heads(k, "k", q, k.size(2));
  check_heads(v, "v", q, k.size(2));
  TORCH_CHECK(q.size(3) % kLanes == 0, "head_dim: a multiple of ", kLanes, ", got ", q.size(3));
  return {Heads<T>(q), Heads<T>(k), Heads<T>(v), q.size(0), q.size(1), q.size(2), k.size(2), q.size(3),
          float(1.0 / std::sqrt(double(q.size(3))))};
}

// unit(problem, b, g) for every (sequence b, KV head g) of q, k, v, one thread each, in q's element type.
template <typename Unit>
void over_units(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Unit unit) {
  const auto run = [&](auto zero) {
    const auto p = problem<decltype(zero)>(q, k, v);
    at::parallel_for(0, p.batch * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) unit(p, u / p.kv_heads, u % p.kv_heads);
    });
  };
  if (q.scalar_type() == at::kFloat) run(float{});
  else run(c10::BFloat16{});
}

}  // namespace

namespace mlsyslab {

std::tuple<at::Tensor, at::Tensor> causal_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v) {
  auto out = at::empty(q.sizes(), q.options());
  auto lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  over_units(q, k, v, [&](const auto& p, int64_t b, int64_t g) {
    using T = std::remove_pointer_t<decltype(p.q.data)>;
    forward_unit(p, Heads<T>(out), lse.data_ptr<float>(), b, g);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, bool tiles) {
  auto dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), k.options()),
       dv = at::empty(v.sizes(), v.options());
  check_heads(grad, "grad", q, q.size(2));
  check_heads(out, "out", q, q.size(2));
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 3 && lse.size(0) == q.size(0) &&
              lse.size(1) == q.size(2) && lse.size(2) == q.size(1), "lse: contiguous fp32 [batch, heads, tokens]");
  if (tiles) {
    causal_attention_backward_tiles(grad, q, k, v, out, lse, dq, dk, dv);
    return {dq, dk, dv};
  }
  over_units(q, k, v, [&](const auto& p, int64_t b, int64_t g) {
    using T = std::remove_pointer_t<decltype(p.q.data)>;
    backward_unit(p, Heads<T>(grad), Heads<T>(out), lse.data_ptr<float>(), Heads<T>(dq), Heads<T>(dk), Heads<T>(dv),
                  b, g);
  });
  return {dq, dk, dv};
}

}  // namespace mlsyslab

TORCH_LIBRARY_FRAGMENT(mlsyslab, m) {
  m.def("causal_attention_forward(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)",
        &mlsyslab::causal_attention_forward);
  // tiles: in bf16 on AMX tiles (csrc/causal_attention_tiles.cpp), else the fp32 FMA loops here
  m.def("causal_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "bool tiles=False) -> (Tensor, Tensor, Tensor)", &mlsyslab::causal_attention_backward);
}
