// y = x·Wᵀ (+ residual) as a register-blocked GEMM over panels of kPanel = 48 outputs: the streamed kernel's path
// (streamed_linear.cpp dispatches here, for every row count) for fp32 weights on CPUs with AVX-512, and for bf16
// ones on CPUs with AVX512_BF16, whose `vdpbf16ps` multiplies 16 pairs of bf16 and adds each pair's two products to
// an fp32 lane (32 multiply-adds an instruction, against an FMA's 16; Intel SDM, VDPBF16PS).
//
// Layout (`panel_pack`): panels of 48 outputs, each the weight's input steps in order, a step of the 48 outputs
// being three vectors of 32-bit words: fp32, one input a step (word o: output o's weight); bf16, a pair of inputs
// (word o: output o's weights for inputs 2i and 2i+1). Panels in output order, zero-padded to whole panels and
// whole steps. A thread takes contiguous panels and reads each once from memory as one sequential stream (the
// hardware prefetchers follow it), then re-reads it from L2 for each further block of up to kRowBlock = 8 rows of
// x: 8 rows × 3 vectors = 24 fp32 accumulators in registers (of AVX-512's 32), the three weight vectors of a step
// loaded once and each row's step of x (an fp32, or a 32-bit pair of bf16) broadcast to all lanes (`x` is copied
// once per call into a buffer of whole steps, zero-padded). Sums are fp32, each output's steps in input order,
// whatever the row block: a row's result does not depend on how many rows the call has. The residual is added in
// fp32 and the result rounded once (vec.h `narrow`: round to nearest even).
//
// Why: at batch 1 the widening kernel (streamed_linear.cpp) spends, per 32 weights, two shifts and two FMAs in
// bf16 and two FMAs and a lane reduction per group in fp32, and it streamed one 538 MB fp32 matrix at 87-88% of
// what a sum reads (Zen 4, 2026-11-25); from 4 rows oneDNN's packed matmul was ahead of it, but oneDNN's bf16
// one reached only 155-300 GFLOP/s at 8-32 rows. bf16, measured on Zen 4 (2 cores, 2026-11-25, SmolLM2-135M's 121
// matrices, medians of 5, the machine's slow memory phase): this kernel against oneDNN's packed bf16 at
// 1 / 4 / 8 / 16 / 32 / 64 / 256 / 2,048 rows: 8.2 / 6.7 / 7.2 / 13.3 / 23.0 / 42.2 / 167 / 1,359 ms against
// 15.2 / 12.5 / 15.7 / 19.8 / 30.7 / 54.4 / 171 / 1,432; the widening kernel at 1 / 4 rows 8.7 / 14.4 ms.
// (Panels of 32 outputs × 12 rows, and 64 × 6, were within 0-10% of 48 × 8, slower at 24-64 rows.)
// Not built without AVX-512 (AVX2 has 16 vector registers, too few for the block), nor for bf16 without
// AVX512_BF16 (`kPanelsFor`): the widening kernel serves those. Tested in tests/nn/test_cpu_kernels.py against
// the exact product, through the streamed kernel's ops.
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace mlsyslab {

at::Tensor panel_pack(const at::Tensor& weight) {
  const int64_t width = panel_step(weight.scalar_type());
  const int64_t out = weight.size(0), in = weight.size(1);
  const int64_t panels = (out + kPanel - 1) / kPanel, steps = (in + width - 1) / width;
  const at::Tensor padded = at::constant_pad_nd(weight, {0, steps * width - in, 0, panels * kPanel - out});
  return padded.view({panels, kPanel, steps, width}).transpose(1, 2).contiguous();  // [panels, steps, kPanel, width]
}

template <typename T, typename X>
const T* panel_input(const X* x, int64_t rows, int64_t in, int64_t row_stride, int64_t steps) {
  thread_local std::vector<T> buffer;
  const int64_t padded = steps * kPanelStep<T>, align = 64 / sizeof(T);  // rows on cache lines: tile loads split none
  // On AMX tiles the zero rows `amx_buffer_rows` asks for: none in calls of 16 rows or fewer (filling 15 of them wrote
  // up to 46 KB a call, most of L1, and the bf16 batch-1 step got 1.044-1.046x faster without: TPOT 16.35 against
  // 17.04 ms, 14 rounds alternating; 1.016x at 4 rows; 2026-12-02).
  const bool tiles = std::is_same_v<T, c10::BFloat16> && amx_ready();
  const int64_t size = (tiles ? amx_buffer_rows(rows) : rows) * padded;
  buffer.resize(size + align);
  T* start = buffer.data() + (align - reinterpret_cast<uintptr_t>(buffer.data()) / sizeof(T) % align) % align;
  std::fill(start + rows * padded, start + size, T(0.f));  // the A tiles' rows past the last
  for (int64_t r = 0; r < rows; ++r) {
    T* row = start + r * padded;
    if constexpr (std::is_same_v<X, T>) {
      std::memcpy(row, x + r * row_stride, in * sizeof(X));
    } else {  // the other dtype's rows: rounded to the weights' (fp32 rows of bf16 weights: as the pair instruction takes them)
      for (int64_t i = 0; i < in; ++i) row[i] = narrow<T>(widen(x[r * row_stride + i]));
    }
    std::fill(row + in, row + padded, T(0.f));
  }
  return start;
}

template const float* panel_input(const float*, int64_t, int64_t, int64_t, int64_t);
template const float* panel_input(const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t);
template const c10::BFloat16* panel_input(const float*, int64_t, int64_t, int64_t, int64_t);
template const c10::BFloat16* panel_input(const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t);

}  // namespace mlsyslab

