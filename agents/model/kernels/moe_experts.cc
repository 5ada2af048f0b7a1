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
// MoeLayer(x [m, h], norm_weight [h], eps [1], router [n, h], routing [4] int32, gate_up, down, rows) -> y [m, h]:
// a sparse layer's whole MLP slot in one call, so no MindSpore op runs between ours (their ops cost a decode step
// more than the experts did, docs/model.md "Speed: MoE against the dense model"): normed = rmsnorm(x) as the
// projections' norm, logits = normed @ router^T, softmax over all n experts in float32, the k largest (ties: the
// lower id, as torch.topk), renormalised to sum 1 where ``normalise`` (the three families' routers in
// transformers), then the experts as MoeExperts computes them. ``routing`` = (k, normalise, first, residual): this
// rank holds experts [first, first + E) of the n (expert parallelism: every rank routes every token, and a pick of
// another rank's expert adds nothing); ``residual`` 1: y = x + block (one rank), 0: the block alone (a partial sum
// that the ranks' all-reduce adds up before the residual). MoeLayerInt8 takes gate_up, gate_up_scale, down,
// down_scale as MoeExpertsInt8 does. Qwen2-MoE's shared expert is not here: it is held as the dense MLP is (packed
// or int8 projections, agents/model/moe.py SharedExpert) and added after this op by those projections' ops.
#include <algorithm>

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


// A layer's routing constants (MoeLayer's ``routing`` input).
struct Route {
  int64_t k, first;
  bool normalise, residual;
};

// ids [rows, k] (this rank's index of each pick's expert, -1 for another rank's) and weights [rows, k] from the
// normed rows [rows, h] and the router [n, h] of every expert; ``local``: the experts this rank holds.
void route_tokens(const float *normed, const float *router, int64_t rows, int64_t h, int64_t n, int64_t local,
                  const Route &route, int32_t *ids, float *weights) {
  const int64_t k = route.k;
  // a task is enough tokens for ~256K multiply-adds: a decode step's routing stays on the calling thread
  const int64_t per_task = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, n * h));
  run_tasks((rows + per_task - 1) / per_task, 2, [&](int64_t task) {
    std::vector<float> probs(static_cast<size_t>(n));
    std::vector<char> taken(static_cast<size_t>(n));
    for (int64_t t = task * per_task; t < rows && t < (task + 1) * per_task; ++t) {
      const float *xt = normed + t * h;
      float top = -INFINITY;
      for (int64_t e = 0; e < n; ++e) {
        probs[static_cast<size_t>(e)] = dot(router + e * h, xt, h);
        top = std::max(top, probs[static_cast<size_t>(e)]);
      }
      float sum = 0.0f;
      for (float &p : probs) sum += (p = std::exp(p - top));
      for (float &p : probs) p /= sum;
      std::fill(taken.begin(), taken.end(), 0);
      int32_t *id = ids + t * k;
      float *w = weights + t * k, picked = 0.0f;
      for (int64_t j = 0; j < k; ++j) {  // the largest left; the first (lowest id) of equal ones
        int64_t best = -1;
        for (int64_t e = 0; e < n; ++e) {
          const auto i = static_cast<size_t>(e);
          if (!taken[i] && (best < 0 || probs[i] > probs[static_cast<size_t>(best)])) best = e;
        }
        taken[static_cast<size_t>(best)] = 1;
        w[j] = probs[static_cast<size_t>(best)];
        picked += w[j];
        id[j] = best >= route.first && best < route.first + local ? static_cast<int32_t>(best - route.first) : -1;
      }
      if (route.normalise)
        for (int64_t j = 0; j < k; ++j) w[j] /= picked;
    }
  });
}

// MoeLayer's inputs by position (which entry point: int8 experts or float).
struct LayerArgs {
  int gate_up, gate_up_scale, down, down_scale, rows, y;
  explicit LayerArgs(bool int8)
      : gate_up(5), gate_up_scale(int8 ? 6 : -1), down(int8 ? 7 : 6), down_scale(int8 ? 8 : -1),
        rows(down + (int8 ? 2 : 1)), y(rows + 1) {}
};

