// Decode attention straight from the paged KV cache: one new query token per sequence, K/V read in
// place through the block table (vLLM's paged_attention kernel, Kwon et al., SOSP 2023, here for CPU).
//
// For each (sequence, KV head) — an item — the `heads / kv_heads` query heads sharing that KV head (GQA)
// walk the context once, in two units shared out among threads: the blocks before the middle block boundary,
// and the rest (FlashDecoding's split of the context, Dao et al. 2023, in two parts: at batch 1 SmolLM2 has
// 3 items for 2 threads). Each unit walks its part one vector's worth of tokens at a time
// (kLanes: 16 with AVX-512, 8 with AVX2), with the online softmax (Milakov & Gimelshein 2018;
// FlashAttention's decode form): the scores q·k/√d of a chunk come out as one vector (its dot products
// reduced together by a transpose-and-add, not one horizontal sum each), the running maximum and sum
// are updated, the accumulator rescaled, and the chunk's V rows added with their weights. Every cached
// K/V row is read once from where it lives, K and V of a block together; no gathered copy of the
// context (the PyTorch path copies it, then multiplies: three passes over the bytes) and no score
// buffer. Blocks are scattered over the pool, so a thread walks its units' chunks as one list (`walk_order`) and
// each chunk asks for the next one's rows, row by row, while it reads its own. Arithmetic is fp32; a bf16 cache
// is widened in registers (bf16 is the top half of an fp32), so a bf16 model's cache holds its K/V exactly in half
// the bytes (vectors: vec.h). Measured on an AVX-512 host (bf16, 32 sequences of 170 tokens, SmolLM2's 30 layers
// of 9 query / 3 KV heads): 18.5 ms a step with a score buffer and one horizontal sum per token, 10 ms
// this way with blocks laid out as the engine allocates them, 6.6 ms if the cache fit in the caches —
// the rest is waiting on memory. On Zen 3 (AVX2), 16-token chunks in 16-float vectors took 22 µs per
// item of 228 tokens (the compiler split every vector and shuffle in two), 8-token chunks 11 µs. Rows are read
// as `load_pair`s (vec.h: a bf16 pair is widened by a shift and a mask, where GCC took six instructions per
// vector) and each K row once, in registers, for all the group's heads: one thread, 3 items of 2,000 tokens,
// 308 -> 157 µs a call in bf16 (50 -> 25 ns per token and item), 257 -> 175 µs in fp32. The two parts'
// partial results are merged by `merge_parts`; the split depends on the context length only, so a sequence's
// numbers do not depend on its batch. With AVX512_BF16, a bf16 cache's scores are pair dot products (`pair_scores`).
// The weighted V sums run up to four heads and a pair of accumulators each at a time over the chunk's tokens
// (`weighted_values`): with the chunk's rows widened once into an array of kLanes · C vectors (more than the
// registers, so spilled) a call over 32 sequences of 230 tokens with SmolLM2's 9 / 3 heads, the cache in L3, took
// 0.27-0.31 ms in bf16 and 0.27-0.28 in fp32 on Zen 4, a head at a time 0.23-0.26 and 0.22-0.25 (2026-11-25; not
// measured on AVX2); four at a time: `weighted_values`.
// Built at first use by `mlsyslab.nn.cpu_kernels`; tested against `nn.paged_attention.decode_attention`.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

using namespace mlsyslab;

