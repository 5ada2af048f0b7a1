// Decode attention over the paged KV cache for MindSpore CPU, called as an AOT ``ops.Custom`` (see
// agents/native_kernels.py). One call per layer does what the portable graph does with ~30 small ops: rotary
// embedding of the step's query and key, the write of its key/value rows into the cache, and attention of every
// sequence's one query token over its context.
//
// Why: the portable graph gathers each sequence's K/V rows into a copy and reads the copy again with batched
// matmuls, and pays MindSpore's per-op cost for every rope, slice and per-head scatter; at batch 128 x context
// 256 that was ~65% of a decode step (docs/model.md). Here each K/V row is read once, in place, through the block
// table; the query heads sharing a kv head (GQA) are handled together; softmax is two-pass in float32.
//
// Inputs (float32 unless noted), in this order:
//   qkv           [batch, (heads + 2 * kv_heads) * head_dim]  the fused projection of the step's tokens
//   cos, sin      [batch, head_dim]           rotary tables at each token's position (rotate-half layout)
//   slot_mapping  [batch]         int32       cache slot the token's key/value go to
//   block_tables  [batch, width]  int32       physical block of each logical block
//   context_lens  [batch]         int32       tokens to attend over, the new one included (0: padding row)
//   block_offsets [block_size]    int32       only its length is read: the block size
//   key caches    kv_heads x [num_slots, head_dim]   written in place at slot_mapping
//   value caches  kv_heads x [num_slots, head_dim]   written in place at slot_mapping
// Output: [batch, heads * head_dim]; padding rows (context length 0) write nothing and give zeros.
// Returns 0, or an error code that MindSpore raises as a RuntimeError, checked before anything is written:
// 1 wrong number of inputs or ranks, 2 a dtype other than the above, 3 inconsistent shapes, 4 a context length
// or slot out of range, 5 a block-table entry outside the cache.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

bool is_dtype(const char *dtype, const char *want) { return std::strcmp(dtype, want) == 0; }

// Rotate-half rotary embedding of one head: out = x * cos + concat(-x[half:], x[:half]) * sin.
void rope(const float *x, const float *cos, const float *sin, int64_t head_dim, float *out) {
  const int64_t half = head_dim / 2;
  for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] - x[d + half] * sin[d];
  for (int64_t d = half; d < head_dim; ++d) out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

// Cache rows of one block, for the block after the current one: prefetching them while the current block is
// processed keeps the memory system busy across the jumps between non-contiguous blocks.
inline void prefetch_block(const float *rows, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(rows + i);
}

inline const float *block_rows(const float *cache, const int32_t *table, int64_t block, int64_t block_size,
                               int64_t head_dim) {
  return cache + static_cast<int64_t>(table[block]) * block_size * head_dim;
}

// scores[r * len + t] = scale * q_r . k_t for the ``rep`` query heads sharing this kv head.
template <int64_t kHeadDim>
void score_keys(const float *q, const int32_t *table, int64_t len, int64_t block_size, const float *keys,
                int64_t dyn_head_dim, int64_t rep, float scale, float *scores) {
  const int64_t head_dim = kHeadDim ? kHeadDim : dyn_head_dim;
  const int64_t blocks = (len + block_size - 1) / block_size;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const float *k = block_rows(keys, table, blk, block_size, head_dim);
    if (blk + 1 < blocks) prefetch_block(block_rows(keys, table, blk + 1, block_size, head_dim), block_size * head_dim);
    const int64_t start = blk * block_size;
    const int64_t rows = len - start < block_size ? len - start : block_size;
    for (int64_t r = 0; r < rep; ++r) {
      const float *qr = q + r * head_dim;
      float *s = scores + r * len + start;
      int64_t i = 0;
      for (; i + 4 <= rows; i += 4) {  // four rows at a time: independent sums, one horizontal add each
        const float *k0 = k + i * head_dim, *k1 = k0 + head_dim, *k2 = k1 + head_dim, *k3 = k2 + head_dim;
        float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
        for (int64_t d = 0; d < head_dim; ++d) {
          d0 += qr[d] * k0[d];
          d1 += qr[d] * k1[d];
          d2 += qr[d] * k2[d];
          d3 += qr[d] * k3[d];
        }
        s[i] = d0 * scale;
        s[i + 1] = d1 * scale;
        s[i + 2] = d2 * scale;
        s[i + 3] = d3 * scale;
      }
      for (; i < rows; ++i) {
        const float *kr = k + i * head_dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * kr[d];
        s[i] = dot * scale;
      }
    }
  }
}

