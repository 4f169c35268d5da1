// y = x·Wᵀ (+ residual) for a few rows of x: the matrix-vector products of a decode step, at the speed
// the weight streams from memory.
//
// At decode batch sizes each weight element is used once or a few times per step, so a step costs the
// weight's bytes over the memory bandwidth (the decode roofline). `stream_pack` lays the weight out once
// so that the kernel reads it as one sequential stream per thread: tiles of 8 output rows × kChunk
// inputs (kChunk = two vectors' worth), a group of 8 rows' tiles in input order, groups in output order,
// zero-padded to whole tiles. (On the plain row-major weight, 8 rows read side by side are 8 streams,
// and rows of 576 bf16 streamed 17-21 GB/s where rows of 1,536 reached 29-30: the prefetchers lose
// each short stream's start; tiled, every shape streams as the long rows did.) Each thread takes a
// contiguous range of groups. The x rows are converted to fp32 once, into a buffer that stays in L1, in
// the order the weights come out of a tile; each weight vector is loaded and widened once per row of x.
// bf16 weights are read as 32-bit words: word << 16 is the even input's weight as an fp32 and
// word & 0xFFFF0000 the odd one's (bf16 is the top half of an fp32), two instructions per 2·kLanes
// weights. Sums are fp32, each output's chunks in order, its lanes by one fixed tree
// (`transpose_sum`): a row's result does not depend on how many rows the call has, so a sequence
// decodes the same in any batch. The residual is added in fp32 and the result rounded once (bf16:
// round to nearest even).
//
// Why our own: oneDNN packs bf16 weights only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT
// (`mkldnn_reorder_linear_weight` refuses elsewhere: AVX2 laptops, AMD Zen 3), its bf16 matrix-vector
// product streamed 17-20 GB/s of 24 on an AVX-512 host, and MKL's fp32 one 14 GB/s of 27-30 on Zen 3
// (docs/serving.md). Used by `nn.packed_linear.PackedLinear` for the row counts it picks; tested in
// tests/nn/test_cpu_kernels.py against the exact product.
//
// For fp32 weights on CPUs with AVX-512 and bf16 ones on CPUs with AVX512_BF16 (`kPanelsFor`), the tiles and the
// product are the panel kernel's instead (panel_linear.cpp: panels of 48 outputs, rows blocked in registers), which
// is ahead of this widening one there; the ops and the range functions below dispatch to it.
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using namespace mlsyslab;

constexpr int64_t kChunk = 2 * kLanes;  // inputs of one tile row: two vectors
constexpr int64_t kGroup = 8;           // output rows of one tile

template <typename T> inline T bits_as(const void* p) { T v; std::memcpy(&v, p, sizeof v); return v; }

// x rows as fp32, zero-padded to `padded` inputs, each chunk in the order `load_pair` returns the weights
// (vec.h: fp32 chunks as they are, bf16 chunks as their even inputs then their odd ones). Into a buffer each
// thread keeps (no allocation per call: a decode step makes ~120 calls). Whole chunks of an x in the weight's
// dtype are converted by `load_pair` itself, a load and two vector instructions per chunk (the scalar loop,
// one store per input to its slot, is kept for the last, partial chunk and for mixed dtypes).
template <typename T, typename X>
const float* x_in_tile_order(const X* x, int64_t rows, int64_t in, int64_t row_stride, int64_t padded) {
  thread_local std::vector<float> buffer;
  buffer.resize(rows * padded);
  for (int64_t r = 0; r < rows; ++r) {
    const X* row = x + r * row_stride;
    float* out = buffer.data() + r * padded;
    int64_t i = 0;
    if constexpr (std::is_same_v<T, X>) {  // whole chunks: a pair load puts them in its own order
      for (; i + kChunk <= in; i += kChunk) {
        Floats first, second;
        load_pair(row + i, first, second);
        std::memcpy(out + i, &first, sizeof first);
        std::memcpy(out + i + kLanes, &second, sizeof second);
      }
    }
    std::fill(out + i, out + padded, 0.f);
    for (; i < in; ++i) out[i / kChunk * kChunk + pair_slot<T>(i % kChunk)] = widen(row[i]);
  }
  return buffer.data();
}

