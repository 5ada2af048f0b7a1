// Attention over the paged KV cache for MindSpore CPU, called as AOT ``ops.Custom`` ops (agents/model/native_kernels.py).
// Each call does, for one layer, what the portable graph does with ~30 small ops: rotary embedding of the step's
// queries and keys, the write of their key/value rows into the cache, and attention.
//
// Why: the portable decode graph gathers each sequence's K/V rows into a copy and reads the copy again with
// batched matmuls, and pays MindSpore's per-op cost for every rope, slice and per-head scatter (at batch 128 x
// context 256 that was ~65% of a decode step, docs/model.md); the portable prefill pads every prompt to a common
// length. Here each K/V row is read once, in place; prompts are packed without padding; the query heads sharing
// a kv head (GQA) are handled together; softmax is two-pass in float32.
//
// Common inputs (float32 unless noted): qkv [tokens, (heads + 2 * kv_heads) * head_dim], the fused projection;
// cos, sin [tokens, head_dim], rotary tables at each token's position (rotate-half layout); slot_mapping
// [tokens] int32, the cache slot of each token's key/value; then the layer's cache [2 * kv_heads, num_slots,
// head_dim] (the key heads, then the value heads), written in place at slot_mapping. Output: [tokens, heads *
// head_dim].
// An int8 cache (``model_config.kv_cache_dtype: int8``) is [2 * kv_heads, num_slots, head_dim + 4] int8: each row
// holds head_dim int8 values then its float32 scale (4 bytes), max |x| / 127 of that token's key or value of that
// head, so q = round(x / scale) in [-127, 127] and x ~ q * scale. Rows are quantized as they are written and
// dequantized (q * scale in float32) block by block as attention reads them (``KvRows``): a quarter of the bytes
// per token read and held (plus the scale), the arithmetic after it the float32 path's.
//
// PagedDecodeAttention: one token per sequence (tokens = batch). Between slot_mapping and the cache:
//   block_tables [batch, width] int32, context_lens [batch] int32 (the new token included; 0 = padding row, which
//   writes nothing and gives zeros), block_offsets [block_size] int32 (only its length is read).
// PackedPrefillAttention: the prompts of the call packed back to back, causal attention within each. Between
//   slot_mapping and the cache: query_lens [batch] int32 (0 = padding sequence); tokens past their sum are
//   padding: they write nothing and give zeros.
// ChunkedPrefillAttention (at the end of this file): queries over cached context through the block tables, causal
//   within each sequence's chunk: chunked prefill, prefill after a prefix-cache hit, and decode tokens in one call.
//
// All return 0, or an error code that MindSpore raises as a RuntimeError, checked before anything is written:
// 1 wrong number of inputs or ranks, 2 a dtype other than the above, 3 inconsistent shapes, 4 a length or slot
// out of range, 5 a block-table entry outside the cache.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

// Rotate-half rotary embedding of one head: out = x * cos + concat(-x[half:], x[:half]) * sin.
void rope(const float *x, const float *cos, const float *sin, int64_t head_dim, float *out) {
  const int64_t half = head_dim / 2;
  for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] - x[d + half] * sin[d];
  for (int64_t d = half; d < head_dim; ++d) out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

constexpr int64_t kScaleBytes = 4;  // an int8 cache row's float32 scale, after its values

// ``row`` [dim] float32 -> int8 values then the float32 scale max |x| / 127 (0 for a zero row), q = round(x / scale)
// to nearest even (numpy's rint, the tests' reference).
void quantize_row(const float *x, int64_t dim, int8_t *row) {
  float top = 0.0f;
  for (int64_t d = 0; d < dim; ++d) top = std::fabs(x[d]) > top ? std::fabs(x[d]) : top;
  const float scale = top / 127.0f;
  for (int64_t d = 0; d < dim; ++d) {
    const float q = scale > 0.0f ? std::nearbyint(x[d] / scale) : 0.0f;
    row[d] = static_cast<int8_t>(q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q));
  }
  std::memcpy(row + dim, &scale, sizeof(float));
}

// out [dim] = q * scale of one int8 row.
inline void dequantize_row(const int8_t *row, int64_t dim, float *out) {
  float scale;
  std::memcpy(&scale, row + dim, sizeof(float));
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(row[d]) * scale;
}