// In place: each of the ``rep`` rows of ``len`` scores becomes its softmax.
void softmax_rows(float *scores, int64_t len, int64_t rep) {
  for (int64_t r = 0; r < rep; ++r) {
    float *s = scores + r * len;
    float top = s[0];
    for (int64_t t = 1; t < len; ++t) top = s[t] > top ? s[t] : top;
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = std::exp(s[t] - top);
      total += s[t];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  }
}

// out[r] = sum_t probs[r * len + t] * v_t.
template <int64_t kHeadDim>
void weigh_values(const float *probs, const int32_t *table, int64_t len, int64_t block_size, const float *values,
                  int64_t dyn_head_dim, int64_t rep, float *out) {
  const int64_t head_dim = kHeadDim ? kHeadDim : dyn_head_dim;
  std::memset(out, 0, sizeof(float) * rep * head_dim);
  const int64_t blocks = (len + block_size - 1) / block_size;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const float *v = block_rows(values, table, blk, block_size, head_dim);
    if (blk + 1 < blocks) prefetch_block(block_rows(values, table, blk + 1, block_size, head_dim), block_size * head_dim);
    const int64_t start = blk * block_size;
    const int64_t rows = len - start < block_size ? len - start : block_size;
    for (int64_t r = 0; r < rep; ++r) {
      const float *p = probs + r * len + start;
      float *o = out + r * head_dim;
      for (int64_t i = 0; i < rows; ++i) {
        const float pi = p[i];
        const float *vr = v + i * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) o[d] += pi * vr[d];
      }
    }
  }
}

// One sequence and kv head. ``kHeadDim`` fixes the row length at compile time for the common Llama head sizes
// (64, 128), which let the compiler unroll the row loops (1.4-2x faster than a runtime length); 0 = any.
template <int64_t kHeadDim>
void attend(const float *q, const int32_t *table, int64_t len, int64_t block_size, const float *keys,
            const float *values, int64_t head_dim, int64_t rep, float scale, float *scores, float *out) {
  score_keys<kHeadDim>(q, table, len, block_size, keys, head_dim, rep, scale, scores);
  softmax_rows(scores, len, rep);
  weigh_values<kHeadDim>(scores, table, len, block_size, values, head_dim, rep, out);
}

struct Problem {
  const float *qkv, *cos, *sin;
  const int32_t *slots, *tables, *lens;
  void **params;  // the op's inputs: key caches start at params[kCacheInput]
  float *out;
  int64_t batch, width, block_size, n_kv, head_dim, rep;
  float scale;
};

constexpr int kCacheInput = 7;

// (sequence, kv head) tasks taken from a shared counter until none is left.
void work(const Problem &p, std::atomic<int64_t> &next) {
  std::vector<float> scores, q;
  const int64_t heads = p.n_kv * p.rep, qkv_width = (heads + 2 * p.n_kv) * p.head_dim, dim = p.head_dim;
  q.resize(static_cast<size_t>(p.rep * dim));
  for (int64_t task = next.fetch_add(1); task < p.batch * p.n_kv; task = next.fetch_add(1)) {
    const int64_t b = task / p.n_kv, h = task % p.n_kv, len = p.lens[b];
    float *o = p.out + b * heads * dim + h * p.rep * dim;
    if (len == 0) {
      std::memset(o, 0, sizeof(float) * p.rep * dim);
      continue;
    }
    const float *row = p.qkv + b * qkv_width, *cos = p.cos + b * dim, *sin = p.sin + b * dim;
    auto *keys = static_cast<float *>(p.params[kCacheInput + h]);
    auto *values = static_cast<float *>(p.params[kCacheInput + p.n_kv + h]);
    const int64_t slot = p.slots[b];
    rope(row + (heads + h) * dim, cos, sin, dim, keys + slot * dim);
    std::memcpy(values + slot * dim, row + (heads + p.n_kv + h) * dim, sizeof(float) * dim);
    for (int64_t r = 0; r < p.rep; ++r) rope(row + (h * p.rep + r) * dim, cos, sin, dim, q.data() + r * dim);
    scores.resize(static_cast<size_t>(p.rep * len));
    const int32_t *table = p.tables + b * p.width;
    if (dim == 64) {
      attend<64>(q.data(), table, len, p.block_size, keys, values, dim, p.rep, p.scale, scores.data(), o);
    } else if (dim == 128) {
      attend<128>(q.data(), table, len, p.block_size, keys, values, dim, p.rep, p.scale, scores.data(), o);
    } else {
      attend<0>(q.data(), table, len, p.block_size, keys, values, dim, p.rep, p.scale, scores.data(), o);
    }
  }
}

