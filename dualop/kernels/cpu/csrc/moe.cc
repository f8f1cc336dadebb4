// Mixture-of-experts pieces on the CPU (semantics: dualop.kernels.moe_math).
//
// dualop_moe_grouped_linear: out[r, n] = sum_k x[r, k] * w[e(r), n, k] in float32, for rows r
// grouped by expert (rows group_start[g] .. group_end[g] - 1 use expert group_expert[g]; rows of
// no group are left untouched). x is
// float32 (the token rows, or the float32 activation: it is never rounded to 16 bits); the weights
// stay in their dtype and are widened in registers, so a 16-bit layer's weights are read once, at
// their own size (decode is weight-bandwidth bound). Each weight row is used for four token rows
// at a time while it is in L1.
//
// dualop_moe_grouped_linear_bf16: the same grouped matmul with bfloat16 rows and weights and a
// float32 output, on AVX512-BF16's dot product (vdpbf16ps: products of bfloat16 pairs, exact in
// float32, summed in float32). Rows may come as two bfloat16 halves, hi + lo (the float32
// intermediate as hi = bf16(v), lo = bf16(v - hi), v to 16 significant bits): both are multiplied by
// the same weight tile into the same float32 accumulators, so the intermediate is never rounded
// to 16 bits. Inner-product form over the weights as stored (K contiguous, no packing): a tile of
// kTileRows rows x kTileCols weight rows of 16-lane accumulators, 32 K-elements a step (the tail
// masked), horizontal sums at the end; groups of very few rows (decode) read whole weight rows in
// order instead, and groups of few rows prefetch the next weights into L2 (kNarrowRows,
// kFetchAheadRowBytes: decode and small groups are weight-bandwidth bound). Built only where the
// compiler targets AVX512-BF16 (dualop_moe_has_bf16_dot says which); elsewhere it returns -1 and
// Python keeps the float32 route.
//
// dualop_split_bf16: a float32 array as bfloat16 halves, hi = bf16(v) and lo = bf16(v - hi) (the
// difference is exact in float32), the rows the kernel above takes; lo = 0 where hi is infinite.
//
// dualop_grouped_topk: moe_math.route per row: softmax or sigmoid scores, optional correction bias,
// optional expert groups, top-k with ties to the lower index, renormalisation and scaling. NaN ranks
// as -inf (experts and group scores; moe_math's rule), so every pick finds an index in [0, E); the
// weights are the chosen values before ranking (a NaN score weighs NaN).
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace dualop {

template <class T>
DUALOP_INLINE void dot4(const float* __restrict x0, const float* __restrict x1, const float* __restrict x2,
                        const float* __restrict x3, const T* __restrict w, int64_t k, float* out, int64_t stride) {
  float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t i = 0; i < k; ++i) {
    const float wi = to_f32(w[i]);
    a0 += x0[i] * wi;
    a1 += x1[i] * wi;
    a2 += x2[i] * wi;
    a3 += x3[i] * wi;
  }
  out[0] = a0;
  out[stride] = a1;
  out[2 * stride] = a2;
  out[3 * stride] = a3;
}

template <class T>
DUALOP_INLINE float dot1(const float* __restrict x, const T* __restrict w, int64_t k) {
  float a = 0.0f;
#pragma omp simd reduction(+ : a)
  for (int64_t i = 0; i < k; ++i) a += x[i] * to_f32(w[i]);
  return a;
}

// The grouped kernels' work items: (group g, output columns n0 .. n1 - 1, `block` at a time);
// each thread takes whole items under OpenMP's dynamic schedule. body(g, n0, n1).
template <class Body>
static void for_each_group_block(int64_t groups, int64_t n, int64_t block, int threads, const Body& body) {
  const int64_t blocks = (n + block - 1) / block;
#pragma omp parallel for schedule(dynamic, 1) num_threads(dualop_team_size(threads))
  for (int64_t item = 0; item < groups * blocks; ++item) {
    const int64_t g = item / blocks, n0 = (item % blocks) * block;
    body(g, n0, n0 + block < n ? n0 + block : n);
  }
}

constexpr int64_t kBlockN = 16;

