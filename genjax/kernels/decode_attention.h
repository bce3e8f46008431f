// The two cache-reading sums of one decode step's attention, for each KV head of each row:
//
//   scores[b, k, g, s] = sum_h q[b, k, g, h] * keys[b, k, h, s]        (keys: the cache's [H, S])
//   out[b, k, g, h]    = sum_s weights[b, k, g, s] * values[b, k, s, h]  (values: [S, H])
//
// with keys and values in float32 or bfloat16 (widened in registers, exactly), everything else
// float32. The softmax between them stays in XLA (genjax.models.layers), so its roundings and
// exponentials are XLA's.
//
// Why not XLA: XLA:CPU runs these sums, written as a multiply and a sum over the cache (or as
// batched products), at a third of the speed at which it reads memory elsewhere, and it reads
// every slot of the cache buffer, written or not. Here each (row, KV head) block streams its
// keys and values once, and only over the row's span of slots: from the first to the last slot
// its bias does not mask (bias <= kMasked). A slot outside the span has weight exactly 0 in the
// softmax (its biased score is about -3.4e38, whose exponential is 0), so leaving it out changes
// no value; its score is written as 0, which the bias masks again. A row whose every slot is
// masked (XLA then spreads the weights uniformly) takes the whole buffer.
//
// Every output's sum runs in one fixed order (over h, or over s within the span, one fused
// multiply-add each, vectorized across the other axis), so a row's result does not depend on the
// other rows, on the buffer's length or on where its span starts.
//
// Work: the (row, KV head) blocks are shared out between the threads (team.h).
// H must be a multiple of 16 (genjax.kernels.attention checks before calling).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

#include "team.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace genjax_attention {

using namespace genjax_kernels;

constexpr float kMasked = -1e30f;  // a bias at or below this masks its slot

struct Span {
  int64_t begin, end;
};

// The slots [begin, end) between the first and the last one that row's bias does not mask.
inline Span Unmasked(const float* bias, int64_t slots) {
  int64_t begin = 0, end = slots;
  while (begin < slots && bias[begin] <= kMasked) ++begin;
  while (end > begin && bias[end - 1] <= kMasked) --end;
  if (begin == end) return Span{0, slots};
  return Span{begin, end};
}

// C: the cache's element type: float (float32) or uint16_t (bfloat16 bits).
template <typename C>
struct Problem {
  const float* rows;   // q [B, K, G, H] or weights [B, K, G, S]
  const C* cache;      // keys [B, K, H, S] or values [B, K, S, H]
  const float* bias;   // [B, S]
  float* out;          // scores [B, K, G, S] or out [B, K, G, H]
  int64_t kv_heads, groups, head_dim, slots;
};

// Register tiles. A tile keeps its sums in registers (the scores: across a band of key rows)
// and stores them once; summing into the outputs in memory at every multiply-add (a load and a
// store each) ran at about a third of this speed. Each sum still runs over h (scores) or s
// (values) in order, one fused multiply-add each, and a float32 stored and loaded again is
// unchanged, so the bits are those of the plain loops.
constexpr int kTile = 4;  // queries (G) per tile

// Prefetch distances: the values' slot s + kValuesAhead is asked for while slot s is summed; a
// paged block's next block as a whole, as it starts (genjax.cache.paged blocks lie 4 KB apart
// in no order, which the hardware prefetcher cannot guess).
constexpr int64_t kValuesAhead = 8;    // slots

// out[t * out_stride + i] = sum_h q[t * H + h] * keys[h * h_stride + i] for the slots i from
// `begin` in whole runs of V vectors, t < T; returns where the runs end.
//
// From memory (a decode step's caches are out of the caches by then: the weights stream
// through them between layers) the first tiles, one vector of all H key rows at a time, ran at
// 11 GB/s against 20 for the values, for two reasons. H rows side by side are H streams, more
// than the hardware prefetcher follows: the sum runs over bands of kBand rows, its partial sums
// resting in `out` between bands. And the sums over h are chains of dependent multiply-adds:
// with T * V of them side by side (T = 3 alone, SmolLM's queries per KV head, was too few) the
// core overlaps their latency.
constexpr int64_t kBand = 8;  // key rows per band; H is a multiple of it

