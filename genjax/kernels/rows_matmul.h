// y[R, O] = x[R, I] @ w[O, I].T (times scale[O] for int8 weights) for float32 activations, weights
// in float32, bfloat16 or int8, and a few activation rows (decode steps at batch 1-32, beams,
// speculative verification), reading the weights from memory once. Narrow weights are widened to
// float32 in registers (exactly: every bfloat16 and int8 value is a float32 value), so the sums
// are float32 sums of exact products whatever the weights' type.
//
// Why not XLA's products: XLA:CPU's one-row product reads the weights slower, and with several
// rows it packs the weights (or, for int8, writes a float copy) before multiplying. Times over a
// SmolLM-shaped stack of matrices: bench/matmul_stack.py and bench/README.md.
//
// Work: each thread takes one contiguous range of weight rows (team.h). Within it,
// a tile of kTile weight rows is multiplied by every register tile of activation rows in turn,
// so the weight tile comes from memory once and from L1 for the later register tiles. More than
// kBlockRows activation rows (int8 prompts) go a block at a time through the whole range. Each
// output's arithmetic is fixed whatever the number of rows and threads: kLanes partial sums over
// the inputs (input k feeds partial k mod kLanes, one fused multiply-add per input, in input
// order), then summed by halves. So a row's result does not depend on the other rows of the call:
// a request decoded beside others gets the bits it gets alone.
//
// bfloat16 weights with bfloat16 activations, on CPUs with AVX-512 BF16 (vdpbf16ps): the pair
// product takes 32 inputs per instruction, lane i adding the exact products of inputs 2i and
// 2i + 1 to its float32 partial sum (as the instruction defines it: round to nearest even,
// subnormal inputs and sums flushed to zero). Twice the multiply-adds per instruction of the
// widening path, which spends as long widening the weights as multiplying them. The order is
// again fixed per output, so rows stay independent of each other here too.
//
// Inputs must be a multiple of 16 (32 for the pair product; genjax.kernels.rows checks before
// calling).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "team.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace genjax_rows {

constexpr int64_t kMinChunkRows = 16;  // fewer weight rows are not worth another thread
// Activation rows multiplied by a thread's weight rows before it moves on to the next rows: 32
// rows of 1536 float32 inputs (196 KB) stay in L2 while the weights pass. A prompt of more rows
// reads the thread's weights again per block, from L2 or L3 when they fit.
constexpr int64_t kBlockRows = 32;

// Step: how one group of inputs is loaded and multiplied (Widening or PairDot below), with its
// activation type X and weight type W.
template <typename Step>
struct Problem {
  const typename Step::X* x;  // [R, I]
  const typename Step::W* w;  // [O, I]
  const float* scale;  // [O] for int8 weights, else null
  float* y;            // [R, O]
  int64_t rows, outputs, inputs, chunk_rows;
};

using namespace genjax_kernels;

#if defined(__AVX512F__)
// Weight rows per tile and activation rows per register tile: 6 x 4 accumulators, 4 weight
// vectors and one activation vector of the 32 registers.
constexpr int kTile = 4;
constexpr int kRegisterRows = 6;
#else
constexpr int kTile = 2;  // 4 x 2 accumulators of the 16 registers
constexpr int kRegisterRows = 4;
#endif

// float32 activations, weights of type Wt widened to float32: kLanes inputs per step, input k
// into partial sum k mod kLanes.
template <typename Wt>
struct Widening {
  using X = float;
  using W = Wt;
  using Operand = Vec;
  static constexpr int kInputs = kLanes;
  static Operand LoadX(const float* x) { return Load(x); }
  static Operand LoadW(const W* w) { return Widen(w); }
  static Vec Add(Vec acc, Operand a, Operand w) { return Fma(a, w, acc); }
};

#if defined(__AVX512BF16__)
// bfloat16 activations and weights (as uint16_t bits): 32 inputs per step, inputs 2i and 2i + 1
// into partial sum i.
struct PairDot {
  using X = uint16_t;
  using W = uint16_t;
  using Operand = __m512bh;
  static constexpr int kInputs = 32;
  static Operand LoadX(const uint16_t* x) { return (__m512bh)_mm512_loadu_si512(x); }
  static Operand LoadW(const uint16_t* w) { return (__m512bh)_mm512_loadu_si512(w); }
  static Vec Add(Vec acc, Operand a, Operand w) { return _mm512_dpbf16_ps(acc, a, w); }
};
#endif

