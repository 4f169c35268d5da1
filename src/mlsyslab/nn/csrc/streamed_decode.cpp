// A decode step — every decoder layer, the final norm and the logits — inside one parallel region,
// for weights in the streamed kernel's tiles (streamed_linear.cpp).
//
// decode_layers.cpp runs a step as ~20 ATen ops a layer, each matmul its own `at::parallel_for`: at
// batch 1 on SmolLM2 (121 matrices, 2 cores) that is 121 fork/joins, ~600 tensor allocations and
// dispatches, and ~1.4 ms a step between the matmuls (15% of the bf16 step; docs/serving.md). Here the
// threads start once and meet at a barrier between the step's phases, each taking the same share of
// every phase (megakernel-style persistent threads, as llama.cpp's graph compute: a thread pool that
// walks the layers together, one barrier per node):
//   x = rms_norm(h)               every thread, all rows, into its own buffer (a few µs: no barrier)
//   qkv = x·Wqkvᵀ                 output groups shared out                              | barrier
//   (+ bias, head norms),         the two units of each (sequence, KV head) item shared out
//   rope(q, k),
//   k, v -> cache
//   attention                     (paged_decode.cpp): the unit that reads the new token ropes and writes
//                                 its K/V head first; each unit ropes its own copy of the queries | barrier
//   merge the units' softmaxes    every item, by every thread into its own copy (no barrier)
//   h = h + attended·Woᵀ          output groups (residual added in the kernel)          | barrier
//   x = rms_norm(h); gate|up = x·Wguᵀ; act = silu(gate)·up
//                                 columns shared out: a thread computes the gate and up rows of its columns
//                                 and their activation (no barrier between)             | barrier
//   h = h + act·Wdᵀ               output groups                                         | barrier
// Five barriers a layer. (Seven before the merge and the activation each lost theirs: bf16 batch 1 on Zen 3,
// A/B in one process, alternating, bit-equal logits: 0.95x the step time with the vectorized x conversion of
// streamed_linear.cpp, in a noisy phase of the host; 0.99x at 8 rows.)
// and after the last layer logits = rms_norm(h[rows])·Wheadᵀ, each thread noting the largest logit of its
// columns (the step's greedy tokens, merged after a barrier: no second pass over the logits, no
// ATen op after the step). The embedding rows and the rope rows of the step's positions are copied in
// here too. A call can run several steps (multi-step decoding): each row's token, its largest logit or a draw
// from softmax(logits / T) with a uniform the caller drew, is then the next step's input, its embedding row
// copied into h between the steps, without leaving the region. Every number is computed by the same
// compiled functions, on the same row layouts, as the per-op path (the range functions of kernels.h),
// so the logits and the cache are bit-equal to decode_layers' and to the Python layers'
// (tests/nn/test_fused_decode.py). A thread keeps the same share of each matrix every step.
// Used by `nn.fused_decode` when every matrix of the step takes the streamed kernel (steps under
// `nn.packed_linear.streamed_below()` rows wherever the C++ kernels build).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <omp.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace {

using namespace mlsyslab;

// The columns of silu(gate)·up are shared out in spans of this many, whole vectors, so that each element
// is computed by the same instructions as in one call over the row. (Shared out by rows, a batch of 1 left
// one thread ~3 µs a layer alone.)
constexpr int64_t kSiluSpan = 64;

// Thread t's share [begin, end) of n items among `threads`: contiguous, sizes differing by at most one.
struct Share {
  int64_t begin, end;
  Share(int64_t n, int t, int threads) : begin(n * t / threads), end(n * (t + 1) / threads) {}
};

