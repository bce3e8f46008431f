// y[R, O] = x[R, I] @ dequantize(w)[O, I].T for 4-bit weights in blocks of 32 along I.
//
// Layout (genjax.kernels.q4): packed uint8[O, I/2], 16 bytes per block; byte j of a block holds
// element j in its low nibble and element j + 16 in its high nibble (llama.cpp's Q4_0/Q4_1
// order). scale and minimum float16[O, I/32]; element k of block g of row o is
// scale[o, g] * q + minimum[o, g] with q in 0..15.
//
// Per block the sum is split as in llama.cpp's Q4_1 dot product: the activations of each row
// are rounded to int8 per block of 32 (xq with one float scale dx, absmax / 127), so that
//   sum_k x[k] w[k] ~= scale * dx * sum_k xq[k] q[k] + minimum * sum_k x[k],
// the middle sum taken exactly in int32 by the CPU's u8 x s8 dot instructions (AVX-VNNI, or
// AVX2's maddubs), the last one in float over the unrounded activations. Chunks of output rows
// are shared by the calling thread and a team of helper threads (see Team).
//
// The integer block dot follows the method of llama.cpp's ggml_vec_dot_q4_1_q8_1; the code is
// genjax's own.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GENJAX_Q4_AVX2 1
#endif
#include <cmath>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowTile = 4;     // activation rows per pass over a weight row
constexpr int64_t kMaxBlocks = 1024; // inputs up to 32768 (checked at the call)
constexpr int64_t kPrefetchRows = 4;  // weight rows fetched ahead
constexpr int64_t kMinChunkRows = 16;  // fewer rows are not worth another thread

float HalfToFloat(uint16_t h) {
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

struct Problem {
  const float* x;           // [R, I]
  const uint8_t* packed;    // [O, I/2]
  const uint16_t* scale;    // [O, G]
  const uint16_t* minimum;  // [O, G]
  const int8_t* xq;         // [R, I] activations rounded per block
  const float* x_scale;     // [R, G] their scales
  const float* block_sums;  // [R, G] sums of the unrounded activations
  float* y;                 // [R, O]
  int64_t rows, outputs, inputs, blocks;
  int64_t chunk_rows;  // weight rows per unit of work
  bool exact;          // float activations (x_scale all 1, xq unused)
};

#ifdef GENJAX_Q4_AVX2
float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Sum over blocks of minimum[o, g] * block_sums[r, g] for one weight row: the minimums' share.
[[maybe_unused]] float MinimumShare(const uint16_t* mn, const float* sums, int64_t blocks) {
  float total = 0;
  for (int64_t g = 0; g < blocks; ++g) total += HalfToFloat(mn[g]) * sums[g];
  return total;
}

// y[r0:r0+N, o] for one weight row o and N activation rows (a compile-time count, so that the
// accumulators live in registers). Exact: float activations times the nibbles widened to float
// (x_scale is 1); else int8-rounded activations and integer block dots.
template <int N, bool Exact>
void RowTile(const Problem& p, int64_t o, int64_t r0) {
  const uint8_t* w = p.packed + o * (p.inputs / 2);
  const uint16_t* sc = p.scale + o * p.blocks;
  const uint16_t* mn = p.minimum + o * p.blocks;
#ifdef GENJAX_Q4_AVX2
  // Two accumulators per row (even and odd blocks) keep two independent add chains in flight.
  __m256 even[N], odd[N];
  for (int r = 0; r < N; ++r) even[r] = odd[r] = _mm256_setzero_ps();
  const int8_t* xq = p.xq + r0 * p.inputs;
  // combined[r][g] = scale[o, g] * dx[r, g], and the minimums' share of the sum (minimum[o, g]
  // times the block sums of x) started in odd[r], both 8 blocks at a time.
  float combined[N][kMaxBlocks];
  int64_t tail = 0;
  for (; tail + 8 <= p.blocks; tail += 8) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + tail)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + tail)));
    for (int r = 0; r < N; ++r) {
      const int64_t at = (r0 + r) * p.blocks + tail;
      _mm256_storeu_ps(combined[r] + tail, _mm256_mul_ps(d, _mm256_loadu_ps(p.x_scale + at)));
      odd[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(p.block_sums + at), odd[r]);
    }
  }
  float minimum_tail[N] = {};
  for (int64_t g = tail; g < p.blocks; ++g) {
    for (int r = 0; r < N; ++r) {
      const int64_t at = (r0 + r) * p.blocks + g;
      combined[r][g] = HalfToFloat(sc[g]) * p.x_scale[at];
      minimum_tail[r] += HalfToFloat(mn[g]) * p.block_sums[at];
    }
  }
  // The low nibbles of the block's 16 bytes in the lower half, the high ones in the upper half.
  const __m256i shifts = _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0);
  const __m256i low_mask = _mm256_set1_epi8(0x0f);
  auto block = [&](int64_t g, __m256* acc) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * 16));
    if constexpr (Exact) {
      const __m128i mask = _mm_set1_epi8(0x0f);
      const __m128i low = _mm_and_si128(bytes, mask);
      const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
      const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low));
      const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)));
      const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
      const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)));
      for (int r = 0; r < N; ++r) {
        const float* xb = p.x + (r0 + r) * p.inputs + g * kBlock;
        __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xb), q0);
        const __m256 u = _mm256_mul_ps(_mm256_loadu_ps(xb + 8), q1);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), q2, t);
        t = _mm256_add_ps(t, _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q3, u));
        acc[r] = _mm256_fmadd_ps(t, _mm256_broadcast_ss(combined[r] + g), acc[r]);
      }
    } else {
      const __m256i q = _mm256_and_si256(
          _mm256_srlv_epi32(_mm256_broadcastsi128_si256(bytes), shifts), low_mask);
      for (int r = 0; r < N; ++r) {
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * p.inputs + g * kBlock));
#if defined(__AVXVNNI__)
        const __m256i dot = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, v);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
        const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, v);
