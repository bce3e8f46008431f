// Pieces shared by q4_matmul.cc's products: the problem description, float16 conversion, and
// small vector helpers. Included by q4_matmul.cc only (one translation unit).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GENJAX_Q4_AVX2 1
#endif

namespace genjax_q4 {

constexpr int64_t kBlock = 32;
constexpr int64_t kMaxBlocks = 1024;  // inputs up to 32768 (checked at the call)
constexpr int64_t kLanes = 8;         // floats (or int32) per 256-bit vector

inline float HalfToFloat(uint16_t h) {
#ifdef GENJAX_Q4_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exponent = 127 - 15 + 1;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        --exponent;
      }
      bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// One product y[R, O] = x[R, I] @ dequantize(w)[O, I].T and the activations prepared for it.
struct Problem {
  const float* x;           // [R, I]
  const uint8_t* packed;    // [O, I/2]
  const uint16_t* scale;    // [O, G]
  const uint16_t* minimum;  // [O, G]
  // Rounded products: activations rounded to int8 per block, row-major ...
  const int8_t* xq;         // [R, I]
  const float* x_scale;     // [R, G] their scales
  const float* block_sums;  // [R, G] sums of the unrounded activations
  // ... and the same, interleaved for the many-row kernel (RoundedGemm): for each group of 8
  // rows and block, 8 vectors whose lane l holds 4 consecutive int8 of row l.
  const int8_t* xq_groups;          // [R/8, G, 8, 8 rows, 4]
  const float* x_scale_groups;      // [R/8, G, 8 rows]
  const float* block_sums_groups;   // [R/8, G, 8 rows]
  float* y;                         // [R, O]
  int64_t rows, outputs, inputs, blocks;
  int64_t chunk_rows;  // weight rows per unit of work
  bool exact;          // float activations
};

// The arithmetic of one output of a rounded product, which every kernel below performs in this
// order whatever its tiling (so a row's result does not depend on its batch neighbours):
//   acc  = fma(D[g], scale[o, g] * dx[r, g], acc)        over g = 0, 1, ..., G-1 from 0
//   accm = fma(minimum[o, g], block_sums[r, g], accm)    likewise
//   y[r, o] = acc + accm
// with D[g] the exact int32 dot of block g's nibbles with the row's int8 activations. The plain
// C++ form, used by the portable build and for leftover rows of the vector kernels.
inline float RoundedOutput(const Problem& p, int64_t r, int64_t o) {
  const uint8_t* w = p.packed + o * (p.inputs / 2);
  const uint16_t* sc = p.scale + o * p.blocks;
  const uint16_t* mn = p.minimum + o * p.blocks;
  const int8_t* v = p.xq + r * p.inputs;
  const float* dx = p.x_scale + r * p.blocks;
  const float* sums = p.block_sums + r * p.blocks;
  float acc = 0, accm = 0;
  for (int64_t g = 0; g < p.blocks; ++g) {
    const uint8_t* b = w + g * 16;
    const int8_t* vb = v + g * kBlock;
    int32_t dot = 0;
    for (int k = 0; k < 16; ++k) dot += (b[k] & 0x0f) * vb[k] + (b[k] >> 4) * vb[k + 16];
    const float combined = HalfToFloat(sc[g]) * dx[g];
    acc = std::fma(static_cast<float>(dot), combined, acc);
    accm = std::fma(HalfToFloat(mn[g]), sums[g], accm);
  }
  return acc + accm;
}

// The weight of input k of row o in an exact product: fma(q, scale, minimum) in float32.
inline float ExactWeight(const Problem& p, int64_t o, int64_t k) {
  const uint8_t byte = p.packed[o * (p.inputs / 2) + (k / kBlock) * 16 + (k % 16)];
  const int q = (k % kBlock) < 16 ? (byte & 0x0f) : (byte >> 4);
  const int64_t g = o * p.blocks + k / kBlock;
  return std::fma(static_cast<float>(q), HalfToFloat(p.scale[g]), HalfToFloat(p.minimum[g]));
}

// Partial sums per output of an exact product: one per lane of the widest float vector.
#if defined(GENJAX_Q4_AVX2) && defined(__AVX512F__)
constexpr int kExactLanes = 16;
#else
constexpr int kExactLanes = 8;
#endif

// One output of an exact product: partial j = fma(x[r, k], w[o, k], partial j) over the inputs
// k = j, j + kExactLanes, ... in order from 0; then partial j += partial j + h for halves h =
// kExactLanes / 2, ..., 1, which leaves the total in partial 0. The vector kernel keeps the
// partials in the lanes of one register, so each output costs one FMA per kExactLanes inputs.
inline float ExactOutput(const Problem& p, int64_t r, int64_t o) {
  float partial[kExactLanes] = {};
  for (int64_t k = 0; k < p.inputs; ++k) {
    float& sum = partial[k % kExactLanes];
    sum = std::fma(p.x[r * p.inputs + k], ExactWeight(p, o, k), sum);
  }
  for (int half = kExactLanes / 2; half >= 1; half /= 2) {
    for (int j = 0; j < half; ++j) partial[j] += partial[j + half];
  }
  return partial[0];
}

#ifdef GENJAX_Q4_AVX2
// The 32 values of a block in element order, one byte each: the 16 low nibbles of its bytes in
// the lower half, the 16 high ones in the upper half (one variable shift splits both).
inline __m256i UnpackBlock(const uint8_t* bytes16) {
  const __m256i shifts = _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0);
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(bytes16)));
  return _mm256_and_si256(_mm256_srlv_epi32(both, shifts), _mm256_set1_epi8(0x0f));
}

