// Helpers shared by the kernels in this directory (each .cc is built into its own library).
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
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

// Threads per call: $LLM_SERVING_KERNEL_THREADS, else the hardware's. Plain threads started per call rather than
// OpenMP: OpenMP's idle workers spin after a parallel region and took the cores from MindSpore's next ops
// (decode B=128 ran 1.6x slower with spinning workers than with OMP_WAIT_POLICY=passive).
int64_t thread_count(int64_t tasks, int64_t tasks_per_thread) {
  static const int64_t configured = [] {
    const char *env = std::getenv("LLM_SERVING_KERNEL_THREADS");
    const int64_t n = env ? std::atoll(env) : static_cast<int64_t>(std::thread::hardware_concurrency());
    return n > 0 ? n : 1;
  }();
  const int64_t useful = (tasks + tasks_per_thread - 1) / tasks_per_thread;
  return configured < useful ? configured : useful;
}

// Runs ``work(task)`` for tasks 0..count-1 on up to thread_count threads (the caller's included), one thread
// per ``tasks_per_thread`` tasks at most: starting a thread costs about as much as a few decode tasks.
template <typename Work>
void run_tasks(int64_t count, int64_t tasks_per_thread, const Work &work) {
  std::atomic<int64_t> next{0};
  auto loop = [&] {
    for (int64_t task = next.fetch_add(1); task < count; task = next.fetch_add(1)) work(task);
  };
  std::vector<std::thread> helpers;
  for (int64_t i = 1; i < thread_count(count, tasks_per_thread); ++i) helpers.emplace_back(loop);
  loop();
  for (auto &t : helpers) t.join();
}

}  // namespace
