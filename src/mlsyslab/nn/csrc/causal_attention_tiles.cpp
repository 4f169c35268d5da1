// The training model's causal attention backward in bf16 on AMX tiles: FlashAttention-2's (Dao 2023) five products
// per block of queries, each on TDPBF16PS tiles (bf16 pairs in, fp32 sums), the softmax's recomputation and the
// elementwise steps in fp32 vectors between them. Called by csrc/causal_attention.cpp's `causal_attention_backward`
// when asked for `tiles` (`nn.training_kernels`: bf16 where `cpu_kernels.serves_prompt_attention`, the forward's own
// AMX condition), after it has checked the tensors.
//
// For one (sequence, KV head) — a thread's unit, as in causal_attention.cpp — K and V are laid out once as B operands
// for the group's query heads: K and V as [key block][dim pair][16 keys] words (Kᵀ and Vᵀ for S = Q·Kᵀ and dP = dO·Vᵀ,
// as prompt_attention.cpp lays out K) and K again as [key pair][dim] words (for dQ = dS·K). Then for each query head
// and block of 32 queries (two tile rows; the depth of one step of the dOᵀ·P and Qᵀ·dS products):
//   S = Q·Kᵀ and dP = dO·Vᵀ on tiles, over the key blocks up to the block's last query (causal);
//   P = exp(S/√d − lse), dS = P ∘ (dP − D) with D = rowsum(dO ∘ O), in fp32; 0 past each query;
//   P and dS rounded to bf16 for the products that take them (as torch's CPU flash attention rounds P before its
//   matmuls): dS as rows, and both with their rows paired into words (B operands over the queries);
//   dQ = dS·K/√d (rounded once into dq); dVᵀ += dOᵀ·P and dKᵀ += Qᵀ·dS in fp32 tiles over the unit's keys — the
//   transposed sums, so that only the block's 32 queries and gradients are transposed, not P and dS over every key —
//   transposed and rounded once at the unit's end (dK times 1/√d).
// Padding: a block's rows past the sequence are zero queries and zero gradients (their P and dS set to 0), keys past
// the sequence zero rows of K and V up to a multiple of 32 (the depth of a dS·K step).
//
// Why: causal_attention.cpp's backward runs its products as fp32 FMA loops, bf16 widened — ~45 GFLOP/s of the causal
// work on a Sapphire Rapids thread, 7.6 ms a layer of the TP benchmark's medium bf16 rank (4 × 256 tokens, 4 query
// heads of 64, 2 KV heads), 10% of its training step (2026-12-02).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>

