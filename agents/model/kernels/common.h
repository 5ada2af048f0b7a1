// Helpers shared by the kernels in this directory, which are built together into one library
// (agents/model/native_kernels.py), so that every op of a step shares one pool of helper threads (TaskPool below).
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <pthread.h>
#include <thread>
#include <vector>

namespace {

bool is_dtype(const char *dtype, const char *want) { return std::strcmp(dtype, want) == 0; }

// e^x in float32 from arithmetic and a bit cast only, so that the compiler vectorizes it inside ``omp simd``
// loops (libm's expf stays scalar without -ffast-math, and was most of the softmax and greedy-pick time).
// e^x = 2^n * e^r with n = round(x / ln 2) and |r| <= ln(2) / 2; e^r by its Taylor series to r^7 (truncation
// below 6e-9 relative, a few float32 roundings in all). x is clamped to [-87, 88], where 2^n stays a normal
// float: below -87 the result is ~1.6e-38 instead of 0, which no sum of probabilities can tell apart.
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // Round to nearest by adding and subtracting 1.5 * 2^23 (std::floor/nearbyint kept GCC from vectorizing).
  const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
  float r = std::fma(n, -0.693145752f, x);  // ln 2 split in two (the first part exact in float32)
  r = std::fma(n, -1.42860682e-6f, r);
  float p = 1.0f / 5040.0f;
  p = std::fma(p, r, 1.0f / 720.0f);
  p = std::fma(p, r, 1.0f / 120.0f);
  p = std::fma(p, r, 1.0f / 24.0f);
  p = std::fma(p, r, 1.0f / 6.0f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

}  // namespace

// Not in the anonymous namespace: the inline functions' statics (the pool above all) are one object per library,
// whichever of its translation units calls them.
// Hidden: a second build of the library in the same process (other flags) keeps its own pool.
namespace kernel_pool __attribute__((visibility("hidden"))) {

// Threads for a kernel call (the caller's included): $LLM_SERVING_KERNEL_THREADS, else the hardware's up to 16
// (attention is bound by memory bandwidth long before that on a many-core host).
inline int64_t configured_threads() {
  static const int64_t configured = [] {
    const char *env = std::getenv("LLM_SERVING_KERNEL_THREADS");
    const int64_t hardware = static_cast<int64_t>(std::thread::hardware_concurrency());
    const int64_t n = env ? std::atoll(env) : (hardware < 16 ? hardware : 16);
    return n > 0 ? n : 1;
  }();
  return configured;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How long an idle helper thread polls for the next call before it sleeps: $LLM_SERVING_KERNEL_SPIN_US
// microseconds while polling is on (TaskPool::poll); by default 1000 where the projections are ours (AVX-512), 0
// (sleep at once) elsewhere. The ops of a step come microseconds apart; the agent turns polling on for a small
// step's ops only and off after the step (docs/benchmarks.md "Where a saturated step goes, and one helper
// pool"). Where MindSpore's MatMul runs between our ops (no AVX-512), a polling helper would take the cores its
// threads want, as OpenMP's did.
inline int64_t spin_microseconds() {
#if defined(__AVX512F__)
  constexpr int64_t kDefault = 1000;
#else
  constexpr int64_t kDefault = 0;
#endif
  const char *env = std::getenv("LLM_SERVING_KERNEL_SPIN_US");
  const int64_t n = env ? std::atoll(env) : kDefault;
  return n > 0 ? n : 0;
}

// Helper threads that share a call's tasks with the calling thread, started once per library.
//
// Why not OpenMP or threads started per call: MindSpore's own workers keep spinning on the cores between graph
// ops. OpenMP's idle workers spun too (for far longer than our helpers' bounded polling, spin_for_next) and took
// the cores from MindSpore's next matmul (decode B=128 1.6x slower); a thread started per call had to wait for
// a core and the caller then waited for it to start and join (~1 ms per op). Here the caller never waits for a
// helper that has not started: tasks are claimed one at a time, the caller works through them too, and at the
// end it waits only for the tasks a helper is running.
// A helper that wakes late finds the call closed and sleeps again. A forked child has no helpers (and maybe a
// mutex held at the fork), so there the caller does all the work without touching the pool's state.
class TaskPool {
 public:
  static TaskPool &instance() {
    static TaskPool *pool = new TaskPool(configured_threads() - 1);  // never destroyed: helpers block until exit
    return *pool;
  }

  // Runs ``work(task)`` for tasks 0..count-1, waking one helper per ``tasks_per_thread`` tasks beyond the
  // first batch (a wake-up costs about as much as a few small tasks; a many-core host does not wake them all).
  template <typename Work>
  void run(int64_t count, int64_t tasks_per_thread, const Work &work) {
    bool idle = false;
    if (helpers_.empty() || forked_ || count <= tasks_per_thread || !busy_.compare_exchange_strong(idle, true)) {
      for (int64_t task = 0; task < count; ++task) work(task);  // also when another thread's call holds the pool
      return;
    }
    const std::function<void(int64_t)> job = [&work](int64_t task) { work(task); };
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      count_ = count;
      next_.store(0);
      ++generation_;
      published_.store(generation_, std::memory_order_release);
    }
    const auto wanted = static_cast<size_t>((count - 1) / tasks_per_thread);  // helpers worth waking
    for (size_t i = 0; i < wanted && i < helpers_.size(); ++i) wake_.notify_one();
    claim_and_run(job, count);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = nullptr;  // closed: no helper joins from here on
    }
    wait_for_helpers();
    busy_.store(false);
  }

