// Helpers shared by the kernels in this directory (each .cc is built into its own library).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

bool is_dtype(const char *dtype, const char *want) { return std::strcmp(dtype, want) == 0; }

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