// Lane g of the result: the sum of the lanes of acc[g] (an AVX-512 vector's halves added first).
inline Eight transpose_sum(const Floats (&acc)[kGroup]) {
  Eight a[8];
  for (int g = 0; g < 8; ++g) {
#if defined(__AVX512F__)
    a[g] = __builtin_shufflevector(acc[g], acc[g], 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(acc[g], acc[g], 8, 9, 10, 11, 12, 13, 14, 15);
#else
    a[g] = acc[g];
#endif
  }
  return transpose_sum8(a);
}

// How far ahead of a tile the kernel asks for weights (a software prefetch), and with which hint, by CPU.
// Zen 3 (AVX2): a bf16 byte costs twice the FMAs of an fp32 byte, so the out-of-order window covers half as
// many bytes in flight and the hardware prefetcher alone streamed bf16 tiles at 14.6-16.6 GB/s on one core
// where fp32 ones reached 17.7-20. With 1 KB ahead, non-temporal (read once), the batch-1 bf16 step went from
// 10.96-11.60 to 10.20-10.84 ms (in one process, alternating), 8 rows from 29.6-29.9 to 28.4-28.6 ms; for
// fp32 it cost 10% (19.4 -> 21.7 ms), so fp32 tiles take none; the T0/T1/T2 hints were 1-2% slower.
// Zen 4 (AVX-512, 2026-11-25) is the other way round. Over SmolLM2's 121 matrices at 1 row, the variants in
// turn in one process for minutes, medians in the host's slow phase (a sum reads ~36 GB/s) / its fast one
// (~64): bf16 with none 31.2 / 44.8 GB/s, non-temporal 1 KB ahead 27.4 / 36.1, 2 KB 28.5 / 37.2, with the T1
// hint (into L2) 2 KB 30.7-33.4 / 45.3-45.6 against none 30.7-31.8 / 44.2-45.2, 4 KB 28.1 / 33.7; whole batch-1
// bf16 steps, alternating processes, TPOT 8.4-11.1 ms with none against 10.1-13.4 with 1 KB non-temporal. So
// CPUs with AVX-512 prefetch none (Zen 4 measured; Intel's AVX-512 CPUs not). (fp32 tiles, 4 KB ahead into L2,
// had gone from 24.6 / 35.2 to 28.6 / 38.3 GB/s there; fp32 on AVX-512 now takes the panel kernel, which
// streams at 97-99% of a sum without software prefetches.)
#if defined(__AVX512F__)
template <typename T> constexpr int64_t kPrefetchBytes = 0;
#else
template <typename T> constexpr int64_t kPrefetchBytes = std::is_same_v<T, c10::BFloat16> ? 1024 : 0;
#endif

template <typename T>
void group_outputs(const StreamedProduct<T>& p, int64_t group) {
  const T* tiles = p.tiles + group * p.chunks * kGroup * kChunk;
  const int64_t padded = p.chunks * kChunk;
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* x = static_cast<const float*>(p.x) + r * padded;
    Floats acc[kGroup] = {};
    for (int64_t c = 0; c < p.chunks; ++c) {
      if (kPrefetchBytes<T> > 0 && r == 0) {  // later rows find the group's tiles in L1
        const char* ahead = reinterpret_cast<const char*>(tiles + c * kGroup * kChunk) + kPrefetchBytes<T>;
        for (int64_t line = 0; line < int64_t(kGroup * kChunk * sizeof(T)); line += 64)
          __builtin_prefetch(ahead + line, /*read*/ 0, /*no temporal locality: prefetchnta*/ 0);
      }
      const Floats first_x = bits_as<Floats>(x + c * kChunk);
      const Floats second_x = bits_as<Floats>(x + c * kChunk + kLanes);
      for (int g = 0; g < kGroup; ++g) {
        Floats first, second;
        load_pair(tiles + (c * kGroup + g) * kChunk, first, second);
        acc[g] = fused_multiply_add(first, first_x, acc[g]);
        acc[g] = fused_multiply_add(second, second_x, acc[g]);
      }
    }
    const Eight sums = transpose_sum(acc);
    for (int g = 0; g < kGroup && group * kGroup + g < p.out; ++g) {
      const int64_t at = r * p.out + group * kGroup + g;
      p.y[at] = narrow<T>(sums[g] + (p.residual ? widen(p.residual[at]) : 0.f));
    }
  }
}

constexpr int64_t kBytesPerThread = 1 << 16;  // weight bytes below which a second thread costs more than it saves

template <typename T>
at::Tensor run(const at::Tensor& x, const at::Tensor& tiles, int64_t out, const std::optional<at::Tensor>& residual) {
  const int64_t groups = tiles.size(0), chunks = tiles.size(1);
  TORCH_CHECK(x.stride(1) == 1, "x: rows with contiguous inputs");
  const auto input = [&](const auto* rows) { return streamed_input<T>(rows, x.size(0), x.size(1), x.stride(0), chunks); };
  const void* xs = x.scalar_type() == at::kFloat ? input(x.data_ptr<float>()) : input(x.data_ptr<c10::BFloat16>());
  at::Tensor y = at::empty({x.size(0), out}, tiles.options());
  const StreamedProduct<T> p{xs, tiles.data_ptr<T>(), residual ? residual->data_ptr<T>() : nullptr, y.data_ptr<T>(),
                     x.size(0), chunks, out};
  const int64_t grain = std::max<int64_t>(1, kBytesPerThread / (tiles.stride(0) * int64_t(sizeof(T))));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) { streamed_groups(p, begin, end); });
  return y;
}

}  // namespace

