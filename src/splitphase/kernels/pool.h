// Work sharing for the kernels: chunks of a decode-shaped call are claimed by the calling thread
// and by persistent helper threads (torch's intra-op thread count in all). Unlike an OpenMP
// region, the caller never waits for a helper that has not started: on a shared machine a
// helper that lost its core costs at most the one chunk it holds, where a fork-join barrier
// waits for a whole scheduler slice. SPLITPHASE_KERNEL_THREADING=openmp selects the OpenMP
// region instead (the same chunks, claimed by torch's OpenMP team).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define SPLITPHASE_PAUSE() _mm_pause()
#else
#define SPLITPHASE_PAUSE() std::this_thread::yield()
#endif

namespace splitphase_pool {

// Chunks of one job are claimed with a CAS on (generation << 32 | next chunk); a helper only
// runs a chunk of the generation it claimed in, and the caller returns once every chunk is done.
// Each job takes two generations: one closing the last job's state, one publishing its own.
class HelperPool {
 public:
  ~HelperPool() { resize(0); }

  // After fork() the helpers exist only in the parent: the child forgets them (never joins)
  // and starts its own on the next call. The condition variable and mutexes are rebuilt in
  // place: a copy taken while a parent's helper slept in cv_.wait counts that waiter forever,
  // and the child's first notify_all then blocks on it (seen as a hang in the fork test).
  void adopt_after_fork() {
    if (owner_ == getpid()) return;
    new std::vector<std::thread>(std::move(threads_));  // leaked on purpose: not joinable here
    threads_.clear();
    new (&cv_) std::condition_variable();  // the old objects belong to threads that are gone
    new (&mutex_) std::mutex();
    sleepers_.store(0);
    stop_.store(false);
    owner_ = getpid();
  }

  // Spinning helpers go to sleep now: the caller is about to run torch's own parallel code
  // (an OpenMP GEMM), which needs every core; a spinning helper would take one from it.
  void park() { park_.store(true); }

  void run(int threads, int64_t n_chunks, const std::function<void(int64_t)>& fn) {
    if (threads <= 1 || n_chunks <= 1) {
      for (int64_t c = 0; c < n_chunks; ++c) fn(c);
      return;
    }
    if (owner_ != getpid()) {  // the child's only thread: the parent's job lock may be held
      new (&job_mutex_) std::mutex();
      adopt_after_fork();
    }
    std::lock_guard<std::mutex> one_job(job_mutex_);  // callers from several threads queue
    resize(threads - 1);
    // Close the last job's state before touching fn_ and n_chunks_: a helper that loaded it
    // (all chunks claimed) and then read this job's larger n_chunks_ could otherwise claim a
    // chunk past the end with a CAS that still matched, run the last job's dead fn_ or count
    // a chunk twice in done_, and let this caller return while a chunk still ran (seen as a
    // crash in the skinny kernel's closure). The closed state has its own generation and no
    // chunk left; the job is published under the next.
    uint64_t gen = (state_.load() >> 32) + 2;
    state_.store(((gen - 1) << 32) | kClosed);
    fn_.store(&fn, std::memory_order_relaxed);  // published by the state_ store below
    n_chunks_.store(n_chunks, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    park_.store(false);
    state_.store(gen << 32);
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lk(mutex_); }
      cv_.notify_all();
    }
    work(gen);
    while (done_.load(std::memory_order_acquire) < n_chunks) SPLITPHASE_PAUSE();
  }