template <class T>
static void grouped_linear(const float* x, const T* w, const int64_t* group_expert, const int64_t* group_start,
                           const int64_t* group_end, int64_t groups, float* out, int64_t n, int64_t k, int threads) {
  for_each_group_block(groups, n, kBlockN, threads, [&](int64_t g, int64_t n0, int64_t n1) {
    const T* we = w + group_expert[g] * n * k;
    const int64_t r0 = group_start[g], r1 = group_end[g];
    for (int64_t col = n0; col < n1; ++col) {
      const T* wr = we + col * k;
      int64_t r = r0;
      for (; r + 4 <= r1; r += 4)
        dot4(x + r * k, x + (r + 1) * k, x + (r + 2) * k, x + (r + 3) * k, wr, k, out + r * n + col, n);
      for (; r < r1; ++r) out[r * n + col] = dot1(x + r * k, wr, k);
    }
  });
}

#if defined(__AVX512BF16__)
// Tile of the bfloat16 kernel: kTileRows rows x kTileCols weight rows of 16-lane accumulators
// (16 registers, plus the row and weight loads: hi/lo rows need two loads a row).
constexpr int kTileRows = 4;
constexpr int kTileCols = 4;
// Groups of fewer rows than this (decode) read whole weight rows one at a time: one sequential
// stream from memory, measured up to 2x faster there than the 4-row tiles' strided slices.
// With hi/lo halves only single rows gain (2-3 rows measured slower).
template <bool SPLIT>
constexpr int64_t kNarrowRows = SPLIT ? 2 : 4;
// K is walked in slices of kSliceK: a row tile's slice (hi and lo) stays in L1 while the tile
// moves along the item's weight rows; the partial sums of later slices are added to out.
constexpr int64_t kSliceK = 1024;
// Weight bytes (one K slice of an item's weight rows) that stay in L2 while every row tile of the
// group passes over them.
constexpr int64_t kWeightBlockBytes = 256 * 1024;
// Groups whose rows (one K slice, both halves) take at most this many bytes fetch the item's next
// weights into L2 ahead (see grouped_linear_bf16).
constexpr int64_t kFetchAheadRowBytes = 128 * 1024;

DUALOP_INLINE __m512bh load_bf16(const bf16* p, __mmask32 mask) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, p));
}

// The 16 lanes of v summed (what _mm512_reduce_add_ps does, without GCC 12's spurious warning).
DUALOP_INLINE float sum16(__m512 v) {
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(v),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// {sum of a's lanes, b's, c's, d's}: the four reductions share their shuffles.
DUALOP_INLINE __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// out[r * ldo + c] (+)= sum_{i < len} (hi[r * k + i] (+ lo[r * k + i])) * w[c * k + i] for r < ROWS,
// c < COLS; k is the row stride of hi, lo and w. The last partial step of 32 is masked.
template <int ROWS, int COLS, bool SPLIT>
DUALOP_INLINE void bf16_tile(const bf16* __restrict hi, const bf16* __restrict lo, const bf16* __restrict w,
                             int64_t k, int64_t len, bool accumulate, float* __restrict out, int64_t ldo) {
  // A lone weight row keeps kChains independent sums over K, so the dot products' latency overlaps.
  constexpr int kChains = COLS == 1 ? 4 : 1;
  __m512 acc[kChains][ROWS][COLS];
  for (int ch = 0; ch < kChains; ++ch)
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < COLS; ++c) acc[ch][r][c] = _mm512_setzero_ps();
  auto step = [&](int64_t i, __mmask32 mask, __m512 (&sums)[ROWS][COLS]) __attribute__((always_inline)) {
    __m512bh wv[COLS];
    for (int c = 0; c < COLS; ++c) wv[c] = load_bf16(w + c * k + i, mask);
    // the next tile's weight rows: on a group's first row tile they come from memory (measured
    // 5-20% on groups of 8-16 rows, level on large ones)
    if constexpr (COLS > 1)
      for (int c = 0; c < COLS; ++c) _mm_prefetch(reinterpret_cast<const char*>(w + (c + COLS) * k + i), _MM_HINT_T0);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh a = load_bf16(hi + r * k + i, mask);
      for (int c = 0; c < COLS; ++c) sums[r][c] = _mm512_dpbf16_ps(sums[r][c], a, wv[c]);
      if constexpr (SPLIT) {
        const __m512bh b = load_bf16(lo + r * k + i, mask);
        for (int c = 0; c < COLS; ++c) sums[r][c] = _mm512_dpbf16_ps(sums[r][c], b, wv[c]);
      }
    }
  };
  int64_t i = 0;
  for (; i + 32 * kChains <= len; i += 32 * kChains)
    for (int ch = 0; ch < kChains; ++ch) step(i + 32 * ch, ~__mmask32{0}, acc[ch]);
  for (; i + 32 <= len; i += 32) step(i, ~__mmask32{0}, acc[0]);
  if (i < len) step(i, static_cast<__mmask32>((uint64_t{1} << (len - i)) - 1), acc[0]);
  for (int ch = 1; ch < kChains; ++ch)
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < COLS; ++c) acc[0][r][c] = _mm512_add_ps(acc[0][r][c], acc[ch][r][c]);
  for (int r = 0; r < ROWS; ++r) {
    float* o = out + r * ldo;
    if constexpr (COLS == 4) {
      const __m128 sums = sum4(acc[0][r][0], acc[0][r][1], acc[0][r][2], acc[0][r][3]);
      _mm_storeu_ps(o, accumulate ? _mm_add_ps(_mm_loadu_ps(o), sums) : sums);
    } else {
      for (int c = 0; c < COLS; ++c) o[c] = accumulate ? o[c] + sum16(acc[0][r][c]) : sum16(acc[0][r][c]);
    }
  }
}

