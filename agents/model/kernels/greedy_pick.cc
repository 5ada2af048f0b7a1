// The greedy pick at the end of a step for MindSpore CPU, as an AOT ``ops.Custom`` op (agents/model/native_kernels.py):
// one op and two passes over each logits row instead of five graph ops (max, argmax, sub, exp, sum, log).
// Returns 0, or 1 (ranks) or 2 (dtypes), which MindSpore raises as a RuntimeError.
//
// RMSNorm and SwiGLU were tried as native ops too and removed: with them between the matmuls, decode step times
// became bimodal across runs (33-78 ms against a steady 40-45 ms), presumably as MindSpore's own worker threads
// idle through the native ops and wake late for the next matmul.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace {

constexpr int64_t kRowsPerThread = 64;  // a row of 8k-32k logits takes a few microseconds

}  // namespace

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
  run_tasks(batch, kRowsPerThread, [&](int64_t b) {
    const float *row = logits + b * vocab;
    float top = row[0];
#pragma omp simd reduction(max : top)
    for (int64_t i = 1; i < vocab; ++i) top = row[i] > top ? row[i] : top;
    int64_t best = 0;  // the first maximum (the last index if the row is all NaN)
    while (best + 1 < vocab && !(row[best] == top)) ++best;
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < vocab; ++i) total += exp_approx(row[i] - top);
    ids[b] = static_cast<int32_t>(best);
    logprobs[b] = -std::log(total);
  });
  return 0;
}
