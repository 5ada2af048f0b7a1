// Driven by tests/test_native_kernels.py: the kernels' TaskPool (agents/kernels/common.h) runs every task exactly
// once per call, across many calls, with tiny and large task counts, from two threads at once, and in a forked
// child (no helpers there).
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

#include "common.h"

namespace {

bool run_calls(int calls) {
  for (int call = 0; call < calls; ++call) {
    const int64_t count = 1 + (call * 37) % 700;
    std::vector<std::atomic<int>> hits(static_cast<size_t>(count));
    run_tasks(count, 1 + call % 20, [&](int64_t task) { hits[static_cast<size_t>(task)].fetch_add(1); });
    for (auto &h : hits) {
      if (h.load() != 1) return false;
    }
  }
  return true;
}

}  // namespace

int main() {
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
