// A sparse MoE layer's routed experts on CPU (issue 54): each token's picked experts' SwiGLU MLPs, weighted and
// summed, reading only the experts some token picked, in place in the stacked weights (no gathered copy), each
// expert's rows once for all the tokens that picked it. Called by agents.model.moe.MoeBlock on the native backend.
//
// MoeExperts(x [m, h], ids [m, k] int32, weights [m, k], gate_up [E, 2f, h], down [E, h, f], rows [1] int32)
//   -> y [m, h]: y[t] = sum_j weights[t, j] * down[e] @ (silu(gate[e] x[t]) * (up[e] x[t])), e = ids[t, j];
// a pick with an id outside [0, E) (another rank's expert under expert parallelism) is skipped; the rows after
// ``rows`` (the bucket's padding) come out as zeros. float32 throughout.
#include "common.h"

namespace {

constexpr int64_t kRowBlock = 32;  // weight rows of one task: a task reads them once for all its expert's tokens

float dot(const float *a, const float *b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace

extern "C" int MoeExperts(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                          void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 7 || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2 || ndims[3] != 3 || ndims[4] != 3 ||
      ndims[5] != 1 || ndims[6] != 2)
    return 1;
  for (int i = 0; i < nparam; ++i)
    if (!is_dtype(dtypes[i], i == 1 || i == 5 ? "int32" : "float32")) return 2;
  const int64_t m = shapes[0][0], h = shapes[0][1], k = shapes[1][1], experts = shapes[3][0], f = shapes[4][2];
  if (shapes[1][0] != m || shapes[2][0] != m || shapes[2][1] != k || shapes[3][1] != 2 * f || shapes[3][2] != h ||
      shapes[4][0] != experts || shapes[4][1] != h || shapes[6][0] != m || shapes[6][1] != h)
    return 3;
  const auto *x = static_cast<const float *>(params[0]);
  const auto *ids = static_cast<const int32_t *>(params[1]);
  const auto *weights = static_cast<const float *>(params[2]);
  const auto *gate_up = static_cast<const float *>(params[3]);
  const auto *down = static_cast<const float *>(params[4]);
  int64_t rows = *static_cast<const int32_t *>(params[5]);
  rows = rows < 0 ? 0 : (rows > m ? m : rows);
  auto *y = static_cast<float *>(params[6]);

  // the picks grouped by expert (a counting sort, in token order within an expert): pick p is token picks[p] / k's
  // choice picks[p] % k; expert e's picks are picks[first[e] .. first[e + 1])
  std::vector<int64_t> first(experts + 1, 0), picks;
  for (int64_t p = 0; p < rows * k; ++p)
    if (ids[p] >= 0 && ids[p] < experts) ++first[ids[p] + 1];
  for (int64_t e = 0; e < experts; ++e) first[e + 1] += first[e];
  picks.resize(static_cast<size_t>(first[experts]));
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (int64_t p = 0; p < rows * k; ++p)
    if (ids[p] >= 0 && ids[p] < experts) picks[static_cast<size_t>(next[ids[p]]++)] = p;
  std::vector<int64_t> touched;
  for (int64_t e = 0; e < experts; ++e)
    if (first[e + 1] > first[e]) touched.push_back(e);

  // each pick's activation silu(gate x) * (up x) [f], then its expert's output [h]; tasks are (expert, row block)
  const int64_t n_picks = first[experts];
  std::vector<float> act(static_cast<size_t>(n_picks * f)), out(static_cast<size_t>(rows * k * h), 0.0f);
  const int64_t f_blocks = (f + kRowBlock - 1) / kRowBlock, h_blocks = (h + kRowBlock - 1) / kRowBlock;
  const int64_t n_touched = static_cast<int64_t>(touched.size());
  run_tasks(n_touched * f_blocks, 4, [&](int64_t task) {
    const int64_t e = touched[static_cast<size_t>(task / f_blocks)], r0 = (task % f_blocks) * kRowBlock;
    const int64_t r1 = r0 + kRowBlock < f ? r0 + kRowBlock : f;
    const float *w = gate_up + e * 2 * f * h;
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t q = first[e]; q < first[e + 1]; ++q) {
        const float *xt = x + (picks[static_cast<size_t>(q)] / k) * h;
        const float gate = dot(w + r * h, xt, h), up = dot(w + (f + r) * h, xt, h);
        act[static_cast<size_t>(q * f + r)] = gate / (1.0f + std::exp(-gate)) * up;
      }
    }
  });
  run_tasks(n_touched * h_blocks, 4, [&](int64_t task) {
    const int64_t e = touched[static_cast<size_t>(task / h_blocks)], r0 = (task % h_blocks) * kRowBlock;
    const int64_t r1 = r0 + kRowBlock < h ? r0 + kRowBlock : h;
    const float *w = down + e * h * f;
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t q = first[e]; q < first[e + 1]; ++q)
        out[static_cast<size_t>(picks[static_cast<size_t>(q)] * h + r)] =
            dot(w + r * f, act.data() + q * f, f);
    }
  });
  // each token's picks summed in pick order with their routing weights (every thread count gives these sums)
  for (int64_t t = 0; t < rows; ++t) {
    float *dst = y + t * h;
    std::memset(dst, 0, static_cast<size_t>(h) * sizeof(float));
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = ids[t * k + j];
      if (e < 0 || e >= experts) continue;
      const float wt = weights[t * k + j];
      const float *src = out.data() + (t * k + j) * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) dst[i] += wt * src[i];
    }
  }
  if (rows < m) std::memset(y + rows * h, 0, static_cast<size_t>((m - rows) * h) * sizeof(float));
  return 0;
}
