// Helper threads shared by genjax's CPU kernels, and the jobs they split between them.
//
// A job is a count of independent chunks (ranges of a product's output rows), claimed through an
// atomic counter by the calling thread and the helpers. A decode step runs hundreds of small
// products back to back (tens of microseconds each); waking a sleeping thread for each costs
// about as much as the product, so a helper spins for a short while after each job, waiting for
// the next, and only then sleeps. Jobs are published as a generation number and a shared pointer,
// owned jointly because a helper may look at a job after its call has returned (it then finds no
// chunk left and only drops its reference).

#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>

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

class Team {
 public:
  explicit Team(int helpers) {
    for (int t = 0; t < helpers; ++t) std::thread([this] { Loop(); }).detach();
    size_ = helpers;
  }

  int size() const { return size_; }

  // Runs every chunk of `job`, on this thread and the helpers; returns when all are done.
  void Run(const std::shared_ptr<Job>& job) {
    if (size_ == 0 || job->chunks < 2) {
      job->Work();
      return;
    }
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

// The process's team, made on first use with one helper fewer than XLA's intra-op threads (the
// calling thread is the last); never destroyed, its threads end with the process. Each kernel
// library has its own.
inline Team& TeamFor(int64_t threads) {
  static Team* team = new Team(threads > 1 ? static_cast<int>(threads - 1) : 0);
  return *team;
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
