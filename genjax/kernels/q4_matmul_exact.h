// Exact products (float32 activations; prompts): each output is ExactOutput's arithmetic
// (q4_matmul_common.h): kExactLanes partial sums over the inputs (input k feeds partial
// k mod kExactLanes, one fused multiply-add per input, in input order), then summed by halves.
// One vector accumulator per output holds those partial sums, so every tiling below gives the
// same bits.
//
// A panel of weight rows is dequantized once per product into a float buffer in the file's own
// order (no transposition) that stays in L2. Then for each register tile of kExactRows
// activation rows (loaded into L1 once) every kExactTile weight rows of the panel run down the
// inputs: one vector FMA per (activation row, weight row) per kExactLanes inputs, the weights
// streaming from L2. So the packed matrix is read from memory, and each weight decoded, once per
// product: a GEMM's packing step with the 4-bit decoding folded in. When the activations fit
// in L1 the panel shrinks to one register tile's weight rows (they stay in L1 too), and calls
// of up to 4 rows skip the buffer: weights are decoded into registers as they are used
// (ExactFused), which costs less than writing and reading them back.

#pragma once

#include <vector>

#include "q4_matmul_common.h"

namespace genjax_q4 {

#ifdef GENJAX_Q4_AVX2
#if defined(__AVX512F__)
using Vec = __m512;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Load(const float* a) { return _mm512_loadu_ps(a); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline __m256 Halve(Vec v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
// Weight rows per tile, and activation rows per register tile: 6 x 4 accumulators, 4 weight
// vectors and one activation vector of the 32 registers; 10 loads per 24 FMAs.
constexpr int kExactTile = 4;
constexpr int kExactRows = 6;
#else
using Vec = __m256;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Load(const float* a) { return _mm256_loadu_ps(a); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 Halve(Vec v) { return v; }
constexpr int kExactTile = 2;  // 4 x 2 accumulators of 16 registers
constexpr int kExactRows = 4;
#endif
static_assert(sizeof(Vec) == kExactLanes * sizeof(float), "one partial sum per lane");
// Dequantized weights decoded at a time (a panel): small enough to stay in L2 while every
// activation row runs against it.
constexpr int64_t kPanelBytes = 256 * 1024;
constexpr int64_t kSmallBytes = 32 * 1024;  // activations that leave L1 room for a weight tile

// The partial sums' total, by halves (ExactOutput's order).
inline float SumByHalves(Vec v) {
  const __m256 eight = Halve(v);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#if defined(__AVX512F__)
// y[0:4] = SumByHalves of a, b, c and d, the four reduced together: each step adds the same
// pairs of partial sums as SumByHalves, for four outputs per instruction.
inline void StoreSums4(float* y, Vec a, Vec b, Vec c, Vec d) {
  // lanes 0-7 of a + lanes 8-15 of a, then b's: [a 8 | b 8], and [c 8 | d 8]
  const Vec ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
  const Vec cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
  // lanes 0-3 + lanes 4-7 of each: [a 4 | b 4 | c 4 | d 4]
  Vec v = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xee));  // lane 0 + lane 2, lane 1 + lane 3
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x55));  // then + lane 1, in each group of 4
  const __m512i firsts = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  _mm_storeu_ps(y, _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, v)));
}
#endif

// tile[t * I + k] = weight k of row o0 + t, fma(q, scale, minimum), for `count` rows.
void DequantizeRows(const Problem& p, int64_t o0, int64_t count, float* tile) {
  const __m128i mask = _mm_set1_epi8(0x0f);
  for (int64_t t = 0; t < count; ++t) {
    const uint8_t* w = p.packed + (o0 + t) * (p.inputs / 2);
    float* out = tile + t * p.inputs;
    for (int64_t g = 0; g < p.blocks; ++g) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * 16));
      const __m128i low = _mm_and_si128(bytes, mask);
      const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
      const __m256 s = _mm256_set1_ps(HalfToFloat(p.scale[(o0 + t) * p.blocks + g]));
      const __m256 m = _mm256_set1_ps(HalfToFloat(p.minimum[(o0 + t) * p.blocks + g]));
      const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
      for (int h = 0; h < 4; ++h) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[h]));
        _mm256_storeu_ps(out + g * kBlock + h * 8, _mm256_fmadd_ps(q, s, m));
      }
    }
  }
}

// y[r0 + r, o0 + t] = the total of acc[r][t]'s partial sums.
template <int NR, int NO>
void StoreTile(const Problem& p, Vec (&acc)[NR][NO], int64_t o0, int64_t r0) {
  for (int r = 0; r < NR; ++r) {
    float* y = p.y + (r0 + r) * p.outputs + o0;
#if defined(__AVX512F__)
    if constexpr (NO == 4) {
      StoreSums4(y, acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      continue;
    }
#endif
    for (int t = 0; t < NO; ++t) y[t] = SumByHalves(acc[r][t]);
  }
}

// y[r0:r0+NR, o0:o0+NO] from dequantized weight rows.
template <int NR, int NO>
void ExactTile(const Problem& p, const float* tile, int64_t o0, int64_t r0) {
  Vec acc[NR][NO];
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NO; ++t) acc[r][t] = Zero();
  }
  const float* x = p.x + r0 * p.inputs;
  for (int64_t k = 0; k < p.inputs; k += kExactLanes) {
    Vec w[NO];
    for (int t = 0; t < NO; ++t) w[t] = Load(tile + t * p.inputs + k);
    for (int r = 0; r < NR; ++r) {
      const Vec a = Load(x + r * p.inputs + k);
      for (int t = 0; t < NO; ++t) acc[r][t] = Fma(a, w[t], acc[r][t]);
    }
  }
  StoreTile<NR, NO>(p, acc, o0, r0);
}

