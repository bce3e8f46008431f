// Copies rows of a paged KV pool's blocks into logical order:
//
//   out[b, p, m, :] = pool[table[b, m], p, :]     pool [N, P, R], table int32 [B, M],
//                                                  out [B, P, M, R]
//
// (and rows of a table [N, R], as a pool [N, 1, R]: genjax.models.layers.take_rows).
//
// Keys pools [N, K, H, bs] are gathered as P = K * H, R = bs (out: [B, K, H, M * bs]); values
// pools [N, K, bs, H] as P = K, R = bs * H (out: [B, K, M * bs, H]): genjax.cache.paged's
// layouts, reshaped for free on the Python side. A table entry counts from the end when
// negative and is clamped into [0, N), as a JAX gather's index is.
//
// Why not XLA: XLA:CPU's gather followed by the transpose into logical order copied SmolLM's 30
// layers of 8 rows x 44 blocks (260 MB) in 68 ms on the 2-core Intel Xeon, under 4 GB/s; these
// are plain runs of R elements (64 bytes for a float32 key run, 4 KiB for a values run).
//
// Work: the (b, p) pairs are shared out between the threads (team.h). Bits are copied as they
// are, so any element type of the pool gives XLA's values.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "team.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace genjax_block_gather {

struct GatherJob : genjax_kernels::Job {
  const char* pool;
  const int32_t* table;
  char* out;
  int64_t pool_blocks, parts, blocks_per_row, run_bytes, pairs_per_chunk, pairs;

  void Chunk(int64_t chunk) override {
    const int64_t first = chunk * pairs_per_chunk;
    const int64_t last = std::min(first + pairs_per_chunk, pairs);
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t b = pair / parts, p = pair % parts;
      char* target = out + pair * blocks_per_row * run_bytes;
      for (int64_t m = 0; m < blocks_per_row; ++m) {
        int64_t block = table[b * blocks_per_row + m];
        if (block < 0) block += pool_blocks;
        block = std::clamp<int64_t>(block, 0, pool_blocks - 1);
        std::memcpy(target + m * run_bytes, pool + (block * parts + p) * run_bytes, run_bytes);
      }
    }
  }
};

inline ffi::Error Gather(ffi::ThreadPool pool, ffi::AnyBuffer blocks, ffi::Buffer<ffi::S32> table,
                         ffi::Result<ffi::AnyBuffer> out) {
  // A pool [N, R] (an embedding table) is gathered as [N, 1, R]: passed as it is, since XLA
  // copies a reshaped parameter that a decode loop carries.
  const auto given = blocks.dimensions();
  const bool flat = given.size() == 2;
  const int64_t pd[3] = {given.size() ? given[0] : 0, flat ? 1 : given.size() > 1 ? given[1] : 0,
                         flat ? given[1] : given.size() > 2 ? given[2] : 0};
  const auto td = table.dimensions();
  const auto od = out->dimensions();
  if ((given.size() != 3 && !flat) || td.size() != 2 || od.size() != 4 || od[0] != td[0] ||
      od[1] != pd[1] || od[2] != td[1] || od[3] != pd[2] ||
      out->element_type() != blocks.element_type() || pd[0] < 1) {
    return ffi::Error::InvalidArgument(
        "block_gather: pool [N, P, R] (or [N, R]), table [B, M] and out [B, P, M, R] of the "
        "pool's type expected");
  }
  auto job = std::make_shared<GatherJob>();
  job->pool = static_cast<const char*>(blocks.untyped_data());
  job->table = table.typed_data();
  job->out = static_cast<char*>(out->untyped_data());
  job->pool_blocks = pd[0];
  job->parts = pd[1];
  job->blocks_per_row = td[1];
  job->run_bytes = pd[2] * static_cast<int64_t>(ffi::ByteWidth(blocks.element_type()));
  job->pairs = td[0] * pd[1];
  // One contiguous range of (b, p) pairs per thread: each streams one region of the output.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  job->pairs_per_chunk = std::max<int64_t>(1, (job->pairs + threads - 1) / threads);
  job->chunks = (job->pairs + job->pairs_per_chunk - 1) / job->pairs_per_chunk;
  if (job->chunks > 0) genjax_kernels::Run(pool, job);
  return ffi::Error::Success();
}

}  // namespace genjax_block_gather

XLA_FFI_DEFINE_HANDLER_SYMBOL(GenjaxBlockGather, genjax_block_gather::Gather,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