template <typename T>
struct Step {
  int64_t steps, layers, tokens, hidden, heads, kv_heads, head_dim, ffn, vocab, slots_per_head;
  float eps;
  const T* embedding;  // [vocab, hidden]: where the next step's rows come from
  const T* cos;  // [positions, head_dim]: a token's rope row is its position's
  const T* sin;
  const int64_t* positions;  // [tokens] of the step being run ([steps, tokens] in `run`'s template)
  const T* const* norms;  // 2 per layer
  const T* const* tiles;  // 4 per layer (q|k|v, o, gate|up, down), then the lm_head's
  const T* const* qkv_bias;  // one q|k|v row per layer (Qwen2), added as the heads are read; nullptr: none
  const T* const* qk_norms;  // per layer the q and k head norms' weights (Qwen3), before rope; nullptr: none
  const int64_t* chunks;  // of each matrix's tiles
  const T* final_norm;
  T* k_cache;  // [layers, kv_heads, slots_per_head, head_dim]
  T* v_cache;
  const int64_t* slots;  // [tokens], as positions
  const int64_t* rows;   // the rows of h whose logits are wanted
  int64_t logit_rows;
  PagedDecode<T> attention;  // pointers of layer 0's cache (moved per layer) and the step's lengths (as positions)
  // step buffers: h, q|k|v, silu(gate)·up, logits, the attention's queries (each thread has its own of the rest)
  T* h;
  T* qkv;
  T* act;
  T* logits;
  float* query;
  // per thread and logits row: the largest logit of the thread's columns and its first column
  float* best_logit;   // [threads, logit_rows]
  int64_t* best_column;  // [threads, logit_rows], -1 where the thread had no columns
  const float* temperature;  // [logit_rows]: 0 takes the largest logit, else a draw from softmax(logits / T)
  const double* uniform;     // [steps, logit_rows]: each draw's uniform
  int64_t* picked;           // [steps, logit_rows]: each step's tokens
  bool writes_first;         // rows that extend one sequence (a speculative draft) read each other's K/V

  // The inputs of step `step` of a run: its positions, slots and context lengths (a copy of pointers and sizes).
  Step at(int64_t step) const {
    Step now = *this;
    now.positions += step * tokens;
    now.slots += step * tokens;
    now.attention.lengths += step * tokens;
    return now;
  }
};

// A thread's own buffers: its rows of rms_norm(h), one item's merged attention output (fp32) and
// every item's, rounded as `attended.to(dtype)`, and gate|up for the columns of silu(gate)·up it computes.
template <typename T>
struct Scratch {
  std::vector<T> normed;
  std::vector<float> merged;
  std::vector<T> attended, gates;
  explicit Scratch(const Step<T>& s)
      : normed(std::max(s.tokens, s.logit_rows) * s.hidden), merged(s.heads / s.kv_heads * s.head_dim),
        attended(s.tokens * s.heads * s.head_dim), gates(s.tokens * 2 * s.ffn) {}
};

// act = silu(gate)·up for thread t's spans of columns, gate|up = x·Wguᵀ computed for those columns only (the gate
// rows' output groups and the up rows' of the same columns, into the thread's own buffer): no barrier between the
// product and the activation. (A group across the gate/up boundary or a span's, when ffn or the span is not a
// multiple of the group, is computed by both threads, each into its own buffer.)
template <typename T>
void gate_up_silu(const Step<T>& s, int64_t matrix, const T* x, T* gates, int t, int threads) {
  const int64_t chunks = s.chunks[matrix];
  const void* xs = streamed_input<T>(x, s.tokens, s.hidden, s.hidden, chunks);
  const Share columns((s.ffn + kSiluSpan - 1) / kSiluSpan, t, threads);
  const int64_t begin = columns.begin * kSiluSpan, end = std::min(columns.end * kSiluSpan, s.ffn);
  if (begin >= end) return;
  const StreamedProduct<T> p{xs, s.tiles[matrix], nullptr, gates, s.tokens, chunks, 2 * s.ffn};
  constexpr int64_t group = kGroupOutputs<T>;
  streamed_groups(p, begin / group, (end + group - 1) / group);
  streamed_groups(p, (s.ffn + begin) / group, (s.ffn + end + group - 1) / group);
  for (int64_t r = 0; r < s.tokens; ++r)
    silu_and_mul_span(gates + r * 2 * s.ffn + begin, gates + r * 2 * s.ffn + s.ffn + begin,
                      s.act + r * s.ffn + begin, end - begin);
}

