// The projections of a Llama layer for MindSpore CPU, called as AOT ``ops.Custom`` ops (agents/model/native_kernels.py):
// y = x W^T with W packed once at load time, fused with the work around each projection (RMSNorm before it, the
// residual add or SwiGLU after it).
//
// Why: MindSpore's CPU MatMul packs its weight operand again on every call and splits small-M products poorly:
// in a decode step at batch 32 its 33 matmuls ran at ~125 GFLOP/s (14 ms of a 24 ms step) and at batch 128 at
// ~330 GFLOP/s. This kernel reads weights already in the order its inner loop wants them and reaches 310-460
// GFLOP/s from 32 rows up on the same machine (docs/model.md). The fusions remove ~13 small graph ops per layer.
//
// Packed weight: W [N, K] (Hugging Face's [out, in]) is held as [panels * K, 32]: panel p is a K x 32 block whose
// row k holds the weights of input k for outputs 32p..32p+31 (zeros past N). For SwiGLU the gate and up rows of
// the same outputs share a panel: panel p holds gate rows 16p..16p+15 then up rows 16p..16p+15
// (agents/weights/packed.py does the packing).
//
// Entry points (float32 inputs except ``rows``; the output's shape gives N or F; ``LinearIsVectorized()`` says
// whether the build has the AVX-512 tiles):
//   Linear(x [M, K], w) -> [M, N]                                              y = x W^T (benchmarks' reference)
//   NormLinear(x [M, K], norm_weight [K], eps [1], w, rows) -> [M, N]          y = rmsnorm(x) W^T
//   NormSwiGlu(x [M, K], norm_weight [K], eps [1], w_gate_up, rows) -> [M, F]  y = silu(g) * u, [g u] = rmsnorm(x) W^T
//   ResidualLinear(x [M, K], w, residual [M, N], rows) -> [M, N]               y = residual + x W^T
// ``rows`` [1] int32: how many leading rows of x are real tokens (clamped to [0, M]); the rest are a bucket's
// padding and come out as zeros without being computed. Why: a step is padded to its graph's bucket (a decode
// batch of 73 runs in the 128 graph, a packed prefill of 175 tokens in the 192 one), and the padding rows cost
// as much as real ones in a matmul; the attention ops already skip them.
// Each returns 0, or an error code that MindSpore raises as a RuntimeError: 1 wrong number of inputs or ranks,
// 2 a dtype other than float32 (int32 for rows; the packed weight may also be float16, int32 or int8, below),
// 3 inconsistent shapes.
//
// Half precision (``model_config.precision: half``): a packed weight given as float16 has the float32 panels'
// layout; each weight is widened exactly to float32 and everything else is the float32 path's arithmetic.
// Fast precision (``model_config.precision: fast``): a packed weight given as int32 instead of float32 holds
// bfloat16 pairs, [panels * ceil(K / 2), 32]: int32 (p, k2, j) = bf16(W[32p + j, 2 k2]) | bf16(W[32p + j, 2 k2 + 1])
// << 16 (zero past K). The op then rounds its input rows to bfloat16 as well (after the RMSNorm, nearest-even)
// and accumulates the products in float32 with AVX512_BF16's vdpbf16ps (two products per lane per instruction:
// twice the float32 FMA's work per instruction, half the weight bytes). Epilogues (SwiGLU, residual) stay float32.
// ``LinearHasBf16()`` says whether the build has that instruction; without it the same maths runs in plain loops.
// Int8 weights (``model_config.quantization: w8a16``): a packed weight given as int8 holds, per panel, K rows of
// 32 int8 weights q (the float32 panels' layout) then 4 rows (128 bytes) holding the panel's 32 float32 scales:
// [panels * (K + 4), 32]. Each weight is formed as float(q) * scale in float32 and then used exactly as a float32
// weight (same FMAs, same order): the op equals the float32 op on the dequantized weight bit for bit, and reads a
// quarter of its bytes (decode is bound by reading weights). Inputs and epilogues stay float32.
#include <atomic>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

constexpr int64_t kPanel = 32;  // output columns per packed panel (two AVX-512 registers)
constexpr int kMaxRows = 12;    // rows per tile: 24 accumulator registers of 32
constexpr int64_t kScaleRows = 4;  // an int8 panel's 32 float32 scales, as rows of 32 int8

// Asks for the panel row 48 rows (6 KB) ahead of row ``k``: the weights of a decode step do not fit in the cache
// and come from memory once per panel, which the hardware prefetcher alone followed too late (measured over
// cycled weights: 32-row products 270 -> 360 GFLOP/s, 128-row 405 -> 435). Past the panel's end it warms the
// next panel.
inline void prefetch_ahead(const float *panel, int64_t k) {
  __builtin_prefetch(panel + (k + 48) * kPanel);
  __builtin_prefetch(panel + (k + 48) * kPanel + 16);
}

