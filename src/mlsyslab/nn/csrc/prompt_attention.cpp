// Causal attention of whole prompts (a prefill with nothing cached before it) on AMX tiles, bf16 in and out.
//
// For each (prompt, KV head), the prompt's K and V are laid out once as TDPBF16PS B operands (16 input pairs × 16
// columns a tile: K as [key block][dim pair][16 keys], V as [key pair][dim]) for the group's query heads (grouped-query
// attention), then for each query head and each block of 16 queries:
//   S = Q·Kᵀ in fp32 on tiles, for the key blocks up to the block's last query (causal: later blocks are skipped);
//   P = exp(S/√d − the row's maximum) in vec.h's exp, the row's sum in fp32, P rounded to bf16 for the product
//       (as torch's CPU flash attention rounds it before its P·V matmul), the keys after the query set to 0;
//   O = P·V in fp32 on tiles, times 1 / the row's sum, rounded to bf16.
// The queries' rows are copied a block at a time (zero rows past the prompt) from any token stride, heads contiguous.
// A unit of work is one (prompt, query head), the heads of a group consecutive so that a thread lays out K and V once
// for the heads it runs of it (units of (prompt, KV head) left one thread idle a third of the time on one long prompt
// of SmolLM2's 3 KV heads: 0.74x torch's time at 2,048 tokens); a prompt's result does not depend on the batch. Not
// bit-equal to torch's SDPA (its exp and its order of sums differ): within a bf16 rounding of it
// (tests/nn/test_cpu_kernels.py).
//
// Why: torch's CPU flash attention computes each (prompt, head, block of 32 queries) as small oneDNN brgemm calls,
// re-packing K and V for each query head; over 16 prompts of 128 tokens with SmolLM2's 9 heads (3 KV) it ran at
// ~80 GFLOP/s on 2 threads of a Sapphire Rapids VM (3.2-3.8 ms a layer, 2026-12-02), where a TDPBF16PS loop here
// reads 2-4 TFLOP/s a thread from L1 and L2. Used by `nn.paged_attention` for a step's whole prompts where the CPU
// has AMX (`amx_ready`) and head_dim is 32, 64 or 128 (`cpu_kernels.serves_prompt_attention`), and by the training
// model's bf16 forward (`nn.training_kernels.causal_attention`), which also takes each row's log-sum-exp (`lse`) for
// its backward (csrc/causal_attention.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>