namespace mlsyslab {

template <typename T, typename X>
const void* streamed_input(const X* x, int64_t rows, int64_t in, int64_t row_stride, int64_t chunks) {
  if constexpr (kPanelsFor<T>) return panel_input<T>(x, rows, in, row_stride, chunks);
  else return x_in_tile_order<T>(x, rows, in, row_stride, chunks * kChunk);
}

template <typename T>
void streamed_groups(const StreamedProduct<T>& product, int64_t begin, int64_t end) {
  if constexpr (kPanelsFor<T>) {
    panel_products(product, begin, end);
  } else {
    for (int64_t group = begin; group < end; ++group) group_outputs(product, group);
  }
}

template const void* streamed_input<float>(const float*, int64_t, int64_t, int64_t, int64_t);
template const void* streamed_input<float>(const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t);
template const void* streamed_input<c10::BFloat16>(const float*, int64_t, int64_t, int64_t, int64_t);
template const void* streamed_input<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t);
template void streamed_groups(const StreamedProduct<float>&, int64_t, int64_t);
template void streamed_groups(const StreamedProduct<c10::BFloat16>&, int64_t, int64_t);

at::Tensor stream_pack(const at::Tensor& weight) {
  check_float_or_bf16(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "weight: [out, in], got ", weight.sizes());
  if (panels_for(weight.scalar_type())) return panel_pack(weight);
  const int64_t out = weight.size(0), in = weight.size(1);
  const int64_t groups = (out + kGroup - 1) / kGroup, chunks = (in + kChunk - 1) / kChunk;
  const at::Tensor padded = at::constant_pad_nd(weight, {0, chunks * kChunk - in, 0, groups * kGroup - out});
  return padded.view({groups, kGroup, chunks, kChunk}).transpose(1, 2).contiguous();
}

void check_tiles(const at::Tensor& tiles, int64_t out, int64_t in, const char* name) {
  check_float_or_bf16(tiles, name);
  const bool panels = panels_for(tiles.scalar_type());
  const int64_t group = panels ? kPanel : kGroup, chunk = panels ? panel_step(tiles.scalar_type()) : kChunk;
  TORCH_CHECK(tiles.dim() == 4 && tiles.size(2) == group && tiles.size(3) == chunk && tiles.is_contiguous(),
              name, ": a contiguous [groups, chunks, ", group, ", ", chunk, "] tensor from stream_pack, got ",
              tiles.sizes());
  TORCH_CHECK(out > (tiles.size(0) - 1) * group && out <= tiles.size(0) * group, name, ": out_features ", out,
              " does not fit tiles of ", tiles.size(0), " groups of ", group, " rows");
  TORCH_CHECK(in > (tiles.size(1) - 1) * chunk && in <= tiles.size(1) * chunk, name, ": ", in, " inputs do not ",
              "fit tiles of ", tiles.size(1), " chunks of ", chunk);
}

at::Tensor streamed_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t out,
                           const std::optional<at::Tensor>& residual) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2, "x: [rows, in], got ", x.sizes());
  check_tiles(tiles, out, x.size(1), "tiles");
  if (residual) {
    TORCH_CHECK(residual->scalar_type() == tiles.scalar_type() && residual->is_contiguous() && residual->dim() == 2 &&
                residual->size(0) == x.size(0) && residual->size(1) == out,
                "residual: a contiguous tensor [rows, out] = [", x.size(0), ", ", out, "] in the weight's dtype");
  }
  if (tiles.scalar_type() == at::kFloat) return run<float>(x, tiles, out, residual);
  return run<c10::BFloat16>(x, tiles, out, residual);
}

}  // namespace mlsyslab

TORCH_LIBRARY_FRAGMENT(mlsyslab, m) {
  m.def("stream_pack(Tensor weight) -> Tensor", &mlsyslab::stream_pack);
  // whether weights of the dtype take the panel kernel (panel_linear.cpp) in this build
  m.def("streamed_panels(ScalarType dtype) -> bool", [](at::ScalarType dtype) { return mlsyslab::panels_for(dtype); });
  // whether bf16 panels take AMX tiles (amx_linear.cpp) in this build and process
  m.def("streamed_amx() -> bool", [] { return mlsyslab::amx_ready(); });
  m.def("streamed_linear(Tensor x, Tensor tiles, int out_features, Tensor? residual=None) -> Tensor",
        &mlsyslab::streamed_linear);
}