// out[i][j] = sum_k a[i * lda + k] * panel[k * 32 + j] for ``kRows`` rows of a and one packed panel.
template <int kRows>
void tile(const float *a, int64_t lda, const float *panel, int64_t k_dim, float (*out)[kPanel]) {
#if defined(__AVX512F__)
  __m512 lo[kRows], hi[kRows];
  for (int i = 0; i < kRows; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    prefetch_ahead(panel, k);
    const __m512 b0 = _mm512_loadu_ps(panel + k * kPanel), b1 = _mm512_loadu_ps(panel + k * kPanel + 16);
    for (int i = 0; i < kRows; ++i) {
      const __m512 ai = _mm512_set1_ps(a[i * lda + k]);
      lo[i] = _mm512_fmadd_ps(ai, b0, lo[i]);
      hi[i] = _mm512_fmadd_ps(ai, b1, hi[i]);
    }
  }
  for (int i = 0; i < kRows; ++i) {
    _mm512_storeu_ps(out[i], lo[i]);
    _mm512_storeu_ps(out[i] + 16, hi[i]);
  }
#else  // plain loops (~80 GFLOP/s here): agents/model/native_kernels.py uses MindSpore's MatMul where this is the build
  for (int i = 0; i < kRows; ++i)
    for (int64_t j = 0; j < kPanel; ++j) out[i][j] = 0.0f;
  for (int64_t k = 0; k < k_dim; ++k) {
    prefetch_ahead(panel, k);
    const float *bk = panel + k * kPanel;
    for (int i = 0; i < kRows; ++i) {
      const float ai = a[i * lda + k];
#pragma omp simd
      for (int64_t j = 0; j < kPanel; ++j) out[i][j] += ai * bk[j];
    }
  }
#endif
}

// Calls ``call(std::integral_constant<int, n>{})`` with n = ``rows`` (1 <= rows <= kRows): a tile's row count as a
// compile-time constant, so that its accumulators stay in registers.
template <int kRows, typename Call>
void with_rows(int rows, const Call &call) {
  if constexpr (kRows > 1) {
    if (rows < kRows) return with_rows<kRows - 1>(rows, call);
  }
  call(std::integral_constant<int, kRows>{});
}

// Float32 -> bfloat16, rounded to nearest even (NaN kept a quiet NaN). Plain integer arithmetic, so that it
// vectorizes and equals the numpy reference bit for bit (the tests round the same way).
inline uint16_t to_bf16(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u : rounded);
}

// A float that may alias other types: two bfloat16 inputs read as one 32-bit lane.
typedef float aliased_float __attribute__((may_alias, aligned(2)));

inline float from_bf16(uint32_t h) { return __builtin_bit_cast(float, h << 16); }

// out[i][j] = sum_k a[i * lda + k] * W[k][j] for ``kRows`` bfloat16 rows of a (``lda`` even, zero past K) and one
// bfloat16 panel of ``pairs`` int32 rows (see the header), in float32.
template <int kRows>
void tile_bf16(const uint16_t *a, int64_t lda, const int32_t *panel, int64_t pairs, float (*out)[kPanel]) {
#if defined(__AVX512BF16__)
  __m512 lo[kRows], hi[kRows];
  for (int i = 0; i < kRows; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    prefetch_ahead(reinterpret_cast<const float *>(panel), p);  // rows of 32 x 4 bytes, as the float32 panels
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + p * kPanel);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + p * kPanel + 16);
    for (int i = 0; i < kRows; ++i) {
      // the row's two bfloat16 inputs as one 32-bit lane (loaded through memcpy or as an int, GCC 12 stored every
      // sum to the stack in each iteration: half the speed)
      const __m512bh ai = (__m512bh)_mm512_set1_ps(*reinterpret_cast<const aliased_float *>(a + i * lda + 2 * p));
      lo[i] = _mm512_dpbf16_ps(lo[i], ai, b0);
      hi[i] = _mm512_dpbf16_ps(hi[i], ai, b1);
    }
  }
  for (int i = 0; i < kRows; ++i) {
    _mm512_storeu_ps(out[i], lo[i]);
    _mm512_storeu_ps(out[i] + 16, hi[i]);
  }
#else  // the same products and float32 sums in plain loops (correct, not fast: the backend refuses this build)
  for (int i = 0; i < kRows; ++i)
    for (int64_t j = 0; j < kPanel; ++j) out[i][j] = 0.0f;
  for (int64_t p = 0; p < pairs; ++p) {
    const int32_t *wp = panel + p * kPanel;
    for (int i = 0; i < kRows; ++i) {
      const float a0 = from_bf16(a[i * lda + 2 * p]), a1 = from_bf16(a[i * lda + 2 * p + 1]);
      for (int64_t j = 0; j < kPanel; ++j) {
        const auto w = static_cast<uint32_t>(wp[j]);
        out[i][j] += a0 * from_bf16(w & 0xFFFFu) + a1 * from_bf16(w >> 16);
      }
    }
  }
#endif
}

// float16 -> float32 (exact; subnormals, infinities and NaN included), for the plain-loop build.
inline float from_f16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return __builtin_bit_cast(float, sign | 0x7F800000u | (mantissa << 13));
  if (exponent != 0) return __builtin_bit_cast(float, sign | ((exponent + 112u) << 23) | (mantissa << 13));
  const float tiny = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // mantissa x 2^-24
  return sign ? -tiny : tiny;
}

// out[i][j] = sum_k a[i * lda + k] * W[k][j] for ``kRows`` float32 rows of a and one float16 panel (the float32
// panel layout, [k_dim, 32] halves): each weight widened to float32 exactly, then the float32 tile's FMAs in the
// same order, so the only difference from exact mode is the weights' rounding to float16.
template <int kRows>
void tile_f16(const float *a, int64_t lda, const uint16_t *panel, int64_t k_dim, float (*out)[kPanel]) {
#if defined(__AVX512F__)
  __m512 lo[kRows], hi[kRows];
  for (int i = 0; i < kRows; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    __builtin_prefetch(panel + (k + 96) * kPanel);  // 6 KB ahead, as prefetch_ahead for float32 panels
    const __m512 b0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(panel + k * kPanel)));
    const __m512 b1 =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(panel + k * kPanel + 16)));
    for (int i = 0; i < kRows; ++i) {
      const __m512 ai = _mm512_set1_ps(a[i * lda + k]);
      lo[i] = _mm512_fmadd_ps(ai, b0, lo[i]);
      hi[i] = _mm512_fmadd_ps(ai, b1, hi[i]);
    }
  }
  for (int i = 0; i < kRows; ++i) {
    _mm512_storeu_ps(out[i], lo[i]);
    _mm512_storeu_ps(out[i] + 16, hi[i]);
  }
