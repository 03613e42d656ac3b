// The worker threads behind parallel_claim (common.h), in place of an OpenMP team.
//
// A 16-request decode step opens ~200 parallel regions, a few microseconds of serial work apart. OpenMP
// gives two choices for its idle workers: spin (its default, ~3 ms), which steals the cores the server's
// HTTP loop and, on small machines, its clients need between steps; or sleep at once (the server's
// OMP_WAIT_POLICY=PASSIVE), which costs a futex wake of ~15 us or more at every one of those regions. These
// workers spin for kSpin after a region, so the regions of one step find them awake, then sleep, so the
// gaps between steps leave the cores alone.

#include "common.h"

#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include <pthread.h>

namespace kvserve {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kSpin = std::chrono::microseconds(200);  // a worker's spin after a region, before it sleeps

std::atomic<bool> g_enabled{true};
thread_local bool t_in_region = false;  // this thread is running a part of a region
std::atomic<int64_t> g_threads{0};  // 0: torch's intra-op thread count

class Pool {
 public:
  // Runs task(context, t) for t = 0 .. threads-1: t = 0 here, the others on workers; returns when all are
  // done. False if the pool is busy with another thread's region.
  bool run(int64_t threads, WorkerPool::Task task, void* context) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    grow(threads - 1);
    task_ = task;
    context_ = context;
    threads_ = threads;
    unfinished_.store(static_cast<int64_t>(workers_), std::memory_order_relaxed);
    {
      // Under the mutex, so a worker between its last check and its wait cannot miss the notify.
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    std::exception_ptr error;
    t_in_region = true;
    try {
      task(context, 0);
    } catch (...) {
      error = std::current_exception();
    }
    t_in_region = false;
    // The workers claim what is left; this waits for the last one to finish its item (and for any that
    // had nothing to do to say so), also when this thread's part threw: they still use its stack. A worker
    // that lost its core may take a while: let it have ours.
    const auto yield_after = Clock::now() + kSpin;
    while (unfinished_.load(std::memory_order_acquire) > 0) {
      if (Clock::now() < yield_after)
        pause();
      else
        std::this_thread::yield();
    }
    if (!error) error = std::exchange(worker_error_, nullptr);
    worker_error_ = nullptr;
    if (error) std::rethrow_exception(error);  // as at::parallel_for does: the caller sees the first error
    return true;
  }

 private:
  static void pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  // Workers are detached and the pool never destroyed: a joinable thread at exit would abort the process.
  // Called before the region's generation is published: a new worker starts from the one before it.
  void grow(int64_t wanted) {
    const uint64_t current = generation_.load(std::memory_order_acquire);
    for (; workers_ < wanted; ++workers_)
      std::thread([this, index = workers_ + 1, current] { loop(index, current); }).detach();
  }

  void loop(int64_t index, uint64_t seen) {
    t_in_region = true;  // a worker only ever runs parts of regions
    for (;;) {
      seen = wait_for_region(seen);
      if (index < threads_) {
        try {
          task_(context_, index);
        } catch (...) {  // an exception leaving this thread would end the process: the caller rethrows it
          std::lock_guard<std::mutex> lock(error_mutex_);
          if (!worker_error_) worker_error_ = std::current_exception();
        }
      }
      unfinished_.fetch_sub(1, std::memory_order_release);
    }
  }

  uint64_t wait_for_region(uint64_t seen) {
    const auto sleep_at = Clock::now() + kSpin;
    for (int spins = 0;; ++spins) {
      const uint64_t now = generation_.load(std::memory_order_acquire);
      if (now != seen) return now;
      pause();
      if (spins % 64 == 63) {
        if (Clock::now() >= sleep_at) break;
        // Any other thread that wants this core (OpenMP's team for a torch op, the HTTP loop) gets it.
        std::this_thread::yield();
      }
    }
    std::unique_lock<std::mutex> lock(sleep_mutex_);
    sleepers_.fetch_add(1, std::memory_order_acq_rel);
    wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
    sleepers_.fetch_sub(1, std::memory_order_acq_rel);
    return generation_.load(std::memory_order_acquire);
  }

  std::mutex run_mutex_;    // one region at a time
  std::mutex sleep_mutex_;  // guards the sleep/wake handshake
  std::mutex error_mutex_;
  std::exception_ptr worker_error_;  // the first exception a worker's part threw in this region
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};  // bumped once per region
  std::atomic<int64_t> unfinished_{0};   // workers yet to finish the current region
  std::atomic<int64_t> sleepers_{0};
  int64_t workers_ = 0;                  // threads started (only the region's caller changes it)
  // The current region, published before generation_ is bumped and read after a worker sees the bump.
  WorkerPool::Task task_ = nullptr;
  void* context_ = nullptr;
  int64_t threads_ = 0;
};

std::atomic<Pool*> g_pool{nullptr};

Pool* pool_for_this_process() {
  // A forked child has none of its parent's threads: it starts a pool of its own (the parent's is leaked).
  // A fork hook rather than a getpid() per region: that is a system call on every region of every step.
  static const bool forget_in_child =
      pthread_atfork(nullptr, nullptr, [] { g_pool.store(nullptr, std::memory_order_relaxed); }) == 0;
  (void)forget_in_child;
  Pool* pool = g_pool.load(std::memory_order_acquire);
  if (pool != nullptr) return pool;
  auto* fresh = new Pool();
  if (g_pool.compare_exchange_strong(pool, fresh, std::memory_order_acq_rel)) return fresh;
  delete fresh;  // another thread's came first; this one never started a worker
  return pool;
}

}  // namespace

void WorkerPool::run(int64_t threads, Task task, void* context) {
  if (threads > 1 && g_enabled.load(std::memory_order_relaxed)) {
    // A region inside a region, or the pool busy with another thread's: claiming lets this thread do it all.
    if (t_in_region || !pool_for_this_process()->run(threads, task, context)) task(context, 0);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) task(context, t);
  });
}

void use_worker_pool(bool enabled) { g_enabled.store(enabled, std::memory_order_relaxed); }

void set_kernel_threads(int64_t threads) { g_threads.store(std::max<int64_t>(threads, 0), std::memory_order_relaxed); }

int64_t kernel_threads() {
  const int64_t threads = g_threads.load(std::memory_order_relaxed);
  return threads > 0 && g_enabled.load(std::memory_order_relaxed) ? threads : at::get_num_threads();
}

}  // namespace kvserve
