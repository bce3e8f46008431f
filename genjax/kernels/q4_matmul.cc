// y[R, O] = x[R, I] @ dequantize(w)[O, I].T for 4-bit weights in blocks of 32 along I.
//
// Layout (genjax.kernels.q4): packed uint8[O, I/2], 16 bytes per block; byte j of a block holds
// element j in its low nibble and element j + 16 in its high nibble (llama.cpp's Q4_0/Q4_1
// order). scale and minimum float16[O, I/32]; element k of block g of row o is
// scale[o, g] * q + minimum[o, g] with q in 0..15.
//
// Rounded products (decode steps) split each block's sum as llama.cpp's Q4_1 dot product does:
// the activations of each row are rounded to int8 per block of 32 (xq with one float scale dx,
// absmax / 127), so that
//   sum_k x[k] w[k] ~= scale * dx * sum_k xq[k] q[k] + minimum * sum_k x[k],
// the middle sum taken exactly in int32 by the CPU's u8 x s8 dot instructions (AVX-VNNI, or
// AVX2's maddubs), the last one in float over the unrounded activations
// (q4_matmul_rounded.h). Exact products (prompts) dequantize panels of weight rows to float32
// and run a register-tiled FMA product over the activation rows (q4_matmul_exact.h). Each
// kernel fixes the order of its float operations per output, so a row's result does not depend
// on the other rows of the call. Ranges of output rows are shared by the calling thread and the
// threads of XLA's intra-op pool (team.h).
//
// The integer block dot follows the method of llama.cpp's ggml_vec_dot_q4_1_q8_1; the code is
// genjax's own.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "q4_matmul_common.h"
#include "q4_matmul_exact.h"
#include "q4_matmul_rounded.h"
#include "team.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace genjax_q4 {

constexpr int64_t kMinChunkRows = 16;  // fewer weight rows are not worth another thread
// From this many activation rows, rounded products take RoundedGemm (one activation row per
// lane) rather than RoundedRows (one weight row per lane).
constexpr int64_t kGemmMinRows = 8;

void Chunk(const Problem& p, int64_t chunk) {
  const int64_t begin = chunk * p.chunk_rows;
  const int64_t end = std::min(begin + p.chunk_rows, p.outputs);
#ifdef GENJAX_Q4_AVX2
  if (p.exact) {
    Exact(p, begin, end);
  } else if (p.rows >= kGemmMinRows) {
    RoundedGemm(p, begin, end);
  } else {
    RoundedRows(p, begin, end);
  }
#else
  for (int64_t o = begin; o < end; ++o) {
    for (int64_t r = 0; r < p.rows; ++r) {
      p.y[r * p.outputs + o] = p.exact ? ExactOutput(p, r, o) : RoundedOutput(p, r, o);
    }
  }
#endif
}

// xq[r, k] = round(x[r, k] / dx[r, g]) with dx = absmax of the block / 127 (0 for a zero block),
// and the float sum of each block.
void RoundActivations(const float* x, int64_t rows, int64_t inputs, int8_t* xq, float* dx,
                      float* sums) {
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
      const float scale = absmax / 127.0f;
      const float inverse = scale > 0 ? 1.0f / scale : 0.0f;
      for (int k = 0; k < kBlock; ++k) {
        xq[r * inputs + g * kBlock + k] = static_cast<int8_t>(std::nearbyint(xb[k] * inverse));
      }
      dx[r * blocks + g] = scale;
    }
  }
}

// The rounded activations in RoundedGemm's layout (Problem::xq_groups and the two [R/8, G, 8]
// arrays); rows past the last are zeros, so their lanes compute zeros that are not stored.
void GroupActivations(const int8_t* xq, const float* dx, const float* sums, int64_t rows,
                      int64_t blocks, int8_t* xq_groups, float* dx_groups, float* sums_groups) {
  const int64_t groups = (rows + 7) / 8, inputs = blocks * kBlock;
  for (int64_t rg = 0; rg < groups; ++rg) {
    for (int64_t g = 0; g < blocks; ++g) {
      int8_t* out = xq_groups + (rg * blocks + g) * 8 * 32;
      for (int l = 0; l < 8; ++l) {
        const int64_t r = rg * 8 + l;
        const bool real = r < rows;
        dx_groups[(rg * blocks + g) * 8 + l] = real ? dx[r * blocks + g] : 0.0f;
        sums_groups[(rg * blocks + g) * 8 + l] = real ? sums[r * blocks + g] : 0.0f;
        for (int j = 0; j < 8; ++j) {
          int8_t* lane = out + j * 32 + l * 4;
          if (real) {
            std::memcpy(lane, xq + r * inputs + g * kBlock + 4 * j, 4);
          } else {
            std::memset(lane, 0, 4);
          }
        }
      }
    }
  }
}

// One product's work: chunks of weight rows, shared by the calling thread and XLA's pool
// (team.h), with the rounded activations it reads.
struct Job : genjax_kernels::Job {
  Problem problem;
  std::vector<int8_t> xq, xq_groups;
  std::vector<float> x_scale, block_sums, x_scale_groups, block_sums_groups;

  void Chunk(int64_t chunk) override { genjax_q4::Chunk(problem, chunk); }
};

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
  Problem& p = job->problem;
  p = Problem{};
  p.x = x.typed_data();
  p.packed = packed.typed_data();
  p.scale = reinterpret_cast<const uint16_t*>(scale.typed_data());
  p.minimum = reinterpret_cast<const uint16_t*>(minimum.typed_data());
  p.y = y->typed_data();
  p.rows = rows;
  p.outputs = outputs;
  p.inputs = inputs;
  p.blocks = blocks;
  p.exact = exact;
  if (!exact) {
    job->xq.resize(rows * inputs);
    job->x_scale.resize(rows * blocks);
    job->block_sums.resize(rows * blocks);
    RoundActivations(p.x, rows, inputs, job->xq.data(), job->x_scale.data(),
                     job->block_sums.data());
    p.xq = job->xq.data();
    p.x_scale = job->x_scale.data();
    p.block_sums = job->block_sums.data();
    if (rows >= kGemmMinRows) {
      const int64_t padded = (rows + 7) / 8 * 8;
      job->xq_groups.resize(padded * inputs);
      job->x_scale_groups.resize(padded * blocks);
      job->block_sums_groups.resize(padded * blocks);
      GroupActivations(p.xq, p.x_scale, p.block_sums, rows, blocks, job->xq_groups.data(),
                       job->x_scale_groups.data(), job->block_sums_groups.data());
      p.xq_groups = job->xq_groups.data();
      p.x_scale_groups = job->x_scale_groups.data();
      p.block_sums_groups = job->block_sums_groups.data();
    }
  }
  // Ranges are whole multiples of the kernels' tiles of weight rows (kMinChunkRows).
  p.chunk_rows = genjax_kernels::ChunkRows(outputs, pool.num_threads(), kMinChunkRows);
  job->chunks = (outputs + p.chunk_rows - 1) / p.chunk_rows;
  genjax_kernels::Run(pool, job);
  return ffi::Error::Success();
}

}  // namespace genjax_q4

XLA_FFI_DEFINE_HANDLER_SYMBOL(GenjaxQ4Matmul, genjax_q4::Q4MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Attr<bool>("exact")
                                  .Ret<ffi::Buffer<ffi::F32>>());