// Weight rows [row, end), elements [k0, k0 + len) of each, into L2 a cache line at a time.
DUALOP_INLINE void prefetch_rows_l2(const bf16* w, int64_t k, int64_t row, int64_t end, int64_t k0, int64_t len) {
  for (; row < end; ++row)
    for (int64_t i = 0; i < len; i += 64 / static_cast<int64_t>(sizeof(bf16)))
      _mm_prefetch(reinterpret_cast<const char*>(w + row * k + k0 + i), _MM_HINT_T1);
}

// bf16_tile for the edges of a group or block: the compile-time shape picked from rows x cols.
template <bool SPLIT, int ROWS>
DUALOP_INLINE void bf16_tile_cols(int cols, const bf16* hi, const bf16* lo, const bf16* w, int64_t k, int64_t len,
                                  bool accumulate, float* out, int64_t ldo) {
  static_assert(kTileCols == 4);
  switch (cols) {
    case 4: bf16_tile<ROWS, 4, SPLIT>(hi, lo, w, k, len, accumulate, out, ldo); break;
    case 3: bf16_tile<ROWS, 3, SPLIT>(hi, lo, w, k, len, accumulate, out, ldo); break;
    case 2: bf16_tile<ROWS, 2, SPLIT>(hi, lo, w, k, len, accumulate, out, ldo); break;
    default: bf16_tile<ROWS, 1, SPLIT>(hi, lo, w, k, len, accumulate, out, ldo); break;
  }
}

template <bool SPLIT>
static void bf16_tile_edge(int rows, int cols, const bf16* hi, const bf16* lo, const bf16* w, int64_t k, int64_t len,
                           bool accumulate, float* out, int64_t ldo) {
  static_assert(kTileRows == 4);
  switch (rows) {
    case 4: bf16_tile_cols<SPLIT, 4>(cols, hi, lo, w, k, len, accumulate, out, ldo); break;
    case 3: bf16_tile_cols<SPLIT, 3>(cols, hi, lo, w, k, len, accumulate, out, ldo); break;
    case 2: bf16_tile_cols<SPLIT, 2>(cols, hi, lo, w, k, len, accumulate, out, ldo); break;
    default: bf16_tile_cols<SPLIT, 1>(cols, hi, lo, w, k, len, accumulate, out, ldo); break;
  }
}