namespace {

using namespace mlsyslab;
using Bf16 = c10::BFloat16;

constexpr int64_t kTile = 16;       // rows of a tile; columns of a C tile; input pairs of a B tile
constexpr int64_t kStep = 32;       // bf16 inputs of one product step (an A tile's row)
constexpr int64_t kRowBytes = 64;   // bytes of a tile row
constexpr int64_t kQueries = 32;    // queries of a block

// The tiles (`SquareTiles(8)`): 0 the A operand, 1 and 2 B operands by turns, 4-7 C sums.

// Up to four 16 × 16 fp32 tiles side by side, C_i at c + 16·i floats (rows c_bytes apart), =, or += with
// `accumulate`, Σ over `steps` of A(step)·B_i(step): A's 16 rows of 32 bf16 at a + step·64 bytes (rows a_bytes
// apart), loaded once a step for the four; B_i's 16 rows of 16 bf16 pairs at b + i·b_column + step·b_step bytes (rows
// b_bytes apart). Four accumulators, so that each product's latency hides behind the others' (one at a time, the
// products ran at the speed of one TDPBF16PS's latency).
void row_products(const char* a, int64_t a_bytes, const char* b, int64_t b_column, int64_t b_step, int64_t b_bytes,
                  int count, int64_t steps, float* c, int64_t c_bytes, bool accumulate) {
  float* const c1 = c + kTile;
  float* const c2 = c + 2 * kTile;
  float* const c3 = c + 3 * kTile;
  if (accumulate) {
    _tile_loadd(4, c, c_bytes);
    if (count > 1) _tile_loadd(5, c1, c_bytes);
    if (count > 2) _tile_loadd(6, c2, c_bytes);
    if (count > 3) _tile_loadd(7, c3, c_bytes);
  } else {
    _tile_zero(4);
    if (count > 1) _tile_zero(5);
    if (count > 2) _tile_zero(6);
    if (count > 3) _tile_zero(7);
  }
  for (int64_t step = 0; step < steps; ++step) {
    const char* bs = b + step * b_step;
    _tile_loadd(0, a + step * kRowBytes, a_bytes);
    _tile_loadd(1, bs, b_bytes);
    _tile_dpbf16ps(4, 0, 1);
    if (count > 1) {
      _tile_loadd(2, bs + b_column, b_bytes);
      _tile_dpbf16ps(5, 0, 2);
    }
    if (count > 2) {
      _tile_loadd(1, bs + 2 * b_column, b_bytes);
      _tile_dpbf16ps(6, 0, 1);
    }
    if (count > 3) {
      _tile_loadd(2, bs + 3 * b_column, b_bytes);
      _tile_dpbf16ps(7, 0, 2);
    }
  }
  _tile_stored(4, c, c_bytes);
  if (count > 1) _tile_stored(5, c1, c_bytes);
  if (count > 2) _tile_stored(6, c2, c_bytes);
  if (count > 3) _tile_stored(7, c3, c_bytes);
}

using Rows = Heads<const Bf16>;

struct Problem {
  Rows q, k, v, grad, out;
  Bf16 *dq, *dk, *dv;  // contiguous [batch, tokens, heads or kv_heads, head_dim]
  const float* lse;    // [batch, heads, tokens]
  int64_t tokens, heads, kv_heads, dim;
  float scale;
};

// A thread's buffers, reused across its units.
struct Buffers {
  std::vector<uint32_t> keys_t, values_t;  // [key block][dim / 2][16]: (x[key][2p], x[key][2p + 1]) at [b][p][key % 16]
  std::vector<uint32_t> key_pairs;         // [keys / 2][dim]: (k[2j][c], k[2j + 1][c]) at [j][c]
  std::vector<float> dkeys_t, dvalues_t;   // dKᵀ and dVᵀ sums, [dim][keys]
  std::vector<Bf16> queries, grads;        // the block's rows [32][dim], zero past the sequence
  std::vector<uint32_t> row_pairs;         // a block's rows paired, [16][dim] words
  std::vector<uint32_t> queries_t, grads_t;  // the block's rows transposed, [dim][32] bf16 as [dim][16] words
  std::vector<float> scores, dscores;      // [32][columns]: S, dP
  std::vector<Bf16> dweights;              // dS rounded, [32][columns]
  std::vector<uint32_t> weight_pairs, dweight_pairs;  // P and dS rounded, rows paired: [16][columns] words
  std::vector<float> dqueries;             // [32][dim]
};

// The C tiles of rows [16·row_tiles] × columns [16·column_tiles] of A·B, A's rows a_bytes apart, B's column tile n at
// b + n·b_column bytes, four column tiles at a time.
void products(const void* a, int64_t a_bytes, int64_t row_tiles, const void* b, int64_t b_column, int64_t b_step,
              int64_t b_bytes, int64_t column_tiles, int64_t steps, float* c, int64_t c_row, bool accumulate) {
  for (int64_t m = 0; m < row_tiles; ++m)
    for (int64_t n = 0; n < column_tiles; n += 4)
      row_products(static_cast<const char*>(a) + m * kTile * a_bytes, a_bytes,
                   static_cast<const char*>(b) + n * b_column, b_column, b_step, b_bytes,
                   int(std::min<int64_t>(4, column_tiles - n)), steps, c + m * kTile * c_row + n * kTile,
                   c_row * int64_t(sizeof(float)), accumulate);
}

// Two rows' bf16 values interleaved into 32-bit words, a vector of each at a time: (even[c], odd[c]) at to[c].
void interleave(Floats even, Floats odd, uint32_t* to) {
  const Words words = bf16_words(even) | (bf16_words(odd) << 16);
  std::memcpy(to, &words, sizeof words);
}

// A block's rows [32][d] transposed, [d][32] — an A operand over the queries: each pair of rows interleaved into words
// (vectors), then those [16][d] words transposed (a word a move: half the moves of a bf16 transpose).
void transpose_block(const Bf16* rows, int64_t d, std::vector<uint32_t>& pairs, uint32_t* to) {
  pairs.resize(kQueries / 2 * d);
  for (int64_t i = 0; i < kQueries / 2; ++i)
    for (int64_t c = 0; c < d; c += kLanes)
      interleave(load_lanes(rows + 2 * i * d + c), load_lanes(rows + (2 * i + 1) * d + c), pairs.data() + i * d + c);
  for (int64_t i = 0; i < kQueries / 2; ++i)
    for (int64_t c = 0; c < d; ++c) to[c * (kQueries / 2) + i] = pairs[i * d + c];
}

void backward_unit(const Problem& p, int64_t b, int64_t g, Buffers& w) {
  const int64_t d = p.dim, pairs = d / 2, padded = (p.tokens + kStep - 1) / kStep * kStep, group = p.heads / p.kv_heads;
  const int64_t row_bytes = d * int64_t(sizeof(Bf16)), pair_bytes = d * int64_t(sizeof(uint32_t));
  // a key block's B operand: `pairs` rows of 16 words; one step's tile of it 16 of those rows
  const int64_t block_bytes = pairs * kTile * int64_t(sizeof(uint32_t)), block_step = kTile * kTile * int64_t(sizeof(uint32_t));
  const int64_t word_tile = kTile * int64_t(sizeof(uint32_t));  // a B tile's columns: 16 words
  const auto key = [&](int64_t t) { return p.k.row(b, t, g); };
  lay_out_column_blocks(key, p.tokens, padded, d, w.keys_t);
  lay_out_column_blocks([&](int64_t t) { return p.v.row(b, t, g); }, p.tokens, padded, d, w.values_t);
  lay_out_row_pairs(key, p.tokens, padded, d, w.key_pairs);
  w.dkeys_t.assign(d * padded, 0.f);
  w.dvalues_t.assign(d * padded, 0.f);
  w.queries.resize(kQueries * d);
  w.grads.resize(kQueries * d);
  w.queries_t.resize(d * kQueries / 2);
  w.grads_t.resize(d * kQueries / 2);
  w.dqueries.resize(kQueries * d);
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    for (int64_t first = 0; first < p.tokens; first += kQueries) {
      const int64_t rows = std::min(kQueries, p.tokens - first);
      const int64_t key_tiles = (first + rows + kTile - 1) / kTile, columns = (key_tiles * kTile + kStep - 1) / kStep * kStep;
      float deltas[kQueries], lse[kQueries];
      for (int64_t r = 0; r < kQueries; ++r) {
        Bf16 *q = w.queries.data() + r * d, *dout = w.grads.data() + r * d;
        if (r >= rows) {
          std::memset(static_cast<void*>(q), 0, row_bytes);
          std::memset(static_cast<void*>(dout), 0, row_bytes);
          deltas[r] = lse[r] = 0.f;
          continue;
        }
        std::memcpy(q, p.q.row(b, first + r, h), row_bytes);
        std::memcpy(dout, p.grad.row(b, first + r, h), row_bytes);
        const Bf16* o = p.out.row(b, first + r, h);
        Floats dot = {};
        for (int64_t i = 0; i < d; i += kLanes) dot = fused_multiply_add(load_lanes(dout + i), load_lanes(o + i), dot);
        deltas[r] = sum(dot);
        lse[r] = p.lse[(b * p.heads + h) * p.tokens + first + r];
      }
      transpose_block(w.queries.data(), d, w.row_pairs, w.queries_t.data());
      transpose_block(w.grads.data(), d, w.row_pairs, w.grads_t.data());
      w.scores.resize(kQueries * columns);
      w.dscores.resize(kQueries * columns);
      // S = Q·Kᵀ and dP = dO·Vᵀ, [32][16·key_tiles]
      products(w.queries.data(), row_bytes, 2, w.keys_t.data(), block_bytes, block_step, kRowBytes, key_tiles,
               d / kStep, w.scores.data(), columns, false);
      products(w.grads.data(), row_bytes, 2, w.values_t.data(), block_bytes, block_step, kRowBytes, key_tiles,
               d / kStep, w.dscores.data(), columns, false);
      // P = exp(S/√d − lse) and dS = P ∘ (dP − D), 0 past each query, two rows at a time
      w.dweights.resize(kQueries * columns);
      w.weight_pairs.resize(kQueries / 2 * columns);
      w.dweight_pairs.resize(kQueries / 2 * columns);
      for (int64_t r = 0; r < kQueries; r += 2) {
        Floats weight[2], dweight[2];
        for (int64_t c = 0; c < columns; c += kLanes) {
          for (int i = 0; i < 2; ++i) {
            const int64_t visible = r + i < rows ? first + r + i + 1 : 0;  // keys [0, visible) at or before the query
            const auto seen = kLaneIndex < Ints{} + int32_t(visible - c);
            const int64_t at = (r + i) * columns + c;
            weight[i] = seen ? exp(load_lanes(w.scores.data() + at) * p.scale - lse[r + i]) : broadcast(0.f);
            dweight[i] = seen ? weight[i] * (load_lanes(w.dscores.data() + at) - deltas[r + i]) : broadcast(0.f);
            store_lanes(w.dweights.data() + at, dweight[i]);
          }
          interleave(weight[0], weight[1], w.weight_pairs.data() + r / 2 * columns + c);
          interleave(dweight[0], dweight[1], w.dweight_pairs.data() + r / 2 * columns + c);
        }
      }
      // dQ = dS·K [32][d]; dVᵀ += dOᵀ·P and dKᵀ += Qᵀ·dS [d][16·key_tiles]
      products(w.dweights.data(), columns * int64_t(sizeof(Bf16)), 2, w.key_pairs.data(), word_tile,
               kTile * pair_bytes, pair_bytes, d / kTile, columns / kStep, w.dqueries.data(), d, false);
      const int64_t pair_row = columns * int64_t(sizeof(uint32_t));
      products(w.grads_t.data(), kRowBytes, d / kTile, w.weight_pairs.data(), word_tile, 0, pair_row, key_tiles, 1,
               w.dvalues_t.data(), padded, true);
      products(w.queries_t.data(), kRowBytes, d / kTile, w.dweight_pairs.data(), word_tile, 0, pair_row, key_tiles, 1,
               w.dkeys_t.data(), padded, true);
      for (int64_t r = 0; r < rows; ++r) {
        Bf16* dq = p.dq + ((b * p.tokens + first + r) * p.heads + h) * d;
        for (int64_t c = 0; c < d; c += kLanes) store_lanes(dq + c, load_lanes(w.dqueries.data() + r * d + c) * p.scale);
      }
    }
  }
  for (int64_t t = 0; t < p.tokens; ++t) {
    Bf16 *dk = p.dk + ((b * p.tokens + t) * p.kv_heads + g) * d, *dv = p.dv + ((b * p.tokens + t) * p.kv_heads + g) * d;
    for (int64_t c = 0; c < d; ++c) {
      dk[c] = narrow<Bf16>(w.dkeys_t[c * padded + t] * p.scale);
      dv[c] = narrow<Bf16>(w.dvalues_t[c * padded + t]);
    }
  }
}

}  // namespace