namespace {

using namespace mlsyslab;
using Bf16 = c10::BFloat16;

constexpr int64_t kBlock = 16;     // queries of a block, keys of a score tile, columns of a B tile
constexpr int64_t kTileRow = 64;   // bytes of a tile row
constexpr int64_t kPairs = 16;     // input pairs of a B tile (32 bf16 of an A tile's row)
constexpr int64_t kKeyChunk = 32;  // keys of one P·V step (an A tile's row of P)

// The tiles (`SquareTiles(7)`): 0 the A operand, 1-3 B operands, 4-6 C accumulators (three products side by side,
// independent of each other; the first version, one accumulator and the queries' tiles read in place, measured the
// same ratio to torch's time, 1.34x, in another minute of this host).

// A thread's buffers, reused across its items.
struct Buffers {
  std::vector<uint32_t> keys;    // [key blocks][head_dim / 2][kBlock]: (k[key][2p], k[key][2p + 1]) at [b][p][key % 16]
  std::vector<uint32_t> values;  // [keys / 2][head_dim]: (v[2j][c], v[2j + 1][c]) at [j][c]
  std::vector<float> scores;     // [kBlock][padded keys]
  std::vector<Bf16> weights;     // P: [kBlock][padded keys]
  std::vector<float> sums;       // O before the division: [kBlock][head_dim]
  std::vector<Bf16> queries;     // the block's queries, zero rows past the prompt: [kBlock][head_dim]
  int64_t laid_out_first = -1, laid_out_length = 0, laid_out_kv_head = -1;  // whose K and V `keys` and `values` hold
};

struct Problem {
  const Bf16 *q, *k, *v;  // [tokens, heads or kv_heads, head_dim] with these token strides (elements)
  int64_t q_stride, k_stride, v_stride;
  Bf16* out;              // [tokens, heads, head_dim], contiguous
  float* lse;             // [heads, tokens]: each row's log Σ exp(s·scale), or nullptr
  int64_t tokens, heads, kv_heads, head_dim;
  float scale;
};

// K and V of one (prompt, KV head) as B operands, keys past `length` up to `padded` zero.
void lay_out(const Problem& p, int64_t first, int64_t length, int64_t padded, int64_t kv_head, Buffers& b) {
  const int64_t d = p.head_dim;
  lay_out_column_blocks([&](int64_t key) { return p.k + (first + key) * p.k_stride + kv_head * d; }, length, padded, d,
                        b.keys);
  lay_out_row_pairs([&](int64_t key) { return p.v + (first + key) * p.v_stride + kv_head * d; }, length, padded, d,
                    b.values);
}

// Rows r of the scores: exp(s·scale − max) over keys [0, first_query + r], rounded into P, 0 beyond (to `columns`:
// the scores there, past the last key block or the query, are whatever the buffer held); the rows' sums of the fp32
// weights into `totals`, their maxima into `maxima`.
void softmax_rows(const float* scores, int64_t columns, int64_t first_query, int64_t rows, float scale, Bf16* weights,
                  float* totals, float* maxima) {
  for (int64_t r = 0; r < kBlock; ++r) {
    const float* s = scores + r * columns;
    Bf16* w = weights + r * columns;
    if (r >= rows) {  // a padding row: no query, weights 0
      std::memset(static_cast<void*>(w), 0, columns * sizeof(Bf16));
      totals[r] = 1.f;
      continue;
    }
    const int64_t seen = first_query + r + 1;  // keys [0, seen) are at or before the query
    const auto before = [seen](int64_t c) { return kLaneIndex < Ints{} + int32_t(seen - c); };
    Floats top = broadcast(std::numeric_limits<float>::lowest());  // (-ffast-math: no infinities)
    for (int64_t c = 0; c < seen; c += kLanes) {
      const Floats lanes = load_lanes(s + c) * scale;
      top = (before(c) & (lanes > top)) ? lanes : top;
    }
    const float maximum = max(top);
    maxima[r] = maximum;
    Floats total = {};
    int64_t c = 0;
    for (; c < seen; c += kLanes) {
      const Floats e = before(c) ? exp(load_lanes(s + c) * scale - maximum) : broadcast(0.f);
      total += e;
      store_lanes(w + c, e);
    }
    for (; c < columns; c += kLanes) store_lanes(w + c, broadcast(0.f));
    totals[r] = sum(total);
  }
}

// C tiles 4.. (4 + count) = the products of A rows `a` (stride a_bytes) by `count` <= 3 B operands, b(i, step) the
// i-th's at input step `step` (16 pairs), over `steps` steps; stored to c(i) at stride c_bytes.
template <typename B, typename C>
void three_products(const void* a, int64_t a_bytes, int64_t steps, int count, int64_t b_bytes, B b, C c,
                    int64_t c_bytes) {
  _tile_zero(4);
  if (count > 1) _tile_zero(5);
  if (count > 2) _tile_zero(6);
  for (int64_t step = 0; step < steps; ++step) {
    _tile_loadd(0, static_cast<const char*>(a) + step * kTileRow, a_bytes);
    _tile_loadd(1, b(0, step), b_bytes);
    _tile_dpbf16ps(4, 0, 1);
    if (count > 1) {
      _tile_loadd(2, b(1, step), b_bytes);
      _tile_dpbf16ps(5, 0, 2);
    }
    if (count > 2) {
      _tile_loadd(3, b(2, step), b_bytes);
      _tile_dpbf16ps(6, 0, 3);
    }
  }
  _tile_stored(4, c(0), c_bytes);
  if (count > 1) _tile_stored(5, c(1), c_bytes);
  if (count > 2) _tile_stored(6, c(2), c_bytes);
}

// Attention of one (prompt, query head), block by block; its KV head's K and V laid out unless the thread's previous
// head shared them (heads of a group are consecutive items).
void attend_head(const Problem& p, int64_t first, int64_t length, int64_t head, Buffers& b) {
  const int64_t d = p.head_dim, pairs = d / 2, kv_head = head / (p.heads / p.kv_heads);
  const int64_t padded = (length + kKeyChunk - 1) / kKeyChunk * kKeyChunk;
  if (b.laid_out_first != first || b.laid_out_length != length || b.laid_out_kv_head != kv_head) {
    lay_out(p, first, length, padded, kv_head, b);
    b.laid_out_first = first, b.laid_out_length = length, b.laid_out_kv_head = kv_head;
  }
  b.scores.resize(kBlock * padded);
  b.weights.resize(kBlock * padded);
  b.sums.resize(kBlock * d);
  b.queries.resize(kBlock * d);
  float totals[kBlock], maxima[kBlock];
  const int64_t q_bytes = d * int64_t(sizeof(Bf16));
  for (int64_t query = 0; query < length; query += kBlock) {
    const int64_t rows = std::min(kBlock, length - query);
    for (int64_t r = 0; r < kBlock; ++r) {  // the block's query rows side by side, in L1 for every key block
      Bf16* to = b.queries.data() + r * d;
      if (r < rows) std::memcpy(to, p.q + (first + query + r) * p.q_stride + head * d, q_bytes);
      else std::memset(static_cast<void*>(to), 0, q_bytes);
    }
    const int64_t key_blocks = (query + rows + kBlock - 1) / kBlock;  // causal: keys up to the block's last query
    const int64_t columns = (key_blocks * kBlock + kKeyChunk - 1) / kKeyChunk * kKeyChunk;
    const int64_t score_bytes = columns * int64_t(sizeof(float));
    for (int64_t block = 0; block < key_blocks; block += 3)  // S = Q·Kᵀ, three key blocks at a time
      three_products(b.queries.data(), q_bytes, pairs / kPairs, int(std::min<int64_t>(3, key_blocks - block)), kTileRow,
                     [&](int i, int64_t step) { return b.keys.data() + ((block + i) * pairs + step * kPairs) * kBlock; },
                     [&](int i) { return b.scores.data() + (block + i) * kBlock; }, score_bytes);
    softmax_rows(b.scores.data(), columns, query, rows, p.scale, b.weights.data(), totals, maxima);
    if (p.lse != nullptr)
      for (int64_t r = 0; r < rows; ++r) p.lse[head * p.tokens + first + query + r] = maxima[r] + std::log(totals[r]);
    for (int64_t c = 0; c < d; c += 3 * kBlock)  // O = P·V, three blocks of 16 dims at a time
      three_products(b.weights.data(), columns * int64_t(sizeof(Bf16)), columns / kKeyChunk,
                     int(std::min<int64_t>(3, (d - c) / kBlock)), d * int64_t(sizeof(uint32_t)),
                     [&](int i, int64_t step) { return b.values.data() + step * kPairs * d + c + i * kBlock; },
                     [&](int i) { return b.sums.data() + c + i * kBlock; }, d * int64_t(sizeof(float)));
    for (int64_t r = 0; r < rows; ++r) {
      Bf16* o = p.out + ((first + query + r) * p.heads + head) * d;
      const float inverse = 1.f / totals[r];
      for (int64_t c = 0; c < d; c += kLanes) store_lanes(o + c, load_lanes(b.sums.data() + r * d + c) * inverse);
    }
  }
}

}  // namespace