// Work items: (group, block of weight rows sized so one K slice of them stays in L2); in an item,
// for each K slice, every row tile of the group passes over the block's weight rows (groups of
// fewer than kNarrowRows rows: each whole weight row once, in order).
template <bool SPLIT>
static void grouped_linear_bf16(const bf16* hi, const bf16* lo, const bf16* w, const int64_t* group_expert,
                                const int64_t* group_start, const int64_t* group_end, int64_t groups, float* out,
                                int64_t n, int64_t k, int threads) {
  if (n <= 0) return;
  if (k <= 0) {  // empty sums
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t i = group_start[g] * n; i < group_end[g] * n; ++i) out[i] = 0.0f;
    return;
  }
  const int64_t slice = k < kSliceK ? k : kSliceK;
  int64_t block = kWeightBlockBytes / (slice * static_cast<int64_t>(sizeof(bf16))) / kTileCols * kTileCols;
  block = block < kTileCols ? kTileCols : block;
  for_each_group_block(groups, n, block, threads, [&](int64_t g, int64_t n0, int64_t n1) {
    const bf16* we = w + group_expert[g] * n * k;
    const int64_t first = group_start[g], group_rows = group_end[g] - group_start[g];
    if (group_rows <= 0) return;
    if (group_rows < kNarrowRows<SPLIT>) {  // whole weight rows one at a time: one sequential stream
      for (int64_t col = n0; col < n1; ++col)
        bf16_tile_edge<SPLIT>(static_cast<int>(group_rows), 1, hi + first * k, SPLIT ? lo + first * k : nullptr,
                              we + col * k, k, k, false, out + first * n + col, n);
      return;
    }
    for (int64_t k0 = 0; k0 < k; k0 += slice) {
      const int64_t len = k0 + slice < k ? slice : k - k0;
      const bool accumulate = k0 > 0;
      // What the item reads next from memory: its block's next K slice, else the expert's next block.
      const bool next_slice = k0 + slice < k;
      const int64_t ahead_k0 = next_slice ? k0 + slice : 0;
      const int64_t ahead_len = next_slice ? (ahead_k0 + slice < k ? slice : k - ahead_k0) : slice;
      const int64_t ahead_first = next_slice ? n0 : n1;
      const int64_t ahead_end = next_slice ? n1 : (n1 + block < n ? n1 + block : n);
      // only where the group's rows are few (so the slice's rows, this block and the next fit L2
      // together); large groups are compute-bound and measured slower with it
      const bool fetch_ahead_group =
          group_rows * len * static_cast<int64_t>(sizeof(bf16)) * (SPLIT ? 2 : 1) <= kFetchAheadRowBytes;
      for (int64_t r = group_start[g]; r < group_end[g]; r += kTileRows) {
        const int rows = static_cast<int>(group_end[g] - r < kTileRows ? group_end[g] - r : kTileRows);
        const bf16* hr = hi + r * k + k0;
        const bf16* lr = SPLIT ? lo + r * k + k0 : nullptr;
        // on the second row tile (the first brought this slice into L2), fetch that into L2 a tile
        // at a time, so the memory stream overlaps the passes that run from cache
        const bool fetch_ahead = r == first + kTileRows && fetch_ahead_group;
        int64_t col = n0;
        if (rows == kTileRows)
          for (; col + kTileCols <= n1; col += kTileCols) {
            if (fetch_ahead) {
              const int64_t row = ahead_first + (col - n0);
              prefetch_rows_l2(we, k, row, row + kTileCols < ahead_end ? row + kTileCols : ahead_end, ahead_k0,
                               ahead_len);
            }
            bf16_tile<kTileRows, kTileCols, SPLIT>(hr, lr, we + col * k + k0, k, len, accumulate, out + r * n + col, n);
          }
        for (; col < n1; col += kTileCols) {
          const int cols = static_cast<int>(n1 - col < kTileCols ? n1 - col : kTileCols);
          bf16_tile_edge<SPLIT>(rows, cols, hr, lr, we + col * k + k0, k, len, accumulate, out + r * n + col, n);
        }
      }
    }
  });
}
#endif

