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

// scores[b, k] for one block: g-by-s, summed over h in order.
template <typename C>
void ScoresBlock(const Problem<C>& p, int64_t block) {
  const int64_t b = block / p.kv_heads, G = p.groups, H = p.head_dim, S = p.slots;
  const Span span = Unmasked(p.bias + b * S, S);
  const float* q = p.rows + block * G * H;
  const C* keys = p.cache + block * H * S;
  float* scores = p.out + block * G * S;
  for (int64_t g = 0; g < G; ++g) std::fill(scores + g * S, scores + (g + 1) * S, 0.0f);
  const int64_t vector_end = span.begin + (span.end - span.begin) / kLanes * kLanes;
  for (int64_t h = 0; h < H; ++h) {
    const C* row = keys + h * S;
    int64_t s = span.begin;
    for (; s < vector_end; s += kLanes) {
      const Vec key = Widen(row + s);  // widened once for the G queries
      for (int64_t g = 0; g < G; ++g) {
        float* score = scores + g * S + s;
        Store(score, Fma(Splat(q[g * H + h]), key, Load(score)));
      }
    }
    for (; s < span.end; ++s) {
      const float key = WidenOne(row[s]);
      for (int64_t g = 0; g < G; ++g) {
        float* score = scores + g * S + s;
        *score = std::fma(q[g * H + h], key, *score);
      }
    }
  }
}

// out[b, k] for one block: g-by-h, summed over the span's slots in order.
template <typename C>
void ValuesBlock(const Problem<C>& p, int64_t block) {
  const int64_t b = block / p.kv_heads, G = p.groups, H = p.head_dim, S = p.slots;
  const Span span = Unmasked(p.bias + b * S, S);
  const float* weights = p.rows + block * G * S;
  const C* values = p.cache + block * S * H;
  float* out = p.out + block * G * H;
  std::fill(out, out + G * H, 0.0f);
  for (int64_t s = span.begin; s < span.end; ++s) {
    const C* row = values + s * H;
    for (int64_t h = 0; h < H; h += kLanes) {
      const Vec value = Widen(row + h);  // widened once for the G queries
      for (int64_t g = 0; g < G; ++g) {
        float* o = out + g * H + h;
        Store(o, Fma(Splat(weights[g * S + s]), value, Load(o)));
      }
    }
  }
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
  for (int64_t g = 0; g < G; ++g) std::fill(scores + g * S, scores + (g + 1) * S, 0.0f);
  if (span.begin == span.end) return;
  for (int64_t m = span.begin / bs; m * bs < span.end; ++m) {
    const C* keys = p.cache + (pages.Block(b, m) * p.kv_heads + k) * H * bs;  // [H, bs]
    const int64_t first = std::max(span.begin, m * bs), last = std::min(span.end, (m + 1) * bs);
    const int64_t vector_last = first + (last - first) / kLanes * kLanes;
    for (int64_t h = 0; h < H; ++h) {
      const C* row = keys + h * bs - m * bs;  // row[s]: slot s of this block
      int64_t s = first;
      for (; s < vector_last; s += kLanes) {
        const Vec key = Widen(row + s);
        for (int64_t g = 0; g < G; ++g) {
          float* score = scores + g * S + s;
          Store(score, Fma(Splat(q[g * H + h]), key, Load(score)));
        }
      }
      for (; s < last; ++s) {
        const float key = WidenOne(row[s]);
        for (int64_t g = 0; g < G; ++g) {
          float* score = scores + g * S + s;
          *score = std::fma(q[g * H + h], key, *score);
        }
      }
    }
  }
}

template <typename C>
void PagedValuesBlock(const Problem<C>& p, const Pages& pages, int64_t block) {
  const int64_t b = block / p.kv_heads, k = block % p.kv_heads;
  const int64_t G = p.groups, H = p.head_dim, S = p.slots, bs = pages.block_size;
  const Span span = Unmasked(p.bias + b * S, S);
  const float* weights = p.rows + block * G * S;
  float* out = p.out + block * G * H;
  std::fill(out, out + G * H, 0.0f);
  for (int64_t s = span.begin; s < span.end; ++s) {
    const int64_t m = s / bs;
    const C* row = p.cache + ((pages.Block(b, m) * p.kv_heads + k) * bs + s - m * bs) * H;
    for (int64_t h = 0; h < H; h += kLanes) {
      const Vec value = Widen(row + h);
      for (int64_t g = 0; g < G; ++g) {
        float* o = out + g * H + h;
        Store(o, Fma(Splat(weights[g * S + s]), value, Load(o)));
      }
    }
  }
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
