// Decode attention straight from the paged KV cache: one new query token per sequence, K/V read in
// place through the block table (vLLM's paged_attention kernel, Kwon et al., SOSP 2023, here for CPU).
//
// For each (sequence, KV head) — split across torch's OpenMP threads — the `heads / kv_heads` query
// heads sharing that KV head (GQA) take scores q·k/√d over the context, block by block, a softmax, and
// the sum of p·v. Every cached K/V row is read once from where it lives: no gathered copy of the
// context (the PyTorch path copies it, then multiplies, three passes over the bytes). The next block is
// prefetched while one is used, since blocks are scattered over the pool. Arithmetic is fp32; a bf16
// cache is widened in registers (bf16 is the top half of an fp32), so a bf16 model's cache holds its
// K/V exactly in half the bytes. Vectors of 16 floats use GCC's vector extensions (one AVX-512
// register; the compiler splits them on narrower CPUs). Built at first use by
// `mlsyslab.nn.paged_decode_kernel`; tested against `nn.paged_attention.decode_attention`.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;
typedef float Floats __attribute__((vector_size(kLanes * 4)));
typedef uint16_t Halves __attribute__((vector_size(kLanes * 2)));
typedef uint32_t Words __attribute__((vector_size(kLanes * 4)));

inline Floats load(const float* p) { Floats v; std::memcpy(&v, p, sizeof v); return v; }

inline Floats load(const c10::BFloat16* p) {
  Halves half; std::memcpy(&half, p, sizeof half);
  Words word = __builtin_convertvector(half, Words) << 16;
  Floats v; std::memcpy(&v, &word, sizeof v); return v;
}

inline float sum(Floats v) { float s = 0.f; for (int i = 0; i < kLanes; ++i) s += v[i]; return s; }

template <typename T>
inline void prefetch(const T* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < count * int64_t(sizeof(T)); i += 64) __builtin_prefetch(bytes + i);
}

// visit(token, row) for each of a sequence's first `length` cached tokens in order, `row` the token's
// HeadDim values widened to fp32; the next block is prefetched while one is read.
template <int HeadDim, typename T, typename BlockOf, typename Visit>
inline void for_each_token(const T* cache, BlockOf block, int64_t length, int64_t block_size, Visit visit) {
  constexpr int C = HeadDim / kLanes;
  for (int64_t start = 0; start < length; start += block_size) {
    const T* rows = block(cache, start);
    if (start + block_size < length) prefetch(block(cache, start + block_size), block_size * HeadDim);
    for (int64_t t = 0; t < std::min(block_size, length - start); ++t) {
      Floats row[C];
      for (int c = 0; c < C; ++c) row[c] = load(rows + t * HeadDim + c * kLanes);
      visit(start + t, row);
    }
  }
}

struct Shape {
  int64_t sequences, heads, kv_heads, num_blocks, block_size, width;
  float scale;
};

