// Vector helpers shared by genjax's CPU kernels: Vec holds kLanes floats (AVX-512: 16, AVX2
// with FMA: 8, else a portable array of 8), with loads, stores, fused multiply-adds, and widening
// loads of bfloat16 (as uint16_t bits) and int8 values to float32 (exact).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace genjax_kernels {

constexpr int64_t kLineBytes = 64;  // a cache line

// Asks for the cache line holding `p` ahead of its use (never faults, even past an array's end).
inline void Prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// Prefetch for each cache line of [p, p + bytes).
inline void PrefetchBytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += kLineBytes) Prefetch(c + i);
}

// One value widened to float32, as Widen does a vector of them.
inline float WidenOne(float w) { return w; }
inline float WidenOne(int8_t w) { return w; }
inline float WidenOne(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Load(const float* a) { return _mm512_loadu_ps(a); }
inline void Store(float* a, Vec v) { _mm512_storeu_ps(a, v); }
inline Vec Splat(float a) { return _mm512_set1_ps(a); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec Widen(const float* w) { return _mm512_loadu_ps(w); }
inline Vec Widen(const uint16_t* w) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}
inline Vec Widen(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
inline float Sum(Vec v) {
  const __m256 eight = _mm256_add_ps(
      _mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Load(const float* a) { return _mm256_loadu_ps(a); }
inline void Store(float* a, Vec v) { _mm256_storeu_ps(a, v); }
inline Vec Splat(float a) { return _mm256_set1_ps(a); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec Widen(const float* w) { return _mm256_loadu_ps(w); }
inline Vec Widen(const uint16_t* w) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
inline Vec Widen(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
inline float Sum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
// Portable: the same partial sums, one float at a time.
struct Vec {
  float v[8];
};
constexpr int kLanes = 8;
inline Vec Zero() { return Vec{}; }
inline Vec Load(const float* a) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = a[i];
  return r;
}
inline void Store(float* a, Vec v) {
  for (int i = 0; i < kLanes; ++i) a[i] = v.v[i];
}
inline Vec Splat(float a) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = a;
  return r;
}
inline Vec Fma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < kLanes; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return c;
}
template <typename W>
inline Vec Widen(const W* w) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = WidenOne(w[i]);
  return r;
}
inline float Sum(Vec v) {
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) v.v[i] += v.v[i + width];
  }
  return v.v[0];
}
#endif

}  // namespace genjax_kernels