template <int T, int V, typename C>
int64_t ScoresVectors(const float* q, int64_t H, const C* keys, int64_t h_stride, int64_t begin,
                      int64_t count, float* out, int64_t out_stride) {
  const int64_t end = begin + (count - begin) / (V * kLanes) * (V * kLanes);
  for (int64_t h0 = 0; h0 < H; h0 += kBand) {
    for (int64_t i = begin; i < end; i += V * kLanes) {
      Vec acc[V][T];
      for (int v = 0; v < V; ++v)
        for (int t = 0; t < T; ++t)
          acc[v][t] = h0 ? Load(out + t * out_stride + i + v * kLanes) : Zero();
      for (int64_t h = h0; h < h0 + kBand; ++h) {
        Vec key[V];  // widened once for the T queries
        for (int v = 0; v < V; ++v) key[v] = Widen(keys + h * h_stride + i + v * kLanes);
        for (int t = 0; t < T; ++t) {
          const Vec query = Splat(q[t * H + h]);
          for (int v = 0; v < V; ++v) acc[v][t] = Fma(query, key[v], acc[v][t]);
        }
      }
      for (int v = 0; v < V; ++v)
        for (int t = 0; t < T; ++t) Store(out + t * out_stride + i + v * kLanes, acc[v][t]);
    }
  }
  return end;
}

constexpr int kScoreVectors = kLanes == 16 ? 4 : 2;  // AVX2 has half the registers

template <int T, typename C>
void ScoresTile(const float* q, int64_t H, const C* keys, int64_t h_stride, int64_t count,
                float* out, int64_t out_stride) {
  int64_t i = ScoresVectors<T, kScoreVectors>(q, H, keys, h_stride, 0, count, out, out_stride);
  i = ScoresVectors<T, 1>(q, H, keys, h_stride, i, count, out, out_stride);
  for (; i < count; ++i) {
    float acc[T] = {};
    for (int64_t h = 0; h < H; ++h) {
      const float key = WidenOne(keys[h * h_stride + i]);
      for (int t = 0; t < T; ++t) acc[t] = std::fma(q[t * H + h], key, acc[t]);
    }
    for (int t = 0; t < T; ++t) out[t * out_stride + i] = acc[t];
  }
}

// ScoresTile over the G queries, kTile at a time.
template <typename C>
void Scores(const float* q, int64_t G, int64_t H, const C* keys, int64_t h_stride, int64_t count,
            float* out, int64_t out_stride) {
  for (int64_t g = 0; g < G; g += kTile) {
    const float* qg = q + g * H;
    float* og = out + g * out_stride;
    switch (std::min<int64_t>(kTile, G - g)) {
      case 1: ScoresTile<1>(qg, H, keys, h_stride, count, og, out_stride); break;
      case 2: ScoresTile<2>(qg, H, keys, h_stride, count, og, out_stride); break;
      case 3: ScoresTile<3>(qg, H, keys, h_stride, count, og, out_stride); break;
      default: ScoresTile<4>(qg, H, keys, h_stride, count, og, out_stride); break;
    }
  }
}

// out[t * H + h] = sum_{s in span} w[t * S + s] * row_at(s)[h] for T queries and the head's H
// values, kLanes * 4 of them per pass; row_at(s) points at slot s's H values.
template <int T, typename C, typename RowAt>
void ValuesTile(const float* w, int64_t S, Span span, RowAt row_at, int64_t H, float* out) {
  constexpr int kVectors = 4;
  for (int64_t h0 = 0; h0 < H; h0 += kVectors * kLanes) {
    const int vectors = static_cast<int>(std::min<int64_t>(kVectors, (H - h0) / kLanes));
    Vec acc[kVectors][T];
    for (int v = 0; v < kVectors; ++v)
      for (int t = 0; t < T; ++t) acc[v][t] = Zero();
    for (int64_t s = span.begin; s < span.end; ++s) {
      const C* row = row_at(s) + h0;
      if (s + kValuesAhead < span.end) {
        PrefetchBytes(row_at(s + kValuesAhead) + h0, vectors * kLanes * sizeof(C));
      }
      Vec weight[T];
      for (int t = 0; t < T; ++t) weight[t] = Splat(w[t * S + s]);
      for (int v = 0; v < vectors; ++v) {
        const Vec value = Widen(row + v * kLanes);  // widened once for the T queries
        for (int t = 0; t < T; ++t) acc[v][t] = Fma(weight[t], value, acc[v][t]);
      }
    }
    for (int v = 0; v < vectors; ++v)
      for (int t = 0; t < T; ++t) Store(out + t * H + h0 + v * kLanes, acc[v][t]);
  }
}