// acc + the sums of 4 products of unsigned bytes u with signed bytes s, per int32 lane: exact
// (AVX2's maddubs cannot saturate here: u is at most 15).
inline __m256i DotBytes(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
#endif
}

// Transposes 8 rows of 8 floats in place (row t, lane j) -> (row j, lane t).
inline void Transpose8(__m256 v[8]) {
  const __m256 a0 = _mm256_unpacklo_ps(v[0], v[1]), a1 = _mm256_unpackhi_ps(v[0], v[1]);
  const __m256 a2 = _mm256_unpacklo_ps(v[2], v[3]), a3 = _mm256_unpackhi_ps(v[2], v[3]);
  const __m256 a4 = _mm256_unpacklo_ps(v[4], v[5]), a5 = _mm256_unpackhi_ps(v[4], v[5]);
  const __m256 a6 = _mm256_unpacklo_ps(v[6], v[7]), a7 = _mm256_unpackhi_ps(v[6], v[7]);
  const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xee);
  const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xee);
  const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xee);
  const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xee);
  v[0] = _mm256_permute2f128_ps(b0, b4, 0x20);
  v[1] = _mm256_permute2f128_ps(b1, b5, 0x20);
  v[2] = _mm256_permute2f128_ps(b2, b6, 0x20);
  v[3] = _mm256_permute2f128_ps(b3, b7, 0x20);
  v[4] = _mm256_permute2f128_ps(b0, b4, 0x31);
  v[5] = _mm256_permute2f128_ps(b1, b5, 0x31);
  v[6] = _mm256_permute2f128_ps(b2, b6, 0x31);
  v[7] = _mm256_permute2f128_ps(b3, b7, 0x31);
}

// The float16 values h[t * stride + g] for 8 rows t and blocks g in [0, blocks), as floats laid
// out [g][t] (out holds blocks * 8): one row's scales per lane, so a vector serves 8 rows.
inline void HalvesByBlock(const uint16_t* h, int64_t stride, int64_t blocks, float* out) {
  int64_t g = 0;
  for (; g + 8 <= blocks; g += 8) {
    __m256 v[8];
    for (int t = 0; t < 8; ++t) {
      v[t] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + t * stride + g)));
    }
    Transpose8(v);
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + (g + j) * 8, v[j]);
  }
  for (; g < blocks; ++g) {
    for (int t = 0; t < 8; ++t) out[g * 8 + t] = HalfToFloat(h[t * stride + g]);
  }
}
#endif

}  // namespace genjax_q4