// y[r0:r0+NR, o0:o0+NO].
template <typename Step, int NR, int NO>
void Tile(const Problem<Step>& p, int64_t o0, int64_t r0) {
  Vec acc[NR][NO];
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NO; ++t) acc[r][t] = Zero();
  }
  const typename Step::X* x = p.x + r0 * p.inputs;
  const typename Step::W* w = p.w + o0 * p.inputs;
  for (int64_t k = 0; k < p.inputs; k += Step::kInputs) {
    typename Step::Operand wk[NO];
    for (int t = 0; t < NO; ++t) wk[t] = Step::LoadW(w + t * p.inputs + k);
    // The next tile's weights, into L2: the hardware prefetcher alone falls behind once a few
    // rows' multiplications sit between the loads (5 rows: 1.45x the one-row time without this
    // prefetch, 1.2x with it).
    for (int t = 0; t < NO; ++t) __builtin_prefetch(w + (NO + t) * p.inputs + k, 0, 2);
    for (int r = 0; r < NR; ++r) {
      const typename Step::Operand a = Step::LoadX(x + r * p.inputs + k);
      for (int t = 0; t < NO; ++t) acc[r][t] = Step::Add(acc[r][t], a, wk[t]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    float* y = p.y + (r0 + r) * p.outputs + o0;
    for (int t = 0; t < NO; ++t) y[t] = p.scale ? Sum(acc[r][t]) * p.scale[o0 + t] : Sum(acc[r][t]);
  }
}

// Weight rows [o0, o0 + NO) against activation rows [r, end), a register tile at a time.
template <typename Step, int NO>
void BlockRows(const Problem<Step>& p, int64_t o0, int64_t r, int64_t end) {
  for (; r + kRegisterRows <= end; r += kRegisterRows) Tile<Step, kRegisterRows, NO>(p, o0, r);
  switch (end - r) {
    case 1: Tile<Step, 1, NO>(p, o0, r); break;
    case 2: Tile<Step, 2, NO>(p, o0, r); break;
    case 3: Tile<Step, 3, NO>(p, o0, r); break;
#if defined(__AVX512F__)
    case 4: Tile<Step, 4, NO>(p, o0, r); break;
    case 5: Tile<Step, 5, NO>(p, o0, r); break;
#endif
    default: break;
  }
}

template <typename Step>
struct RowsJob : genjax_kernels::Job {
  Problem<Step> p;
  void Chunk(int64_t chunk) override {
    const int64_t begin = chunk * p.chunk_rows;
    const int64_t end = std::min(begin + p.chunk_rows, p.outputs);
    for (int64_t r = 0; r < p.rows; r += kBlockRows) {
      const int64_t r_end = std::min(r + kBlockRows, p.rows);
      int64_t o = begin;
      for (; o + kTile <= end; o += kTile) BlockRows<Step, kTile>(p, o, r, r_end);
      for (; o < end; ++o) BlockRows<Step, 1>(p, o, r, r_end);
    }
  }
};

template <typename Step>
ffi::Error Run(ffi::ThreadPool pool, const typename Step::X* x, ffi::Span<const int64_t> xd,
               const typename Step::W* w, ffi::Span<const int64_t> wd, const float* scale,
               float* y) {
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || xd[1] % Step::kInputs != 0) {
    return ffi::Error::InvalidArgument(
        "rows_matmul: x [R, I] and w [O, I] must be matrices with I a multiple of 16 (32 for "
        "bfloat16 activations)");
  }
  auto job = std::make_shared<RowsJob<Step>>();
  job->p = Problem<Step>{x, w, scale, y, xd[0], wd[0], xd[1], 0};
  job->p.chunk_rows = genjax_kernels::ChunkRows(job->p.outputs, pool.num_threads(), kMinChunkRows);
  job->chunks = (job->p.outputs + job->p.chunk_rows - 1) / job->p.chunk_rows;
  genjax_kernels::Run(pool, job);
  return ffi::Error::Success();
}

ffi::Error Float32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> y) {
  return Run<Widening<float>>(pool, x.typed_data(), x.dimensions(), w.typed_data(),
                              w.dimensions(), nullptr, y->typed_data());
}

ffi::Error Bfloat16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto* bits = reinterpret_cast<const uint16_t*>(w.typed_data());
  return Run<Widening<uint16_t>>(pool, x.typed_data(), x.dimensions(), bits, w.dimensions(),
                                 nullptr, y->typed_data());
}

#if defined(__AVX512BF16__)
ffi::Error Bfloat16Pairs(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                         ffi::ResultBuffer<ffi::F32> y) {
  const auto* x_bits = reinterpret_cast<const uint16_t*>(x.typed_data());
  const auto* w_bits = reinterpret_cast<const uint16_t*>(w.typed_data());
  return Run<PairDot>(pool, x_bits, x.dimensions(), w_bits, w.dimensions(), nullptr,
                      y->typed_data());
}
#endif

ffi::Error Int8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  if (scale.element_count() != w.dimensions()[0]) {
    return ffi::Error::InvalidArgument("rows_matmul: scale must hold one float per output");
  }
  return Run<Widening<int8_t>>(pool, x.typed_data(), x.dimensions(), w.typed_data(),
                               w.dimensions(), scale.typed_data(), y->typed_data());
}

}  // namespace genjax_rows

XLA_FFI_DEFINE_HANDLER_SYMBOL(GenjaxRowsMatmulF32, genjax_rows::Float32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GenjaxRowsMatmulBF16, genjax_rows::Bfloat16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GenjaxRowsMatmulS8, genjax_rows::Int8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#if defined(__AVX512BF16__)
XLA_FFI_DEFINE_HANDLER_SYMBOL(GenjaxRowsMatmulBF16Pairs, genjax_rows::Bfloat16Pairs,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#endif
