// The kernels one file calls from another: decode_layers.cpp runs a whole decode step through the
// per-step kernels of layer_ops.cpp, paged_decode.cpp and streamed_linear.cpp, each an ATen op here;
// streamed_decode.cpp runs the same step inside one parallel region, sharing out among its threads the
// row, item and group ranges of the range functions below (each is also inside a `torch.ops.mlsyslab`
// op, which shares the same ranges out with `at::parallel_for`).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstring>
#include <type_traits>
#include <vector>

namespace mlsyslab {

void check_float_or_bf16(const at::Tensor& t, const char* name);  // layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up);
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// One row of each (T: float or c10::BFloat16).
template <typename T> float rms_norm_row(const T* x, const T* weight, T* out, int64_t hidden, float eps);  // returns the rsqrt
template <typename T> void silu_and_mul_span(const T* gate, const T* up, T* out, int64_t width);
template <typename T> void rope_head(T* head, const T* cos, const T* sin, int64_t head_dim);

// paged_decode.cpp: decode attention over the paged cache. An item is one (sequence, KV head); its context is
// walked as two units, the blocks before the middle block boundary and the rest (which holds the new token),
// each leaving a partial softmax that `merge_parts` combines.
template <typename T>
struct PagedDecode {
  const float* query;  // [sequences, heads, head_dim], the second part's `part_query_offset` floats further
  const T* k_cache;    // [kv_heads, num_blocks, block_size, head_dim], and v_cache
  const T* v_cache;
  const int64_t* tables;   // [sequences, width]
  const int64_t* lengths;  // [sequences]
  float* partial;          // [units, heads / kv_heads, head_dim + 2]: a unit's unnormalised sum, maximum and total
  int64_t sequences, heads, kv_heads, num_blocks, block_size, width, head_dim;
  float scale;
  int64_t part_query_offset;
  int64_t items() const { return sequences * kv_heads; }
  int64_t units() const { return 2 * items(); }
  // the first token of the second part: the middle block boundary (0 for a context of one block)
  int64_t split(int64_t sequence) const { return (lengths[sequence] + block_size - 1) / block_size / 2 * block_size; }
};
template <typename T> void paged_decode_units(const PagedDecode<T>& problem, int64_t begin, int64_t end);
// out [group, head_dim]: the attention of `item`'s `group` query heads, from its two units' partials (one compiled
// function for every caller, so the numbers do not depend on who merges).
void merge_parts(const float* partial, int64_t item, int64_t group, int64_t head_dim, float* out);
void check_paged_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t heads, const at::Tensor& tables,
                       const at::Tensor& lengths, int64_t sequences);
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& lengths, double scale);

// streamed_linear.cpp: y = x·Wᵀ (+ residual) on the tiles of `stream_pack`, by groups of kGroupOutputs<T> outputs:
// the panel kernel's panels of kPanel (panel_linear.cpp) where it serves the dtype (`kPanelsFor`), else the
// widening kernel's groups of 8.
#if defined(__AVX512BF16__)
constexpr bool kPairDot = true;  // AVX512_BF16's pair instruction
#else
constexpr bool kPairDot = false;
#endif
#if defined(__AVX512F__)
constexpr bool kAvx512 = true;
#else
constexpr bool kAvx512 = false;
#endif
constexpr int64_t kPanel = 48;
// Whether data of dtype T takes the pair instruction: bf16 where the CPU has it.
template <typename T> constexpr bool kPairDotFor = kPairDot && std::is_same_v<T, c10::BFloat16>;
// Whether weights of dtype T take the panel kernel: fp32 with AVX-512, bf16 with the pair instruction.
template <typename T> constexpr bool kPanelsFor = std::is_same_v<T, float> ? kAvx512 : kPairDot;
inline bool panels_for(at::ScalarType dtype) {  // the same, at run time
  return dtype == at::kFloat ? kAvx512 : kPairDot && dtype == at::kBFloat16;
}
template <typename T> constexpr int64_t kGroupOutputs = kPanelsFor<T> ? kPanel : 8;
template <typename T> constexpr int64_t kPanelStep = 4 / sizeof(T);  // inputs of a panel step: a 32-bit word's
inline int64_t panel_step(at::ScalarType dtype) { return 4 / int64_t(c10::elementSize(dtype)); }  // the same, at run time
template <typename T>
struct StreamedProduct {
  const void* x;      // the rows in the kernel's input layout, from streamed_input
  const T* tiles;     // [groups, chunks, kGroupOutputs<T>, chunk width], from stream_pack
  const T* residual;  // [rows, out] or null
  T* y;               // [rows, out]
  int64_t rows, chunks, out;
};
// x's rows (fp32 or bf16) in the layout the kernel for T's tiles reads, in a buffer of the calling thread's.
template <typename T, typename X>
const void* streamed_input(const X* x, int64_t rows, int64_t in, int64_t row_stride, int64_t chunks);
void check_tiles(const at::Tensor& tiles, int64_t out, int64_t in, const char* name);  // tiles of a [out, in] weight
template <typename T> void streamed_groups(const StreamedProduct<T>& product, int64_t begin, int64_t end);
at::Tensor streamed_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t out,
                           const std::optional<at::Tensor>& residual);