#else
  for (int i = 0; i < kRows; ++i)
    for (int64_t j = 0; j < kPanel; ++j) out[i][j] = 0.0f;
  for (int64_t k = 0; k < k_dim; ++k) {
    const uint16_t *wk = panel + k * kPanel;
    for (int i = 0; i < kRows; ++i) {
      const float ai = a[i * lda + k];
      for (int64_t j = 0; j < kPanel; ++j) out[i][j] += ai * from_f16(wk[j]);
    }
  }
#endif
}

// dst[i] = float(src[i]) for ``n`` float16 values (n a multiple of 16 on AVX-512 builds: whole panels).
void widen_f16(const uint16_t *src, int64_t n, float *dst) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + i))));
#else
  for (int64_t i = 0; i < n; ++i) dst[i] = from_f16(src[i]);
#endif
}

// out[i][j] = sum_k a[i * lda + k] * W[k][j] for ``kRows`` float32 rows of a and one int8 panel (the header's
// layout: ``k_dim`` rows of 32 int8, then 32 float32 scales), each weight float(q) * scale in float32.
template <int kRows>
void tile_i8(const float *a, int64_t lda, const int8_t *panel, int64_t k_dim, float (*out)[kPanel]) {
  const float *scales = reinterpret_cast<const float *>(panel + k_dim * kPanel);
#if defined(__AVX512F__)
  const __m512 s0 = _mm512_loadu_ps(scales), s1 = _mm512_loadu_ps(scales + 16);
  __m512 lo[kRows], hi[kRows];
  for (int i = 0; i < kRows; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    __builtin_prefetch(panel + (k + 192) * kPanel);  // 6 KB ahead, as prefetch_ahead for float32 panels
    const __m128i *q = reinterpret_cast<const __m128i *>(panel + k * kPanel);
    const __m512 b0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), s0);
    const __m512 b1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), s1);
    for (int i = 0; i < kRows; ++i) {
      const __m512 ai = _mm512_set1_ps(a[i * lda + k]);
      lo[i] = _mm512_fmadd_ps(ai, b0, lo[i]);
      hi[i] = _mm512_fmadd_ps(ai, b1, hi[i]);
    }
  }
  for (int i = 0; i < kRows; ++i) {
    _mm512_storeu_ps(out[i], lo[i]);
    _mm512_storeu_ps(out[i] + 16, hi[i]);
  }
#else
  for (int i = 0; i < kRows; ++i)
    for (int64_t j = 0; j < kPanel; ++j) out[i][j] = 0.0f;
  for (int64_t k = 0; k < k_dim; ++k) {
    const int8_t *qk = panel + k * kPanel;
    for (int i = 0; i < kRows; ++i) {
      const float ai = a[i * lda + k];
      for (int64_t j = 0; j < kPanel; ++j) out[i][j] += ai * (static_cast<float>(qk[j]) * scales[j]);
    }
  }
#endif
}

// dst [k_dim, 32] = float(q) * scale for one int8 panel (the weights tile_i8 forms, formed once).
void widen_i8(const int8_t *panel, int64_t k_dim, float *dst) {
  const float *scales = reinterpret_cast<const float *>(panel + k_dim * kPanel);
  for (int64_t k = 0; k < k_dim; ++k) {
#pragma omp simd
    for (int64_t j = 0; j < kPanel; ++j) dst[k * kPanel + j] = static_cast<float>(panel[k * kPanel + j]) * scales[j];
  }
}

// Rows handed to one task with the whole of K: at most ~512 KB of x, so that they stay in L2 while the task's panel
// is applied to them (a prefill of thousands of tokens would otherwise stream x from memory once per panel).
// The rows are cut into equal chunks, and each chunk into near-equal tiles of at most 12 rows.
int64_t chunk_count(int64_t m, int64_t k_dim) {
  const int64_t most = 131072 / k_dim > kMaxRows ? 131072 / k_dim : kMaxRows;
  return (m + most - 1) / most;
}

// Runs ``m`` rows against ``panels`` panels, handing each tile's result to ``finish(first_row, rows, panel,
// out)``; ``run_tile(first_row, rows, panel, out)`` computes one tile. Tasks are (row chunk, panel) pairs,
// chunk-major, so that both threads share a chunk while it is hot.
template <typename RunTile, typename Finish>
void gemm_tiles(int64_t m, int64_t k_dim, int64_t panels, const RunTile &run_tile, const Finish &finish) {
  const int64_t chunks = chunk_count(m, k_dim);
  run_tasks(chunks * panels, 2, [&](int64_t task) {
    const int64_t chunk = task / panels, p = task % panels;
    const int64_t first = m * chunk / chunks, rows = m * (chunk + 1) / chunks - first;
    const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows;
    float out[kMaxRows][kPanel];
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t begin = first + rows * t / tiles, end = first + rows * (t + 1) / tiles;
      run_tile(begin, end - begin, p, out);
      finish(begin, end - begin, p, out);
    }
  });
}