// The weights of block g of a row as kBlock / kExactLanes vectors of consecutive inputs,
// fma(q, scale, minimum) as DequantizeRows computes them: inputs 0-15 are the low nibbles of the
// block's 16 bytes, inputs 16-31 the high ones.
inline void DecodeBlock(const uint8_t* bytes16, float scale, float minimum,
                        Vec (&out)[kBlock / kExactLanes]) {
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes16));
  const __m128i low = _mm_and_si128(bytes, mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
#if defined(__AVX512F__)
  const Vec s = _mm512_set1_ps(scale), m = _mm512_set1_ps(minimum);
  out[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)), s, m);
  out[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high)), s, m);
#else
  const Vec s = _mm256_set1_ps(scale), m = _mm256_set1_ps(minimum);
  const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
  for (int h = 0; h < 4; ++h) {
    out[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[h])), s, m);
  }
#endif
}

// ExactTile's arithmetic with the weights decoded into registers as they are used, for calls of
// a few activation rows, where writing and reading back a decoded panel would cost more than
// the product itself.
template <int NR, int NO>
void ExactFused(const Problem& p, int64_t o0, int64_t r0) {
  constexpr int kParts = kBlock / kExactLanes;
  Vec acc[NR][NO];
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NO; ++t) acc[r][t] = Zero();
  }
  const float* x = p.x + r0 * p.inputs;
  for (int64_t g = 0; g < p.blocks; ++g) {
    Vec w[NO][kParts];
    for (int t = 0; t < NO; ++t) {
      const int64_t at = (o0 + t) * p.blocks + g;
      DecodeBlock(p.packed + (o0 + t) * (p.inputs / 2) + g * 16, HalfToFloat(p.scale[at]),
                  HalfToFloat(p.minimum[at]), w[t]);
    }
    for (int h = 0; h < kParts; ++h) {
      for (int r = 0; r < NR; ++r) {
        const Vec a = Load(x + r * p.inputs + g * kBlock + h * kExactLanes);
        for (int t = 0; t < NO; ++t) acc[r][t] = Fma(a, w[t][h], acc[r][t]);
      }
    }
  }
  StoreTile<NR, NO>(p, acc, o0, r0);
}

template <int NR>
void FusedRows(const Problem& p, int64_t begin, int64_t end) {
  int64_t o = begin;
  for (; o + kExactTile <= end; o += kExactTile) ExactFused<NR, kExactTile>(p, o, 0);
  switch (end - o) {
    case 1: ExactFused<NR, 1>(p, o, 0); break;
    case 2: ExactFused<NR, 2>(p, o, 0); break;
    case 3: ExactFused<NR, 3>(p, o, 0); break;
    default: break;
  }
}

// y[r0:r0+NR, o0:o1] from a panel of dequantized weight rows starting at row o0.
template <int NR>
void PanelRows(const Problem& p, const float* panel, int64_t o0, int64_t o1, int64_t r0) {
  int64_t o = o0;
  for (; o + kExactTile <= o1; o += kExactTile) {
    ExactTile<NR, kExactTile>(p, panel + (o - o0) * p.inputs, o, r0);
  }
  const float* rest = panel + (o - o0) * p.inputs;
  switch (o1 - o) {
    case 1: ExactTile<NR, 1>(p, rest, o, r0); break;
    case 2: ExactTile<NR, 2>(p, rest, o, r0); break;
    case 3: ExactTile<NR, 3>(p, rest, o, r0); break;
    default: break;
  }
}

// Weight rows [begin, end) against every activation row, one panel of weight rows at a time.
void Exact(const Problem& p, int64_t begin, int64_t end) {
  switch (p.rows) {  // a few rows: no panel
    case 1: return FusedRows<1>(p, begin, end);
    case 2: return FusedRows<2>(p, begin, end);
    case 3: return FusedRows<3>(p, begin, end);
    case 4: return FusedRows<4>(p, begin, end);
    default: break;
  }
  // When all the activations fit in L1 a panel of one tile suffices, and its weights stay in L1
  // too; otherwise the panel is as large as kPanelBytes allows, so the weights are decoded once.
  const int64_t row_bytes = p.inputs * static_cast<int64_t>(sizeof(float));
  const int64_t fit = p.rows * row_bytes <= kSmallBytes ? kExactTile : kPanelBytes / row_bytes;
  const int64_t panel_rows = std::max<int64_t>(kExactTile, fit / kExactTile * kExactTile);
  std::vector<float> panel(panel_rows * p.inputs);
  for (int64_t o0 = begin; o0 < end; o0 += panel_rows) {
    const int64_t o1 = std::min(end, o0 + panel_rows);
    DequantizeRows(p, o0, o1 - o0, panel.data());
    int64_t r = 0;
    for (; r + kExactRows <= p.rows; r += kExactRows) PanelRows<kExactRows>(p, panel.data(), o0, o1, r);
    switch (p.rows - r) {
      case 1: PanelRows<1>(p, panel.data(), o0, o1, r); break;
      case 2: PanelRows<2>(p, panel.data(), o0, o1, r); break;
      case 3: PanelRows<3>(p, panel.data(), o0, o1, r); break;
#if defined(__AVX512F__)
      case 4: PanelRows<4>(p, panel.data(), o0, o1, r); break;
      case 5: PanelRows<5>(p, panel.data(), o0, o1, r); break;
#endif
      default: break;
    }
  }
}
#endif

}  // namespace genjax_q4