// panel_linear.cpp: the weight [out, in] as [panels, steps, kPanel, kPanelStep] (T's inputs of each step, a
// 32-bit word); x's rows in T as [rows, steps · kPanelStep] (zero-padded) in a buffer of the calling thread's;
// and the products of panels [begin, end).
at::Tensor panel_pack(const at::Tensor& weight);
template <typename T, typename X>
const T* panel_input(const X* x, int64_t rows, int64_t in, int64_t row_stride, int64_t steps);
template <typename T> void panel_products(const StreamedProduct<T>& product, int64_t begin, int64_t end);
// amx_linear.cpp: the bf16 panel products on AMX tiles, where the CPU has them and the OS grants them (`amx_ready`);
// x's rows then come padded with zeros to whole blocks of kAmxRows (`panel_input`) in calls over kAmxRows rows.
constexpr int64_t kAmxRows = 16;
// Rows of x a call's A tiles read: a call over kAmxRows rows runs 16-row blocks, the last padded with zero rows; a call
// of kAmxRows or fewer runs one block on tiles of its own rows, and reads no padding.
inline int64_t amx_buffer_rows(int64_t rows) { return rows > kAmxRows ? (rows + kAmxRows - 1) / kAmxRows * kAmxRows : rows; }
bool amx_ready();
void amx_panel_products(const StreamedProduct<c10::BFloat16>& product, int64_t begin, int64_t end);

// A [batch, tokens, heads, head_dim] tensor's rows, any strides but the last dimension's (causal_attention.cpp,
// causal_attention_tiles.cpp).
template <typename T>
struct Heads {
  T* data;
  int64_t batch_stride, token_stride, head_stride;
  explicit Heads(const at::Tensor& t)
      : data(static_cast<T*>(t.data_ptr())), batch_stride(t.stride(0)), token_stride(t.stride(1)),
        head_stride(t.stride(2)) {}
  T* row(int64_t b, int64_t t, int64_t h) const { return data + b * batch_stride + t * token_stride + h * head_stride; }
};

// The attention kernels on AMX tiles (prompt_attention.cpp, causal_attention_tiles.cpp): palette 1 with tiles
// 0 .. tiles − 1 each 16 rows of 64 bytes, and bf16 rows [length][d] (`row(i)` a pointer to row i) laid out as TDPBF16PS
// B operands, zeros up to `padded` rows:
// - over d, the rows as columns (Kᵀ for Q·Kᵀ): [row block][d / 2][16] words, (x[i][2p], x[i][2p + 1]) at
//   [i / 16][p][i % 16];
// - over the rows, d as columns (V for P·V): [padded / 2][d] words, (x[2j][c], x[2j + 1][c]) at [j][c].
struct alignas(64) SquareTiles {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  explicit SquareTiles(int tiles) {
    for (int tile = 0; tile < tiles; ++tile) {
      bytes_per_row[tile] = 64;
      rows[tile] = 16;
    }
  }
};

template <typename Row>
void lay_out_column_blocks(Row row, int64_t length, int64_t padded, int64_t d, std::vector<uint32_t>& to) {
  const int64_t pairs = d / 2;
  to.assign(padded * pairs, 0);
  for (int64_t i = 0; i < length; ++i) {
    const c10::BFloat16* x = row(i);
    uint32_t* block = to.data() + i / 16 * pairs * 16 + i % 16;
    for (int64_t pair = 0; pair < pairs; ++pair) std::memcpy(block + pair * 16, x + 2 * pair, sizeof(uint32_t));
  }
}

template <typename Row>
void lay_out_row_pairs(Row row, int64_t length, int64_t padded, int64_t d, std::vector<uint32_t>& to) {
  to.assign(padded / 2 * d, 0);
  for (int64_t i = 0; i < length; i += 2) {
    const c10::BFloat16 *even = row(i), *odd = i + 1 < length ? row(i + 1) : nullptr;
    uint32_t* pairs = to.data() + i / 2 * d;
    for (int64_t c = 0; c < d; ++c) pairs[c] = uint32_t(even[c].x) | (odd ? uint32_t(odd[c].x) << 16 : 0u);
  }
}

// causal_attention_tiles.cpp: the training attention's bf16 backward on AMX tiles (tensors checked by the caller,
// causal_attention.cpp; dq, dk, dv contiguous).
void causal_attention_backward_tiles(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, at::Tensor& dq,
                                     at::Tensor& dk, at::Tensor& dv);

// softmax_draw.cpp: the token the uniform picks from softmax(logits / temperature) of one row, by inverse CDF.
template <typename T> int64_t draw_row(const T* logits, int64_t vocab, float temperature, double uniform);

// decode_layers.cpp: slots [tokens], each new token's slot in a cache of `cache_slots` slots per head.
void check_slots(const at::Tensor& slots, int64_t tokens, int64_t cache_slots);

}  // namespace mlsyslab