#if defined(__AVX512F__)

namespace {

using namespace mlsyslab;

constexpr int kVectors = kPanel / 16;
constexpr int64_t kRowBlock = 8;

// One step of a panel: how a step of x is broadcast and multiplied into the sums, by the weights' dtype.
template <typename T> struct Step;
template <> struct Step<float> {
  using Weights = __m512;
  static __m512 broadcast(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 multiply_add(__m512 sums, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, sums); }
};
#if defined(__AVX512BF16__)
template <> struct Step<c10::BFloat16> {
  using Weights = __m512bh;
  static __m512bh broadcast(const c10::BFloat16* x) {  // the row's inputs 2p and 2p + 1, read as one 32-bit word
    int32_t word;
    std::memcpy(&word, x, sizeof word);
    return __m512bh(_mm512_set1_epi32(word));
  }
  static __m512 multiply_add(__m512 sums, __m512bh x, __m512bh w) { return _mm512_dpbf16_ps(sums, x, w); }
};
#endif

// sums [R, kPanel] = R rows of x (`steps` steps a row) · one panel's weights.
template <typename T, int R>
void panel_rows(const T* x, int64_t steps, const typename Step<T>::Weights* panel, float* sums) {
  constexpr int64_t width = kPanelStep<T>;
  __m512 acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < steps; ++p) {
    typename Step<T>::Weights w[kVectors];
    for (int v = 0; v < kVectors; ++v) w[v] = panel[p * kVectors + v];
    for (int r = 0; r < R; ++r) {
      const auto xs = Step<T>::broadcast(x + (r * steps + p) * width);
      for (int v = 0; v < kVectors; ++v) acc[r][v] = Step<T>::multiply_add(acc[r][v], xs, w[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(sums + r * kPanel + v * 16, acc[r][v]);
}

template <typename T, int... R>
void dispatch_rows(int64_t rows, const T* x, int64_t steps, const typename Step<T>::Weights* panel, float* sums,
                   std::integer_sequence<int, R...>) {
  ((rows == R + 1 ? panel_rows<T, R + 1>(x, steps, panel, sums) : void()), ...);
}

}  // namespace

namespace mlsyslab {

template <typename T>
void panel_products(const StreamedProduct<T>& p, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (amx_ready()) return amx_panel_products(p, begin, end);
  }
  if constexpr (kPanelsFor<T>) {
    const T* x = static_cast<const T*>(p.x);
    const int64_t steps = p.chunks;
    alignas(64) float sums[kRowBlock * kPanel];
    for (int64_t panel = begin; panel < end; ++panel) {
      const auto* weights = reinterpret_cast<const typename Step<T>::Weights*>(p.tiles + panel * steps * kPanel * kPanelStep<T>);
      const int64_t first = panel * kPanel, columns = std::min(kPanel, p.out - first);
      for (int64_t row = 0; row < p.rows; row += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, p.rows - row);
        dispatch_rows(rows, x + row * steps * kPanelStep<T>, steps, weights, sums,
                      std::make_integer_sequence<int, kRowBlock>{});
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t at = (row + r) * p.out + first;
          for (int64_t c = 0; c < columns; ++c)
            p.y[at + c] = narrow<T>(sums[r * kPanel + c] + (p.residual ? widen(p.residual[at + c]) : 0.f));
        }
      }
    }
  }
}

template void panel_products(const StreamedProduct<float>&, int64_t, int64_t);
template void panel_products(const StreamedProduct<c10::BFloat16>&, int64_t, int64_t);

}  // namespace mlsyslab

#endif  // __AVX512F__