// Threads per call: $LLM_SERVING_KERNEL_THREADS, else the hardware's. Plain threads started per call rather than
// OpenMP: OpenMP's idle workers spin after a parallel region and took the cores from MindSpore's next ops
// (decode B=128 ran 1.6x slower with spinning workers than with OMP_WAIT_POLICY=passive).
int64_t thread_count(int64_t tasks) {
  static const int64_t configured = [] {
    const char *env = std::getenv("LLM_SERVING_KERNEL_THREADS");
    const int64_t n = env ? std::atoll(env) : static_cast<int64_t>(std::thread::hardware_concurrency());
    return n > 0 ? n : 1;
  }();
  const int64_t useful = tasks / 16 + 1;  // a thread start costs about as much as a few short tasks
  return configured < useful ? configured : useful;
}

}  // namespace

extern "C" int PagedDecodeAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                    void *stream, void *extra) {
  (void)stream;
  (void)extra;
  const int n_kv = (nparam - kCacheInput - 1) / 2;
  if (n_kv < 1 || nparam != kCacheInput + 1 + 2 * n_kv) return 1;
  const int two_d[] = {0, 1, 2, 4, kCacheInput};
  for (int i : two_d) {
    if (ndims[i] != 2) return 1;
  }
  for (int i = 0; i < nparam - 1; ++i) {
    const bool is_index = i >= 3 && i < kCacheInput;
    if (!is_dtype(dtypes[i], is_index ? "int32" : "float32")) return 2;
  }
  Problem p{};
  p.qkv = static_cast<const float *>(params[0]);
  p.cos = static_cast<const float *>(params[1]);
  p.sin = static_cast<const float *>(params[2]);
  p.slots = static_cast<const int32_t *>(params[3]);
  p.tables = static_cast<const int32_t *>(params[4]);
  p.lens = static_cast<const int32_t *>(params[5]);
  p.params = params;
  p.out = static_cast<float *>(params[nparam - 1]);
  p.batch = shapes[0][0];
  p.width = shapes[4][1];
  p.block_size = shapes[6][0];
  p.n_kv = n_kv;
  p.head_dim = shapes[kCacheInput][1];
  const int64_t num_slots = shapes[kCacheInput][0], num_blocks = num_slots / p.block_size;
  const int64_t heads = shapes[0][1] / p.head_dim - 2 * n_kv;
  p.rep = heads / n_kv;
  if (p.block_size < 1 || p.head_dim % 2 != 0 || p.rep < 1 || p.rep * n_kv != heads ||
      (heads + 2 * n_kv) * p.head_dim != shapes[0][1] || shapes[1][1] != p.head_dim || shapes[2][1] != p.head_dim)
    return 3;
  for (int64_t b = 0; b < p.batch; ++b) {
    if (p.lens[b] < 0 || p.lens[b] > p.width * p.block_size) return 4;
    if (p.lens[b] > 0 && (p.slots[b] < 0 || p.slots[b] >= num_slots)) return 4;
    for (int64_t i = 0; i < (p.lens[b] + p.block_size - 1) / p.block_size; ++i) {
      if (p.tables[b * p.width + i] < 0 || p.tables[b * p.width + i] >= num_blocks) return 5;
    }
  }
  p.scale = 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  std::atomic<int64_t> next{0};
  std::vector<std::thread> helpers;
  for (int64_t i = 1; i < thread_count(p.batch * n_kv); ++i) helpers.emplace_back(work, std::cref(p), std::ref(next));
  work(p, next);
  for (auto &t : helpers) t.join();
  return 0;
}