// One kv head's key or value rows of a layer's cache: float32 [slots, dim], or int8 [slots, dim + 4] (the header).
// Readers always get float32 rows: an int8 block is dequantized into the caller's scratch.
struct KvRows {
  float *f32 = nullptr;
  int8_t *i8 = nullptr;
  int64_t dim = 0;

  int64_t row_bytes() const { return i8 != nullptr ? dim + kScaleBytes : dim * static_cast<int64_t>(sizeof(float)); }
  const char *bytes(int64_t first) const {
    return i8 != nullptr ? reinterpret_cast<const char *>(i8 + first * (dim + kScaleBytes))
                         : reinterpret_cast<const char *>(f32 + first * dim);
  }
  // Rows [first, first + n) as float32: the cache's own, or dequantized into ``scratch`` [n, dim].
  const float *rows(int64_t first, int64_t n, float *scratch) const {
    if (i8 == nullptr) return f32 + first * dim;
    for (int64_t r = 0; r < n; ++r) dequantize_row(i8 + (first + r) * (dim + kScaleBytes), dim, scratch + r * dim);
    return scratch;
  }
  void prefetch(int64_t first, int64_t n) const {
    const char *p = bytes(first);
    for (int64_t i = 0; i < n * row_bytes(); i += 64) __builtin_prefetch(p + i);
  }
  // Stores ``x`` [dim] at ``slot`` (quantized in an int8 cache).
  void write(int64_t slot, const float *x) const {
    if (i8 != nullptr) {
      quantize_row(x, dim, i8 + slot * (dim + kScaleBytes));
    } else {
      std::memcpy(f32 + slot * dim, x, sizeof(float) * dim);
    }
  }
  // dst [dim] = the row at ``slot`` as float32 (what attention reads back).
  void read(int64_t slot, float *dst) const {
    if (i8 != nullptr) {
      dequantize_row(i8 + slot * (dim + kScaleBytes), dim, dst);
    } else {
      std::memcpy(dst, f32 + slot * dim, sizeof(float) * dim);
    }
  }
};

// scores[r * stride + i] = scale * q_r . k_i for ``rows`` consecutive keys of one block and the ``rep`` query
// heads sharing their kv head.
template <int64_t kHeadDim>
void score_rows(const float *q, const float *k, int64_t rows, int64_t dyn_head_dim, int64_t rep, float scale,
                float *scores, int64_t stride) {
  const int64_t head_dim = kHeadDim ? kHeadDim : dyn_head_dim;
#if defined(__AVX512F__)
  if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {  // the query in registers, one reduction per key
    constexpr int64_t kChunks = kHeadDim / 16;
    for (int64_t r = 0; r < rep; ++r) {
      __m512 qr[kChunks];
      for (int64_t c = 0; c < kChunks; ++c) qr[c] = _mm512_loadu_ps(q + r * kHeadDim + 16 * c);
      for (int64_t i = 0; i < rows; ++i) {
        const float *ki = k + i * kHeadDim;
        __m512 acc = _mm512_mul_ps(qr[0], _mm512_loadu_ps(ki));
        for (int64_t c = 1; c < kChunks; ++c) acc = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(ki + 16 * c), acc);
        scores[r * stride + i] = _mm512_reduce_add_ps(acc) * scale;
      }
    }
    return;
  }
