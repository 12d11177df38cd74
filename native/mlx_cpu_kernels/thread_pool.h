// A small persistent pool for the decode kernels: a call's work is split into chunks
// that the caller and the workers take in turn. Workers spin briefly after each job
// (a decode step issues a few hundred back-to-back calls) and then sleep.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace gmlx_kernels {

class ThreadPool {
 public:
  using ChunkFn = void (*)(void* context, int64_t chunk);

  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Runs fn(context, i) for every i in [0, num_chunks), on the caller and the workers.
  void run(ChunkFn fn, void* context, int64_t num_chunks);

 private:
  void worker_loop();
  // Runs chunks of job `generation` until none is left; false once that job is gone.
  void take_chunks(uint64_t generation);

  int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;  // guards sleeping/waking and is_stopping_
  std::condition_variable wake_;
  std::mutex run_mutex_;  // one job at a time
  // (job generation << 32) | next chunk: a worker that wakes late can claim chunks
  // only of the job it woke for, and finds none once that job is done.
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> num_done_{0};
  std::atomic<ChunkFn> fn_{nullptr};
  std::atomic<void*> context_{nullptr};
  std::atomic<int64_t> num_chunks_{0};
  bool is_stopping_ = false;
};

// The process-wide pool. A job holds it, so resizing waits for the job and then joins
// the old workers.
void run_on_pool(ThreadPool::ChunkFn fn, void* context, int64_t num_chunks);
int pool_num_threads();
// Jobs the pool has handed to its workers since the process started (diagnostics, benchmarks).
int64_t num_pool_jobs();
// Idle workers poll with sched_yield (default) or a pure pause spin (for A/B runs and tests).
void set_yielding_spin(bool is_yielding);
void set_num_threads(int num_threads);
int default_num_threads();

}  // namespace gmlx_kernels