// y [rows, out] (+)= x [rows, in] · Wᵀ, W the step's matrix `matrix`, for thread t's share of its output groups.
template <typename T>
void product(const Step<T>& s, int64_t matrix, const T* x, int64_t rows, int64_t in, int64_t out, T* y, int t,
             int threads, const T* residual = nullptr) {
  const int64_t chunks = s.chunks[matrix];
  const void* xs = streamed_input<T>(x, rows, in, in, chunks);
  const Share share((out + kGroupOutputs<T> - 1) / kGroupOutputs<T>, t, threads);
  streamed_groups(StreamedProduct<T>{xs, s.tiles[matrix], residual, y, rows, chunks, out}, share.begin, share.end);
}

// normed[i] = rms_norm(h[rows[i]]) with `weight`, for `count` rows (rows null: the first `count`).
template <typename T>
void norm_rows(const Step<T>& s, const T* weight, T* normed, int64_t count, const int64_t* rows = nullptr) {
  for (int64_t i = 0; i < count; ++i)
    rms_norm_row(s.h + (rows ? rows[i] : i) * s.hidden, weight, normed + i * s.hidden, s.hidden, s.eps);
}

// `table`'s row (cos or sin) for the step's token `token`: its position's.
template <typename T>
const T* rope_row(const Step<T>& s, const T* table, int64_t token) {
  return table + s.positions[token] * s.head_dim;
}

// `to` = `from` + the layer's q|k|v bias at `offset` in the row (or a copy where the model has none), rounded to T as
// torch's `out += bias` rounds (nn.packed_linear.FusedPackedLinear).
template <typename T>
void add_qkv_bias(const Step<T>& s, int64_t layer, int64_t offset, const T* from, T* to) {
  if (s.qkv_bias == nullptr) {
    if (to != from) std::memcpy(to, from, s.head_dim * sizeof(T));
    return;
  }
  const T* bias = s.qkv_bias[layer] + offset;
  for (int64_t i = 0; i < s.head_dim; ++i) to[i] = narrow<T>(widen(from[i]) + widen(bias[i]));
}

// The item's query heads roped and widened for the attention kernel, at `query`'s offset `part_offset` (each of
// an item's two units reads its own copy, written by the thread that runs it). Roped from a copy: the qkv row
// stays as the product left it while the other unit's thread may read it.
template <typename T>
void roped_queries(const Step<T>& s, int64_t layer, int64_t item, int64_t part_offset) {
  const int64_t token = item / s.kv_heads, kv_head = item % s.kv_heads, group = s.heads / s.kv_heads;
  const int64_t d = s.head_dim;
  const T* row = s.qkv + token * (s.heads + 2 * s.kv_heads) * d;
  T q[128];  // head_dim <= 128 (check_paged_cache)
  for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
    add_qkv_bias(s, layer, head * d, row + head * d, q);
    if (s.qk_norms != nullptr) rms_norm_row(q, s.qk_norms[2 * layer], q, d, s.eps);
    rope_head(q, rope_row(s, s.cos, token), rope_row(s, s.sin, token), d);
    float* query = s.query + part_offset + (token * s.heads + head) * d;
    for (int64_t i = 0; i < d; ++i) query[i] = widen(q[i]);
  }
}

