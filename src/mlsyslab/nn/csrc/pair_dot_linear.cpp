// y = x·Wᵀ (+ residual) for bf16 weights on CPUs with AVX512_BF16: a register-blocked GEMM on the
// `vdpbf16ps` instruction, which multiplies 16 pairs of bf16 and adds each pair's two products to an fp32
// lane (32 multiply-adds an instruction; Intel SDM, VDPBF16PS). It is the streamed kernel's bf16 path on
// such CPUs (streamed_linear.cpp dispatches here), for every row count.
//
// Layout (`pair_pack`): panels of kPanel = 48 outputs, each the weight's input pairs in order, a pair of 48
// outputs being 48 32-bit words (three vectors: output o's word holds its weights for inputs 2i and 2i+1),
// panels in output order, zero-padded to whole panels and an even input count. A thread takes contiguous
// panels and reads each once from memory as one sequential stream (as the widening kernel's tiles: the
// hardware prefetchers follow it), then re-reads it from L2 for each block of up to kRowBlock = 8 rows of x:
// 8 rows × 3 vectors = 24 fp32 accumulators in registers, the three weight vectors of a pair loaded once
// and each row's pair of x broadcast to all lanes (`x` is copied once per call into a buffer of 32-bit
// pairs, zero-padded). Sums are fp32, each output's pairs in input order, whatever the row block: a row's
// result does not depend on how many rows the call has. The residual is added in fp32 and the result
// rounded once (vec.h `narrow`: round to nearest even).
//
// Why: at batch 1 the widening kernel (streamed_linear.cpp) spends two shifts and two FMAs per 32 bf16,
// and from 4 rows oneDNN's packed bf16 matmul (which also uses the pair instruction) was ahead of it; but
// oneDNN's reached only 155-300 GFLOP/s at 8-32 rows. Measured on Zen 4 (2 cores, 2026-11-25, SmolLM2-135M's
// 121 matrices, medians of 5, the machine's slow memory phase): this kernel against oneDNN's packed bf16 at
// 1 / 4 / 8 / 16 / 32 / 64 / 256 / 2,048 rows: 8.2 / 6.7 / 7.2 / 13.3 / 23.0 / 42.2 / 167 / 1,359 ms against
// 15.2 / 12.5 / 15.7 / 19.8 / 30.7 / 54.4 / 171 / 1,432; the widening kernel at 1 / 4 rows 8.7 / 14.4 ms.
// (Panels of 32 outputs × 12 rows, and 64 × 6, were within 0-10% of 48 × 8, slower at 24-64 rows.)
// Not built on CPUs without AVX512_BF16 (`kPairDot` false): the widening kernel serves bf16 there.
// Tested in tests/nn/test_cpu_kernels.py against the exact product, through the streamed kernel's ops.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace mlsyslab {

at::Tensor pair_pack(const at::Tensor& weight) {
  const int64_t out = weight.size(0), in = weight.size(1);
  const int64_t panels = (out + kPanel - 1) / kPanel, pairs = (in + 1) / 2;
  const at::Tensor padded = at::constant_pad_nd(weight, {0, 2 * pairs - in, 0, panels * kPanel - out});
  return padded.view({panels, kPanel, pairs, 2}).transpose(1, 2).contiguous();  // [panels, pairs, kPanel, 2]
}

template <typename X>
const uint32_t* pair_input(const X* x, int64_t rows, int64_t in, int64_t row_stride, int64_t pairs) {
  thread_local std::vector<c10::BFloat16> buffer;
  buffer.resize(rows * 2 * pairs);
  for (int64_t r = 0; r < rows; ++r) {
    c10::BFloat16* row = buffer.data() + r * 2 * pairs;
    if constexpr (std::is_same_v<X, c10::BFloat16>) {
      std::memcpy(row, x + r * row_stride, in * sizeof(X));
    } else {  // fp32 rows: rounded to bf16 first, as the pair instruction takes them
      for (int64_t i = 0; i < in; ++i) row[i] = narrow<c10::BFloat16>(x[r * row_stride + i]);
    }
    if (in % 2) row[in] = c10::BFloat16(0.f);
  }
  return reinterpret_cast<const uint32_t*>(buffer.data());
}

template const uint32_t* pair_input(const float*, int64_t, int64_t, int64_t, int64_t);
template const uint32_t* pair_input(const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t);

}  // namespace mlsyslab

#if defined(__AVX512BF16__)

namespace {

using namespace mlsyslab;

constexpr int kVectors = kPanel / 16;
constexpr int64_t kRowBlock = 8;

// sums [R, kPanel] = R rows of x (pairs of bf16, `pairs` a row) · one panel's weights.
template <int R>
void panel_rows(const uint32_t* x, int64_t pairs, const __m512bh* panel, float* sums) {
  __m512 acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[kVectors];
    for (int v = 0; v < kVectors; ++v) w[v] = panel[p * kVectors + v];
    for (int r = 0; r < R; ++r) {
      int32_t word;  // the row's inputs 2p and 2p + 1, read as one 32-bit word
      std::memcpy(&word, x + r * pairs + p, sizeof word);
      const __m512bh pair = __m512bh(_mm512_set1_epi32(word));
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pair, w[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(sums + r * kPanel + v * 16, acc[r][v]);
}

template <int... R>
void dispatch_rows(int64_t rows, const uint32_t* x, int64_t pairs, const __m512bh* panel, float* sums,
                   std::integer_sequence<int, R...>) {
  ((rows == R + 1 ? panel_rows<R + 1>(x, pairs, panel, sums) : void()), ...);
}

}  // namespace

namespace mlsyslab {

void pair_panels(const StreamedProduct<c10::BFloat16>& p, int64_t begin, int64_t end) {
  const uint32_t* x = static_cast<const uint32_t*>(p.x);
  const int64_t pairs = p.chunks;
  alignas(64) float sums[kRowBlock * kPanel];
  for (int64_t panel = begin; panel < end; ++panel) {
    const auto* weights = reinterpret_cast<const __m512bh*>(p.tiles + panel * pairs * kPanel * 2);
    const int64_t first = panel * kPanel, columns = std::min(kPanel, p.out - first);
    for (int64_t row = 0; row < p.rows; row += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, p.rows - row);
      dispatch_rows(rows, x + row * pairs, pairs, weights, sums, std::make_integer_sequence<int, kRowBlock>{});
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = (row + r) * p.out + first;
        for (int64_t c = 0; c < columns; ++c)
          p.y[at + c] = narrow<c10::BFloat16>(sums[r * kPanel + c] + (p.residual ? widen(p.residual[at + c]) : 0.f));
      }
    }
  }
}

}  // namespace mlsyslab

#endif  // __AVX512BF16__