 private:
  // Claim and run chunks of generation `gen` until none is left.
  void work(uint64_t gen) {
    while (true) {
      uint64_t v = state_.load(std::memory_order_acquire);
      const int64_t index = static_cast<int64_t>(v & 0xffffffffu);
      if ((v >> 32) != gen || index >= n_chunks_.load(std::memory_order_relaxed)) return;
      if (!state_.compare_exchange_weak(v, v + 1)) continue;
      (*fn_.load(std::memory_order_relaxed))(index);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void helper_loop() {
    uint64_t seen = state_.load() >> 32;
    while (true) {
      uint64_t gen = seen;
      for (int spin = 0; spin < 20000 && gen == seen && !stop_.load() && !park_.load(); ++spin) {
        SPLITPHASE_PAUSE();
        gen = state_.load(std::memory_order_acquire) >> 32;
      }
      if (gen == seen && !stop_.load()) {  // idle: sleep until the next job
        std::unique_lock<std::mutex> lk(mutex_);
        sleepers_.fetch_add(1);
        cv_.wait(lk, [&] { return stop_.load() || (state_.load() >> 32) != seen; });
        sleepers_.fetch_sub(1);
        gen = state_.load() >> 32;
      }
      if (stop_.load()) return;
      seen = gen;
      work(gen);
    }
  }

  void resize(size_t helpers) {
    adopt_after_fork();
    if (helpers == threads_.size()) return;
    stop_.store(true);
    { std::lock_guard<std::mutex> lk(mutex_); }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
    stop_.store(false);
    for (size_t i = 0; i < helpers; ++i) threads_.emplace_back([this] { helper_loop(); });
  }

  static constexpr uint64_t kClosed = 0xffffffffu;  // a chunk index past any job's end

  std::mutex job_mutex_, mutex_;
  std::condition_variable cv_;
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> state_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> park_{false};
  std::atomic<const std::function<void(int64_t)>*> fn_{nullptr};
  std::atomic<int64_t> n_chunks_{0};
  pid_t owner_ = getpid();
};

inline HelperPool& pool() {
  static HelperPool p;  // one pool per process, shared by every kernel (inline: one instance)
  return p;
}

inline bool use_openmp() {
  static const bool openmp = [] {
    const char* v = std::getenv("SPLITPHASE_KERNEL_THREADING");
    return v != nullptr && std::strcmp(v, "openmp") == 0;
  }();
  return openmp;
}

// Sends idle helpers to sleep (see HelperPool::park); the next job wakes them.
inline void park_helpers() { pool().park(); }

// Above this many rows (tokens) a call sits between torch's OpenMP GEMMs (prefill, or a decode
// step past the skinny kernel's rows), so it runs on their OpenMP team, whose threads are still
// spinning from the last GEMM. The helpers would have to be woken first and would then race
// that spinning team for the cores (measured on base-125m's 512-token prefill: the element-wise
// passes and attention 25-30% faster on the OpenMP team). Calls up to the skinny kernel's row
// limit sit between the native kernels and keep the helpers. Python sets the limit to the
// skinny kernel's (it depends on which packed GEMM takes over from it).
inline std::atomic<int64_t>& helper_max_rows() {
  static std::atomic<int64_t> rows{64};
  return rows;
}

// After an element-wise pass over more rows than a decode step on the skinny kernel has,
// torch's GEMM comes next: park the helpers. Decode-shaped calls keep them spinning for the
// next kernel.
inline void park_after(int64_t rows) {
  if (rows > std::min<int64_t>(16, helper_max_rows().load(std::memory_order_relaxed))) {
    park_helpers();
  }
}

// Calls fn(begin, end) over [0, n) in chunks of at least `grain`, about `per_thread` chunks
// for each intra-op thread; `rows` is the tokens the call covers (it picks the thread team,
// above). Many small chunks bound what a descheduled helper holds up; few large ones cost
// fewer claims and restarts (the skinny kernel's choice, see there).
inline void parallel_chunks(int64_t n, int64_t grain, int64_t rows,
                            const std::function<void(int64_t, int64_t)>& fn,
                            int64_t per_thread = 32) {
  int threads = at::get_num_threads();
  int64_t parts = per_thread * threads;
  int64_t chunk = std::max<int64_t>(grain, (n + parts - 1) / parts);
  int64_t n_chunks = (n + chunk - 1) / chunk;
  if (threads <= 1 || n_chunks <= 1) {
    fn(0, n);
    return;
  }
  auto run = [&](int64_t c) { fn(c * chunk, std::min(n, (c + 1) * chunk)); };
  if (!use_openmp() && rows <= helper_max_rows().load(std::memory_order_relaxed)) {
    pool().run(threads, n_chunks, run);
    return;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  {
    for (int64_t c = next.fetch_add(1); c < n_chunks; c = next.fetch_add(1)) run(c);
  }
}

}  // namespace splitphase_pool