// Lane i of the result: the sum of the lanes of v[i]. With 16 lanes, four rounds of pairwise shuffle-and-add, each
// halving the vectors while doubling how many of v are folded into each (45 operations, against 16
// separate horizontal sums of ~8 each).
inline Floats transpose_sum(const Floats* v) {
#if defined(__AVX512F__)
  Floats w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = __builtin_shufflevector(v[i], v[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[i], v[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    x[i] = __builtin_shufflevector(w[i], w[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(w[i], w[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    y[i] = __builtin_shufflevector(x[i], x[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(x[i], x[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(y[0], y[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(y[0], y[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
#else
  return transpose_sum8(*reinterpret_cast<const Eight(*)[8]>(v));  // AVX2: 8 lanes
#endif
}

// Always inlined: GCC 12 split a call of it into a function of prefetches alone, took that for one without effects
// and dropped the calls.
template <typename T>
__attribute__((always_inline)) inline void prefetch(const T* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < count * int64_t(sizeof(T)); i += 64) __builtin_prefetch(bytes + i);
}

// The running state of one query head: maximum score so far, sum of e^(score - maximum), and the
// e^(score - maximum)-weighted sum of V rows.
template <int C>
struct Softmax {
  float top = -std::numeric_limits<float>::max(), total = 0.f;  // finite: compiled with -ffast-math
  Floats acc[C] = {};
};

// A unit's first and last token: its part of its sequence's context.
template <typename T>
std::pair<int64_t, int64_t> unit_tokens(const PagedDecode<T>& problem, int64_t unit) {
  const int64_t s = unit / 2 / problem.kv_heads, split = problem.split(s);
  return unit % 2 ? std::make_pair(split, problem.lengths[s]) : std::make_pair(int64_t(0), split);
}

// A chunk of the context as a unit walks it: where its K/V rows start in the caches, and how many rows it has.
struct Chunk {
  int64_t offset, rows;
};

// Every chunk units [begin, end) walk, in walk order, and where each unit's chunks end: a walk across the scattered
// blocks of the units' contexts, so that each chunk can ask for the next one's rows while it is read, across block
// and unit boundaries. The one place a unit's K/V rows are located in the pool.
struct Walk {
  std::vector<Chunk> chunks;
  std::vector<int64_t> unit_ends;  // unit begin + i's chunks end at chunks[unit_ends[i]]
};

template <typename T>
Walk walk_order(const PagedDecode<T>& problem, int64_t begin, int64_t end) {
  Walk walk;
  for (int64_t unit = begin; unit < end; ++unit) {
    const int64_t s = unit / 2 / problem.kv_heads, h = unit / 2 % problem.kv_heads;
    const auto [first, last] = unit_tokens(problem, unit);
    for (int64_t start = first; start < last; start += problem.block_size) {
      // head h's copy of block b: (h · num_blocks + b)
      const int64_t block = h * problem.num_blocks + problem.tables[s * problem.width + start / problem.block_size];
      const int64_t in_block = std::min(problem.block_size, last - start);
      for (int64_t chunk = 0; chunk < in_block; chunk += kLanes)
        walk.chunks.push_back({(block * problem.block_size + chunk) * problem.head_dim,
                               std::min<int64_t>(kLanes, in_block - chunk)});
    }
    walk.unit_ends.push_back(int64_t(walk.chunks.size()));
  }
  return walk;
}

// Ask for row `row` of a chunk (nothing past its rows, or where there is no chunk).
template <int HeadDim, typename T>
__attribute__((always_inline)) inline void prefetch_row(const T* cache, const Chunk* chunk, int row) {
  if (chunk && row < chunk->rows) prefetch(cache + chunk->offset + row * HeadDim, HeadDim);
}

#if defined(__AVX512BF16__)
// With AVX512_BF16 and a bf16 cache, a chunk's scores q·k as pair dot products (`vdpbf16ps`: 32 bf16 multiply-adds an
// instruction, the K rows not widened): dots[g · kLanes + t] = the lanes of q_g·k_t, scaled. The queries are
// taken rounded to bf16 (`q`: the group's heads, HeadDim / 32 vectors each) — exact for a bf16 model, whose queries
// are bf16 — and each product is exact in fp32, so only the order of the fp32 sums differs from the widening path.
// Two key rows at a time, for independent chains. 32 sequences of 230 tokens, SmolLM2's 9 / 3 heads, the cache in
// L3 (Zen 4, 2026-11-25): 0.268-0.282 ms a call against 0.317-0.329 widening.
// `next`: the walk's next chunk, whose K rows (in `cache`) are asked for two rows at a time alongside (see `decode`).
template <int HeadDim>
void pair_scores(const c10::BFloat16* keys, int n, const __m512bh* q, int64_t group, float scale, Floats* dots,
                 const c10::BFloat16* cache, const Chunk* next) {
  constexpr int V = HeadDim / 32;  // 32 bf16 a vector
  for (int t = 0; t < kLanes; t += 2) {
    prefetch_row<HeadDim>(cache, next, t);
    prefetch_row<HeadDim>(cache, next, t + 1);
    __m512bh k[2][V];
    for (int u = 0; u < 2; ++u)
      for (int v = 0; v < V; ++v)
        k[u][v] = t + u < n ? __m512bh(_mm512_loadu_si512(keys + (t + u) * HeadDim + 32 * v))
                            : __m512bh(_mm512_setzero_si512());
    for (int64_t g = 0; g < group; ++g)
      for (int u = 0; u < 2; ++u) {
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), k[u][0], q[g * V]);
        for (int v = 1; v < V; ++v) dot = _mm512_dpbf16_ps(dot, k[u][v], q[g * V + v]);
        dots[g * kLanes + t + u] = Floats(dot) * scale;
      }
  }
}
#endif

// The chunk's weighted V rows added to the accumulators of G query heads: each pair of accumulator vectors of the G
// heads summed over the chunk's tokens in registers, each V row read and widened once per pair for all G heads, and
// the next chunk's V rows asked for alongside. Each accumulator takes its tokens in order, as with one head at a time
// (which read and widened each V row once per head): the same sums. 32 sequences of 230 tokens, SmolLM2's 9 / 3
// heads, the cache in L3 (Zen 4, 2026-11-25): in one process, alternating, 10% less time a call in bf16 and 6% in
// fp32; with the walk's prefetches (`decode`), processes alternating, bf16 0.20-0.23 against 0.22-0.25 ms a call.
constexpr int64_t kHeadsAtOnce = 4;  // 2 · 4 accumulators, a V pair and a weight: 11 of the 16 or 32 vector registers

template <int G, int HeadDim, typename T>
void weighted_values(const T* values, int n, const Floats* weights, Softmax<HeadDim / kLanes>* state, const T* cache,
                     const Chunk* next) {
  constexpr int C = HeadDim / kLanes;
  for (int c = 0; c < C; c += 2) {
    Floats even[G], odd[G];
    for (int g = 0; g < G; ++g) even[g] = state[g].acc[c], odd[g] = state[g].acc[c + 1];
    for (int t = 0; t < n; ++t) {
      if (c == 0) prefetch_row<HeadDim>(cache, next, t);
      Floats v_even, v_odd;
      load_pair(values + t * HeadDim + c * kLanes, v_even, v_odd);
      for (int g = 0; g < G; ++g) {
        const Floats weight = broadcast(weights[g][t]);
        even[g] = fused_multiply_add(weight, v_even, even[g]);
        odd[g] = fused_multiply_add(weight, v_odd, odd[g]);
      }
    }
    for (int g = 0; g < G; ++g) state[g].acc[c] = even[g], state[g].acc[c + 1] = odd[g];
  }
}

template <typename T, int HeadDim>
void decode(const PagedDecode<T>& problem, int64_t begin, int64_t end) {
  constexpr int C = HeadDim / kLanes, kPair = 2 * kLanes;  // a K/V row: C vectors, C / 2 pairs (`load_pair`)
  const T* k_cache = problem.k_cache;
  const T* v_cache = problem.v_cache;
  const int64_t group = problem.heads / problem.kv_heads;
  std::vector<Floats> q(kPairDotFor<T> ? 0 : group * C);  // the widening path's query heads, scaled, in pair order
#if defined(__AVX512BF16__)
  std::vector<__m512bh> q_bf16(group * HeadDim / 32);  // kPairDotFor<T>: the group's query heads in bf16, unscaled
#endif
  // The walk's chunks: each chunk asks for the next one's K rows while its scores are computed and for the next one's
  // V rows while its own are summed, a row at a time among its own rows' loads. (Asking for the next whole block at a
  // block's start, as before, or two, four or eight blocks ahead, 64 prefetches at once: with the blocks scattered over
  // the pool, 32 sequences of 256 tokens in bf16, every layer's cache cold, read 8.6-10.2 GB/s; this way 9.5-14.5.
  // In the engine, these prefetches off and on in one process, alternating, Zen 4, 2026-11-25: bf16 steps of 32
  // decodes 38.4 -> 34.8 ms, median of 5, faster in each round; of 16, 4 rounds of 5 faster, medians 19.7 both.)
  const Walk walk = walk_order(problem, begin, end);
  const std::vector<Chunk>& chunks = walk.chunks;
  if (!chunks.empty()) {
    prefetch(k_cache + chunks[0].offset, chunks[0].rows * HeadDim);
    prefetch(v_cache + chunks[0].offset, chunks[0].rows * HeadDim);
  }
  std::vector<Softmax<C>> state(group);
  std::vector<Floats> dots(group * kLanes);  // per query head, each chunk token's lanes of q·k
  std::vector<Floats> weights(group);  // one chunk's e^(score - maximum), per query head
  int64_t walked = 0;
  for (int64_t unit = begin; unit < end; ++unit) {
    const int64_t item = unit / 2, s = item / problem.kv_heads, h = item % problem.kv_heads;
    const float* q_row =
        problem.query + (unit % 2) * problem.part_query_offset + (s * problem.heads + h * group) * HeadDim;
    if constexpr (!kPairDotFor<T>) {  // the widening path's scaled queries (the pair path's are below)
      float* q_pairs = reinterpret_cast<float*>(q.data());
      for (int64_t i = 0; i < group * HeadDim; ++i)
        q_pairs[i / kPair * kPair + pair_slot<T>(i % kPair)] = q_row[i] * problem.scale;
    }
#if defined(__AVX512BF16__)
    if constexpr (kPairDotFor<T>) {
      auto* qb = reinterpret_cast<c10::BFloat16*>(q_bf16.data());
      for (int64_t i = 0; i < group * HeadDim; ++i) qb[i] = narrow<c10::BFloat16>(q_row[i]);
    }
#endif
    std::fill(state.begin(), state.end(), Softmax<C>{});
    for (; walked < walk.unit_ends[unit - begin]; ++walked) {
      const int n = int(chunks[walked].rows);
      const T* keys = k_cache + chunks[walked].offset;
      const T* values = v_cache + chunks[walked].offset;
      const Chunk* next = walked + 1 < int64_t(chunks.size()) ? &chunks[walked + 1] : nullptr;
      const auto in_context = kLaneIndex < Ints{} + n;
      // Each K row widened once, into registers, for every query head of the group (rows past the context
      // are zeros: the block's unused slots hold anything).
#if defined(__AVX512BF16__)
      if constexpr (kPairDotFor<T>) pair_scores<HeadDim>(keys, n, q_bf16.data(), group, problem.scale, dots.data(),
                                                         k_cache, next);
      else
#endif
      for (int t = 0; t < kLanes; ++t) {
        prefetch_row<HeadDim>(k_cache, next, t);
        Floats k[C];
        for (int c = 0; c < C; c += 2) {
          if (t < n) load_pair(keys + t * HeadDim + c * kLanes, k[c], k[c + 1]);
          else k[c] = k[c + 1] = Floats{};
        }
        for (int64_t g = 0; g < group; ++g) {
          Floats dot = k[0] * q[g * C];
          for (int c = 1; c < C; ++c) dot = fused_multiply_add(k[c], q[g * C + c], dot);
          dots[g * kLanes + t] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const Floats scores =
            in_context ? transpose_sum(&dots[g * kLanes]) : broadcast(-std::numeric_limits<float>::max());
        Softmax<C>& run = state[g];
        const float top = std::max(run.top, max(scores));
        if (top > run.top) {  // a new maximum: rescale what is summed so far (past the first chunks, rare)
          const float rescale = std::exp(run.top - top);
          run.total *= rescale;
          for (int c = 0; c < C; ++c) run.acc[c] *= rescale;
          run.top = top;
        }
        weights[g] = in_context ? exp(scores - top) : Floats{};
        run.total += sum(weights[g]);
      }
      for (int64_t g = 0; g < group; g += kHeadsAtOnce) {
        const Chunk* ask = g == 0 ? next : nullptr;  // the next chunk's V rows, once
        switch (std::min<int64_t>(kHeadsAtOnce, group - g)) {
          case 4: weighted_values<4, HeadDim>(values, n, &weights[g], &state[g], v_cache, ask); break;
          case 3: weighted_values<3, HeadDim>(values, n, &weights[g], &state[g], v_cache, ask); break;
          case 2: weighted_values<2, HeadDim>(values, n, &weights[g], &state[g], v_cache, ask); break;
          default: weighted_values<1, HeadDim>(values, n, &weights[g], &state[g], v_cache, ask);
        }
      }
    }
    float* partial = problem.partial + unit * group * (HeadDim + 2);
    for (int64_t g = 0; g < group; ++g, partial += HeadDim + 2) {
      const float* acc = reinterpret_cast<const float*>(state[g].acc);  // pair order, as V's rows were read
      for (int i = 0; i < HeadDim; ++i) partial[i] = acc[i / kPair * kPair + pair_slot<T>(i % kPair)];
      partial[HeadDim] = state[g].top;
      partial[HeadDim + 1] = state[g].total;
    }
  }
}

template <typename T>
at::Tensor attend(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& tables, const at::Tensor& lengths, double scale) {
  const int64_t sequences = query.size(0), heads = query.size(1), kv_heads = k_cache.size(0), head_dim = query.size(2);
  const int64_t group = heads / kv_heads;
  auto out = at::empty_like(query);
  auto partial = at::empty({2 * sequences * kv_heads, group, head_dim + 2}, query.options());
  const PagedDecode<T> problem{query.data_ptr<float>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                               tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), partial.data_ptr<float>(),
                               sequences, heads, kv_heads, k_cache.size(1), k_cache.size(2), tables.size(1), head_dim,
                               static_cast<float>(scale), 0};
  at::parallel_for(0, problem.units(), 1, [&](int64_t begin, int64_t end) { paged_decode_units(problem, begin, end); });
  float* merged = out.data_ptr<float>();  // item (s, h)'s heads are the query's heads h·group.. of sequence s
  for (int64_t item = 0; item < problem.items(); ++item)
    merge_parts(problem.partial, item, group, head_dim, merged + item * group * head_dim);
  return out;
}

}  // namespace

namespace mlsyslab {

template <typename T>
void paged_decode_units(const PagedDecode<T>& problem, int64_t begin, int64_t end) {
  auto kernel = problem.head_dim == 32 ? decode<T, 32> : problem.head_dim == 64 ? decode<T, 64> : decode<T, 128>;
  kernel(problem, begin, end);
}

// softmax(scores)·V over both parts from each part's (Σ e^(score - max)·v, max, Σ e^(score - max)): rescaled to the
// larger maximum (Milakov & Gimelshein 2018; FlashDecoding's reduction). A first part of no tokens is skipped. Never
// inlined: `attend` below and the fused step must run the same instructions to get the same numbers.
__attribute__((noinline)) void merge_parts(const float* partial, int64_t item, int64_t group, int64_t head_dim,
                                           float* out) {
  const int64_t stride = head_dim + 2;
  for (int64_t g = 0; g < group; ++g) {
    const float* first = partial + (2 * item * group + g) * stride;
    const float* second = partial + ((2 * item + 1) * group + g) * stride;
    float first_scale = 0.f, second_scale = 1.f;
    if (first[head_dim + 1] > 0.f) {
      const float top = std::max(first[head_dim], second[head_dim]);
      first_scale = std::exp(first[head_dim] - top);
      second_scale = std::exp(second[head_dim] - top);
    }
    const float total = first[head_dim + 1] * first_scale + second[head_dim + 1] * second_scale;
    for (int64_t i = 0; i < head_dim; ++i)
      out[g * head_dim + i] = (first[i] * first_scale + second[i] * second_scale) / total;
  }
}

template void paged_decode_units(const PagedDecode<float>&, int64_t, int64_t);
template void paged_decode_units(const PagedDecode<c10::BFloat16>&, int64_t, int64_t);

void check_paged_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t heads, const at::Tensor& tables,
                       const at::Tensor& lengths, int64_t sequences) {
  const int64_t head_dim = k_cache.size(-1);
  TORCH_CHECK(head_dim == 32 || head_dim == 64 || head_dim == 128, "head_dim: 32, 64 or 128, got ", head_dim);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type() &&
              (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
              "k_cache, v_cache: contiguous fp32 or bf16 [kv_heads, num_blocks, block_size, head_dim]");
  TORCH_CHECK(heads % k_cache.size(0) == 0, "heads (", heads, ") must be a multiple of kv_heads (", k_cache.size(0),
              ")");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous() &&
              tables.size(0) == sequences, "tables: contiguous int64 [sequences, blocks]");
  TORCH_CHECK(lengths.dim() == 1 && lengths.scalar_type() == at::kLong && lengths.is_contiguous() &&
              lengths.size(0) == sequences,
              "lengths: int64 [sequences]");
  const int64_t block_size = k_cache.size(2), num_blocks = k_cache.size(1);
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t* table = tables.data_ptr<int64_t>();
  for (int64_t s = 0; s < sequences; ++s) {  // a few hundred integers: checked here, not trusted
    TORCH_CHECK(length[s] >= 1 && length[s] <= tables.size(1) * block_size, "lengths[", s, "] = ", length[s],
                ": must be between 1 and the table's ", tables.size(1) * block_size, " tokens");
    for (int64_t b = 0; b < (length[s] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[s * tables.size(1) + b] >= 0 && table[s * tables.size(1) + b] < num_blocks,
                  "tables[", s, "][", b, "] = ", table[s * tables.size(1) + b], ": not a block of the pool");
  }
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kFloat && query.is_contiguous() && query.dim() == 3,
              "query: a contiguous fp32 CPU tensor [sequences, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == query.size(2), "k_cache: [kv_heads, num_blocks, block_size, ",
              "head_dim] with the query's head_dim (", query.size(2), ")");
  check_paged_cache(k_cache, v_cache, query.size(1), tables, lengths, query.size(0));
  if (k_cache.scalar_type() == at::kFloat) return attend<float>(query, k_cache, v_cache, tables, lengths, scale);
  return attend<c10::BFloat16>(query, k_cache, v_cache, tables, lengths, scale);
}

}  // namespace mlsyslab

TORCH_LIBRARY_FRAGMENT(mlsyslab, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lengths, "
        "float scale) -> Tensor", &mlsyslab::paged_decode_attention);
}