template <typename C, typename RowAt>
void Values(const float* w, int64_t G, int64_t S, Span span, RowAt row_at, int64_t H,
            float* out) {
  for (int64_t g = 0; g < G; g += kTile) {
    const float* wg = w + g * S;
    float* og = out + g * H;
    switch (std::min<int64_t>(kTile, G - g)) {
      case 1: ValuesTile<1, C>(wg, S, span, row_at, H, og); break;
      case 2: ValuesTile<2, C>(wg, S, span, row_at, H, og); break;
      case 3: ValuesTile<3, C>(wg, S, span, row_at, H, og); break;
      default: ValuesTile<4, C>(wg, S, span, row_at, H, og); break;
    }
  }
}

// scores[b, k] for one block: g-by-s, summed over h in order.
template <typename C>
void ScoresBlock(const Problem<C>& p, int64_t block) {
  const int64_t b = block / p.kv_heads, G = p.groups, H = p.head_dim, S = p.slots;
  const Span span = Unmasked(p.bias + b * S, S);
  const float* q = p.rows + block * G * H;
  const C* keys = p.cache + block * H * S;
  float* scores = p.out + block * G * S;
  for (int64_t g = 0; g < G; ++g) {
    std::fill(scores + g * S, scores + g * S + span.begin, 0.0f);
    std::fill(scores + g * S + span.end, scores + (g + 1) * S, 0.0f);
  }
  Scores(q, G, H, keys + span.begin, S, span.end - span.begin, scores + span.begin, S);
}

// out[b, k] for one block: g-by-h, summed over the span's slots in order.
template <typename C>
void ValuesBlock(const Problem<C>& p, int64_t block) {
  const int64_t b = block / p.kv_heads, G = p.groups, H = p.head_dim, S = p.slots;
  const Span span = Unmasked(p.bias + b * S, S);
  const C* values = p.cache + block * S * H;
  Values<C>(p.rows + block * G * S, G, S, span, [&](int64_t s) { return values + s * H; }, H,
            p.out + block * G * H);
}

// The paged layout (genjax.cache.paged): the cache is a pool of blocks, keys [N, K, H, bs] or
// values [N, K, bs, H], and row b's slot s lives in block tables[b, s / bs] at offset s % bs.
// Each output sums over the same slots in the same order as the contiguous layout above, so a
// row's bits equal those of its blocks gathered into logical order first.
struct Pages {
  const int32_t* tables;  // [B, M]
  int64_t blocks_per_row, block_size, pool_blocks;

  // The pool block holding row b's logical block m (clamped into the pool, as XLA's gather).
  int64_t Block(int64_t b, int64_t m) const {
    int64_t block = tables[b * blocks_per_row + m];
    if (block < 0) block += pool_blocks;
    return std::clamp<int64_t>(block, 0, pool_blocks - 1);
  }
};

template <typename C>
void PagedScoresBlock(const Problem<C>& p, const Pages& pages, int64_t block) {
  const int64_t b = block / p.kv_heads, k = block % p.kv_heads;
  const int64_t G = p.groups, H = p.head_dim, S = p.slots, bs = pages.block_size;
  const Span span = Unmasked(p.bias + b * S, S);
  const float* q = p.rows + block * G * H;
  float* scores = p.out + block * G * S;
  for (int64_t g = 0; g < G; ++g) {
    std::fill(scores + g * S, scores + g * S + span.begin, 0.0f);
    std::fill(scores + g * S + span.end, scores + (g + 1) * S, 0.0f);
  }
  for (int64_t m = span.begin / bs; m * bs < span.end; ++m) {
    const C* keys = p.cache + (pages.Block(b, m) * p.kv_heads + k) * H * bs;  // [H, bs]
    if ((m + 1) * bs < span.end) {
      PrefetchBytes(p.cache + (pages.Block(b, m + 1) * p.kv_heads + k) * H * bs,
                    H * bs * sizeof(C));
    }
    const int64_t first = std::max(span.begin, m * bs), last = std::min(span.end, (m + 1) * bs);
    Scores(q, G, H, keys + (first - m * bs), bs, last - first, scores + first, S);
  }
}