// A packed weight: float32 panels (exact) or bfloat16 pairs (fast), and x as the matching rows (float32 [m, K],
// or bfloat16 [m, 2 * pairs]).
struct Operands {
  const float *x = nullptr, *w = nullptr;
  const uint16_t *x_bf16 = nullptr, *w_f16 = nullptr;
  const int32_t *w_bf16 = nullptr;
  const int8_t *w_i8 = nullptr;
  int64_t k_dim = 0;
};

// Runs float32 x against panels of narrow weights (float16, or int8 with scales) that are widened to float32
// as they are used: ``panel_at(p)`` is panel p, ``narrow_tile(rows, x rows, panel, out)`` a tile that widens
// each weight as it reads it, ``widen(panel, wide)`` the whole panel at once. With one tile per task (m <= 12) the
// tile widens as it reads; with several, the panel is widened once into the thread's scratch and the float32 tile
// reads that: the same weights, products and order (bitwise the same result) without a conversion per tile
// (which cost ~10% at 128 rows for float16).
template <typename Finish, typename PanelAt, typename NarrowTile, typename Widen>
void gemm_widened(const Operands &op, int64_t m, int64_t panels, const Finish &finish, const PanelAt &panel_at,
                  const NarrowTile &narrow_tile, const Widen &widen) {
  const int64_t k_dim = op.k_dim;
  static std::atomic<uint64_t> calls{0};
  const uint64_t call = ++calls;
  gemm_tiles(m, k_dim, panels, [&](int64_t begin, int64_t rows, int64_t p, float (*out)[kPanel]) {
    const auto *panel = panel_at(p);
    if (m <= kMaxRows) {
      narrow_tile(static_cast<int>(rows), op.x + begin * k_dim, panel, out);
      return;
    }
    thread_local std::vector<float> wide;
    thread_local uint64_t wide_call = 0;
    thread_local int64_t wide_panel = -1;
    if (wide_call != call || wide_panel != p) {
      wide.resize(static_cast<size_t>(k_dim * kPanel));
      widen(panel, wide.data());
      wide_call = call;
      wide_panel = p;
    }
    with_rows<kMaxRows>(static_cast<int>(rows), [&](auto n) {
      tile<decltype(n)::value>(op.x + begin * k_dim, k_dim, wide.data(), k_dim, out);
    });
  }, finish);
}

// Runs x [m, k_dim] against every panel of w (see gemm_tiles).
template <typename Finish>
void gemm(const Operands &op, int64_t m, int64_t panels, const Finish &finish) {
  const int64_t k_dim = op.k_dim;
  if (op.w_bf16 != nullptr) {
    const int64_t pairs = (k_dim + 1) / 2;
    gemm_tiles(m, k_dim, panels, [&](int64_t begin, int64_t rows, int64_t p, float (*out)[kPanel]) {
      with_rows<kMaxRows>(static_cast<int>(rows), [&](auto n) {
        tile_bf16<decltype(n)::value>(op.x_bf16 + begin * 2 * pairs, 2 * pairs, op.w_bf16 + p * pairs * kPanel, pairs,
                                      out);
      });
    }, finish);
    return;
  }
  if (op.w_i8 != nullptr) {
    gemm_widened(op, m, panels, finish, [&](int64_t p) { return op.w_i8 + p * (k_dim + kScaleRows) * kPanel; },
                 [&](int rows, const float *a, const int8_t *panel, float (*out)[kPanel]) {
                   with_rows<kMaxRows>(rows, [&](auto n) { tile_i8<decltype(n)::value>(a, k_dim, panel, k_dim, out); });
                 },
                 [&](const int8_t *panel, float *wide) { widen_i8(panel, k_dim, wide); });
    return;
  }
  if (op.w_f16 != nullptr) {
    gemm_widened(op, m, panels, finish, [&](int64_t p) { return op.w_f16 + p * k_dim * kPanel; },
                 [&](int rows, const float *a, const uint16_t *panel, float (*out)[kPanel]) {
                   with_rows<kMaxRows>(rows, [&](auto n) { tile_f16<decltype(n)::value>(a, k_dim, panel, k_dim, out); });
                 },
                 [&](const uint16_t *panel, float *wide) { widen_f16(panel, k_dim * kPanel, wide); });
    return;
  }
  gemm_tiles(m, k_dim, panels, [&](int64_t begin, int64_t rows, int64_t p, float (*out)[kPanel]) {
    with_rows<kMaxRows>(static_cast<int>(rows), [&](auto n) {
      tile<decltype(n)::value>(op.x + begin * k_dim, k_dim, op.w + p * k_dim * kPanel, k_dim, out);
    });
  }, finish);
}

// x [m, k_dim] float32 -> bfloat16 rows of 2 * ceil(k_dim / 2) (zero padded) in thread-local scratch.
const uint16_t *bf16_rows(const float *x, int64_t m, int64_t k_dim) {
  const int64_t lda = (k_dim + 1) / 2 * 2;
  thread_local std::vector<uint16_t> scratch;
  scratch.resize(static_cast<size_t>(m * lda));
  uint16_t *out = scratch.data();
  run_tasks((m + 15) / 16, 4, [&](int64_t task) {
    for (int64_t r = task * 16; r < m && r < task * 16 + 16; ++r) {
      const float *row = x + r * k_dim;
      uint16_t *dst = out + r * lda;
#pragma omp simd
      for (int64_t k = 0; k < k_dim; ++k) dst[k] = to_bf16(row[k]);
      if (lda > k_dim) dst[k_dim] = 0;
    }
  });
  return out;
}

