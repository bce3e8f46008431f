// How genjax's CPU kernels split a call between threads: jobs of independent chunks, run on the
// calling thread and on XLA's own intra-op thread pool.
//
// A job is a count of independent chunks (ranges of a product's output rows, or attention
// blocks), claimed through an atomic counter by every thread that works on it. The job is owned
// jointly (a shared pointer) because a task may start after its call has returned: it then finds
// no chunk left and only drops its reference.
//
// Why XLA's pool: a decode step runs hundreds of small ops back to back (tens of microseconds
// each), so a thread woken from sleep for each costs about as much as the op. XLA's idle workers
// spin for a while before they sleep, so a task handed to them between ops starts at once. A team
// of genjax's own spinning helpers, used before, competed with those workers for the cores: on the
// 2-core Intel Xeon, SmolLM's greedy step with it took 82.3 against 76.3 ms in float32 at batch 32,
// 77.0 against 65.4 with int8 weights, 30.3 against 24.1 in bfloat16 at batch 8 (bench/README.md).

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace genjax_kernels {

struct Job {
  virtual ~Job() = default;
  virtual void Chunk(int64_t chunk) = 0;

  int64_t chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    int64_t mine = 0;
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      Chunk(c);
      ++mine;
    }
    if (mine) done.fetch_add(mine);
  }
};

inline void PauseBriefly() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Runs every chunk of `job` on this thread and on tasks handed to `pool` (xla::ffi::ThreadPool,
// the call's intra-op pool); returns when all are done.
template <typename Pool>
void Run(Pool& pool, const std::shared_ptr<Job>& job) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, job->chunks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->Work(); });
  job->Work();
  while (job->done.load(std::memory_order_acquire) < job->chunks) PauseBriefly();
}

// Chunk size in output rows: one contiguous range per thread (each thread then streams one
// region of memory, which measured faster than interleaved smaller chunks: 26 against 12-18
// GB/s), a whole multiple of `tile` rows and at least `minimum`.
inline int64_t ChunkRows(int64_t outputs, int64_t threads, int64_t minimum) {
  const int64_t share = (outputs + threads - 1) / threads;
  const int64_t rows = (share + minimum - 1) / minimum * minimum;
  return rows > minimum ? rows : minimum;
}

}  // namespace genjax_kernels
