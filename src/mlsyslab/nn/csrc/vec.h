// 16-float vectors (GCC vector extensions: one AVX-512 register, split by the compiler on narrower
// CPUs) and the few operations the kernels build on them: loads that widen bf16, horizontal reductions,
// and an exp.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace mlsyslab {

constexpr int kLanes = 16;
typedef float Floats __attribute__((vector_size(kLanes * 4)));
typedef int32_t Ints __attribute__((vector_size(kLanes * 4)));
typedef uint16_t Halves __attribute__((vector_size(kLanes * 2)));
typedef uint32_t Words __attribute__((vector_size(kLanes * 4)));

constexpr Ints kLaneIndex = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

inline Floats broadcast(float x) { return Floats{} + x; }

inline Floats load(const float* p) { Floats v; std::memcpy(&v, p, sizeof v); return v; }

// bf16 is the top half of an fp32: widening is a shift.
inline Floats load(const c10::BFloat16* p) {
  Halves half; std::memcpy(&half, p, sizeof half);
  Words word = __builtin_convertvector(half, Words) << 16;
  Floats v; std::memcpy(&v, &word, sizeof v); return v;
}

// Horizontal sum and maximum by halving shuffles (a loop over the lanes compiles to 15 dependent steps).
template <typename Op>
inline float reduce(Floats v, Op op) {
  v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}
inline float sum(Floats v) { return reduce(v, [](Floats a, Floats b) { return a + b; }); }
inline float max(Floats v) { return reduce(v, [](Floats a, Floats b) { return a > b ? a : b; }); }

// e^x for 16 lanes, in arithmetic and bit operations only: x = n·ln2 + r with |r| <= ln2/2, e^r by its
// degree-6 Taylor polynomial (relative error < 2e-7 on that range; expf's is ~1e-7), 2^n put into the
// exponent bits. x is clamped to [-80, 80]: e^±80 (5.5e34 and 1.8e-35) stand for overflow and
// underflow, which for softmax weights beside the maximum's 1 change nothing in fp32.
inline Floats exp(Floats x) {
  x = x < -80.f ? broadcast(-80.f) : x;
  x = x > 80.f ? broadcast(80.f) : x;
  const Ints n = __builtin_convertvector(x * 1.44269504f + (x < 0.f ? broadcast(-0.5f) : broadcast(0.5f)), Ints);
  const Floats whole = __builtin_convertvector(n, Floats);
  const Floats r = x - whole * 0.693145751953125f - whole * 1.428606765330187e-06f;  // ln2 split: exact n·ln2_hi
  Floats p = broadcast(1.f / 720.f);
  for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = p * r + c;
  Ints bits; std::memcpy(&bits, &p, sizeof bits);
  bits += n << 23;
  Floats v; std::memcpy(&v, &bits, sizeof v); return v;
}

}  // namespace mlsyslab