namespace mlsyslab {

void prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& starts,
                      const at::Tensor& lengths, at::Tensor& out, const std::optional<at::Tensor>& lse) {
  TORCH_CHECK(amx_ready(), "prompt_attention: needs AMX tiles (amx_ready)");
  for (const at::Tensor* t : {&q, &k, &v, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "q, k, v, out: bf16 [tokens, heads, head_dim], each token's heads contiguous");
  const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == tokens && k.size(2) == d && heads % kv_heads == 0 &&
              out.sizes() == q.sizes() && out.is_contiguous(), "k, v [tokens, kv_heads, head_dim], heads a multiple of "
              "kv_heads, out contiguous as q");
  TORCH_CHECK(d % (2 * kPairs) == 0 && d <= 128, "head_dim: 32, 64 or 128, got ", d);
  TORCH_CHECK(starts.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && starts.dim() == 1 &&
              starts.sizes() == lengths.sizes() && starts.is_contiguous() && lengths.is_contiguous(),
              "starts, lengths: int64 [prompts]");
  TORCH_CHECK(!lse || (lse->scalar_type() == at::kFloat && lse->is_contiguous() && lse->dim() == 2 &&
                       lse->size(0) == heads && lse->size(1) == tokens), "lse: contiguous fp32 [heads, tokens]");
  const int64_t prompts = starts.size(0);
  const int64_t* first = starts.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  for (int64_t i = 0; i < prompts; ++i)
    TORCH_CHECK(first[i] >= 0 && length[i] > 0 && first[i] + length[i] <= tokens, "prompt ", i, " (start ", first[i],
                ", length ", length[i], ") outside the ", tokens, " tokens");
  const Problem p{q.data_ptr<c10::BFloat16>(), k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>(), q.stride(0),
                  k.stride(0), v.stride(0), out.data_ptr<c10::BFloat16>(), lse ? lse->data_ptr<float>() : nullptr,
                  tokens, heads, kv_heads, d,
                  static_cast<float>(1.0 / std::sqrt(double(d)))};
  at::parallel_for(0, prompts * heads, 1, [&](int64_t begin, int64_t end) {
    thread_local Buffers buffers;
    buffers.laid_out_first = -1;  // the tensors are the call's: nothing laid out yet
    static const SquareTiles config(7);
    _tile_loadconfig(&config);
    for (int64_t item = begin; item < end; ++item)
      attend_head(p, first[item / heads], length[item / heads], item % heads, buffers);
    _tile_release();
  });
}

}  // namespace mlsyslab

#else

namespace mlsyslab {

void prompt_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "prompt_attention: this build has no AMX tiles");
}

}  // namespace mlsyslab

#endif

TORCH_LIBRARY_FRAGMENT(mlsyslab, m) {
  // whole prompts' causal attention on AMX tiles: q/k/v [tokens, heads, d] bf16, prompts at starts, into out (and
  // each row's log-sum-exp into lse [heads, tokens])
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, Tensor starts, Tensor lengths, Tensor(a!) out, "
        "Tensor(b!)? lse=None) -> ()",
        &mlsyslab::prompt_attention);
}