// Whether every input but ``rows_at`` (the int32 row count; -1 for none) and ``weight_at`` (the packed weight:
// float32, float16, int32 bfloat16 pairs or int8 with scales) and the output is float32.
bool dtypes_ok(int nparam, const char **dtypes, int rows_at, int weight_at) {
  for (int i = 0; i < nparam; ++i) {
    if (i == weight_at ? !(is_dtype(dtypes[i], "float32") || is_dtype(dtypes[i], "float16") ||
                           is_dtype(dtypes[i], "int32") || is_dtype(dtypes[i], "int8"))
                       : !is_dtype(dtypes[i], i == rows_at ? "int32" : "float32"))
      return false;
  }
  return true;
}

// The real rows of an ``m``-row input: the ``rows`` input clamped to [0, m].
int64_t real_rows(const void *rows, int64_t m) {
  const int64_t n = *static_cast<const int32_t *>(rows);
  return n < 0 ? 0 : (n > m ? m : n);
}

// Zeros rows [from, m) of y [m, n]: the bucket's padding.
void zero_padding(float *y, int64_t from, int64_t m, int64_t n) {
  if (from < m) std::memset(y + from * n, 0, static_cast<size_t>((m - from) * n) * sizeof(float));
}

// Whether a packed weight of the shape [shape[0], shape[1]] and ``dtype`` holds ``panels`` panels over ``k_dim``
// inputs (``k_dim`` rows of floats, ceil(k_dim / 2) rows of bfloat16 pairs, or k_dim + 4 rows of int8 and scales).
bool packed_shape(const int64_t *shape, const char *dtype, int64_t panels, int64_t k_dim) {
  const int64_t rows = is_dtype(dtype, "int32") ? (k_dim + 1) / 2
                       : is_dtype(dtype, "int8") ? k_dim + kScaleRows
                                                 : k_dim;
  return shape[1] == kPanel && shape[0] == panels * rows;
}

// The operands of x [m, k_dim] (its first ``m`` rows) against a packed weight of ``dtype``: for bfloat16 weights,
// x rounded to bfloat16 rows in the calling thread's scratch.
Operands operands(const float *x, int64_t m, int64_t k_dim, const void *w, const char *dtype) {
  Operands op;
  op.k_dim = k_dim;
  if (is_dtype(dtype, "int32")) {
    op.w_bf16 = static_cast<const int32_t *>(w);
    op.x_bf16 = bf16_rows(x, m, k_dim);
  } else if (is_dtype(dtype, "int8")) {
    op.w_i8 = static_cast<const int8_t *>(w);
    op.x = x;
  } else if (is_dtype(dtype, "float16")) {
    op.w_f16 = static_cast<const uint16_t *>(w);
    op.x = x;
  } else {
    op.w = static_cast<const float *>(w);
    op.x = x;
  }
  return op;
}

// What NormLinear and NormSwiGlu share: their inputs checked, and x normalized.
struct NormCall {
  int64_t m = 0, rows = 0, k_dim = 0, n = 0, panels = 0;  // m: x's rows, of which ``rows`` real; n: y's columns
  Operands op;
  const float *normed = nullptr;  // the float32 normed rows (what a LoRA update reads, whatever the weight's dtype)
  float *y = nullptr;
};

// Checks the inputs (``per_panel`` output columns per packed panel: 32, or 16 for SwiGLU; ``extra`` inputs between
// ``rows`` and the output, checked by the caller) and normalizes x into thread-local scratch (the caller's thread
// owns it for the call; helpers read it).
int norm_call(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, int64_t per_panel,
              NormCall &call, int extra = 0) {
  const int out = 5 + extra;
  if (nparam != 6 + extra || ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 1 || ndims[3] != 2 || ndims[4] != 1 ||
      ndims[out] != 2)
    return 1;
  if (!dtypes_ok(5, dtypes, 4, 3) || !is_dtype(dtypes[out], "float32")) return 2;
  call.m = shapes[0][0];
  call.k_dim = shapes[0][1];
  call.n = shapes[out][1];
  call.panels = (call.n + per_panel - 1) / per_panel;
  if (shapes[1][0] != call.k_dim || shapes[2][0] != 1 || shapes[4][0] != 1 || shapes[out][0] != call.m ||
      !packed_shape(shapes[3], dtypes[3], call.panels, call.k_dim))
    return 3;
  call.rows = real_rows(params[4], call.m);
  thread_local std::vector<float> normed;
  normed.resize(static_cast<size_t>(call.rows * call.k_dim));
  rms_norm(static_cast<const float *>(params[0]), call.rows, call.k_dim, static_cast<const float *>(params[1]),
           *static_cast<const float *>(params[2]), normed.data());
  call.op = operands(normed.data(), call.rows, call.k_dim, params[3], dtypes[3]);
  call.normed = normed.data();
  call.y = static_cast<float *>(params[out]);
  zero_padding(call.y, call.rows, call.m, call.n);
  return 0;
}