#endif
  for (int64_t r = 0; r < rep; ++r) {
    const float *qr = q + r * head_dim;
    float *s = scores + r * stride;
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

// out[r] += sum_i probs[r * stride + i] * v_i over ``rows`` consecutive values of one block.
// The AVX-512 path keeps two sums for the FMA latency: rows of even global index (``first`` is the block's first
// row in the sequence) go to ``out``, odd ones to ``odd_out``, and ``weigh_values`` adds the two at the end. So each
// sum runs in row order whatever the block size, and a token's attention is bitwise the same from the ragged
// prefill (its prompt as one block), a chunk or a decode step (cache blocks): a prefix-cache hit then gives the
// cold run's exact logprobs.
template <int64_t kHeadDim>
void weigh_rows(const float *probs, const float *v, int64_t rows, int64_t dyn_head_dim, int64_t rep, float *out,
                float *odd_out, int64_t first, int64_t stride) {
  const int64_t head_dim = kHeadDim ? kHeadDim : dyn_head_dim;
#if defined(__AVX512F__)
  if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {  // the output row in registers, two sums for the FMA latency
    constexpr int64_t kChunks = kHeadDim / 16;
    for (int64_t r = 0; r < rep; ++r) {
      const float *p = probs + r * stride;
      float *o = (first % 2 ? odd_out : out) + r * kHeadDim;  // the sum of this block's rows 0, 2, 4, ...
      float *o2 = (first % 2 ? out : odd_out) + r * kHeadDim;  // and of its rows 1, 3, 5, ...
      __m512 even[kChunks], odd[kChunks];
      for (int64_t c = 0; c < kChunks; ++c) {
        even[c] = _mm512_loadu_ps(o + 16 * c);
        odd[c] = _mm512_loadu_ps(o2 + 16 * c);
      }
      int64_t i = 0;
      for (; i + 2 <= rows; i += 2) {
        const __m512 p0 = _mm512_set1_ps(p[i]), p1 = _mm512_set1_ps(p[i + 1]);
        const float *v0 = v + i * kHeadDim, *v1 = v0 + kHeadDim;
        for (int64_t c = 0; c < kChunks; ++c) {
          even[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), even[c]);
          odd[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * c), odd[c]);
        }
      }
      if (i < rows) {
        const __m512 p0 = _mm512_set1_ps(p[i]);
        for (int64_t c = 0; c < kChunks; ++c) {
          even[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v + i * kHeadDim + 16 * c), even[c]);
        }
      }
      for (int64_t c = 0; c < kChunks; ++c) {
        _mm512_storeu_ps(o + 16 * c, even[c]);
        _mm512_storeu_ps(o2 + 16 * c, odd[c]);
      }
    }
    return;
  }
#endif
  (void)odd_out;
  (void)first;
  for (int64_t r = 0; r < rep; ++r) {  // one sum in row order: the same for any block size
    const float *p = probs + r * stride;
    float *o = out + r * head_dim;
    for (int64_t i = 0; i < rows; ++i) {
      const float pi = p[i];
      const float *vr = v + i * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) o[d] += pi * vr[d];
    }
  }
}

// Calls ``visit(start, rows, float32 rows)`` for each block of a sequence's ``len`` cache rows, in order, with the
// next block prefetched: that keeps the memory system busy across the jumps between non-contiguous blocks.
template <typename Visit>
void for_each_block(const KvRows &cache, const int32_t *table, int64_t len, int64_t block_size, const Visit &visit) {
  thread_local std::vector<float> scratch;  // an int8 block, dequantized
  if (cache.i8 != nullptr) scratch.resize(static_cast<size_t>(block_size * cache.dim));
  const int64_t blocks = (len + block_size - 1) / block_size;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    if (blk + 1 < blocks) cache.prefetch(static_cast<int64_t>(table[blk + 1]) * block_size, block_size);
    const int64_t start = blk * block_size, rows = len - start < block_size ? len - start : block_size;
    visit(start, rows, cache.rows(static_cast<int64_t>(table[blk]) * block_size, rows, scratch.data()));
  }
}

// scores[r * len + t] = scale * q_r . k_t over the sequence's blocks.
template <int64_t kHeadDim>
void score_keys(const float *q, const int32_t *table, int64_t len, int64_t block_size, const KvRows &keys,
                int64_t head_dim, int64_t rep, float scale, float *scores) {
  for_each_block(keys, table, len, block_size, [&](int64_t start, int64_t rows, const float *k) {
    score_rows<kHeadDim>(q, k, rows, head_dim, rep, scale, scores + start, len);
  });
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
      s[t] = exp_approx(s[t] - top);
      total += s[t];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  }
}

