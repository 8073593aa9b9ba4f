// 8-lane FP32 vectors for inferd's CPU kernels (GCC vector extensions: an AVX2 register, two NEON registers), and
// 16-lane ones where the build has AVX-512, shared by paged_attention.cpp and fused_ops.cpp. Every lane goes through
// the same operations, so a value's result does not depend on its lane, its neighbours or the width; with
// -ffast-math `a += b * c` is one FMA per lane.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace inferd {

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
#if defined(__AVX512F__)
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
#endif

inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }

// Consecutive FP32 values in and out of a vector of any width V.
template <typename V>
inline V load_lanes(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename V>
inline void store_lanes(float* p, V v) { std::memcpy(p, &v, sizeof(v)); }

// Consecutive BF16 values as FP32, as many as V has lanes (a BF16 is the top half of an FP32); VU: V's uint32
// twin, VH: the uint16 vector of as many lanes.
template <typename V, typename VU, typename VH>
inline V load_bf16_lanes(const at::BFloat16* p) {
  VH h;
  std::memcpy(&h, p, sizeof(h));
  const VU u = __builtin_convertvector(h, VU) << 16;
  V v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// 8 consecutive BF16 values as FP32.
inline v8 load8(const at::BFloat16* p) {
#if defined(__AVX2__)
  const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  v8 v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#else
  return load_bf16_lanes<v8, v8u, v8u16>(p);
#endif
}

// Each lane rounded to BF16's precision as c10::BFloat16(float) rounds: to nearest, ties to even; NaN to 0x7fc0.
// V: a GCC vector of floats (8 or 16 lanes), VU: its uint32 twin.
template <typename V, typename VU>
inline V round_bf16_lanes(V v) {
  VU u;
  std::memcpy(&u, &v, sizeof(u));
  u = (u + (((u >> 16) & 1u) + 0x7fffu)) & 0xffff0000u;
  u = v != v ? VU{} + 0x7fc00000u : u;
  V r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
}
inline v8 round_bf16(v8 v) { return round_bf16_lanes<v8, v8u>(v); }

// The lanes of v stored as BF16, rounded by round_bf16_lanes; VH: the uint16 vector of as many lanes.
template <typename V, typename VU, typename VH>
inline void store_bf16_lanes(at::BFloat16* p, V v) {
  v = round_bf16_lanes<V, VU>(v);
  VU u;
  std::memcpy(&u, &v, sizeof(u));
  const VH h = __builtin_convertvector(u >> 16, VH);
  std::memcpy(p, &h, sizeof(h));
}
inline void store8(at::BFloat16* p, v8 v) { store_bf16_lanes<v8, v8u, v8u16>(p, v); }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// 16 lanes stored as BF16 with store_bf16_lanes' bits, in one VCVTNEPS2BF16 where it gives them: it rounds to nearest,
// ties to even, as c10::BFloat16 does, for every normal number, zero and infinity (checked against round_bf16_lanes
// on all 2^32 float bit patterns), but flushes denormals to zero and keeps a NaN's payload (Intel SDM,
// VCVTNEPS2BF16), so a vector with a denormal or a NaN lane (exactly the 33,554,428 patterns the mask flags) takes
// the generic rounding. 1 instruction and 3 mask tests a vector where the generic path takes about 18 (two AVX2
// halves). With the CPU's denormals-are-zero mode on (not set by these kernels) a denormal reads as zero here.
inline void store_bf16_16(at::BFloat16* p, __m512 v) {
  const __m512 a = _mm512_abs_ps(v);
  const __mmask16 odd = __mmask16(_mm512_cmp_ps_mask(a, _mm512_set1_ps(1.17549435e-38f), _CMP_NGE_UQ) &
                                  ~_mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_EQ_OQ));
  if (__builtin_expect(odd == 0, 1)) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
  } else {
    v16 w;
    std::memcpy(&w, &v, sizeof(w));
    store_bf16_lanes<v16, v16u, v16u16>(p, w);
  }
}
#endif

// e^x per lane: x = n ln 2 + r with |r| <= ln 2 / 2 (Cody & Waite's two-part ln 2), e^r by its Taylor polynomial to
// degree 7 (truncation error below 2^-24 on that interval), times 2^n built in the exponent bits (2^127 * 2 for
// n = 128, x near ln(FLT_MAX)). 0 below -86 (e^-86 = 4e-38, near the end of the normal range) and for -inf; e^0 is
// exactly 1; infinity above ln(FLT_MAX), as expf's. V: a GCC vector of floats (8 or 16 lanes), VI: its int32 twin;
// every lane goes through the same operations, so a lane's result does not depend on the width.
template <typename V, typename VI>
inline V exp_lanes(V x) {
  const V t = x * 1.44269504f;
  const VI n = __builtin_convertvector(t + (t < 0.f ? V{} - 0.5f : V{} + 0.5f), VI);
  const V nf = __builtin_convertvector(n, V);
  const V r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
  V p = V{} + 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  VI bits;
  std::memcpy(&bits, &p, sizeof(bits));
  const VI top = VI{} + 127;
  bits += (n > top ? top : n) << 23;
  V y;
  std::memcpy(&y, &bits, sizeof(y));
  y = n > top ? y * 2.f : y;
  y = x < -86.f ? V{} : y;
  return x > 88.7228394f ? V{} + INFINITY : y;
}

inline v8 exp8(v8 x) { return exp_lanes<v8, v8i>(x); }

}  // namespace inferd