#else
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, v), _mm256_set1_epi16(1));
#endif
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(combined[r] + g),
                                 acc[r]);
      }
    }
  };
  int64_t g = 0;
  for (; g + 1 < p.blocks; g += 2) {
    block(g, even);
    block(g + 1, odd);
  }
  if (g < p.blocks) block(g, even);
  for (int r = 0; r < N; ++r) {
    p.y[(r0 + r) * p.outputs + o] = HorizontalSum(_mm256_add_ps(even[r], odd[r])) + minimum_tail[r];
  }
#else
  float acc[N] = {};
  for (int64_t g = 0; g < p.blocks; ++g) {
    const uint8_t* b = w + g * 16;
    const float d = HalfToFloat(sc[g]);
    for (int r = 0; r < N; ++r) {
      if constexpr (Exact) {
        const float* xb = p.x + (r0 + r) * p.inputs + g * kBlock;
        float t = 0;
        for (int k = 0; k < 16; ++k) {
          t += xb[k] * static_cast<float>(b[k] & 0x0f) + xb[k + 16] * static_cast<float>(b[k] >> 4);
        }
        acc[r] += t * d;
      } else {
        const int8_t* v = p.xq + (r0 + r) * p.inputs + g * kBlock;
        int32_t dot = 0;
        for (int k = 0; k < 16; ++k) dot += (b[k] & 0x0f) * v[k] + (b[k] >> 4) * v[k + 16];
        acc[r] += static_cast<float>(dot) * d * p.x_scale[(r0 + r) * p.blocks + g];
      }
    }
  }
  for (int r = 0; r < N; ++r) {
    p.y[(r0 + r) * p.outputs + o] =
        acc[r] + MinimumShare(mn, p.block_sums + (r0 + r) * p.blocks, p.blocks);
  }
#endif
}

template <bool Exact>
void RowTileOf(const Problem& p, int64_t o, int64_t r0, int64_t n) {
  switch (n) {
    case 1: return RowTile<1, Exact>(p, o, r0);
    case 2: return RowTile<2, Exact>(p, o, r0);
    case 3: return RowTile<3, Exact>(p, o, r0);
    default: return RowTile<4, Exact>(p, o, r0);
  }
}

// Asks for weight row o's bytes ahead of use: the hardware prefetcher alone leaves the loop
// waiting on memory for matrices that are not in cache (every matrix, in a decode step).
void Prefetch(const Problem& p, int64_t o) {
  const char* packed = reinterpret_cast<const char*>(p.packed + o * (p.inputs / 2));
  for (int64_t b = 0; b < p.inputs / 2; b += 64) __builtin_prefetch(packed + b);
  const char* scale = reinterpret_cast<const char*>(p.scale + o * p.blocks);
  const char* minimum = reinterpret_cast<const char*>(p.minimum + o * p.blocks);
  for (int64_t b = 0; b < p.blocks * 2; b += 64) {
    __builtin_prefetch(scale + b);
    __builtin_prefetch(minimum + b);
  }
}

void Chunk(const Problem& p, int64_t chunk) {
  const int64_t begin = chunk * p.chunk_rows;
  const int64_t end = begin + p.chunk_rows < p.outputs ? begin + p.chunk_rows : p.outputs;
  // Weight rows outermost: each is read from memory once and stays in L1 for every tile of
  // activation rows.
  for (int64_t o = begin; o < end; ++o) {
    if (o + kPrefetchRows < p.outputs) Prefetch(p, o + kPrefetchRows);
    for (int64_t r0 = 0; r0 < p.rows; r0 += kRowTile) {
      if (p.exact) {
        RowTileOf<true>(p, o, r0, std::min(kRowTile, p.rows - r0));
      } else {
        RowTileOf<false>(p, o, r0, std::min(kRowTile, p.rows - r0));
      }
    }
  }
}