#if defined(__AVX512F__)
// ``weigh_values`` for ``kRows`` query rows (from ``r0``) whose two sums stay in registers across all the blocks:
// the same operations, in the same order, as ``weigh_rows`` with its sums in memory, without reloading and storing
// them at every block.
template <int64_t kHeadDim, int kRows>
void weigh_in_registers(const float *probs, const int32_t *table, int64_t len, int64_t block_size,
                        const KvRows &values, int64_t r0, float *out) {
  constexpr int64_t kChunks = kHeadDim / 16;
  __m512 even[kRows][kChunks], odd[kRows][kChunks];
  for (int r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kChunks; ++c) even[r][c] = odd[r][c] = _mm512_setzero_ps();
  }
  // row t of the sequence goes to even[] or odd[] by its parity, as in weigh_rows
  auto add_row = [&](__m512 (*acc)[kChunks], const float *vi, int64_t t) {
    __m512 vc[kChunks];
    for (int64_t c = 0; c < kChunks; ++c) vc[c] = _mm512_loadu_ps(vi + 16 * c);
    for (int r = 0; r < kRows; ++r) {
      const __m512 p = _mm512_set1_ps(probs[(r0 + r) * len + t]);
      for (int64_t c = 0; c < kChunks; ++c) acc[r][c] = _mm512_fmadd_ps(p, vc[c], acc[r][c]);
    }
  };
  for_each_block(values, table, len, block_size, [&](int64_t start, int64_t rows, const float *v) {
    int64_t i = 0;
    if (start % 2) add_row(odd, v, start), i = 1;
    for (; i + 2 <= rows; i += 2) {
      add_row(even, v + i * kHeadDim, start + i);
      add_row(odd, v + (i + 1) * kHeadDim, start + i + 1);
    }
    if (i < rows) add_row(even, v + i * kHeadDim, start + i);
  });
  for (int r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kChunks; ++c) {
      _mm512_storeu_ps(out + (r0 + r) * kHeadDim + 16 * c, _mm512_add_ps(even[r][c], odd[r][c]));
    }
  }
}
#endif

// out[r] = sum_t probs[r * len + t] * v_t over the sequence's blocks.
template <int64_t kHeadDim>
void weigh_values(const float *probs, const int32_t *table, int64_t len, int64_t block_size, const KvRows &values,
                  int64_t head_dim, int64_t rep, float *out) {
#if defined(__AVX512F__)
  if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {  // the query rows' sums in registers, a few rows at a time
    constexpr int kMost = kHeadDim <= 64 ? 2 : 1;  // 8 or 16 registers of sums a row
    int64_t r0 = 0;
    for (; r0 + kMost <= rep; r0 += kMost) {
      weigh_in_registers<kHeadDim, kMost>(probs, table, len, block_size, values, r0, out);
    }
    for (; r0 < rep; ++r0) weigh_in_registers<kHeadDim, 1>(probs, table, len, block_size, values, r0, out);
    return;
  }
#endif
  thread_local std::vector<float> odd;
  odd.assign(static_cast<size_t>(rep * head_dim), 0.0f);
  std::memset(out, 0, sizeof(float) * rep * head_dim);
  for_each_block(values, table, len, block_size, [&](int64_t start, int64_t rows, const float *v) {
    weigh_rows<kHeadDim>(probs + start, v, rows, head_dim, rep, out, odd.data(), start, len);
  });
}

// One sequence and kv head. ``kHeadDim`` fixes the row length at compile time for the common Llama head sizes
// (64, 128), which let the compiler unroll the row loops (1.4-2x faster than a runtime length); 0 = any.
template <int64_t kHeadDim>
void attend(const float *q, const int32_t *table, int64_t len, int64_t block_size, const KvRows &keys,
            const KvRows &values, int64_t head_dim, int64_t rep, float scale, float *scores, float *out) {
  score_keys<kHeadDim>(q, table, len, block_size, keys, head_dim, rep, scale, scores);
  softmax_rows(scores, len, rep);
  weigh_values<kHeadDim>(scores, table, len, block_size, values, head_dim, rep, out);
}

// ``rep`` query heads over ``len`` key/value rows; dispatches to the unrolled head sizes.
void attend_any(const float *q, const int32_t *table, int64_t len, int64_t block_size, const KvRows &keys,
                const KvRows &values, int64_t dim, int64_t rep, float scale, float *scores, float *out) {
  if (dim == 64) {
    attend<64>(q, table, len, block_size, keys, values, dim, rep, scale, scores, out);
  } else if (dim == 128) {
    attend<128>(q, table, len, block_size, keys, values, dim, rep, scale, scores, out);
  } else {
    attend<0>(q, table, len, block_size, keys, values, dim, rep, scale, scores, out);
  }
}

constexpr int64_t kTile = 8;  // queries of one sequence attended together by ChunkedPrefillAttention