// Rope the item's K head in place and write its K and V heads into their cache slot (its second unit, which reads
// the new token, runs on the same thread after this).
template <typename T>
void rope_and_cache(const Step<T>& s, int64_t layer, int64_t item) {
  const int64_t token = item / s.kv_heads, kv_head = item % s.kv_heads, d = s.head_dim;
  T* row = s.qkv + token * (s.heads + 2 * s.kv_heads) * d;
  const int64_t k_offset = (s.heads + kv_head) * d, v_offset = (s.heads + s.kv_heads + kv_head) * d;
  T* k = row + k_offset;
  add_qkv_bias(s, layer, k_offset, k, k);
  if (s.qk_norms != nullptr) rms_norm_row(k, s.qk_norms[2 * layer + 1], k, d, s.eps);
  rope_head(k, rope_row(s, s.cos, token), rope_row(s, s.sin, token), d);
  const int64_t slot = ((layer * s.kv_heads + kv_head) * s.slots_per_head + s.slots[token]) * d;
  std::memcpy(s.k_cache + slot, k, d * sizeof(T));
  add_qkv_bias(s, layer, v_offset, row + v_offset, s.v_cache + slot);
}

template <typename T>
void layer(const Step<T>& s, int64_t l, Scratch<T>& own, int t, int threads) {
  const int64_t d = s.head_dim, attention_width = s.heads * d, group = s.heads / s.kv_heads;
  PagedDecode<T> attention = s.attention;
  const int64_t layer_elements = s.kv_heads * s.slots_per_head * d;
  attention.k_cache += l * layer_elements;
  attention.v_cache += l * layer_elements;
  // Units, not items, are shared out: at batch 1 the 3 items of SmolLM2 left one of 2 threads idle for a third of
  // the attention (its 2 items took 811-932 µs a step, the other's 1 item 470); as 6 units each thread walks half.
  const Share units(attention.units(), t, threads);
  // No K/V asked for ahead here: beside the qkv product's stream it sped a Zen 3 thread's attention by 85 µs a step,
  // but slowed a Sapphire Rapids VM's whole step (2026-12-02, bf16, on and off alternating step by step, medians of
  // the paired ratios: 1.1% at batch 1, 3.5-3.8% at 16 rows, 1.6% at 32) — the weights' stream lost more.
  norm_rows(s, s.norms[2 * l], own.normed.data(), s.tokens);
  product(s, 4 * l, own.normed.data(), s.tokens, s.hidden, attention_width + 2 * s.kv_heads * d, s.qkv, t, threads);
#pragma omp barrier
  if (s.writes_first) {  // a row may read the K/V another row writes: every write before any read (one more barrier)
    for (int64_t unit = units.begin; unit < units.end; ++unit) {
      if (unit % 2) rope_and_cache(s, l, unit / 2);
    }
#pragma omp barrier
  }
  for (int64_t unit = units.begin; unit < units.end; ++unit) {
    if (unit % 2 && !s.writes_first) rope_and_cache(s, l, unit / 2);
    roped_queries(s, l, unit / 2, unit % 2 ? attention.part_query_offset : 0);
  }
  paged_decode_units(attention, units.begin, units.end);
#pragma omp barrier
  // Every thread merges every item's two units, into its own copy: a few hundred values a token, where a barrier
  // between sharing the merge out and the o product cost more.
  for (int64_t item = 0; item < attention.items(); ++item) {  // item (s, h): heads h·group.. of sequence s
    merge_parts(attention.partial, item, group, d, own.merged.data());
    for (int64_t i = 0; i < group * d; ++i) own.attended[item * group * d + i] = narrow<T>(own.merged[i]);
  }
  product(s, 4 * l + 1, own.attended.data(), s.tokens, attention_width, s.hidden, s.h, t, threads, s.h);
#pragma omp barrier
  norm_rows(s, s.norms[2 * l + 1], own.normed.data(), s.tokens);
  gate_up_silu(s, 4 * l + 2, own.normed.data(), own.gates.data(), t, threads);
#pragma omp barrier
  product(s, 4 * l + 3, s.act, s.tokens, s.ffn, s.hidden, s.h, t, threads, s.h);
#pragma omp barrier
}