  // Whether helpers poll for the next call after their tasks (on at start). The agent turns it on for a step
  // whose ops are short (a small batch: a helper's wake-up is much of each op) and off after each step, when the
  // next op is a step away and the master wants the core; off ends the polling now.
  void poll(bool on) {
    polling_.store(on, std::memory_order_relaxed);
    if (!on) rests_.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  explicit TaskPool(int64_t helpers) {
    pthread_atfork(nullptr, nullptr, [] { forked_ = true; });
    for (int64_t i = 0; i < helpers; ++i) helpers_.emplace_back([this] { helper_loop(); });
    for (auto &helper : helpers_) helper.detach();
  }

  // Polls for the next call for a while (spin_microseconds) before sleeping on the condition variable. A
  // sleeping helper costs the caller a futex system call to wake and joins tens of microseconds late, much of a
  // small op's run (a batch-1 projection); the calls of one step come microseconds apart, so a polling helper is
  // there for all of them. Between steps, or beside a large step's long ops, it would hold a core the master
  // wants: it polls only while poll() is on, until it is turned off (or the bound). A rank without helpers (a
  // tensor-parallel rank on one core) never polls.
  void spin_for_next(uint64_t seen, uint64_t rests) const {
    if (spin_.count() == 0 || !polling_.load(std::memory_order_relaxed)) return;
    const auto until = std::chrono::steady_clock::now() + spin_;
    while (published_.load(std::memory_order_acquire) == seen && rests_.load(std::memory_order_relaxed) == rests) {
      for (int i = 0; i < 64; ++i) cpu_relax();
      if (std::chrono::steady_clock::now() > until) return;
    }
  }

  // Waits for the helpers still running a task of the closed call. Each has one task at most left. While polling
  // is on (a small step: its ops and their last tasks are short) the caller polls for them first, since sleeping
  // on the condition variable costs a futex wait and a wake-up per op, much of a small op on a virtual machine
  // (docs/benchmarks.md, "Where the one-stream token goes"); a helper that lost its core meanwhile (a loaded
  // host) is waited for asleep, and so are the long tasks of a large step.
  void wait_for_helpers() {
    const bool poll = spin_.count() != 0 && polling_.load(std::memory_order_relaxed);
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::microseconds(poll ? kCallerPollMicroseconds : 0);
    while (active_.load(std::memory_order_acquire) != 0) {
      for (int i = 0; i < 16; ++i) cpu_relax();
      if (std::chrono::steady_clock::now() > until) {
        std::unique_lock<std::mutex> lock(mutex_);
        idle_.wait(lock, [this] { return active_.load(std::memory_order_acquire) == 0; });
        return;
      }
    }
  }

  void claim_and_run(const std::function<void(int64_t)> &job, int64_t count) {
    for (int64_t task = next_.fetch_add(1); task < count; task = next_.fetch_add(1)) job(task);
  }

  void helper_loop() {
    uint64_t seen = 0, rests = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      lock.unlock();
      spin_for_next(seen, rests);
      lock.lock();
      wake_.wait(lock, [&] { return job_ != nullptr && generation_ != seen; });
      seen = generation_;
      rests = rests_.load(std::memory_order_relaxed);
      const std::function<void(int64_t)> *job = job_;
      const int64_t count = count_;
      active_.fetch_add(1, std::memory_order_relaxed);
      lock.unlock();
      claim_and_run(*job, count);
      lock.lock();  // (under the mutex: a caller about to sleep in wait_for_helpers cannot miss the notification)
      if (active_.fetch_sub(1, std::memory_order_release) == 1) idle_.notify_all();
    }
  }

  std::vector<std::thread> helpers_;
  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  const std::function<void(int64_t)> *job_ = nullptr;  // the open call, or null
  int64_t count_ = 0;
  uint64_t generation_ = 0;
  std::atomic<int> active_{0};  // helpers inside the open call (changed under the mutex, polled without it)
  std::atomic<int64_t> next_{0};
  std::atomic<bool> busy_{false};  // one call at a time uses the helpers
  std::atomic<uint64_t> published_{0};  // generation_, readable without the mutex (spin_for_next)
  std::atomic<bool> polling_{true};
  std::atomic<uint64_t> rests_{0};  // calls of poll(false): a helper polls only until the next one
  const std::chrono::microseconds spin_{spin_microseconds()};
  static constexpr int64_t kCallerPollMicroseconds = 50;  // a small op's last task takes a few
  static inline bool forked_ = false;
};

template <typename Work>
void run_tasks(int64_t count, int64_t tasks_per_thread, const Work &work) {
  TaskPool::instance().run(count, tasks_per_thread, work);
}

}  // namespace kernel_pool

using kernel_pool::run_tasks;

namespace {

// normed[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, as Hugging Face's LlamaRMSNorm does in float32 (the
// projections' norms, kernels/linear.cc, and the MoE layer's, kernels/moe_experts.cc).
inline void rms_norm(const float *x, int64_t m, int64_t k_dim, const float *weight, float eps, float *normed) {
  run_tasks((m + 15) / 16, 4, [&](int64_t task) {
    for (int64_t r = task * 16; r < m && r < task * 16 + 16; ++r) {
      const float *row = x + r * k_dim;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t k = 0; k < k_dim; ++k) squares += row[k] * row[k];
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(k_dim) + eps);
      float *out = normed + r * k_dim;
#pragma omp simd
      for (int64_t k = 0; k < k_dim; ++k) out[k] = (row[k] * inv) * weight[k];
    }
  });
}

}  // namespace