static void split_bf16(const float* __restrict v, bf16* __restrict hi, bf16* __restrict lo, int64_t count,
                       int threads) {
#pragma omp parallel for simd schedule(static) num_threads(dualop_team_size(threads))
  for (int64_t i = 0; i < count; ++i) {
    const bf16 h = from_f32<bf16>(v[i]);
    const float high = to_f32(h);
    hi[i] = h;
    lo[i] = from_f32<bf16>(std::abs(high) == INFINITY ? 0.0f : v[i] - high);
  }
}

template <class T>
DUALOP_INLINE float score_of(T logit, int scoring) {
  const float v = to_f32(logit);
  return scoring == 1 ? sigmoid_f32(v) : v;  // softmax is finished per row below
}

// What routing ranks: NaN as -inf.
DUALOP_INLINE float ranked(float v) { return v != v ? -std::numeric_limits<float>::infinity() : v; }

// Index of the largest ranked value among the not-taken entries; ties (-inf and NaN included) go to
// the lower index.
DUALOP_INLINE int64_t arg_max_free(const float* v, const uint8_t* taken, int64_t count) {
  int64_t best = -1;
  for (int64_t i = 0; i < count; ++i) {
    if (taken[i]) continue;
    if (best < 0 || ranked(v[i]) > ranked(v[best])) best = i;
  }
  return best;
}

template <class T>
static void grouped_topk(const T* logits, const float* bias, float* weights, int32_t* ids, int64_t tokens,
                         int64_t experts, int top_k, bool renormalize, int64_t groups, int topk_group, int scoring,
                         float scale, int threads) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel num_threads(dualop_team_size(threads))
  {
    std::vector<float> score(experts), choice(experts), group_score(groups > 1 ? groups : 1);
    std::vector<uint8_t> taken(experts), group_taken(groups > 1 ? groups : 1);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const T* row = logits + t * experts;
      for (int64_t e = 0; e < experts; ++e) score[e] = score_of(row[e], scoring);
      if (scoring == 0) {
        float m = neg_inf, sum = 0.0f;
        for (int64_t e = 0; e < experts; ++e) m = score[e] > m ? score[e] : m;
        for (int64_t e = 0; e < experts; ++e) {
          score[e] = exp_f32(score[e] - m);
          sum += score[e];
        }
        for (int64_t e = 0; e < experts; ++e) score[e] /= sum;
      }
      for (int64_t e = 0; e < experts; ++e) {
        choice[e] = bias ? score[e] + bias[e] : score[e];
        taken[e] = 0;
      }
      if (groups > 1) {
        const int64_t per = experts / groups;
        for (int64_t g = 0; g < groups; ++g) {
          const float* c = choice.data() + g * per;
          float best = neg_inf, second = neg_inf;  // NaN never compares greater: it ranks as -inf
          for (int64_t i = 0; i < per; ++i) {
            if (c[i] > best) {
              second = best;
              best = c[i];
            } else if (c[i] > second) {
              second = c[i];
            }
          }
          group_score[g] = (bias && per > 1) ? best + second : best;  // +inf + -inf: NaN, ranked -inf
          group_taken[g] = 0;
        }
        const int keep = topk_group < groups ? topk_group : static_cast<int>(groups);
        for (int j = 0; j < keep; ++j) group_taken[arg_max_free(group_score.data(), group_taken.data(), groups)] = 1;
        for (int64_t e = 0; e < experts; ++e)
          if (!group_taken[e / per]) choice[e] = neg_inf;
      }
      float* w = weights + t * top_k;
      int32_t* id = ids + t * top_k;
      float total = 0.0f;
      for (int j = 0; j < top_k; ++j) {
        const int64_t e = arg_max_free(choice.data(), taken.data(), experts);
        taken[e] = 1;
        id[j] = static_cast<int32_t>(e);
        w[j] = bias ? score[e] : choice[e];
        total += w[j];
      }
      for (int j = 0; j < top_k; ++j) {
        float v = renormalize ? w[j] / total : w[j];
        if (scale != 1.0f) v *= scale;
        w[j] = v;
      }
    }
  }
}

}  // namespace dualop