template <typename T>
void note_largest_logits(const Step<T>& s, int t, int threads) {
  constexpr int64_t group = kGroupOutputs<T>;
  const Share groups((s.vocab + group - 1) / group, t, threads);  // the columns `product` gave this thread
  const int64_t begin = groups.begin * group, end = std::min(groups.end * group, s.vocab);
  for (int64_t r = 0; r < s.logit_rows; ++r) {
    const T* row = s.logits + r * s.vocab;
    float best = -std::numeric_limits<float>::max();
    int64_t column = -1;
    for (int64_t c = begin; c < end; ++c)
      if (column < 0 || widen(row[c]) > best) best = widen(row[c]), column = c;
    s.best_logit[t * s.logit_rows + r] = best;
    s.best_column[t * s.logit_rows + r] = column;
  }
}

// Each row's first largest logit (as torch's max(dim).indices, for finite logits), from the threads' notes: the
// threads' columns are in thread order, so a later thread's equal logit loses.
void merge_greedy(const float* best_logit, const int64_t* best_column, int64_t threads, int64_t rows, int64_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    out[r] = -1;
    float best = 0.f;
    for (int64_t t = 0; t < threads; ++t) {
      const int64_t column = best_column[t * rows + r];
      if (column >= 0 && (out[r] < 0 || best_logit[t * rows + r] > best)) {
        best = best_logit[t * rows + r];
        out[r] = column;
      }
    }
  }
}

// `s.steps` decode steps, each row's token fed back as its next input (then logit_rows are all the rows, in order).
// After a step's logits each thread picks the tokens of its share of the rows, the largest logit (temperature 0:
// from every thread's notes) or the draw of the row's uniform from softmax(logits / T) (softmax_draw.cpp's, the
// Python path's numbers), and copies their embedding rows into h for the next step: two barriers a step.
template <typename T>
void run(const Step<T>& s, int64_t max_threads) {
#pragma omp parallel num_threads(max_threads)
  {
    const int threads = omp_get_num_threads(), t = omp_get_thread_num();
    Scratch<T> own(s);
    std::vector<int64_t> greedy(s.logit_rows);
    const Share rows(s.logit_rows, t, threads);
    for (int64_t step = 0; step < s.steps; ++step) {
      const Step<T> now = s.at(step);
      for (int64_t l = 0; l < s.layers; ++l) layer(now, l, own, t, threads);
      norm_rows(now, s.final_norm, own.normed.data(), s.logit_rows, s.rows);
      product(now, 4 * s.layers, own.normed.data(), s.logit_rows, s.hidden, s.vocab, s.logits, t, threads);
      note_largest_logits(now, t, threads);
#pragma omp barrier
      merge_greedy(s.best_logit, s.best_column, threads, s.logit_rows, greedy.data());
      for (int64_t r = rows.begin; r < rows.end; ++r) {
        const float temperature = s.temperature[r];
        const int64_t token = temperature > 0.f
            ? draw_row(s.logits + r * s.vocab, s.vocab, temperature, s.uniform[step * s.logit_rows + r]) : greedy[r];
        s.picked[step * s.logit_rows + r] = token;
        if (step + 1 < s.steps) std::memcpy(s.h + r * s.hidden, s.embedding + token * s.hidden, s.hidden * sizeof(T));
      }
      if (step + 1 == s.steps) break;
#pragma omp barrier
    }
  }
}

}  // namespace