// The layer's work once its inputs are checked (``a``: their positions).
template <typename Rows>
void moe_layer(void **params, int64_t **shapes, const LayerArgs &a, const Rows &gate_up,
               const Rows &down) {
  const int64_t m = shapes[0][0], h = shapes[0][1], n = shapes[3][0], experts = shapes[a.gate_up][0];
  const int64_t f = shapes[a.down][2];
  const int32_t *r = static_cast<const int32_t *>(params[4]);
  const Route route{r[0], r[2], r[1] != 0, r[3] != 0};
  const int64_t rows = clamp_rows(params[a.rows], m);
  const float *x = static_cast<const float *>(params[0]);
  float *y = static_cast<float *>(params[a.y]);
  std::vector<float> normed(static_cast<size_t>(rows * h)), weights(static_cast<size_t>(rows * route.k));
  std::vector<int32_t> ids(static_cast<size_t>(rows * route.k));
  rms_norm(x, rows, h, static_cast<const float *>(params[1]), *static_cast<const float *>(params[2]),
           normed.data());
  route_tokens(normed.data(), static_cast<const float *>(params[3]), rows, h, n, experts, route, ids.data(),
               weights.data());
  moe_experts(normed.data(), ids.data(), weights.data(), gate_up, down, m, h, route.k, experts, f, rows, y);
  if (route.residual) {  // the padding rows too, as x + 0
    for (int64_t i = 0; i < m * h; ++i) y[i] += x[i];
  }
}

// Checks MoeLayer's inputs; 0, or the op's error code (1 arity or ranks, 2 dtypes, 3 shapes, 4 routing).
int check_layer(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, const LayerArgs &a,
                bool int8) {
  if (nparam != a.y + 1) return 1;
  for (int i = 0; i < nparam; ++i) {
    const bool is_int8 = int8 && (i == a.gate_up || i == a.down);
    if (!is_dtype(dtypes[i], i == 4 || i == a.rows ? "int32" : (is_int8 ? "int8" : "float32"))) return 2;
  }
  const int want[] = {2, 1, 1, 2, 1};
  for (int i = 0; i < 5; ++i)
    if (ndims[i] != want[i]) return 1;
  if (ndims[a.gate_up] != 3 || ndims[a.down] != 3 || ndims[a.rows] != 1 || ndims[a.y] != 2) return 1;
  if (int8 && (ndims[a.gate_up_scale] != 2 || ndims[a.down_scale] != 2)) return 1;
  const int64_t m = shapes[0][0], h = shapes[0][1], n = shapes[3][0], experts = shapes[a.gate_up][0];
  const int64_t f = shapes[a.down][2];
  if (shapes[1][0] != h || shapes[2][0] < 1 || shapes[3][1] != h || shapes[4][0] != 4 ||
      shapes[a.gate_up][1] != 2 * f || shapes[a.gate_up][2] != h || shapes[a.down][0] != experts ||
      shapes[a.down][1] != h || shapes[a.rows][0] < 1 || shapes[a.y][0] != m || shapes[a.y][1] != h)
    return 3;
  if (int8 && (shapes[a.gate_up_scale][0] != experts || shapes[a.gate_up_scale][1] != 2 * f ||
               shapes[a.down_scale][0] != experts || shapes[a.down_scale][1] != h))
    return 3;
  const int32_t *r = static_cast<const int32_t *>(params[4]);
  if (r[0] < 1 || r[0] > n || r[2] < 0 || r[2] + experts > n) return 4;
  return 0;
}

int layer_call(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool int8) {
  const LayerArgs a(int8);
  if (const int bad = check_layer(nparam, params, ndims, shapes, dtypes, a, int8)) return bad;
  if (int8)
    moe_layer(params, shapes, a,
              Int8Rows{static_cast<const int8_t *>(params[a.gate_up]),
                       static_cast<const float *>(params[a.gate_up_scale])},
              Int8Rows{static_cast<const int8_t *>(params[a.down]), static_cast<const float *>(params[a.down_scale])});
  else
    moe_layer(params, shapes, a, FloatRows{static_cast<const float *>(params[a.gate_up])},
              FloatRows{static_cast<const float *>(params[a.down])});
  return 0;
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

extern "C" int MoeLayer(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                        void *extra) {
  (void)stream;
  (void)extra;
  return layer_call(nparam, params, ndims, shapes, dtypes, false);
}

extern "C" int MoeLayerInt8(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  (void)stream;
  (void)extra;
  return layer_call(nparam, params, ndims, shapes, dtypes, true);
}