namespace dualop {
namespace {

// Whether group_expert, group_start, group_end are int64 [groups] each, every expert below
// `experts` and every row range inside [0, rows): the grouped matmuls read them unchecked.
bool groups_in_bounds(const DualopArray* expert, const DualopArray* start, const DualopArray* end, int64_t experts,
                      int64_t rows) {
  if (!is_dense(expert, dtype_code::int64, 1) || !is_dense_like(start, expert) || !is_dense_like(end, expert))
    return false;
  const auto* e = static_cast<const int64_t*>(expert->data);
  const auto* r0 = static_cast<const int64_t*>(start->data);
  const auto* r1 = static_cast<const int64_t*>(end->data);
  for (int64_t g = 0; g < expert->shape[0]; ++g)
    if (e[g] < 0 || e[g] >= experts || r0[g] < 0 || r0[g] > r1[g] || r1[g] > rows) return false;
  return true;
}

// Whether the grouped matmul's operands agree: x [rows, k] of x_dtype, w row-major [experts, n, k],
// out float32 [rows, n], and the groups in bounds.
bool grouped_operands_agree(const DualopArray* x, int32_t x_dtype, const DualopArray* w, const DualopArray* out,
                            const DualopArray* group_expert, const DualopArray* group_start,
                            const DualopArray* group_end) {
  return is_dense(x, x_dtype, 2) && w && w->ndim == 3 && is_row_major(w) && x->shape[1] == w->shape[2] &&
         is_dense(out, dtype_code::float32, 2) && out->shape[0] == x->shape[0] && out->shape[1] == w->shape[1] &&
         groups_in_bounds(group_expert, group_start, group_end, w->shape[0], x->shape[0]);
}

}  // namespace
}  // namespace dualop

// x float32 [rows, k]; w [experts, n, k] in any float dtype; out float32 [rows, n]; group_expert,
// group_start, group_end int64 [groups]: rows group_start[g] .. group_end[g] times expert
// group_expert[g]. Returns 0, -1 for an unknown dtype, kBadArrays for arrays that disagree.
extern "C" int dualop_moe_grouped_linear(const DualopArray* x, const DualopArray* w, const DualopArray* group_expert,
                                         const DualopArray* group_start, const DualopArray* group_end,
                                         const DualopArray* out, int threads) {
  using namespace dualop;
  if (!grouped_operands_agree(x, dtype_code::float32, w, out, group_expert, group_start, group_end)) return kBadArrays;
  const auto* xf = static_cast<const float*>(x->data);
  const auto* ge = static_cast<const int64_t*>(group_expert->data);
  const auto* gs = static_cast<const int64_t*>(group_start->data);
  const auto* gend = static_cast<const int64_t*>(group_end->data);
  const int64_t groups = group_expert->shape[0], n = w->shape[1], k = w->shape[2];
  auto* o = static_cast<float*>(out->data);
  switch (w->dtype) {
    case dtype_code::float32: grouped_linear(xf, static_cast<const float*>(w->data), ge, gs, gend, groups, o, n, k, threads); return 0;
    case dtype_code::bfloat16: grouped_linear(xf, static_cast<const bf16*>(w->data), ge, gs, gend, groups, o, n, k, threads); return 0;
    case dtype_code::float16: grouped_linear(xf, static_cast<const f16*>(w->data), ge, gs, gend, groups, o, n, k, threads); return 0;
    default: return -1;
  }
}

