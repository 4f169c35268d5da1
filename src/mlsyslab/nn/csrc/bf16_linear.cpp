// y = x·Wᵀ (+ residual) for a few rows of x against a bf16 weight: the matrix-vector products of a
// bf16 decode step, at the speed the weight streams from memory.
//
// At decode batch sizes each weight element is used once or a few times per step, so a step costs the
// weight's bytes over the memory bandwidth (the decode roofline). The weight stays in its plain
// row-major layout [out, in]: output rows are contiguous, so computing G adjacent outputs at a time as
// dot products reads the matrix front to back, one sequential stream per thread, which the hardware
// prefetchers follow (no repacked copy). Each thread takes a contiguous range of output rows. The x
// rows are widened to fp32 once into a buffer that stays in L1; each weight vector is loaded and widened
// once (bf16 is the top half of an fp32: a zero-extend and a shift) and multiplied into every x row of
// the block. Sums are fp32 in a fixed order — each output's k-chunks in order, then its lanes — that
// does not depend on how many rows the call has, so a sequence's result is the same in any batch;
// the residual is added in fp32 and the result rounded once to bf16 (round to nearest even).
//
// Why our own: oneDNN packs bf16 weights only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT
// (`mkldnn_reorder_linear_weight` refuses elsewhere, e.g. AVX2 laptops and AMD Zen 3), and its bf16
// matrix-vector product streamed 17-20 GB/s of 24 on an AVX-512 host (docs/serving.md).
// Used by `nn.packed_linear.PackedLinear` for the row counts it picks; tested in
// tests/nn/test_cpu_kernels.py against fp32 matmul of the same values.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "kernels.h"
#include "vec.h"

#include <cstring>
#include <vector>

