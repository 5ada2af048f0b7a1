// Driven by tests/test_native_kernels.py: the kernels' TaskPool (agents/model/kernels/common.h) runs every task exactly
// once per call, across many calls, with tiny and large task counts, with polling turned off and on between some
// of them, from two threads at once, and in a forked child (no helpers there). With the argument ``poll``: after a call, polling
// helpers use the CPU until polling is turned off, and not after it.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <thread>
#include <vector>

#include "common.h"

namespace {

bool run_calls(int calls) {
  for (int call = 0; call < calls; ++call) {
    const int64_t count = 1 + (call * 37) % 700;
    std::vector<std::atomic<int>> hits(static_cast<size_t>(count));
    std::vector<int64_t> written(static_cast<size_t>(count));  // plain writes: a helper's must be seen after run
    run_tasks(count, 1 + call % 20, [&](int64_t task) {
      hits[static_cast<size_t>(task)].fetch_add(1);
      written[static_cast<size_t>(task)] = task + call;
    });
    if (call % 7 == 0) kernel_pool::TaskPool::instance().poll(call % 14 != 0);
    for (auto &h : hits) {
      if (h.load() != 1) return false;
    }
    for (int64_t task = 0; task < count; ++task) {
      if (written[static_cast<size_t>(task)] != task + call) return false;
    }
  }
  return true;
}

// CPU milliseconds the process uses while this thread sleeps ``ms``.
double cpu_ms_while_sleeping(int ms) {
  timespec a{}, b{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &a);
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &b);
  return (b.tv_sec - a.tv_sec) * 1e3 + (b.tv_nsec - a.tv_nsec) / 1e6;
}

// Runs tasks long enough that a helper surely joins the call; false if a task ran other than once.
bool run_slow_tasks() {
  std::atomic<int> done{0};
  run_tasks(64, 1, [&](int64_t) { std::this_thread::sleep_for(std::chrono::microseconds(200)), done.fetch_add(1); });
  return done.load() == 64;
}

// Run with helpers that poll for longer than the test (LLM_SERVING_KERNEL_SPIN_US): they spin after a call while
// polling is on, stop when it is turned off, and do not spin after a call made with it off.
int check_poll() {
  kernel_pool::TaskPool &pool = kernel_pool::TaskPool::instance();
  if (!run_slow_tasks()) return std::puts("a task ran other than once"), 1;
  const double polling = cpu_ms_while_sleeping(300);
  pool.poll(false);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double turned_off = cpu_ms_while_sleeping(300);
  if (!run_slow_tasks()) return std::puts("a task ran other than once"), 1;
  const double off_call = cpu_ms_while_sleeping(300);
  pool.poll(true);
  if (!run_slow_tasks()) return std::puts("a task ran other than once"), 1;
  const double on_again = cpu_ms_while_sleeping(300);
  pool.poll(false);
  std::printf("CPU ms while sleeping 300 ms: polling %.0f, turned off %.0f, after a call with it off %.0f, on again "
              "%.0f\n", polling, turned_off, off_call, on_again);
  return polling > 30 && turned_off < 15 && off_call < 15 && on_again > 30 ? 0 : 1;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc > 1 && std::strcmp(argv[1], "poll") == 0) return check_poll();
  if (!run_calls(2000)) return std::puts("parent: a task ran other than once"), 1;
  bool other_ok = false;
  std::thread other([&] { other_ok = run_calls(1000); });
  const bool this_ok = run_calls(1000);
  other.join();
  if (!this_ok || !other_ok) return std::puts("concurrent callers: a task ran other than once"), 1;
  const pid_t child = fork();
  if (child == 0) _exit(run_calls(200) ? 0 : 3);
  int status = 0;
  waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return std::puts("forked child failed"), 1;
  if (!run_calls(200)) return std::puts("parent after fork: a task ran other than once"), 1;
  std::puts("ok");
  return 0;
}