// ``tokens`` (at most kTile) consecutive queries of one sequence and kv head (``rep`` rows each, in q), query i attending to the
// first lens[i] rows of the sequence's context. Each block of keys and values is read once for all of them (it
// stays in L1 while they use it) instead of once per query; every row's arithmetic is the one ``attend`` does, in
// the same order, so the results are bitwise those of attending query by query.
template <int64_t kHeadDim>
void attend_tile(const float *q, const int32_t *table, const int64_t *lens, int64_t tokens, int64_t block_size,
                 const KvRows &keys, const KvRows &values, int64_t dim, int64_t rep, float scale, float *scores,
                 float *odd, float *const *out) {
  const int64_t longest = lens[tokens - 1];
  int64_t at[kTile];  // where query i's ``rep x lens[i]`` scores start
  for (int64_t i = 0, offset = 0; i < tokens; offset += rep * lens[i], ++i) at[i] = offset;
  for_each_block(keys, table, longest, block_size, [&](int64_t start, int64_t rows, const float *k) {
    for (int64_t i = 0; i < tokens; ++i) {
      if (start >= lens[i]) continue;
      const int64_t n = lens[i] - start < rows ? lens[i] - start : rows;
      score_rows<kHeadDim>(q + i * rep * dim, k, n, dim, rep, scale, scores + at[i] + start, lens[i]);
    }
  });
  for (int64_t i = 0; i < tokens; ++i) {
    softmax_rows(scores + at[i], lens[i], rep);
    std::memset(out[i], 0, sizeof(float) * rep * dim);
  }
  std::memset(odd, 0, sizeof(float) * tokens * rep * dim);
  for_each_block(values, table, longest, block_size, [&](int64_t start, int64_t rows, const float *v) {
    for (int64_t i = 0; i < tokens; ++i) {
      if (start >= lens[i]) continue;
      const int64_t n = lens[i] - start < rows ? lens[i] - start : rows;
      weigh_rows<kHeadDim>(scores + at[i] + start, v, n, dim, rep, out[i], odd + i * rep * dim, start, lens[i]);
    }
  });
#if defined(__AVX512F__)
  if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {  // as weigh_values: the odd rows' sums added last
    for (int64_t i = 0; i < tokens; ++i) {
      for (int64_t j = 0; j < rep * dim; ++j) out[i][j] += odd[i * rep * dim + j];
    }
  }
#endif
}

void attend_tile_any(const float *q, const int32_t *table, const int64_t *lens, int64_t tokens, int64_t block_size,
                     const KvRows &keys, const KvRows &values, int64_t dim, int64_t rep, float scale, float *scores,
                     float *odd, float *const *out) {
  if (dim == 64) {
    attend_tile<64>(q, table, lens, tokens, block_size, keys, values, dim, rep, scale, scores, odd, out);
  } else if (dim == 128) {
    attend_tile<128>(q, table, lens, tokens, block_size, keys, values, dim, rep, scale, scores, odd, out);
  } else {
    attend_tile<0>(q, table, lens, tokens, block_size, keys, values, dim, rep, scale, scores, odd, out);
  }
}

// What both entry points share: the step's projections, rotary tables, slots and the caches.
struct Layer {
  const float *qkv, *cos, *sin;
  const int32_t *slots;
  const KvRows *keys, *values;  // per kv head
  float *out;
  int64_t n_kv, rep, dim, num_slots;
  float scale;

  int64_t heads() const { return n_kv * rep; }
  int64_t qkv_width() const { return (heads() + 2 * n_kv) * dim; }
  const float *row(int64_t token) const { return qkv + token * qkv_width(); }
  // Ropes token's key of kv head ``h`` and writes it and its value into the cache at the token's slot.
  void write_kv(int64_t token, int64_t h) const {
    const int64_t slot = slots[token];
    thread_local std::vector<float> roped;
    roped.resize(static_cast<size_t>(dim));
    rope(row(token) + (heads() + h) * dim, cos + token * dim, sin + token * dim, dim, roped.data());
    keys[h].write(slot, roped.data());
    values[h].write(slot, row(token) + (heads() + n_kv + h) * dim);
  }
  // Ropes the ``rep`` queries of kv head ``h`` at ``token`` into q [rep, dim].
  void queries(int64_t token, int64_t h, float *q) const {
    for (int64_t r = 0; r < rep; ++r) {
      rope(row(token) + (h * rep + r) * dim, cos + token * dim, sin + token * dim, dim, q + r * dim);
    }
  }
  float *out_row(int64_t token, int64_t h) const { return out + token * heads() * dim + h * rep * dim; }
};