template <typename C>
void PagedValuesBlock(const Problem<C>& p, const Pages& pages, int64_t block) {
  const int64_t b = block / p.kv_heads, k = block % p.kv_heads;
  const int64_t G = p.groups, H = p.head_dim, S = p.slots, bs = pages.block_size;
  const Span span = Unmasked(p.bias + b * S, S);
  auto row_at = [&](int64_t s) {
    const int64_t m = s / bs;
    return p.cache + ((pages.Block(b, m) * p.kv_heads + k) * bs + s - m * bs) * H;
  };
  Values<C>(p.rows + block * G * S, G, S, span, row_at, H, p.out + block * G * H);
}

template <typename C, bool kScores>
struct PagedJob : Job {
  Problem<C> p;
  Pages pages;
  void Chunk(int64_t block) override {
    if (kScores) {
      PagedScoresBlock(p, pages, block);
    } else {
      PagedValuesBlock(p, pages, block);
    }
  }
};

// rows: q [B, K, G, H] (kScores) or weights [B, K, G, S]; pool: keys [N, K, H, bs] or values
// [N, K, bs, H]; tables [B, M] with M * bs = S; bias [B, S].
template <typename C, bool kScores>
ffi::Error RunPaged(ffi::ThreadPool pool, const float* rows, ffi::Span<const int64_t> rd,
                    const C* cache, ffi::Span<const int64_t> cd, const int32_t* tables,
                    ffi::Span<const int64_t> td, const float* bias, ffi::Span<const int64_t> bd,
                    float* out) {
  if (rd.size() != 4 || cd.size() != 4 || td.size() != 2 || bd.size() != 2 || td[0] != rd[0] ||
      bd[0] != rd[0] || cd[1] != rd[1] || cd[0] < 1) {
    return ffi::Error::InvalidArgument(
        "decode_attention: rows [B, K, G, X], pool [N, K, X, Y], tables [B, M] and bias [B, S] "
        "expected");
  }
  const int64_t H = kScores ? cd[2] : cd[3], bs = kScores ? cd[3] : cd[2], S = td[1] * bs;
  if (rd[3] != (kScores ? H : S) || bd[1] != S || H % 16 != 0) {
    return ffi::Error::InvalidArgument(
        "decode_attention: mismatched head or slot axes, or a head width not a multiple of 16");
  }
  auto job = std::make_shared<PagedJob<C, kScores>>();
  job->p = Problem<C>{rows, cache, bias, out, rd[1], rd[2], H, S};
  job->pages = Pages{tables, td[1], bs, cd[0]};
  job->chunks = rd[0] * rd[1];
  genjax_kernels::Run(pool, job);
  return ffi::Error::Success();
}

template <typename C, bool kScores>
struct BlocksJob : Job {
  Problem<C> p;
  void Chunk(int64_t block) override {
    if (kScores) {
      ScoresBlock(p, block);
    } else {
      ValuesBlock(p, block);
    }
  }
};

// rows: q [B, K, G, H] (kScores) or weights [B, K, G, S]; cache: keys [B, K, H, S] or values
// [B, K, S, H]; bias [B, S].
template <typename C, bool kScores>
ffi::Error Run(ffi::ThreadPool pool, const float* rows, ffi::Span<const int64_t> rd,
               const C* cache, ffi::Span<const int64_t> cd, const float* bias,
               ffi::Span<const int64_t> bd, float* out) {
  if (rd.size() != 4 || cd.size() != 4 || bd.size() != 2 || rd[0] != cd[0] || rd[1] != cd[1] ||
      bd[0] != rd[0]) {
    return ffi::Error::InvalidArgument(
        "decode_attention: rows [B, K, G, X], cache [B, K, X, Y] and bias [B, S] expected");
  }
  const int64_t H = kScores ? cd[2] : cd[3], S = kScores ? cd[3] : cd[2];
  if (rd[3] != (kScores ? H : S) || bd[1] != S || H % 16 != 0) {
    return ffi::Error::InvalidArgument(
        "decode_attention: mismatched head or slot axes, or a head width not a multiple of 16");
  }
  auto job = std::make_shared<BlocksJob<C, kScores>>();
  job->p = Problem<C>{rows, cache, bias, out, rd[1], rd[2], H, S};
  job->chunks = rd[0] * rd[1];
  genjax_kernels::Run(pool, job);
  return ffi::Error::Success();
}

