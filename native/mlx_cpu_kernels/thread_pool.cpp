#include "thread_pool.h"

#include <chrono>
#include <memory>

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GMLX_PAUSE() _mm_pause()
#else
#define GMLX_PAUSE() std::this_thread::yield()
#endif

namespace gmlx_kernels {

namespace {
// How long an idle worker polls for the next job before it sleeps: longer than the
// gap between two products of a decode step, short enough to free the core soon after.
constexpr auto kSpinTime = std::chrono::microseconds(200);

constexpr uint64_t kClosedChunk = 0xFFFFFFFFu;  // above any chunk count: nothing to claim

std::atomic<int64_t> g_num_pool_jobs{0};  // jobs handed to the workers, for diagnostics
std::atomic<bool> g_is_yielding_spin{true};

uint64_t generation_of(uint64_t ticket) { return ticket >> 32; }
int64_t chunk_of(uint64_t ticket) { return static_cast<int64_t>(ticket & 0xFFFFFFFFu); }
}  // namespace

ThreadPool::ThreadPool(int num_threads) : num_threads_(num_threads < 1 ? 1 : num_threads) {
  for (int i = 1; i < num_threads_; ++i) {
    workers_.emplace_back([this] { worker_loop(); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    is_stopping_ = true;
    ticket_.store((generation_of(ticket_.load()) + 1) << 32);
  }
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::take_chunks(uint64_t generation) {
  // The job's fields are read before each claim; a claim that succeeds proves the job
  // was still open then, so they were this job's: the caller closes a job's ticket
  // before it writes the next job's fields, and publishes a ticket only after them.
  for (;;) {
    ChunkFn fn = fn_.load(std::memory_order_acquire);
    void* context = context_.load(std::memory_order_acquire);
    int64_t num_chunks = num_chunks_.load(std::memory_order_acquire);
    uint64_t ticket = ticket_.load(std::memory_order_acquire);
    if (generation_of(ticket) != generation || chunk_of(ticket) >= num_chunks) return;
    if (!ticket_.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel)) continue;
    fn(context, chunk_of(ticket));
    num_done_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    auto spin_until = std::chrono::steady_clock::now() + kSpinTime;
    int num_polls = 0;
    while (generation_of(ticket_.load(std::memory_order_acquire)) == seen) {
      GMLX_PAUSE();
      if (++num_polls % 64 != 0) continue;
      // Give the core to another runnable thread (the Python thread building the next
      // step's graph) while polling: on 2 cores a pure spin took it from that thread.
      if (g_is_yielding_spin.load(std::memory_order_relaxed)) std::this_thread::yield();
      if (std::chrono::steady_clock::now() > spin_until) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_of(ticket_.load()) != seen; });
      }
    }
    seen = generation_of(ticket_.load(std::memory_order_acquire));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (is_stopping_) return;
    }
    take_chunks(seen);
  }
}

void ThreadPool::run(ChunkFn fn, void* context, int64_t num_chunks) {
  if (num_chunks <= 0) return;
  if (num_threads_ == 1 || num_chunks == 1) {
    for (int64_t i = 0; i < num_chunks; ++i) fn(context, i);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  g_num_pool_jobs.fetch_add(1, std::memory_order_relaxed);
  fn_.store(fn, std::memory_order_release);
  context_.store(context, std::memory_order_release);
  num_chunks_.store(num_chunks, std::memory_order_release);
  num_done_.store(0, std::memory_order_release);
  uint64_t generation = generation_of(ticket_.load()) + 1;
  {
    // Under the mutex so a worker about to sleep cannot miss the new generation.
    std::lock_guard<std::mutex> lock(mutex_);
    ticket_.store(generation << 32, std::memory_order_release);
  }
  wake_.notify_all();
  take_chunks(generation);
  // Only chunks count: a worker that has not woken yet holds nothing up.
  while (num_done_.load(std::memory_order_acquire) != num_chunks) GMLX_PAUSE();
  // Close the job before the next one's fields are written: a late worker that reads
  // those fields must not find this job's ticket still claimable under them.
  ticket_.store((generation << 32) | kClosedChunk, std::memory_order_release);
}

namespace {
std::mutex g_pool_mutex;
std::unique_ptr<ThreadPool> g_pool;
}  // namespace

int default_num_threads() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

void run_on_pool(ThreadPool::ChunkFn fn, void* context, int64_t num_chunks) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (!g_pool) g_pool = std::make_unique<ThreadPool>(default_num_threads());
  g_pool->run(fn, context, num_chunks);
}

int64_t num_pool_jobs() { return g_num_pool_jobs.load(); }
void set_yielding_spin(bool is_yielding) { g_is_yielding_spin.store(is_yielding); }

int pool_num_threads() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  return g_pool ? g_pool->num_threads() : default_num_threads();
}

void set_num_threads(int num_threads) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  int n = num_threads < 1 ? default_num_threads() : num_threads;
  if (g_pool && g_pool->num_threads() == n) return;
  g_pool.reset();  // joins the old workers
  g_pool = std::make_unique<ThreadPool>(n);
}

}  // namespace gmlx_kernels
