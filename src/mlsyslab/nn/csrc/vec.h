// bf16 <-> fp32 conversions, vectors of floats as wide as the CPU's registers (GCC vector extensions),
// and the few operations the kernels build on them: pair loads that widen bf16, horizontal reductions, an exp.
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace mlsyslab {

// Conversions written as integer bit operations, so that the compiler vectorizes the loops around them
// (c10::BFloat16's scalar conversion, with its NaN branch, kept every loop here scalar: silu_and_mul ran
// at 2.6 ns per element). Round to nearest even, NaN kept NaN — as c10::BFloat16.
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = uint32_t(x.x) << 16;
  float f; std::memcpy(&f, &bits, sizeof f); return f;
}
inline uint16_t bf16_bits(float f) {
  uint32_t bits; std::memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0u) : uint16_t(rounded);
}
template <typename T> inline T narrow(float f);
template <> inline float narrow<float>(float f) { return f; }
template <> inline c10::BFloat16 narrow<c10::BFloat16>(float f) { return c10::BFloat16(bf16_bits(f), c10::BFloat16::from_bits()); }
template <typename T> inline float rounded(float x) { return widen(narrow<T>(x)); }

// N floats as one GCC vector (N·4 bytes: 16 fill an AVX-512 register, 8 an AVX2 one), and the bit view of
// the same lanes.
template <int N> struct Lanes {
  typedef float Floats __attribute__((vector_size(N * 4)));
  typedef uint32_t Words __attribute__((vector_size(N * 4)));
};

// The widest vector the compiler targets (-march=native): 16 floats in one AVX-512 register, or 8 in
// an AVX2 one. (16-float vectors on AVX2 are split in two registers by the compiler, and their shuffles
// went through memory: the decode attention ran at ~20 µs per (sequence, KV head) of 228 tokens on Zen 3.)
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef Lanes<kLanes>::Floats Floats;
typedef int32_t Ints __attribute__((vector_size(kLanes * 4)));
typedef Lanes<8>::Floats Eight;

#if defined(__AVX512F__)
constexpr Ints kLaneIndex = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
constexpr Ints kLaneIndex = {0, 1, 2, 3, 4, 5, 6, 7};
#endif

inline Floats broadcast(float x) { return Floats{} + x; }

// kLanes values of T as one fp32 vector, and back: bf16 rounded to nearest even, NaN kept NaN, as `narrow` rounds a
// value at a time (element-wise lane assignments compiled to one insert or extract per lane).
typedef uint16_t Halves __attribute__((vector_size(kLanes * 2)));
typedef Lanes<kLanes>::Words Words;
inline Floats from_bf16_words(Words words) {  // lanes holding bf16 bits in their low halves, as fp32
  words <<= 16;
  Floats v; std::memcpy(&v, &words, sizeof v); return v;
}
inline Floats load_lanes(const float* p) { Floats v; std::memcpy(&v, p, sizeof v); return v; }
inline Floats load_lanes(const c10::BFloat16* p) {
#if defined(__AVX512F__)  // one widening move (the generic conversion compiled to two halves and an insert)
  return Floats(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p))), 16)));
#else
  Halves halves; std::memcpy(&halves, p, sizeof halves);
  return from_bf16_words(__builtin_convertvector(halves, Words));
#endif
}
inline Words bf16_words(Floats v) {  // each lane's bf16 bits (as `bf16_bits`), in the low half of a 32-bit lane
  Words bits; std::memcpy(&bits, &v, sizeof bits);
  const Words rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? Words{} + 0x7FC0u : rounded;
}
inline void store_lanes(float* p, Floats v) { std::memcpy(p, &v, sizeof v); }
inline void store_lanes(c10::BFloat16* p, Floats v) {
#if defined(__AVX512F__)  // one narrowing move (the generic conversion compiled to a two-table permute)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(__m512i(bf16_words(v))));
#else
  const Halves halves = __builtin_convertvector(bf16_words(v), Halves);
  std::memcpy(p, &halves, sizeof halves);
#endif
}
template <typename T> inline Floats rounded_lanes(Floats v) {  // as `rounded<T>` in each lane
  if constexpr (std::is_same_v<T, float>) return v;
  else return from_bf16_words(bf16_words(v));
}

// a·b + c as one instruction. Written `c += a·b`, -ffast-math regroups a tile row's two products into
// a multiply, an FMA and an add (three floating-point operations for two FMAs' work); the intrinsic
// is not regrouped. On Zen 3, L3-resident bf16 tiles went from 45.5-46.6 to 48.9-50.4 GB/s on one thread.
inline Floats fused_multiply_add(Floats a, Floats b, Floats c) {
#if defined(__AVX512F__)
  return Floats(_mm512_fmadd_ps(__m512(a), __m512(b), __m512(c)));
#elif defined(__AVX2__) && defined(__FMA__)
  return Floats(_mm256_fmadd_ps(__m256(a), __m256(b), __m256(c)));
#else
  return c + a * b;  // other CPUs (aarch64): whatever the compiler makes of it
#endif
}

// 2·kLanes values as two fp32 vectors, "pair order": fp32 values as they are (the first kLanes, then the
// rest); bf16 values read as 32-bit words, word << 16 the even values and word & 0xFFFF0000 the odd ones
// (bf16 is the top half of an fp32): a load and two instructions for 2·kLanes values, where widening each
// half (`load`) took GCC six. A dot product whose other side is in the same order does not care.
inline void load_pair(const float* p, Floats& first, Floats& second) {
  std::memcpy(&first, p, sizeof first);
  std::memcpy(&second, p + kLanes, sizeof second);
}
inline void load_pair(const c10::BFloat16* p, Floats& even, Floats& odd) {
  Words words; std::memcpy(&words, p, sizeof words);
  const Words low = words << 16, high = words & 0xFFFF0000u;
  std::memcpy(&even, &low, sizeof even);
  std::memcpy(&odd, &high, sizeof odd);
}
// Where value i of 2·kLanes lands in `load_pair`'s two vectors (as one array of 2·kLanes floats).
template <typename T> constexpr int pair_slot(int i) {
  return std::is_same_v<T, c10::BFloat16> ? i / 2 + (i % 2) * kLanes : i;
}

// Horizontal sum and maximum by halving shuffles (a loop over the lanes compiles to dependent steps).
template <typename Op>
inline float reduce(Floats v, Op op) {
#if defined(__AVX512F__)
  v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#else
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
#endif
  return v[0];
}
inline float sum(Floats v) { return reduce(v, [](Floats a, Floats b) { return a + b; }); }
inline float max(Floats v) { return reduce(v, [](Floats a, Floats b) { return a > b ? a : b; }); }

// Lane g of the result: the sum of the lanes of v[g], by rounds of pairwise shuffle-and-add (21
// operations for 8 sums, against 8 horizontal sums of 7 dependent adds each).
inline Eight transpose_sum8(const Eight (&a)[8]) {
  Eight u[4], v[2];
  for (int i = 0; i < 4; ++i)
    u[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int i = 0; i < 2; ++i)
    v[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(v[0], v[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(v[0], v[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// e^x for each lane, in arithmetic and bit operations only: x = n·ln2 + r with |r| <= ln2/2, e^r by its
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