// out[i][j] += sum_r t[i * w + r] * panel[r * 32 + j] for ``kRows`` rows: a tile's LoRA expansion (LoraCall::add).
template <int kRows>
void accumulate_tile(const float *t, int64_t w, const float *panel, float (*out)[kPanel]) {
#if defined(__AVX512F__)
  __m512 lo[kRows], hi[kRows];
  for (int i = 0; i < kRows; ++i) {
    lo[i] = _mm512_loadu_ps(out[i]);
    hi[i] = _mm512_loadu_ps(out[i] + 16);
  }
  for (int64_t r = 0; r < w; ++r) {
    const __m512 b0 = _mm512_loadu_ps(panel + r * kPanel), b1 = _mm512_loadu_ps(panel + r * kPanel + 16);
    for (int i = 0; i < kRows; ++i) {
      const __m512 ti = _mm512_set1_ps(t[i * w + r]);
      lo[i] = _mm512_fmadd_ps(ti, b0, lo[i]);
      hi[i] = _mm512_fmadd_ps(ti, b1, hi[i]);
    }
  }
  for (int i = 0; i < kRows; ++i) {
    _mm512_storeu_ps(out[i], lo[i]);
    _mm512_storeu_ps(out[i] + 16, hi[i]);
  }
#else
  for (int64_t r = 0; r < w; ++r)
    for (int i = 0; i < kRows; ++i)
      for (int64_t j = 0; j < kPanel; ++j) out[i][j] += t[i * w + r] * panel[r * kPanel + j];
#endif
}

// LoRA updates inside the projections (agents/model/lora.py): y = base(x) + ((x A^T) * mask) B^T, where a row's
// mask keeps the columns of its own adapter slot. Why in the kernel: as separate ops (two GEMMs, a mask product
// and a SwiGLU in graph ops per projection) the update cost a decode step at batch 32 ~1.5x the base step, almost
// all of it op launches and helper wake-ups rather than FLOPs (docs/model.md "Adapters"). Here each row multiplies
// only its own slot's A and B, and a row without an adapter costs one comparison.
//
// The LoRA inputs follow the base op's own (before the output):
//   a [ceil(n * w / 32), K, 32]: every slot's A stacked, [n * w, K], packed as a weight (slot s: rows s * w..);
//   b [panels, n, w, 32]: B [out, n * w] in the base weight's panel order (b[p][s][r][j] = B[32p + j, s * w + r];
//     for SwiGLU the rows of [gate; up] as its panels interleave them);
//   slots [m] int32: each row's slot; outside [0, n): no adapter.
struct LoraCall {
  const float *a = nullptr, *b = nullptr;
  const int32_t *slots = nullptr;
  int64_t n = 0, w = 0;
  const float *t = nullptr;  // [rows, w]: each adapted row's x A_s^T (shrink)

  bool adapted(int64_t row) const { return slots[row] >= 0 && slots[row] < n; }

  // t = x A_s^T for the adapted rows among the first ``rows`` of x [rows, k_dim] (float32): rows grouped by slot
  // and gathered, so that each slot's rows run as whole tiles against its panels.
  void shrink(const float *x, int64_t rows, int64_t k_dim) {
    thread_local std::vector<float> shrunk, gathered;
    thread_local std::vector<int64_t> order, starts;
    shrunk.assign(static_cast<size_t>(rows * w), 0.0f);
    t = shrunk.data();
    starts.assign(static_cast<size_t>(n + 1), 0);
    for (int64_t r = 0; r < rows; ++r)
      if (adapted(r)) ++starts[static_cast<size_t>(slots[r]) + 1];
    for (int64_t s = 0; s < n; ++s) starts[s + 1] += starts[s];
    const int64_t count = starts[n];
    if (count == 0) return;
    order.resize(static_cast<size_t>(count));
    gathered.resize(static_cast<size_t>(count * k_dim));
    std::vector<int64_t> next(starts.begin(), starts.end() - 1);
    for (int64_t r = 0; r < rows; ++r) {
      if (!adapted(r)) continue;
      const int64_t at = next[slots[r]]++;
      order[at] = r;
      std::memcpy(gathered.data() + at * k_dim, x + r * k_dim, static_cast<size_t>(k_dim) * sizeof(float));
    }
    struct Run {
      int64_t slot, begin, rows;
    };
    std::vector<Run> runs;  // tiles of at most 12 rows of one slot
    for (int64_t s = 0; s < n; ++s)
      for (int64_t begin = starts[s]; begin < starts[s + 1]; begin += kMaxRows)
        runs.push_back({s, begin, starts[s + 1] - begin < kMaxRows ? starts[s + 1] - begin : kMaxRows});
    std::vector<std::pair<size_t, int64_t>> tasks;  // (run, panel of A holding some of its slot's columns)
    for (size_t i = 0; i < runs.size(); ++i)
      for (int64_t q = runs[i].slot * w / kPanel; q <= ((runs[i].slot + 1) * w - 1) / kPanel; ++q)
        tasks.emplace_back(i, q);
    float *out_t = shrunk.data();
    const float *xs = gathered.data();
    const int64_t *rows_of = order.data();
    // a decode step's few tiles run in the calling thread (a helper's wake-up would cost more than they do)
    run_tasks(static_cast<int64_t>(tasks.size()), 8, [&](int64_t task) {
      const Run &run = runs[tasks[static_cast<size_t>(task)].first];
      const int64_t q = tasks[static_cast<size_t>(task)].second;
      float out[kMaxRows][kPanel];
      with_rows<kMaxRows>(static_cast<int>(run.rows), [&](auto nrows) {
        tile<decltype(nrows)::value>(xs + run.begin * k_dim, k_dim, a + q * k_dim * kPanel, k_dim, out);
      });
      // the panel's columns that are this slot's: q * 32 + j in [slot * w, (slot + 1) * w)
      const int64_t lo = run.slot * w - q * kPanel > 0 ? run.slot * w - q * kPanel : 0;
      const int64_t hi = (run.slot + 1) * w - q * kPanel < kPanel ? (run.slot + 1) * w - q * kPanel : kPanel;
      for (int64_t i = 0; i < run.rows; ++i) {
        float *dst = out_t + rows_of[run.begin + i] * w + q * kPanel - run.slot * w;
        for (int64_t j = lo; j < hi; ++j) dst[j] = out[i][j];
      }
    });
  }