// Validates the common inputs (the layer's cache at ``first_cache``: float32 [2 * n_kv, slots, dim] or int8
// [2 * n_kv, slots, dim + 4], the n_kv key heads then the n_kv value heads; the output after it) and fills
// ``layer``. One cache input per layer, not one per head: each graph input costs MindSpore's runtime microseconds
// on every call.
int parse_layer(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, int first_cache,
                std::vector<KvRows> &caches, Layer &layer) {
  if (nparam != first_cache + 2) return 1;
  if (ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2 || ndims[3] != 1 || ndims[first_cache] != 3) return 1;
  const bool int8_cache = is_dtype(dtypes[first_cache], "int8");
  for (int i = 0; i < nparam - 1; ++i) {
    const bool is_index = i >= 3 && i < first_cache;
    if (i == first_cache && int8_cache) continue;
    if (!is_dtype(dtypes[i], is_index ? "int32" : "float32")) return 2;
  }
  const int64_t *cache_shape = shapes[first_cache];
  const int64_t n_kv = cache_shape[0] / 2, dim = cache_shape[2] - (int8_cache ? kScaleBytes : 0);
  if (n_kv < 1 || cache_shape[0] != 2 * n_kv || dim < 2) return 3;
  caches.assign(static_cast<size_t>(2 * n_kv), KvRows{});
  for (int64_t i = 0; i < 2 * n_kv; ++i) {
    caches[i].dim = dim;
    if (int8_cache) {
      caches[i].i8 = static_cast<int8_t *>(params[first_cache]) + i * cache_shape[1] * cache_shape[2];
    } else {
      caches[i].f32 = static_cast<float *>(params[first_cache]) + i * cache_shape[1] * cache_shape[2];
    }
  }
  layer.qkv = static_cast<const float *>(params[0]);
  layer.cos = static_cast<const float *>(params[1]);
  layer.sin = static_cast<const float *>(params[2]);
  layer.slots = static_cast<const int32_t *>(params[3]);
  layer.keys = caches.data();
  layer.values = caches.data() + n_kv;
  layer.out = static_cast<float *>(params[nparam - 1]);
  layer.n_kv = n_kv;
  layer.dim = dim;
  layer.num_slots = cache_shape[1];
  const int64_t tokens = shapes[0][0], heads = shapes[0][1] / layer.dim - 2 * n_kv;
  layer.rep = heads / n_kv;
  if (layer.dim % 2 != 0 || layer.rep < 1 || layer.rep * n_kv != heads || layer.qkv_width() != shapes[0][1] ||
      shapes[1][0] != tokens || shapes[2][0] != tokens || shapes[1][1] != layer.dim || shapes[2][1] != layer.dim ||
      shapes[3][0] != tokens)
    return 3;
  layer.scale = 1.0f / std::sqrt(static_cast<float>(layer.dim));
  return 0;
}

// Decode tasks (one sequence and kv head each) per helper woken, for a call over ``rows`` context rows of
// ``batch`` sequences: enough that a helper's share is worth its hand-off, so a helper joins a single long
// sequence's kv heads. Why: at batch 1 a fixed 16 left the step's attention on one core while the other idled
// (bench model, context 256: 4 tasks of ~14 us, ~5% of a token's kernel CPU; docs/benchmarks.md "Inside the
// kernels at batch 1"); a polling helper's hand-off costs a few microseconds, ~512 rows of work.
int64_t decode_tasks_per_thread(int64_t rows, int64_t batch) {
  constexpr int64_t kRowsPerHandoff = 512, kMost = 16;
  const int64_t mean = batch > 0 ? rows / batch : 0;
  const int64_t wanted = mean > 0 ? (kRowsPerHandoff + mean - 1) / mean : kMost;
  return wanted < 1 ? 1 : (wanted > kMost ? kMost : wanted);
}

}  // namespace