namespace mlsyslab {

// input_ids [tokens], positions, slots, lengths [steps, tokens] -> (logits [rows, vocab] of the rows `logit_rows`
// names, at the last step; each step's tokens [steps, rows]: the largest logit where temperature is 0, else the
// draw of the row's uniform from softmax(logits / temperature)). With more than one step every row is a
// logits row, in order, and each row's token is its next step's input (multi-step decoding, as vLLM's
// `--num-scheduler-steps`: the caller reserved the slots of every step).
// embedding [vocab, hidden]; cos, sin: the rope rows of every position [positions, head_dim]; norms: 2 per
// layer; tiles: 4 per layer (qkv, o, gate|up, down), from stream_pack; qkv_biases: none, or one [q|k|v] per layer;
// qk_norms: none, or the q and k head norms' weights [head_dim] of each layer; caches
// [layers, kv_heads, num_blocks, block_size, head_dim]; tables [tokens, blocks] cover the last step; one new token per
// sequence a step, unless `writes_first`: then rows may be consecutive positions of one sequence (a speculative
// draft verified in one step), each reading the K/V the earlier ones write, so every row's K/V is written before
// any row's attention reads (one step only).
std::tuple<at::Tensor, at::Tensor> streamed_decode(
                           const at::Tensor& embedding, const at::Tensor& input_ids, const at::Tensor& positions,
                           const at::Tensor& cos, const at::Tensor& sin,
                           at::TensorList norms, at::TensorList tiles, at::TensorList qkv_biases,
                           at::TensorList qk_norms,
                           const at::Tensor& final_norm,
                           const at::Tensor& head_tiles, int64_t vocab, at::Tensor k_cache, at::Tensor v_cache,
                           const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lengths,
                           const at::Tensor& logit_rows, const at::Tensor& temperature, const at::Tensor& uniform,
                           int64_t heads, int64_t ffn, double eps, bool writes_first) {
  check_float_or_bf16(embedding, "embedding");
  const auto dtype = embedding.scalar_type();
  TORCH_CHECK(embedding.dim() == 2 && embedding.is_contiguous() && embedding.size(0) >= vocab,
              "embedding: contiguous [vocab, hidden]");
  const int64_t hidden = embedding.size(1);
  TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong && input_ids.is_contiguous(),
              "input_ids: contiguous int64 [tokens]");
  const int64_t tokens = input_ids.size(0);
  for (const auto& [tensor, name] : {std::pair{&positions, "positions"}, {&slots, "slots"}, {&lengths, "lengths"}}) {
    TORCH_CHECK(tensor->dim() == 2 && tensor->size(0) >= 1 && tensor->size(1) == tokens &&
                tensor->scalar_type() == at::kLong && tensor->is_contiguous(), name,
                ": contiguous int64 [steps, tokens], steps >= 1, as positions");
    TORCH_CHECK(tensor->size(0) == positions.size(0), name, ": as many steps as positions");
  }
  const int64_t steps = positions.size(0);
  for (int64_t i = 0; i < tokens; ++i) {
    const int64_t id = input_ids.data_ptr<int64_t>()[i];
    TORCH_CHECK(id >= 0 && id < embedding.size(0), "input_ids[", i, "] = ", id, ": not a token of the embedding (0..",
                embedding.size(0) - 1, ")");
  }
  for (int64_t i = 0; i < steps * tokens; ++i) {
    const int64_t position = positions.data_ptr<int64_t>()[i];
    TORCH_CHECK(position >= 0 && position < cos.size(0), "positions[", i / tokens, "][", i % tokens, "] = ", position,
                ": outside the rope tables' ", cos.size(0), " positions");
  }
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && k_cache.scalar_type() == dtype,
              "k_cache, v_cache: [layers, kv_heads, num_blocks, block_size, head_dim] in the embedding's dtype");
  const int64_t layers = k_cache.size(0), kv_heads = k_cache.size(1), head_dim = k_cache.size(4);
  for (int64_t step = 0; step < steps; ++step) {
    check_paged_cache(k_cache[0], v_cache[0], heads, tables, lengths[step], tokens);
    check_slots(slots[step], tokens, k_cache.size(2) * k_cache.size(3));
  }
  TORCH_CHECK(int64_t(norms.size()) == 2 * layers && int64_t(tiles.size()) == 4 * layers,
              "norms: 2 per layer, tiles: 4 per layer, for ", layers, " layers");
  for (const at::Tensor& norm : norms) {
    TORCH_CHECK(norm.dim() == 1 && norm.size(0) == hidden && norm.is_contiguous() && norm.scalar_type() == dtype,
                "norms: contiguous [hidden] in the embedding's dtype");
  }
  TORCH_CHECK(final_norm.dim() == 1 && final_norm.size(0) == hidden && final_norm.is_contiguous() &&
              final_norm.scalar_type() == dtype, "final_norm: contiguous [hidden] in the embedding's dtype");
  for (const at::Tensor& table : {cos, sin}) {
    TORCH_CHECK(table.dim() == 2 && table.sizes() == cos.sizes() && table.size(1) == head_dim && table.is_contiguous() &&
                table.scalar_type() == dtype, "cos, sin: contiguous [positions, head_dim] in the embedding's dtype");
  }
  const int64_t shapes[4][2] = {{(heads + 2 * kv_heads) * head_dim, hidden}, {hidden, heads * head_dim},
                                {2 * ffn, hidden}, {hidden, ffn}};
  for (int64_t i = 0; i < 4 * layers; ++i) {
    check_tiles(tiles[i], shapes[i % 4][0], shapes[i % 4][1], "tiles");
    TORCH_CHECK(tiles[i].scalar_type() == dtype, "tiles: in the embedding's dtype");
  }
  TORCH_CHECK(qkv_biases.empty() || int64_t(qkv_biases.size()) == layers, "qkv_biases: none, or one per layer for ",
              layers, " layers");
  for (const at::Tensor& bias : qkv_biases) {
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == shapes[0][0] && bias.is_contiguous() && bias.scalar_type() == dtype,
                "qkv_biases: contiguous [", shapes[0][0], "] (q|k|v) in the embedding's dtype");
  }
  TORCH_CHECK(qk_norms.empty() || int64_t(qk_norms.size()) == 2 * layers, "qk_norms: none, or 2 per layer for ",
              layers, " layers");
  for (const at::Tensor& norm : qk_norms) {
    TORCH_CHECK(norm.dim() == 1 && norm.size(0) == head_dim && norm.is_contiguous() && norm.scalar_type() == dtype,
                "qk_norms: contiguous [head_dim] in the embedding's dtype");
  }
  check_tiles(head_tiles, vocab, hidden, "head_tiles");
  TORCH_CHECK(head_tiles.scalar_type() == dtype, "head_tiles: in the embedding's dtype");
  TORCH_CHECK(logit_rows.dim() == 1 && logit_rows.scalar_type() == at::kLong && logit_rows.is_contiguous(),
              "logit_rows: contiguous int64 [rows]");
  for (int64_t i = 0; i < logit_rows.size(0); ++i) {
    const int64_t row = logit_rows.data_ptr<int64_t>()[i];
    TORCH_CHECK(row >= 0 && row < tokens, "logit_rows[", i, "] = ", row, ": not a row of hidden (0..", tokens - 1, ")");
    TORCH_CHECK(steps == 1 || row == i, "logit_rows[", i, "] = ", row, ": a run of ", steps,
                " steps feeds every row's token back, so logit_rows must be 0..tokens-1");
  }
  TORCH_CHECK(!writes_first || steps == 1, "writes_first: rows that read each other's K/V run one step");
  TORCH_CHECK(steps == 1 || logit_rows.size(0) == tokens, "logit_rows: every row (0..", tokens - 1, ") in a run of ",
              steps, " steps");
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == logit_rows.size(0) &&
              temperature.scalar_type() == at::kFloat && temperature.is_contiguous(),
              "temperature: contiguous fp32 [rows], one per logit row");
  TORCH_CHECK(uniform.dim() == 2 && uniform.size(0) == steps && uniform.size(1) == logit_rows.size(0) &&
              uniform.scalar_type() == at::kDouble && uniform.is_contiguous(),
              "uniform: contiguous float64 [steps, rows], one per logit row and step");
  for (int64_t r = 0; r < temperature.size(0); ++r) {
    const float value = temperature.data_ptr<float>()[r];
    TORCH_CHECK(value >= 0.f && std::isfinite(value), "temperature[", r, "] = ", value, ": must be >= 0 (0: greedy)");
  }
  for (int64_t i = 0; i < uniform.numel(); ++i) {
    const double value = uniform.data_ptr<double>()[i];
    TORCH_CHECK(value >= 0.0 && value < 1.0, "uniform[", i / uniform.size(1), "][", i % uniform.size(1), "] = ", value,
                ": must be in [0, 1)");
  }

  const auto options = embedding.options();
  at::Tensor h = embedding.index_select(0, input_ids), qkv = at::empty({tokens, shapes[0][0]}, options);
  at::Tensor act = at::empty({tokens, ffn}, options), logits = at::empty({logit_rows.size(0), vocab}, options);
  at::Tensor query = at::empty({2, tokens, heads, head_dim}, options.dtype(at::kFloat));  // per part of the context
  at::Tensor partial = at::empty({2 * tokens * kv_heads, heads / kv_heads, head_dim + 2}, query.options());
  const int64_t max_threads = at::get_num_threads(), rows = logit_rows.size(0);
  std::vector<float> best_logit(max_threads * rows);
  std::vector<int64_t> best_column(max_threads * rows, -1);
  at::Tensor picked = at::empty({steps, rows}, logit_rows.options());
  const auto fill = [&](auto tag) {
    using T = decltype(tag);
    std::vector<const T*> norm_weights, tile_weights, biases, head_norms;
    std::vector<int64_t> chunks;
    for (const at::Tensor& norm : norms) norm_weights.push_back(norm.data_ptr<T>());
    for (const at::Tensor& norm : qk_norms) head_norms.push_back(norm.data_ptr<T>());
    for (const at::Tensor& bias : qkv_biases) biases.push_back(bias.data_ptr<T>());
    for (int64_t i = 0; i <= 4 * layers; ++i) {
      const at::Tensor& tile = i < 4 * layers ? tiles[i] : head_tiles;
      tile_weights.push_back(tile.data_ptr<T>());
      chunks.push_back(tile.size(1));
    }
    const Step<T> s{steps, layers, tokens, hidden, heads, kv_heads, head_dim, ffn, vocab, k_cache.size(2) * k_cache.size(3),
              float(eps), embedding.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), positions.data_ptr<int64_t>(),
              norm_weights.data(), tile_weights.data(), biases.empty() ? nullptr : biases.data(),
              head_norms.empty() ? nullptr : head_norms.data(), chunks.data(),
              final_norm.data_ptr<T>(),
              k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), slots.data_ptr<int64_t>(),
              logit_rows.data_ptr<int64_t>(), logit_rows.size(0),
              PagedDecode<T>{query.data_ptr<float>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                             tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), partial.data_ptr<float>(),
                             tokens, heads, kv_heads, k_cache.size(2), k_cache.size(3), tables.size(1), head_dim,
                             float(1.0 / std::sqrt(double(head_dim))), tokens * heads * head_dim},
              h.data_ptr<T>(), qkv.data_ptr<T>(), act.data_ptr<T>(), logits.data_ptr<T>(), query.data_ptr<float>(),
              best_logit.data(), best_column.data(), temperature.data_ptr<float>(), uniform.data_ptr<double>(),
              picked.data_ptr<int64_t>(), writes_first};
    run(s, max_threads);
  };
  if (dtype == at::kFloat) fill(float{});
  else fill(c10::BFloat16{});
  return {logits, picked};
}

}  // namespace mlsyslab

TORCH_LIBRARY_FRAGMENT(mlsyslab, m) {
  m.def("streamed_decode(Tensor embedding, Tensor input_ids, Tensor positions, Tensor cos, Tensor sin, Tensor[] norms, "
        "Tensor[] tiles, Tensor[] qkv_biases, Tensor[] qk_norms, Tensor final_norm, Tensor head_tiles, int vocab, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots, Tensor tables, Tensor lengths, Tensor logit_rows, Tensor temperature, Tensor uniform, int heads, "
        "int ffn, float eps, bool writes_first=False) -> "
        "(Tensor, Tensor)", &mlsyslab::streamed_decode);
}