namespace {

using namespace mlsyslab;

// The widest vector the compiler targets (-march=native): one AVX-512 register, or one AVX2 one.
#if defined(__AVX512F__)
constexpr int kWidth = 16;
#else
constexpr int kWidth = 8;
#endif
typedef Lanes<kWidth>::Floats Vec;
typedef Lanes<kWidth>::Words Pairs;  // 2·kWidth bf16 weights read as kWidth 32-bit words
constexpr int64_t kChunk = 2 * kWidth;  // inputs per step of the inner loop

template <typename T> inline T bits_as(const void* p) { T v; std::memcpy(&v, p, sizeof v); return v; }
inline Vec as_floats(Pairs words) { return bits_as<Vec>(&words); }

// x rows in fp32, each chunk of kChunk inputs stored as its even inputs then its odd ones (the order the
// weights come out of a word: the low half of word i is input 2i, the high half input 2i + 1); the
// inputs past the last whole chunk in order.
std::vector<float> split_even_odd(const at::Tensor& x) {
  const at::Tensor rows = x.to(at::kFloat).contiguous();
  const int64_t count = rows.size(0), in = rows.size(1), whole = in / kChunk * kChunk;
  const float* source = rows.data_ptr<float>();
  std::vector<float> out(count * in);
  for (int64_t r = 0; r < count; ++r) {
    const float* row = source + r * in;
    float* split = out.data() + r * in;
    for (int64_t c = 0; c < whole; c += kChunk)
      for (int i = 0; i < kWidth; ++i) {
        split[c + i] = row[c + 2 * i];
        split[c + kWidth + i] = row[c + 2 * i + 1];
      }
    std::memcpy(split + whole, row + whole, (in - whole) * sizeof(float));
  }
  return out;
}

typedef Lanes<8>::Floats Eight;

// Lane g of the result: the sum of the lanes of a[g], by three rounds of pairwise shuffle-and-add (21
// operations for 8 sums, against 8 horizontal sums of 7 dependent adds each). Every output is summed by
// the same tree whichever outputs share the call, so a result does not depend on the group size.
inline Eight transpose_sum(const Vec (&acc)[8]) {
  Eight a[8];
  for (int g = 0; g < 8; ++g) {
#if defined(__AVX512F__)
    a[g] = __builtin_shufflevector(acc[g], acc[g], 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(acc[g], acc[g], 8, 9, 10, 11, 12, 13, 14, 15);
#else
    a[g] = acc[g];
#endif
  }
  Eight u[4], v[2];
  for (int i = 0; i < 4; ++i)
    u[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int i = 0; i < 2; ++i)
    v[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(v[0], v[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(v[0], v[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// sums[r][g] = x[r]·w[g] for G adjacent weight rows and RB rows of x (split by `split_even_odd`, row
// stride `in`). Each word of the weight gives two fp32 lanes by bit operations alone: word << 16 is
// the even input's weight, word & 0xFFFF0000 the odd one's. While one group of rows is read, the next
// group's bytes (the matrix is read front to back) are asked for.
template <int G, int RB>
inline void dot_tile(const c10::BFloat16* w, const float* x, int64_t in, float sums[RB][G]) {
  static_assert(G <= 8, "transpose_sum reduces 8 outputs at a time");
  Vec acc[RB][8] = {};
  const int64_t whole = in / kChunk * kChunk;
  for (int64_t k = 0; k < whole; k += kChunk) {
    for (int g = 0; g < G; ++g) {
      __builtin_prefetch(w + (G + g) * in + k);
      const Pairs pairs = bits_as<Pairs>(w + g * in + k);
      const Vec even = as_floats(pairs << 16), odd = as_floats(pairs & 0xFFFF0000u);
      for (int r = 0; r < RB; ++r) {
        acc[r][g] += even * bits_as<Vec>(x + r * in + k);
        acc[r][g] += odd * bits_as<Vec>(x + r * in + k + kWidth);
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    const Eight totals = transpose_sum(acc[r]);
    for (int g = 0; g < G; ++g) {
      float total = totals[g];
      for (int64_t tail = whole; tail < in; ++tail) total += x[r * in + tail] * widen(w[g * in + tail]);
      sums[r][g] = total;
    }
  }
}

struct Problem {
  const float* x;                 // [rows, in], fp32
  const c10::BFloat16* weight;    // [out, in]
  const c10::BFloat16* residual;  // [rows, out] or null
  c10::BFloat16* y;               // [rows, out]
  int64_t rows, in, out;
};

// Outputs [n, n + G) for rows [r, r + RB), written (with the residual) to y.
template <int G, int RB>
inline void tile(const Problem& p, int64_t n, int64_t r) {
  float sums[RB][G];
  dot_tile<G, RB>(p.weight + n * p.in, p.x + r * p.in, p.in, sums);
  for (int i = 0; i < RB; ++i)
    for (int g = 0; g < G; ++g) {
      const int64_t at = (r + i) * p.out + n + g;
      p.y[at] = narrow<c10::BFloat16>(sums[i][g] + (p.residual ? widen(p.residual[at]) : 0.f));
    }
}

// Output rows [begin, end): G at a time, each group against the x rows two at a time (the group's
// weight rows stay in L1 between the two passes), one output at a time for the range's tail.
template <int G>
void outputs(const Problem& p, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + G <= end; n += G) {
    int64_t r = 0;
    for (; r + 2 <= p.rows; r += 2) tile<G, 2>(p, n, r);
    if (r < p.rows) tile<G, 1>(p, n, r);
  }
  for (; n < end; ++n)
    for (int64_t r = 0; r < p.rows; ++r) tile<1, 1>(p, n, r);
}

constexpr int64_t kBytesPerThread = 1 << 16;  // weight bytes below which a second thread costs more than it saves

}  // namespace

namespace mlsyslab {

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
              weight.is_contiguous(), "weight: a contiguous bf16 CPU tensor [out, in]");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == weight.size(1) &&
              (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x: a bf16 or fp32 CPU tensor [rows, in] with in = ", weight.size(1), ", got ", x.sizes());
  const int64_t rows = x.size(0), in = weight.size(1), out = weight.size(0);
  if (residual) {
    TORCH_CHECK(residual->scalar_type() == at::kBFloat16 && residual->is_contiguous() && residual->dim() == 2 &&
                residual->size(0) == rows && residual->size(1) == out,
                "residual: a contiguous bf16 tensor [rows, out] = [", rows, ", ", out, "]");
  }
  const std::vector<float> xs = split_even_odd(x);
  at::Tensor y = at::empty({rows, out}, weight.options());
  const Problem p{xs.data(), weight.data_ptr<c10::BFloat16>(),
                  residual ? residual->data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>(), rows, in, out};
  const int64_t grain = std::max<int64_t>(1, kBytesPerThread / (2 * in));
  at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) {
    if (rows == 1) outputs<8>(p, begin, end);
    else outputs<4>(p, begin, end);
  });
  return y;
}

}  // namespace mlsyslab

TORCH_LIBRARY_FRAGMENT(mlsyslab, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? residual=None) -> Tensor", &mlsyslab::bf16_linear);
}
