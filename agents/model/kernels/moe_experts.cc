// A sparse MoE layer's routed experts on CPU (issue 54): each token's picked experts' SwiGLU MLPs, weighted and
// summed, reading only the experts some token picked, in place in the stacked weights (no gathered copy), each
// expert's rows once for all the tokens that picked it. Called by agents.model.moe.MoeBlock on the native backend.
//
// MoeExperts(x [m, h], ids [m, k] int32, weights [m, k], gate_up [E, 2f, h], down [E, h, f], rows [1] int32)
//   -> y [m, h]: y[t] = sum_j weights[t, j] * down[e] @ (silu(gate[e] x[t]) * (up[e] x[t])), e = ids[t, j];
// a pick with an id outside [0, E) (another rank's expert under expert parallelism) is skipped; the rows after
// ``rows`` (the bucket's padding) come out as zeros. float32 throughout.
//
// MoeExpertsInt8(x, ids, weights, gate_up int8 [E, 2f, h], gate_up_scale [E, 2f], down int8 [E, h, f],
//   down_scale [E, h], rows) -> y: the same with w8a16 experts (model_config.quantization): each weight row
// formed as float(q) * scale in float32 (the dense int8 kernel's formula, kernels/linear.cc) into a row of scratch
// and then dotted exactly as a float32 row, so the result is bit for bit the float32 op's on the dequantized
// experts; the experts stay int8 in memory (a quarter of the bytes read).
#include "common.h"

namespace {

constexpr int64_t kRowBlock = 32;  // weight rows of one task: a task reads them once for all its expert's tokens

float dot(const float *a, const float *b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Float32 expert rows, read in place.
struct FloatRows {
  static constexpr bool kScratch = false;
  const float *w;
  const float *row(int64_t index, int64_t n, float *) const { return w + index * n; }
};

// Int8 expert rows with a float32 scale each, widened into the caller's scratch row as float(q) * scale.
struct Int8Rows {
  static constexpr bool kScratch = true;
  const int8_t *q;
  const float *scale;
  const float *row(int64_t index, int64_t n, float *scratch) const {
    const int8_t *src = q + index * n;
    const float s = scale[index];
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) scratch[i] = static_cast<float>(src[i]) * s;
    return scratch;
  }
};

// The op's work once its inputs are checked: gate_up rows index e * 2f + r, down rows e * h + r.
template <typename Rows>
void moe_experts(const float *x, const int32_t *ids, const float *weights, const Rows &gate_up, const Rows &down,
                 int64_t m, int64_t h, int64_t k, int64_t experts, int64_t f, int64_t rows, float *y) {
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
    std::vector<float> scratch(Rows::kScratch ? static_cast<size_t>(2 * h) : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const float *gate_row = gate_up.row(e * 2 * f + r, h, scratch.data());
      const float *up_row = gate_up.row(e * 2 * f + f + r, h, scratch.data() + h);
      for (int64_t q = first[e]; q < first[e + 1]; ++q) {
        const float *xt = x + (picks[static_cast<size_t>(q)] / k) * h;
        const float gate = dot(gate_row, xt, h), up = dot(up_row, xt, h);
        act[static_cast<size_t>(q * f + r)] = gate / (1.0f + std::exp(-gate)) * up;
      }
    }
  });
  run_tasks(n_touched * h_blocks, 4, [&](int64_t task) {
    const int64_t e = touched[static_cast<size_t>(task / h_blocks)], r0 = (task % h_blocks) * kRowBlock;
    const int64_t r1 = r0 + kRowBlock < h ? r0 + kRowBlock : h;
    std::vector<float> scratch(Rows::kScratch ? static_cast<size_t>(f) : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const float *w = down.row(e * h + r, f, scratch.data());
      for (int64_t q = first[e]; q < first[e + 1]; ++q)
        out[static_cast<size_t>(picks[static_cast<size_t>(q)] * h + r)] = dot(w, act.data() + q * f, f);
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
}

// Checks the shared inputs (x, ids, weights, rows, y at params[0, 1, 2, rows_at, rows_at + 1]) and the stacked
// weights' shapes (gate_up at params[gate_up_at], down at params[down_at]); 0, or the op's error code.
int check_shapes(int nparam, int64_t **shapes, int *ndims, int gate_up_at, int down_at, int rows_at) {
  const int ys = rows_at + 1;
  if (nparam != ys + 1 || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2 || ndims[gate_up_at] != 3 ||
      ndims[down_at] != 3 || ndims[rows_at] != 1 || ndims[ys] != 2)
    return 1;
  const int64_t m = shapes[0][0], h = shapes[0][1], k = shapes[1][1], experts = shapes[gate_up_at][0];
  const int64_t f = shapes[down_at][2];
  if (shapes[1][0] != m || shapes[2][0] != m || shapes[2][1] != k || shapes[gate_up_at][1] != 2 * f ||
      shapes[gate_up_at][2] != h || shapes[down_at][0] != experts || shapes[down_at][1] != h ||
      shapes[ys][0] != m || shapes[ys][1] != h)
    return 3;
  return 0;
}

int64_t clamp_rows(const void *rows, int64_t m) {
  const int64_t n = *static_cast<const int32_t *>(rows);
  return n < 0 ? 0 : (n > m ? m : n);
}

}  // namespace

extern "C" int MoeExperts(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                          void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 7) return 1;
  for (int i = 0; i < nparam; ++i)
    if (!is_dtype(dtypes[i], i == 1 || i == 5 ? "int32" : "float32")) return 2;
  if (const int bad = check_shapes(nparam, shapes, ndims, 3, 4, 5)) return bad;
  const int64_t m = shapes[0][0], h = shapes[0][1], k = shapes[1][1], experts = shapes[3][0], f = shapes[4][2];
  moe_experts(static_cast<const float *>(params[0]), static_cast<const int32_t *>(params[1]),
              static_cast<const float *>(params[2]), FloatRows{static_cast<const float *>(params[3])},
              FloatRows{static_cast<const float *>(params[4])}, m, h, k, experts, f, clamp_rows(params[5], m),
              static_cast<float *>(params[6]));
  return 0;
}

extern "C" int MoeExpertsInt8(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 9 || ndims[4] != 2 || ndims[6] != 2) return 1;
  for (int i = 0; i < nparam; ++i)
    if (!is_dtype(dtypes[i], i == 1 || i == 7 ? "int32" : (i == 3 || i == 5 ? "int8" : "float32"))) return 2;
  if (const int bad = check_shapes(nparam, shapes, ndims, 3, 5, 7)) return bad;
  const int64_t m = shapes[0][0], h = shapes[0][1], k = shapes[1][1], experts = shapes[3][0], f = shapes[5][2];
  if (shapes[4][0] != experts || shapes[4][1] != 2 * f || shapes[6][0] != experts || shapes[6][1] != h) return 3;
  moe_experts(static_cast<const float *>(params[0]), static_cast<const int32_t *>(params[1]),
              static_cast<const float *>(params[2]),
              Int8Rows{static_cast<const int8_t *>(params[3]), static_cast<const float *>(params[4])},
              Int8Rows{static_cast<const int8_t *>(params[5]), static_cast<const float *>(params[6])}, m, h, k,
              experts, f, clamp_rows(params[7], m), static_cast<float *>(params[8]));
  return 0;
}