extern "C" int PagedDecodeAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                    void *stream, void *extra) {
  (void)stream;
  (void)extra;
  constexpr int kFirstCache = 7;
  Layer layer{};
  std::vector<KvRows> caches;
  if (int rc = parse_layer(nparam, params, ndims, shapes, dtypes, kFirstCache, caches, layer)) return rc;
  if (ndims[4] != 2 || ndims[5] != 1 || ndims[6] != 1) return 1;
  const auto *tables = static_cast<const int32_t *>(params[4]);
  const auto *lens = static_cast<const int32_t *>(params[5]);
  const int64_t batch = shapes[0][0], width = shapes[4][1], block_size = shapes[6][0];
  if (shapes[4][0] != batch || shapes[5][0] != batch || block_size < 1) return 3;
  const int64_t num_blocks = layer.num_slots / block_size;
  for (int64_t b = 0; b < batch; ++b) {
    if (lens[b] < 0 || lens[b] > width * block_size) return 4;
    if (lens[b] > 0 && (layer.slots[b] < 0 || layer.slots[b] >= layer.num_slots)) return 4;
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      if (tables[b * width + i] < 0 || tables[b * width + i] >= num_blocks) return 5;
    }
  }
  int64_t rows = 0;
  for (int64_t b = 0; b < batch; ++b) rows += lens[b];
  run_tasks(batch * layer.n_kv, decode_tasks_per_thread(rows, batch), [&](int64_t task) {
    thread_local std::vector<float> scores, q;
    const int64_t b = task / layer.n_kv, h = task % layer.n_kv, len = lens[b];
    float *o = layer.out_row(b, h);
    if (len == 0) {
      std::memset(o, 0, sizeof(float) * layer.rep * layer.dim);
      return;
    }
    layer.write_kv(b, h);
    q.resize(static_cast<size_t>(layer.rep * layer.dim));
    layer.queries(b, h, q.data());
    scores.resize(static_cast<size_t>(layer.rep * len));
    attend_any(q.data(), tables + b * width, len, block_size, layer.keys[h], layer.values[h], layer.dim, layer.rep,
               layer.scale, scores.data(), o);
  });
  return 0;
}

extern "C" int PackedPrefillAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                      void *stream, void *extra) {
  (void)stream;
  (void)extra;
  constexpr int kFirstCache = 5;
  Layer layer{};
  std::vector<KvRows> caches;
  if (int rc = parse_layer(nparam, params, ndims, shapes, dtypes, kFirstCache, caches, layer)) return rc;
  if (ndims[4] != 1) return 1;
  const auto *lens = static_cast<const int32_t *>(params[4]);
  const int64_t tokens = shapes[0][0], batch = shapes[4][0];
  std::vector<int64_t> starts(static_cast<size_t>(batch) + 1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    if (lens[b] < 0) return 4;
    starts[b + 1] = starts[b] + lens[b];
  }
  const int64_t used = starts[batch];
  if (used > tokens) return 4;
  for (int64_t t = 0; t < used; ++t) {
    if (layer.slots[t] < 0 || layer.slots[t] >= layer.num_slots) return 4;
  }
  const int64_t width = layer.heads() * layer.dim;
  std::memset(layer.out + used * width, 0, sizeof(float) * (tokens - used) * width);
  run_tasks(batch * layer.n_kv, 1, [&](int64_t task) {
    thread_local std::vector<float> keys, values, scores, q;
    const int64_t b = task / layer.n_kv, h = task % layer.n_kv, start = starts[b], len = lens[b], dim = layer.dim;
    if (len == 0) return;
    // The prompt's own roped keys and values, contiguous: attention reads them as one block of ``len`` rows.
    keys.resize(static_cast<size_t>(len * dim));
    values.resize(static_cast<size_t>(len * dim));
    for (int64_t t = 0; t < len; ++t) {  // as the cache holds them (an int8 cache's rows dequantized)
      layer.write_kv(start + t, h);
      const int64_t slot = layer.slots[start + t];
      layer.keys[h].read(slot, keys.data() + t * dim);
      layer.values[h].read(slot, values.data() + t * dim);
    }
    static const int32_t kOneBlock[1] = {0};
    q.resize(static_cast<size_t>(layer.rep * dim));
    scores.resize(static_cast<size_t>(layer.rep * len));
    for (int64_t t = 0; t < len; ++t) {  // causal: token t attends to tokens 0..t of its prompt
      layer.queries(start + t, h, q.data());
      attend_any(q.data(), kOneBlock, t + 1, len, KvRows{keys.data(), nullptr, dim},
                 KvRows{values.data(), nullptr, dim}, dim, layer.rep, layer.scale, scores.data(),
                 layer.out_row(start + t, h));
    }
  });
  return 0;
}