template <typename T, int HeadDim>
void decode(const float* query, const T* k_cache, const T* v_cache, const int64_t* tables, const int64_t* lengths,
            float* out, const Shape& shape) {
  constexpr int C = HeadDim / kLanes;
  const int64_t group = shape.heads / shape.kv_heads, block_size = shape.block_size;
  const int64_t block_elements = block_size * HeadDim;
  at::parallel_for(0, shape.sequences * shape.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<Floats> q(group * C), acc(group * C);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / shape.kv_heads, h = item % shape.kv_heads, length = lengths[s];
      const int64_t* table = tables + s * shape.width;
      auto block = [&](const T* cache, int64_t start) {  // head h's copy of the block holding token `start`
        return cache + (h * shape.num_blocks + table[start / block_size]) * block_elements;
      };
      const float* q_row = query + (s * shape.heads + h * group) * HeadDim;
      for (int64_t i = 0; i < group * C; ++i) q[i] = load(q_row + i * kLanes) * shape.scale;
      scores.resize(group * length);
      for_each_token<HeadDim>(k_cache, block, length, block_size, [&](int64_t t, const Floats* k) {
        for (int64_t g = 0; g < group; ++g) {
          Floats dot = q[g * C] * k[0];
          for (int c = 1; c < C; ++c) dot += q[g * C + c] * k[c];
          scores[g * length + t] = sum(dot);
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * length;
        const float top = *std::max_element(row, row + length);
        float total = 0.f;
        for (int64_t t = 0; t < length; ++t) total += (row[t] = std::exp(row[t] - top));
        for (int64_t t = 0; t < length; ++t) row[t] /= total;
      }
      std::fill(acc.begin(), acc.end(), Floats{});
      for_each_token<HeadDim>(v_cache, block, length, block_size, [&](int64_t t, const Floats* v) {
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * length + t];
          for (int c = 0; c < C; ++c) acc[g * C + c] += p * v[c];
        }
      });
      std::memcpy(out + (s * shape.heads + h * group) * HeadDim, acc.data(), group * HeadDim * sizeof(float));
    }
  });
}

template <typename T>
void dispatch(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
              const at::Tensor& lengths, at::Tensor& out, const Shape& shape) {
  const int64_t head_dim = query.size(2);
  auto kernel = head_dim == 32 ? decode<T, 32> : head_dim == 64 ? decode<T, 64> : decode<T, 128>;
  kernel(query.data_ptr<float>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), tables.data_ptr<int64_t>(),
         lengths.data_ptr<int64_t>(), out.data_ptr<float>(), shape);
}

}  // namespace

namespace mlsyslab {

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kFloat && query.is_contiguous() && query.dim() == 3,
              "query: a contiguous fp32 CPU tensor [sequences, heads, head_dim]");
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(head_dim == 32 || head_dim == 64 || head_dim == 128, "head_dim: 32, 64 or 128, got ", head_dim);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == head_dim &&
              k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type() &&
              (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
              "k_cache, v_cache: contiguous fp32 or bf16 [kv_heads, num_blocks, block_size, head_dim]");
  TORCH_CHECK(query.size(1) % k_cache.size(0) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous() &&
              tables.size(0) == query.size(0), "tables: contiguous int64 [sequences, blocks]");
  TORCH_CHECK(lengths.dim() == 1 && lengths.scalar_type() == at::kLong && lengths.is_contiguous() &&
              lengths.size(0) == query.size(0),
              "lengths: int64 [sequences]");
  const int64_t block_size = k_cache.size(2), num_blocks = k_cache.size(1);
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t* table = tables.data_ptr<int64_t>();
  for (int64_t s = 0; s < query.size(0); ++s) {  // a few hundred integers: checked here, not trusted
    TORCH_CHECK(length[s] >= 1 && length[s] <= tables.size(1) * block_size, "lengths[", s, "] = ", length[s],
                ": must be between 1 and the table's ", tables.size(1) * block_size, " tokens");
    for (int64_t b = 0; b < (length[s] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[s * tables.size(1) + b] >= 0 && table[s * tables.size(1) + b] < num_blocks,
                  "tables[", s, "][", b, "] = ", table[s * tables.size(1) + b], ": not a block of the pool");
  }
  auto out = at::empty_like(query);
  const Shape shape{query.size(0), query.size(1), k_cache.size(0), num_blocks, block_size, tables.size(1),
                    static_cast<float>(scale)};
  if (k_cache.scalar_type() == at::kFloat) dispatch<float>(query, k_cache, v_cache, tables, lengths, out, shape);
  else dispatch<c10::BFloat16>(query, k_cache, v_cache, tables, lengths, out, shape);
  return out;
}

}  // namespace mlsyslab

TORCH_LIBRARY_FRAGMENT(mlsyslab, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lengths, "
        "float scale) -> Tensor", &mlsyslab::paged_decode_attention);
}