  // out += t B_s^T for a tile's rows (first..first+rows) and panel p, before the op's epilogue: the tile's rows of
  // each slot as one tile (B's rows read once per slot, the sums in registers), gathered where they are not
  // consecutive (rows of different adapters interleaved: one row at a time was ~2x the add's time).
  void add(int64_t first, int64_t rows, int64_t p, float (*out)[kPanel]) const {
    bool done[kMaxRows] = {};
    for (int64_t i = 0; i < rows; ++i) {
      if (done[i] || !adapted(first + i)) continue;
      const int32_t slot = slots[first + i];
      int64_t members[kMaxRows];
      int count = 0;
      for (int64_t j = i; j < rows; ++j) {
        if (!done[j] && slots[first + j] == slot) {
          members[count++] = j;
          done[j] = true;
        }
      }
      const float *panel = b + ((p * n + slot) * w) * kPanel;
      if (members[count - 1] - i == count - 1) {  // consecutive rows: in place
        with_rows<kMaxRows>(count, [&](auto nrows) {
          accumulate_tile<decltype(nrows)::value>(t + (first + i) * w, w, panel, out + i);
        });
        continue;
      }
      thread_local std::vector<float> rows_t;
      rows_t.resize(static_cast<size_t>(count * w));
      float sums[kMaxRows][kPanel];
      for (int c = 0; c < count; ++c) {
        std::memcpy(rows_t.data() + c * w, t + (first + members[c]) * w, static_cast<size_t>(w) * sizeof(float));
        std::memcpy(sums[c], out[members[c]], sizeof(sums[c]));
      }
      with_rows<kMaxRows>(count, [&](auto nrows) {
        accumulate_tile<decltype(nrows)::value>(rows_t.data(), w, panel, sums);
      });
      for (int c = 0; c < count; ++c) std::memcpy(out[members[c]], sums[c], sizeof(sums[c]));
    }
  }
};

// Checks the LoRA inputs at ``at`` (a, b, slots) against an op of ``m`` rows, ``k_dim`` inputs and ``panels``
// output panels (error codes as the ops').
int lora_call(void **params, int *ndims, int64_t **shapes, const char **dtypes, int at, int64_t m, int64_t k_dim,
              int64_t panels, LoraCall &call) {
  if (ndims[at] != 3 || ndims[at + 1] != 4 || ndims[at + 2] != 1) return 1;
  if (!is_dtype(dtypes[at], "float32") || !is_dtype(dtypes[at + 1], "float32") || !is_dtype(dtypes[at + 2], "int32"))
    return 2;
  const int64_t *a = shapes[at], *b = shapes[at + 1];
  call.n = b[1];
  call.w = b[2];
  if (call.n < 1 || call.w < 1 || b[0] != panels || b[3] != kPanel || a[0] != (call.n * call.w + kPanel - 1) / kPanel ||
      a[1] != k_dim || a[2] != kPanel || shapes[at + 2][0] != m)
    return 3;
  call.a = static_cast<const float *>(params[at]);
  call.b = static_cast<const float *>(params[at + 1]);
  call.slots = static_cast<const int32_t *>(params[at + 2]);
  return 0;
}

// y [m, n] = x W^T (+ the LoRA update, when ``lora``).
void store_rows(const Operands &op, int64_t m, int64_t n, float *y, const LoraCall *lora = nullptr) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  gemm(op, m, panels, [&](int64_t first, int64_t rows, int64_t p, float (*out)[kPanel]) {
    if (lora != nullptr) lora->add(first, rows, p, out);
    const int64_t col = p * kPanel, cols = n - col < kPanel ? n - col : kPanel;
    for (int64_t i = 0; i < rows; ++i) {
      float *dst = y + (first + i) * n + col;
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) dst[j] = out[i][j];
    }
  });
}

}  // namespace

// 1 when the tiles are AVX-512 code; the plain-loop build is correct but slower than MindSpore's MatMul.
extern "C" int LinearIsVectorized() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

// 1 when the bfloat16 tiles use AVX512_BF16's vdpbf16ps (the fast precision mode's reason to exist).
extern "C" int LinearHasBf16() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

extern "C" int Linear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                      void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2) return 1;
  if (!dtypes_ok(nparam, dtypes, -1, 1)) return 2;
  const int64_t m = shapes[0][0], k_dim = shapes[0][1], n = shapes[2][1];
  const int64_t panels = (n + kPanel - 1) / kPanel;
  if (!packed_shape(shapes[1], dtypes[1], panels, k_dim) || shapes[2][0] != m) return 3;
  store_rows(operands(static_cast<const float *>(params[0]), m, k_dim, params[1], dtypes[1]), m, n,
             static_cast<float *>(params[2]));
  return 0;
}

extern "C" int NormLinear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                          void *extra) {
  (void)stream;
  (void)extra;
  NormCall call;
  if (int rc = norm_call(nparam, params, ndims, shapes, dtypes, kPanel, call)) return rc;
  store_rows(call.op, call.rows, call.n, call.y);
  return 0;
}

