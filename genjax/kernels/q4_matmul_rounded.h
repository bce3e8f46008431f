// Rounded products (int8-rounded activations, exact integer block dots): every kernel here
// computes each output with RoundedOutput's arithmetic (q4_matmul_common.h), in the same order,
// so the tiling (and thus the number of rows in the call) never changes a row's bits.
//
// Two tilings of that arithmetic:
// * RoundedRows (a few activation rows, decode at small batch; bound by reading the weights):
//   8 weight rows at a time, one per float lane. Each block of each weight row is unpacked once
//   and dotted with each activation row's block (one 256-bit u8 x s8 dot per block and row);
//   the 8 rows' dots are then summed across lanes into one vector of 8 block dots, so the scales
//   are applied 8 outputs per instruction.
// * RoundedGemm (many activation rows): one activation row per lane. The activations are
//   interleaved once per call (Problem::xq_groups) so that a vector holds 4 consecutive int8 of
//   8 rows; 4 unpacked weight bytes broadcast to every lane then make one u8 x s8 dot instruction
//   advance 8 rows' block dots with no reduction across lanes. A tile of weight rows is
//   unpacked once into a small buffer and reused for every group of 8 activation rows. This is
//   the arrangement of llama.cpp's repacked Q4_0 GEMM kernels (which interleave weight rows
//   instead; genjax's weights stay in the file's layout, so the activations move).

#pragma once

#include <vector>

#include "q4_matmul_common.h"

namespace genjax_q4 {

#ifdef GENJAX_Q4_AVX2
// 8 vectors of 8 int32 -> one vector whose lane t is the sum of v[t]'s lanes.
inline __m256i SumEachOf8(const __m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  // a = [v0..v3 lower-half sums | v0..v3 upper-half sums], b likewise for v4..v7
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                          _mm256_permute2x128_si256(a, b, 0x31));
}

// y[r0:r0+N, o0:o0+8]: 8 weight rows (one per lane) against N activation rows.
template <int N>
void RoundedRowsTile(const Problem& p, int64_t o0, int64_t r0, const float* scales,
                     const float* minimums, int64_t next) {
  const int64_t stride = p.inputs / 2;
  const uint8_t* w = p.packed + o0 * stride;
  __m256 acc[N], accm[N];
  for (int r = 0; r < N; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.blocks; ++g) {
    // The next tile's bytes are asked for while this one computes: a decode step's matrices
    // are not in cache, and 8 streams at once outrun the hardware prefetcher.
    if (next >= 0 && (g & 3) == 0) {
      for (int t = 0; t < 8; ++t) __builtin_prefetch(p.packed + (next + t) * stride + g * 16);
    }
    __m256i q[8];
    for (int t = 0; t < 8; ++t) q[t] = UnpackBlock(w + t * stride + g * 16);
    const __m256 s = _mm256_loadu_ps(scales + g * 8);
    const __m256 m = _mm256_loadu_ps(minimums + g * 8);
    for (int r = 0; r < N; ++r) {
      const int64_t at = (r0 + r) * p.blocks + g;
      const __m256i v = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(p.xq + (r0 + r) * p.inputs + g * kBlock));
      __m256i d[8];
      for (int t = 0; t < 8; ++t) d[t] = DotBytes(_mm256_setzero_si256(), q[t], v);
      const __m256 dots = _mm256_cvtepi32_ps(SumEachOf8(d));
      const __m256 combined = _mm256_mul_ps(s, _mm256_set1_ps(p.x_scale[at]));
      acc[r] = _mm256_fmadd_ps(dots, combined, acc[r]);
      accm[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(p.block_sums[at]), accm[r]);
    }
  }
  for (int r = 0; r < N; ++r) {
    _mm256_storeu_ps(p.y + (r0 + r) * p.outputs + o0, _mm256_add_ps(acc[r], accm[r]));
  }
}

// Weight rows [begin, end) against every activation row, 8 weight rows and up to 4 activation
// rows at a time.
void RoundedRows(const Problem& p, int64_t begin, int64_t end) {
  std::vector<float> scales(p.blocks * 8), minimums(p.blocks * 8);
  int64_t o = begin;
  for (; o + 8 <= end; o += 8) {
    HalvesByBlock(p.scale + o * p.blocks, p.blocks, p.blocks, scales.data());
    HalvesByBlock(p.minimum + o * p.blocks, p.blocks, p.blocks, minimums.data());
    const int64_t next = o + 16 <= end ? o + 8 : -1;
    for (int64_t r0 = 0; r0 < p.rows; r0 += 4) {
      const int64_t prefetch = r0 == 0 ? next : -1;
      switch (std::min<int64_t>(4, p.rows - r0)) {
        case 1: RoundedRowsTile<1>(p, o, r0, scales.data(), minimums.data(), prefetch); break;
        case 2: RoundedRowsTile<2>(p, o, r0, scales.data(), minimums.data(), prefetch); break;
        case 3: RoundedRowsTile<3>(p, o, r0, scales.data(), minimums.data(), prefetch); break;
        default: RoundedRowsTile<4>(p, o, r0, scales.data(), minimums.data(), prefetch); break;
      }
    }
  }
  for (; o < end; ++o) {
    for (int64_t r = 0; r < p.rows; ++r) p.y[r * p.outputs + o] = RoundedOutput(p, r, o);
  }
}

