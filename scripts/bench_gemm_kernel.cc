// Our float32 GEMM (agents/model/kernels/linear.cc ``Linear``) called directly, without MindSpore's graph call around it.
//
//     g++ -O3 -march=native -fopenmp-simd -fno-math-errno -pthread -std=c++17 scripts/bench_gemm_kernel.cc \
//         agents/model/kernels/linear.cc -o /tmp/bench_gemm_kernel && /tmp/bench_gemm_kernel
//
// Why: through a one-op graph (scripts/bench_model.py, benchmark.py's roofline rate) every call also pays
// MindSpore's ~0.2 ms, a tenth of a 128-row projection; this shows the kernel's own rate, to set against the
// CPU's FMA peak (scripts/fma_peak.c). Same flags as agents/model/native_kernels.py. Threads: $LLM_SERVING_KERNEL_THREADS.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

extern "C" int Linear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                      void *extra);

// Best GFLOP/s of ``reps`` rounds of 10 calls of x [m, k] times a packed [n, k] weight (in cache after the first).
double rate(int64_t m, int64_t n, int64_t k, int reps) {
  const int64_t panels = (n + 31) / 32;
  std::vector<float> x(m * k, 0.01f), w(panels * k * 32, 0.02f), y(m * n);
  int64_t shape_x[2] = {m, k}, shape_w[2] = {panels * k, 32}, shape_y[2] = {m, n};
  int64_t *shapes[3] = {shape_x, shape_w, shape_y};
  int ndims[3] = {2, 2, 2};
  const char *dtypes[3] = {"float32", "float32", "float32"};
  void *params[3] = {x.data(), w.data(), y.data()};
  if (Linear(3, params, ndims, shapes, dtypes, nullptr, nullptr) != 0) return 0.0;
  double best = 1e9;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) Linear(3, params, ndims, shapes, dtypes, nullptr, nullptr);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 10;
    best = seconds < best ? seconds : best;
  }
  return 2.0 * m * n * k / best / 1e9;
}

int main() {
  const int64_t shapes[][3] = {{12, 32, 512}, {128, 1024, 512}, {128, 2816, 512}, {128, 512, 1408},
                               {128, 8000, 512}, {512, 4096, 512}};
  for (const auto &s : shapes)
    std::printf("[%ld x %ld] x [%ld x %ld]: %.1f GFLOP/s\n", s[0], s[2], s[2], s[1], rate(s[0], s[1], s[2], 30));
  return 0;
}