namespace {

// NormSwiGlu, with the LoRA update added to gate and up before the SwiGLU when ``lora_inputs``.
int norm_swiglu(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, int lora_inputs) {
  constexpr int64_t kHalf = kPanel / 2;
  NormCall call;
  if (int rc = norm_call(nparam, params, ndims, shapes, dtypes, kHalf, call, lora_inputs)) return rc;
  LoraCall lora;
  if (lora_inputs != 0) {
    if (int rc = lora_call(params, ndims, shapes, dtypes, 5, call.m, call.k_dim, call.panels, lora)) return rc;
    lora.shrink(call.normed, call.rows, call.k_dim);
  }
  const int64_t f = call.n;
  gemm(call.op, call.rows, call.panels, [&](int64_t first, int64_t rows, int64_t p, float (*out)[kPanel]) {
    if (lora_inputs != 0) lora.add(first, rows, p, out);
    const int64_t col = p * kHalf, cols = f - col < kHalf ? f - col : kHalf;
    for (int64_t i = 0; i < rows; ++i) {
      float *dst = call.y + (first + i) * f + col;
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) {
        const float gate = out[i][j];
        dst[j] = gate / (1.0f + exp_approx(-gate)) * out[i][kHalf + j];
      }
    }
  });
  return 0;
}

// ResidualLinear (``residual`` true) or PartialLinear, with the LoRA update when ``lora_inputs``: inputs x, w,
// [residual,] rows, [a, b, slots,] y.
int linear_rows(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool residual,
                int lora_inputs) {
  const int rows_at = residual ? 3 : 2, out = rows_at + 1 + lora_inputs;
  if (nparam != out + 1 || ndims[0] != 2 || ndims[1] != 2 || ndims[rows_at] != 1 || ndims[out] != 2 ||
      (residual && ndims[2] != 2))
    return 1;
  if (!dtypes_ok(rows_at + 1, dtypes, rows_at, 1) || !is_dtype(dtypes[out], "float32")) return 2;
  const int64_t m = shapes[0][0], k_dim = shapes[0][1], n = shapes[out][1];
  const int64_t panels = (n + kPanel - 1) / kPanel;
  if (!packed_shape(shapes[1], dtypes[1], panels, k_dim) || shapes[rows_at][0] != 1 || shapes[out][0] != m ||
      (residual && (shapes[2][0] != m || shapes[2][1] != n)))
    return 3;
  LoraCall lora;
  if (lora_inputs != 0) {
    if (int rc = lora_call(params, ndims, shapes, dtypes, rows_at + 1, m, k_dim, panels, lora)) return rc;
  }
  const int64_t rows = real_rows(params[rows_at], m);
  const auto *x = static_cast<const float *>(params[0]);
  auto *y = static_cast<float *>(params[out]);
  zero_padding(y, rows, m, n);
  if (lora_inputs != 0) lora.shrink(x, rows, k_dim);
  const LoraCall *update = lora_inputs != 0 ? &lora : nullptr;
  const Operands op = operands(x, rows, k_dim, params[1], dtypes[1]);
  if (!residual) {
    store_rows(op, rows, n, y, update);
    return 0;
  }
  const auto *added = static_cast<const float *>(params[2]);
  gemm(op, rows, panels, [&](int64_t first, int64_t rows, int64_t p, float (*out)[kPanel]) {
    if (update != nullptr) update->add(first, rows, p, out);
    const int64_t col = p * kPanel, cols = n - col < kPanel ? n - col : kPanel;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t at = (first + i) * n + col;
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) y[at + j] = added[at + j] + out[i][j];
    }
  });
  return 0;
}

}  // namespace

extern "C" int NormSwiGlu(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                          void *extra) {
  (void)stream;
  (void)extra;
  return norm_swiglu(nparam, params, ndims, shapes, dtypes, 0);
}

// y [m, n] = x W^T for the leading ``rows`` rows of x, zeros after them: the partial sum of a row-parallel
// projection on a tensor-parallel rank other than 0 (rank 0 adds the residual, through ResidualLinear).
extern "C" int PartialLinear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  (void)stream;
  (void)extra;
  return linear_rows(nparam, params, ndims, shapes, dtypes, false, 0);
}

extern "C" int ResidualLinear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  (void)stream;
  (void)extra;
  return linear_rows(nparam, params, ndims, shapes, dtypes, true, 0);
}

// The same four projections with a LoRA update (LoraCall above): their inputs, then a, b, slots, then the output.
extern "C" int NormLinearLora(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  (void)stream;
  (void)extra;
  NormCall call;
  if (int rc = norm_call(nparam, params, ndims, shapes, dtypes, kPanel, call, 3)) return rc;
  LoraCall lora;
  if (int rc = lora_call(params, ndims, shapes, dtypes, 5, call.m, call.k_dim, call.panels, lora)) return rc;
  lora.shrink(call.normed, call.rows, call.k_dim);
  store_rows(call.op, call.rows, call.n, call.y, &lora);
  return 0;
}

extern "C" int NormSwiGluLora(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  (void)stream;
  (void)extra;
  return norm_swiglu(nparam, params, ndims, shapes, dtypes, 3);
}

extern "C" int PartialLinearLora(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *stream, void *extra) {
  (void)stream;
  (void)extra;
  return linear_rows(nparam, params, ndims, shapes, dtypes, false, 3);
}

extern "C" int ResidualLinearLora(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *stream, void *extra) {
  (void)stream;
  (void)extra;
  return linear_rows(nparam, params, ndims, shapes, dtypes, true, 3);
}