// xq[r, k] = round(x[r, k] / dx[r, g]) with dx = absmax of the block / 127 (0 for a zero block),
// and the float sum of each block. Exact: only the sums, and dx = 1.
void RoundActivations(const float* x, int64_t rows, int64_t inputs, bool exact, int8_t* xq,
                      float* dx, float* sums) {
  const int64_t blocks = inputs / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < blocks; ++g) {
      const float* xb = x + r * inputs + g * kBlock;
      float absmax = 0, sum = 0;
      for (int k = 0; k < kBlock; ++k) {
        absmax = std::fmax(absmax, std::fabs(xb[k]));
        sum += xb[k];
      }
      sums[r * blocks + g] = sum;
      if (exact) {
        dx[r * blocks + g] = 1.0f;
        continue;
      }
      const float scale = absmax / 127.0f;
      const float inverse = scale > 0 ? 1.0f / scale : 0.0f;
      for (int k = 0; k < kBlock; ++k) {
        xq[r * inputs + g * kBlock + k] = static_cast<int8_t>(std::nearbyint(xb[k] * inverse));
      }
      dx[r * blocks + g] = scale;
    }
  }
}

// One product's work: chunks of weight rows, claimed through an atomic counter by the calling
// thread and the helper team. Owned jointly, because a helper may look at it after the call
// has returned (it then finds no chunk left and only drops its reference).
struct Job {
  Problem problem;
  std::vector<int8_t> xq;
  std::vector<float> x_scale;
  std::vector<float> block_sums;
  int64_t chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    int64_t mine = 0;
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      Chunk(problem, c);
      ++mine;
    }
    if (mine) done.fetch_add(mine);
  }
};

// Helper threads kept for the process's life. A decode step runs hundreds of small products
// back to back (tens of microseconds each); waking a sleeping thread for each costs about as
// much as the product, so a helper spins for a short while after each job, waiting for the
// next, and only then sleeps. Jobs are published as a generation number and a shared pointer.
class Team {
 public:
  explicit Team(int helpers) {
    for (int t = 0; t < helpers; ++t) std::thread([this] { Loop(); }).detach();
    size_ = helpers;
  }

  int size() const { return size_; }

  void Run(const std::shared_ptr<Job>& job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleeping_.load() > 0) wake_.notify_all();
    job->Work();
    while (job->done.load(std::memory_order_acquire) < job->chunks) Pause();
  }

 private:
  static void Pause() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
  }

  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      int64_t polls = 0;
      while (generation_.load(std::memory_order_acquire) == seen) {
        Pause();
        if (++polls % 256 == 0 && std::chrono::steady_clock::now() > until) break;
      }
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (generation_.load() == seen) {
          sleeping_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          sleeping_.fetch_sub(1);
        }
        seen = generation_.load();
        job = job_;
      }
      job->Work();
    }
  }

  static constexpr std::chrono::microseconds kSpin{100};
  int size_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleeping_{0};
  std::shared_ptr<Job> job_;
  std::mutex mutex_;
  std::condition_variable wake_;
};

// The team, made on first use with one helper fewer than XLA's intra-op threads (the calling
// thread is the last); never destroyed, its threads end with the process.
Team& TeamFor(int64_t threads) {
  static Team* team = new Team(threads > 1 ? static_cast<int>(threads - 1) : 0);
  return *team;
}

ffi::Error Q4MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F16> scale,
                        ffi::Buffer<ffi::F16> minimum, bool exact,
                        ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = packed.dimensions();
  if (xd.size() != 2 || wd.size() != 2) {
    return ffi::Error::InvalidArgument("q4_matmul: x and packed must be matrices");
  }
  const int64_t rows = xd[0], inputs = xd[1], outputs = wd[0];
  if (inputs % kBlock != 0 || wd[1] * 2 != inputs || inputs > kMaxBlocks * kBlock) {
    return ffi::Error::InvalidArgument(
        "q4_matmul: inputs must be a multiple of 32 up to 32768 and packed [outputs, inputs / 2]");
  }
  auto job = std::make_shared<Job>();
  const int64_t blocks = inputs / kBlock;
  job->xq.resize(exact ? 0 : rows * inputs);
  job->x_scale.resize(rows * blocks);
  job->block_sums.resize(rows * blocks);
  RoundActivations(x.typed_data(), rows, inputs, exact, job->xq.data(), job->x_scale.data(),
                   job->block_sums.data());
  job->problem = Problem{x.typed_data(),
                         packed.typed_data(),
                         reinterpret_cast<const uint16_t*>(scale.typed_data()),
                         reinterpret_cast<const uint16_t*>(minimum.typed_data()),
                         job->xq.data(),
                         job->x_scale.data(),
                         job->block_sums.data(),
                         y->typed_data(),
                         rows,
                         outputs,
                         inputs,
                         blocks,
                         0,
                         exact};
  // One contiguous range of weight rows per thread: each thread then streams one region of
  // memory, which measured faster than interleaved smaller chunks (26 against 12-18 GB/s).
  Team& team = TeamFor(pool.num_threads());
  const int64_t threads = team.size() + 1;
  job->problem.chunk_rows = std::max<int64_t>((outputs + threads - 1) / threads, kMinChunkRows);
  job->chunks = (outputs + job->problem.chunk_rows - 1) / job->problem.chunk_rows;
  if (team.size() == 0 || job->chunks < 2) {
    job->Work();
  } else {
    team.Run(job);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GenjaxQ4Matmul, Q4MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Attr<bool>("exact")
                                  .Ret<ffi::Buffer<ffi::F32>>());
