// Small per-layer ops for MindSpore CPU as AOT ``ops.Custom`` ops (agents/native_kernels.py), each replacing a
// chain of 3-7 graph ops. Why: at decode batch 128 a step runs ~160 graph ops and MindSpore spends ~25 us
// launching each beyond its compute (measured: 40.6 ms per step against 36.4 ms of op time); RMSNorm alone is
// 7 ops and runs 17 times a step. All float32, row-parallel; each returns 0, or 1 (ranks or shapes) or
// 2 (dtypes), which MindSpore raises as a RuntimeError.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace {

constexpr int64_t kRowsPerThread = 256;  // below this a second thread costs more than it saves

bool floats(int n, const char **dtypes) {
  for (int i = 0; i < n; ++i) {
    if (!is_dtype(dtypes[i], "float32")) return false;
  }
  return true;
}

}  // namespace

// RmsNorm(x [rows, hidden], weight [hidden], eps [1]) -> [rows, hidden]: x * rsqrt(mean(x^2) + eps) * weight.
extern "C" int RmsNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 1 || shapes[1][0] != shapes[0][1]) return 1;
  if (!floats(4, dtypes)) return 2;
  const auto *x = static_cast<const float *>(params[0]);
  const auto *weight = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  auto *out = static_cast<float *>(params[3]);
  const int64_t rows = shapes[0][0], hidden = shapes[0][1];
  run_tasks(rows, kRowsPerThread, [&](int64_t r) {
    const float *xr = x + r * hidden;
    float *o = out + r * hidden;
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < hidden; ++i) squares += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) o[i] = xr[i] * inv * weight[i];
  });
  return 0;
}

// SwiGlu(gate_up [rows, 2 * ffn]) -> [rows, ffn]: silu(gate) * up, gate and up being the two halves of a row.
extern "C" int SwiGlu(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  if (nparam != 2 || ndims[0] != 2 || shapes[0][1] % 2 != 0) return 1;
  if (!floats(2, dtypes)) return 2;
  const auto *gate_up = static_cast<const float *>(params[0]);
  auto *out = static_cast<float *>(params[1]);
  const int64_t rows = shapes[0][0], ffn = shapes[0][1] / 2;
  run_tasks(rows, kRowsPerThread / 4, [&](int64_t r) {
    const float *g = gate_up + r * 2 * ffn, *u = g + ffn;
    float *o = out + r * ffn;
#pragma omp simd
    for (int64_t i = 0; i < ffn; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  });
  return 0;
}

// GreedyPick(logits [batch, vocab]) -> (token ids [batch] int32, log-probabilities [batch] float32): the first
// maximal logit and its log-softmax, max - logsumexp (no exp of the full row is kept).
extern "C" int GreedyPick(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                          void *) {
  if (nparam != 3 || ndims[0] != 2) return 1;
  if (!is_dtype(dtypes[0], "float32") || !is_dtype(dtypes[1], "int32") || !is_dtype(dtypes[2], "float32")) return 2;
  const auto *logits = static_cast<const float *>(params[0]);
  auto *ids = static_cast<int32_t *>(params[1]);
  auto *logprobs = static_cast<float *>(params[2]);
  const int64_t batch = shapes[0][0], vocab = shapes[0][1];
  run_tasks(batch, kRowsPerThread / 4, [&](int64_t b) {
    const float *row = logits + b * vocab;
    int64_t best = 0;
    for (int64_t i = 1; i < vocab; ++i) best = row[i] > row[best] ? i : best;
    const float top = row[best];
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < vocab; ++i) total += std::exp(row[i] - top);
    ids[b] = static_cast<int32_t>(best);
    logprobs[b] = -std::log(total);
  });
  return 0;
}