extern "C" int dualop_moe_has_bf16_dot() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// hi, and lo (or absent: no low half), bfloat16 [rows, k]; w bfloat16 [experts, n, k]; out and the
// groups as for dualop_moe_grouped_linear. Returns 0, -1 where the library has no AVX512-BF16
// (dualop_moe_has_bf16_dot() == 0), kBadArrays for arrays that disagree.
extern "C" int dualop_moe_grouped_linear_bf16(const DualopArray* hi, const DualopArray* lo, const DualopArray* w,
                                              const DualopArray* group_expert, const DualopArray* group_start,
                                              const DualopArray* group_end, const DualopArray* out, int threads) {
#if defined(__AVX512BF16__)
  using namespace dualop;
  if (!grouped_operands_agree(hi, dtype_code::bfloat16, w, out, group_expert, group_start, group_end) ||
      w->dtype != dtype_code::bfloat16 || (lo && !is_dense_like(lo, hi)))
    return kBadArrays;
  const auto* h = static_cast<const bf16*>(hi->data);
  const auto* l = static_cast<const bf16*>(data_of(lo));
  const auto* wb = static_cast<const bf16*>(w->data);
  const auto* ge = static_cast<const int64_t*>(group_expert->data);
  const auto* gs = static_cast<const int64_t*>(group_start->data);
  const auto* gend = static_cast<const int64_t*>(group_end->data);
  const int64_t groups = group_expert->shape[0], n = w->shape[1], k = w->shape[2];
  auto* o = static_cast<float*>(out->data);
  if (l)
    grouped_linear_bf16<true>(h, l, wb, ge, gs, gend, groups, o, n, k, threads);
  else
    grouped_linear_bf16<false>(h, l, wb, ge, gs, gend, groups, o, n, k, threads);
  return 0;
#else
  (void)hi, (void)lo, (void)w, (void)group_expert, (void)group_start, (void)group_end, (void)out, (void)threads;
  return -1;
#endif
}

// v float32; hi, lo bfloat16 of v's shape, all row-major. Returns 0, kBadArrays for arrays that
// disagree.
extern "C" int dualop_split_bf16(const DualopArray* v, const DualopArray* hi, const DualopArray* lo, int threads) {
  using namespace dualop;
  if (!v || !is_dense(v, dtype_code::float32, v->ndim) || !is_dense(hi, dtype_code::bfloat16, v->ndim) ||
      !is_dense(lo, dtype_code::bfloat16, v->ndim) || !same_shape(v, hi) || !same_shape(v, lo))
    return kBadArrays;
  split_bf16(static_cast<const float*>(v->data), static_cast<bf16*>(hi->data), static_cast<bf16*>(lo->data),
             element_count(v), threads);
  return 0;
}

// logits [tokens, experts] in any float dtype; bias float32 [experts] or absent; weights float32 and
// ids int32 [tokens, top_k]. Returns 0, -1 for an unknown dtype, -2 for a top_k or group count the
// experts do not allow, kBadArrays for arrays that disagree.
extern "C" int dualop_grouped_topk(const DualopArray* logits, const DualopArray* bias, const DualopArray* weights,
                                   const DualopArray* ids, int renormalize, int64_t groups, int topk_group,
                                   int scoring, float scale, int threads) {
  using namespace dualop;
  if (!logits || logits->ndim != 2 || !is_row_major(logits)) return kBadArrays;
  const int64_t tokens = logits->shape[0], experts = logits->shape[1];
  if (!is_absent_or_dense(bias, dtype_code::float32, 1) || (bias && bias->shape[0] != experts)) return kBadArrays;
  if (!is_dense(weights, dtype_code::float32, 2) || !is_dense(ids, dtype_code::int32, 2) ||
      weights->shape[0] != tokens || !same_shape(weights, ids))
    return kBadArrays;
  const int64_t top_k = weights->shape[1];
  if (top_k < 1 || top_k > experts || (groups > 1 && experts % groups != 0)) return -2;
  const auto* b = static_cast<const float*>(data_of(bias));
  auto* w = static_cast<float*>(weights->data);
  auto* id = static_cast<int32_t*>(ids->data);
  const int k = static_cast<int>(top_k);
  switch (logits->dtype) {
    case dtype_code::float32: grouped_topk(static_cast<const float*>(logits->data), b, w, id, tokens, experts, k, renormalize,
                                           groups, topk_group, scoring, scale, threads); return 0;
    case dtype_code::bfloat16: grouped_topk(static_cast<const bf16*>(logits->data), b, w, id, tokens, experts, k, renormalize,
                                            groups, topk_group, scoring, scale, threads); return 0;
    case dtype_code::float16: grouped_topk(static_cast<const f16*>(logits->data), b, w, id, tokens, experts, k, renormalize,
                                           groups, topk_group, scoring, scale, threads); return 0;
    default: return -1;
  }
}