// ChunkedPrefillAttention: queries over cached context (a chunked prefill, a prefill after a prefix-cache hit, and
// decode tokens, all in one call). Sequence b contributes query_lens[b] tokens, back to back as in the ragged
// prefill, at positions context_lens[b] - query_lens[b] .. context_lens[b] - 1: token i of its chunk attends to the
// first context_lens[b] - query_lens[b] + i + 1 rows of its context, read through its block table (the K/V earlier
// steps wrote, then the chunk's own, causal). Between slot_mapping and the caches: query_lens [batch],
// context_lens [batch], block_tables [batch, width], block_offsets [block_size] (only its length is read), all
// int32. Every token's key/value is written first, then every token attends, so a token reads the rows the
// chunk's earlier tokens wrote in the same call. Sequences with query_lens 0 and tokens past the lengths' sum are
// padding: they write nothing and give zeros.
extern "C" int ChunkedPrefillAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                       void *stream, void *extra) {
  (void)stream;
  (void)extra;
  constexpr int kFirstCache = 8;
  Layer layer{};
  std::vector<KvRows> caches;
  if (int rc = parse_layer(nparam, params, ndims, shapes, dtypes, kFirstCache, caches, layer)) return rc;
  if (ndims[4] != 1 || ndims[5] != 1 || ndims[6] != 2 || ndims[7] != 1) return 1;
  const auto *query_lens = static_cast<const int32_t *>(params[4]);
  const auto *context_lens = static_cast<const int32_t *>(params[5]);
  const auto *tables = static_cast<const int32_t *>(params[6]);
  const int64_t tokens = shapes[0][0], batch = shapes[4][0], width = shapes[6][1], block_size = shapes[7][0];
  if (shapes[5][0] != batch || shapes[6][0] != batch || block_size < 1) return 3;
  const int64_t num_blocks = layer.num_slots / block_size;
  int64_t used = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q = query_lens[b], ctx = context_lens[b];
    if (q < 0 || ctx < q || ctx > width * block_size) return 4;
    for (int64_t i = 0; q > 0 && i < (ctx + block_size - 1) / block_size; ++i) {
      if (tables[b * width + i] < 0 || tables[b * width + i] >= num_blocks) return 5;
    }
    used += q;
  }
  if (used > tokens) return 4;
  for (int64_t t = 0; t < used; ++t) {
    if (layer.slots[t] < 0 || layer.slots[t] >= layer.num_slots) return 4;
  }
  // The context rows each token attends to, and tiles of up to kTile consecutive tokens of one sequence.
  thread_local std::vector<int64_t> len_of, tile_first, tile_seq;
  len_of.resize(static_cast<size_t>(used));
  tile_first.clear();
  tile_seq.clear();
  for (int64_t b = 0, t = 0; b < batch; ++b) {
    for (int64_t i = 0; i < query_lens[b]; ++i, ++t) {
      len_of[t] = context_lens[b] - query_lens[b] + i + 1;
      if (i % kTile == 0) {
        tile_first.push_back(t);
        tile_seq.push_back(b);
      }
    }
  }
  const int64_t tiles = static_cast<int64_t>(tile_first.size());
  tile_first.push_back(used);
  const int64_t out_width = layer.heads() * layer.dim;
  std::memset(layer.out + used * out_width, 0, sizeof(float) * (tokens - used) * out_width);
  constexpr int64_t kWriteTokens = 16;
  run_tasks((used + kWriteTokens - 1) / kWriteTokens, 4, [&](int64_t task) {
    for (int64_t t = task * kWriteTokens; t < used && t < (task + 1) * kWriteTokens; ++t) {
      for (int64_t h = 0; h < layer.n_kv; ++h) layer.write_kv(t, h);
    }
  });
  // Head-major tasks: consecutive ones read the same kv head of the same sequence while it is in the cache.
  const int64_t *lens = len_of.data(), *firsts = tile_first.data(), *seqs = tile_seq.data();
  run_tasks(tiles * layer.n_kv, 16, [&](int64_t task) {
    thread_local std::vector<float> scores, q, odd;
    const int64_t h = task / tiles, tile = task % tiles, first = firsts[tile], n = firsts[tile + 1] - first;
    const int64_t rep = layer.rep, dim = layer.dim;
    q.resize(static_cast<size_t>(n * rep * dim));
    odd.resize(static_cast<size_t>(n * rep * dim));
    float *out[kTile];
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
      layer.queries(first + i, h, q.data() + i * rep * dim);
      out[i] = layer.out_row(first + i, h);
      total += rep * lens[first + i];
    }
    scores.resize(static_cast<size_t>(total));
    attend_tile_any(q.data(), tables + seqs[tile] * width, lens + first, n, block_size, layer.keys[h],
                    layer.values[h], dim, rep, layer.scale, scores.data(), odd.data(), out);
  });
  return 0;
}