// Weight rows per RoundedGemm tile, and groups of 8 activation rows per pass: sized so that the
// int32 dots, float sums and minimums' sums (3 * kTile * kGroups vectors) stay in registers
// (32 with AVX-512's encodings, 16 without).
#if defined(__AVX512VL__)
constexpr int kGemmTile = 4;
#else
constexpr int kGemmTile = 2;
#endif
constexpr int kGemmGroups = 2;

// y for weight rows [o0, o0 + kGemmTile) and NG groups of 8 activation rows from group rg.
template <int NG>
void RoundedGemmTile(const Problem& p, int64_t o0, int64_t rg, const uint8_t* unpacked,
                     const float* scales, const float* minimums) {
  constexpr int T = kGemmTile;
  __m256 acc[T][NG], accm[T][NG];
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < NG; ++i) acc[t][i] = accm[t][i] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < p.blocks; ++g) {
    __m256i d[T][NG];
    for (int t = 0; t < T; ++t) {
      for (int i = 0; i < NG; ++i) d[t][i] = _mm256_setzero_si256();
    }
    for (int j = 0; j < 8; ++j) {
      __m256i v[NG];
      for (int i = 0; i < NG; ++i) {
        v[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            p.xq_groups + (((rg + i) * p.blocks + g) * 8 + j) * 32));
      }
      for (int t = 0; t < T; ++t) {
        int32_t four;
        std::memcpy(&four, unpacked + (t * p.blocks + g) * kBlock + 4 * j, 4);
        const __m256i u = _mm256_set1_epi32(four);
        for (int i = 0; i < NG; ++i) d[t][i] = DotBytes(d[t][i], u, v[i]);
      }
    }
    for (int i = 0; i < NG; ++i) {
      const __m256 dx = _mm256_loadu_ps(p.x_scale_groups + ((rg + i) * p.blocks + g) * 8);
      const __m256 sums = _mm256_loadu_ps(p.block_sums_groups + ((rg + i) * p.blocks + g) * 8);
      for (int t = 0; t < T; ++t) {
        const __m256 combined = _mm256_mul_ps(_mm256_set1_ps(scales[t * p.blocks + g]), dx);
        acc[t][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[t][i]), combined, acc[t][i]);
        accm[t][i] = _mm256_fmadd_ps(_mm256_set1_ps(minimums[t * p.blocks + g]), sums, accm[t][i]);
      }
    }
  }
  for (int i = 0; i < NG; ++i) {
    for (int t = 0; t < T; ++t) {
      alignas(32) float out[8];
      _mm256_store_ps(out, _mm256_add_ps(acc[t][i], accm[t][i]));
      const int64_t first = (rg + i) * 8;
      const int64_t count = std::min<int64_t>(8, p.rows - first);
      for (int l = 0; l < count; ++l) p.y[(first + l) * p.outputs + o0 + t] = out[l];
    }
  }
}

// Weight rows [begin, end) against every activation row, kGemmTile weight rows at a time.
void RoundedGemm(const Problem& p, int64_t begin, int64_t end) {
  constexpr int T = kGemmTile;
  std::vector<uint8_t> unpacked(T * p.blocks * kBlock);
  std::vector<float> scales(T * p.blocks), minimums(T * p.blocks);
  const int64_t groups = (p.rows + 7) / 8;
  int64_t o = begin;
  for (; o + T <= end; o += T) {
    for (int t = 0; t < T; ++t) {
      const uint8_t* w = p.packed + (o + t) * (p.inputs / 2);
      for (int64_t g = 0; g < p.blocks; ++g) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&unpacked[(t * p.blocks + g) * kBlock]),
                            UnpackBlock(w + g * 16));
      }
      const uint16_t* sc = p.scale + (o + t) * p.blocks;
      const uint16_t* mn = p.minimum + (o + t) * p.blocks;
      int64_t g = 0;
      for (; g + 8 <= p.blocks; g += 8) {  // 8 float16 at a time: as costly as the unpacking
        _mm256_storeu_ps(&scales[t * p.blocks + g],
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g))));
        _mm256_storeu_ps(&minimums[t * p.blocks + g],
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + g))));
      }
      for (; g < p.blocks; ++g) {
        scales[t * p.blocks + g] = HalfToFloat(sc[g]);
        minimums[t * p.blocks + g] = HalfToFloat(mn[g]);
      }
    }
    int64_t rg = 0;
    for (; rg + kGemmGroups <= groups; rg += kGemmGroups) {
      RoundedGemmTile<kGemmGroups>(p, o, rg, unpacked.data(), scales.data(), minimums.data());
    }
    for (; rg < groups; ++rg) {
      RoundedGemmTile<1>(p, o, rg, unpacked.data(), scales.data(), minimums.data());
    }
  }
  for (; o < end; ++o) {
    for (int64_t r = 0; r < p.rows; ++r) p.y[r * p.outputs + o] = RoundedOutput(p, r, o);
  }
}
#endif

}  // namespace genjax_q4
