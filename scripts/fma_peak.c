// The float32 FMA peak of this CPU: the ceiling for any float32 matmul, ours or a peer's.
//
//     gcc -O2 -mavx512f -pthread scripts/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
//
// Why: the benchmark's roofline divides the workload's FLOPs by the best matmul rate measured (our GEMM's);
// this shows how far that rate is from the hardware's. Each thread runs 12 independent chains of 512-bit fused
// multiply-adds (more than an FMA's latency times the FMA units), so the loop is bound by FMA throughput only.
// Prints GFLOP/s for 1 and 2 threads, three times each (the machine's clock drifts).
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>

enum { kChains = 12, kIterations = 160000000 };

static float sink[2][16];

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *fma_chains(void *arg) {
  volatile float seed = 1.0f;  // distinct starting values the compiler cannot fold
  __m512 a0 = _mm512_set1_ps(seed), a1 = _mm512_set1_ps(seed + 1), a2 = _mm512_set1_ps(seed + 2),
         a3 = _mm512_set1_ps(seed + 3), a4 = _mm512_set1_ps(seed + 4), a5 = _mm512_set1_ps(seed + 5),
         a6 = _mm512_set1_ps(seed + 6), a7 = _mm512_set1_ps(seed + 7), a8 = _mm512_set1_ps(seed + 8),
         a9 = _mm512_set1_ps(seed + 9), a10 = _mm512_set1_ps(seed + 10), a11 = _mm512_set1_ps(seed + 11);
  const __m512 x = _mm512_set1_ps(0.9999999f), y = _mm512_set1_ps(1e-7f);
  for (long i = 0; i < kIterations; ++i) {  // written out: the chains must stay in registers
    a0 = _mm512_fmadd_ps(a0, x, y), a1 = _mm512_fmadd_ps(a1, x, y), a2 = _mm512_fmadd_ps(a2, x, y);
    a3 = _mm512_fmadd_ps(a3, x, y), a4 = _mm512_fmadd_ps(a4, x, y), a5 = _mm512_fmadd_ps(a5, x, y);
    a6 = _mm512_fmadd_ps(a6, x, y), a7 = _mm512_fmadd_ps(a7, x, y), a8 = _mm512_fmadd_ps(a8, x, y);
    a9 = _mm512_fmadd_ps(a9, x, y), a10 = _mm512_fmadd_ps(a10, x, y), a11 = _mm512_fmadd_ps(a11, x, y);
    __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7),
                     "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));  // keeps the compiler from merging the chains
  }
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                   _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)),
                                                 _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11))));
  _mm512_storeu_ps(sink[(long)arg], sum);
  return NULL;
}

int main(void) {
  for (int round = 0; round < 3; ++round) {
    for (long threads = 1; threads <= 2; ++threads) {
      pthread_t ids[2];
      const double t0 = now();
      for (long t = 0; t < threads; ++t) pthread_create(&ids[t], NULL, fma_chains, (void *)t);
      for (long t = 0; t < threads; ++t) pthread_join(ids[t], NULL);
      const double flops = (double)threads * kIterations * kChains * 16 * 2;
      printf("threads %ld: %.1f GFLOP/s\n", threads, flops / (now() - t0) / 1e9);
    }
  }
  return 0;
}