template <bool kScores>
ffi::Error Float32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::F32> cache,
                   ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> out) {
  return Run<float, kScores>(pool, rows.typed_data(), rows.dimensions(), cache.typed_data(),
                             cache.dimensions(), bias.typed_data(), bias.dimensions(),
                             out->typed_data());
}

template <bool kScores>
ffi::Error Bfloat16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::BF16> cache,
                    ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> out) {
  const auto* bits = reinterpret_cast<const uint16_t*>(cache.typed_data());
  return Run<uint16_t, kScores>(pool, rows.typed_data(), rows.dimensions(), bits,
                                cache.dimensions(), bias.typed_data(), bias.dimensions(),
                                out->typed_data());
}

template <bool kScores>
ffi::Error PagedFloat32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows,
                        ffi::Buffer<ffi::F32> cache, ffi::Buffer<ffi::S32> tables,
                        ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> out) {
  return RunPaged<float, kScores>(pool, rows.typed_data(), rows.dimensions(), cache.typed_data(),
                                  cache.dimensions(), tables.typed_data(), tables.dimensions(),
                                  bias.typed_data(), bias.dimensions(), out->typed_data());
}

template <bool kScores>
ffi::Error PagedBfloat16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows,
                         ffi::Buffer<ffi::BF16> cache, ffi::Buffer<ffi::S32> tables,
                         ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> out) {
  const auto* bits = reinterpret_cast<const uint16_t*>(cache.typed_data());
  return RunPaged<uint16_t, kScores>(pool, rows.typed_data(), rows.dimensions(), bits,
                                     cache.dimensions(), tables.typed_data(), tables.dimensions(),
                                     bias.typed_data(), bias.dimensions(), out->typed_data());
}

}  // namespace genjax_attention

#define GENJAX_ATTENTION_HANDLER(symbol, function, cache_type)                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, function, ffi::Ffi::Bind()              \
                                                      .Ctx<ffi::ThreadPool>()   \
                                                      .Arg<ffi::Buffer<ffi::F32>>() \
                                                      .Arg<ffi::Buffer<cache_type>>() \
                                                      .Arg<ffi::Buffer<ffi::F32>>() \
                                                      .Ret<ffi::Buffer<ffi::F32>>());

GENJAX_ATTENTION_HANDLER(GenjaxAttentionScoresF32, genjax_attention::Float32<true>, ffi::F32)
GENJAX_ATTENTION_HANDLER(GenjaxAttentionScoresBF16, genjax_attention::Bfloat16<true>, ffi::BF16)
GENJAX_ATTENTION_HANDLER(GenjaxAttentionValuesF32, genjax_attention::Float32<false>, ffi::F32)
GENJAX_ATTENTION_HANDLER(GenjaxAttentionValuesBF16, genjax_attention::Bfloat16<false>, ffi::BF16)

#define GENJAX_PAGED_ATTENTION_HANDLER(symbol, function, cache_type)            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, function, ffi::Ffi::Bind()              \
                                                      .Ctx<ffi::ThreadPool>()   \
                                                      .Arg<ffi::Buffer<ffi::F32>>() \
                                                      .Arg<ffi::Buffer<cache_type>>() \
                                                      .Arg<ffi::Buffer<ffi::S32>>() \
                                                      .Arg<ffi::Buffer<ffi::F32>>() \
                                                      .Ret<ffi::Buffer<ffi::F32>>());

GENJAX_PAGED_ATTENTION_HANDLER(GenjaxPagedAttentionScoresF32, genjax_attention::PagedFloat32<true>,
                               ffi::F32)
GENJAX_PAGED_ATTENTION_HANDLER(GenjaxPagedAttentionScoresBF16,
                               genjax_attention::PagedBfloat16<true>, ffi::BF16)
GENJAX_PAGED_ATTENTION_HANDLER(GenjaxPagedAttentionValuesF32,
                               genjax_attention::PagedFloat32<false>, ffi::F32)
GENJAX_PAGED_ATTENTION_HANDLER(GenjaxPagedAttentionValuesBF16,
                               genjax_attention::PagedBfloat16<false>, ffi::BF16)