namespace mlsyslab {

void causal_attention_backward_tiles(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, at::Tensor& dq,
                                     at::Tensor& dk, at::Tensor& dv) {
  TORCH_CHECK(amx_ready(), "causal_attention_backward: tiles need AMX (amx_ready)");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.size(3) % kStep == 0,
              "causal_attention_backward: tiles take bf16 with head_dim a multiple of ", kStep, ", got ",
              q.scalar_type(), " with head_dim ", q.size(3));
  TORCH_CHECK(dq.is_contiguous() && dk.is_contiguous() && dv.is_contiguous(), "dq, dk, dv: contiguous");
  const Problem p{Rows(q), Rows(k), Rows(v), Rows(grad), Rows(out), dq.data_ptr<Bf16>(), dk.data_ptr<Bf16>(),
                  dv.data_ptr<Bf16>(), lse.data_ptr<float>(), q.size(1), q.size(2), k.size(2), q.size(3),
                  float(1.0 / std::sqrt(double(q.size(3))))};
  at::parallel_for(0, q.size(0) * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    thread_local Buffers buffers;
    static const SquareTiles config(8);
    _tile_loadconfig(&config);
    for (int64_t u = begin; u < end; ++u) backward_unit(p, u / p.kv_heads, u % p.kv_heads, buffers);
    _tile_release();
  });
}

}  // namespace mlsyslab

#else

namespace mlsyslab {

void causal_attention_backward_tiles(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&) {
  TORCH_CHECK(false, "causal_attention_backward: this build has no AMX tiles");
}

}  // namespace mlsyslab

#endif
