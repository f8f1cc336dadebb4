// Ragged paged attention on the CPU. Semantics: dualop/ops/attention.py (forward_native).
//
// One task is (sequence, KV head, block of up to kRows query rows): it walks the sequence's KV
// positions once, reading each K and V row of its head straight from its page (no gathered copy),
// and updates an online softmax in float32 for the block's G * rows query vectors (G = Hq / Hkv,
// the query heads sharing that KV head), a block of KV positions at a time (one rescale per block,
// the weights by a vectorised exp). So decode reads every cached K/V row once. Tasks run in
// parallel (OpenMP). Metadata is validated by the op; here it is clamped anyway (num_seqs to
// [0, S], cu_q_lens to [0, T] and non-decreasing, kv_lens to [0, pages_per_seq * page_size], page
// ids to [0, num_pages)), so no value reads out of bounds. Rows outside every sequence are left
// alone (the caller zeroes the padding rows); positions from kv_len on are never read.
//
// With AVX-512 (the host's, -march=native) a task is (sequence, range of KV heads, block of query
// rows) and runs run_task_avx512: a range of heads (all of them when there are tasks enough for
// the threads) so that each position's K/V rows, the heads side by side, are read as one run, the
// next block's rows prefetched head by head. Per KV head the query vectors go in chunks of 4, 2 or
// 1; a chunk's scores of a block of 16 positions come straight from the K rows in their dtype
// (bfloat16 -> float32 is a shift; float16 by vcvtph2ps) as 16 lanes of float32 partial sums per
// (position, query vector), 16 such sums reduced at once by a transposing tree of adds; they are
// masked and soft-capped 16 at a time, weighed by exp_f32's steps on 16 lanes, and V accumulated
// by FMAs from the V rows into accumulators held in registers for the block. No -ffast-math: the
// float32 products and sums are those of the portable body, in another order. Elsewhere,
// run_task: the same online softmax, portable.
//
// A float8 cache (float8_e4m3fn or float8_e5m2 pages with float32, bfloat16 or float16 queries)
// runs run_task with each K/V element decoded to float32 through a table of the format's 256
// values (fp8_tables; exact), on every host: the cache scales are folded into the score scale and
// v_scale, as for every cache.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define DUALOP_RPA_AVX512 1
#include <immintrin.h>

#include "avx512.h"  // sum_lanes16
#endif

namespace dualop {
namespace {

constexpr int64_t kRows = 8;

// float8 cache elements: the byte, decoded by table. e4m3fn: bias 7, 3 mantissa bits, no inf, NaN
// 0x7f/0xff; e5m2: bias 15, 2 mantissa bits, inf and NaN (an all-ones exponent).
struct e4m3 { uint8_t bits; };
struct e5m2 { uint8_t bits; };

constexpr float pow2(int e) {
  float v = 1.0f;
  for (; e > 0; --e) v *= 2.0f;
  for (; e < 0; ++e) v *= 0.5f;
  return v;
}

struct Fp8Table {
  float value[256];
  constexpr Fp8Table(int mantissa_bits, int bias, bool has_inf) : value{} {
    const int top = (1 << (7 - mantissa_bits)) - 1;  // the all-ones exponent
    for (int code = 0; code < 256; ++code) {
      const int mag = code & 0x7f, e = mag >> mantissa_bits, m = mag & ((1 << mantissa_bits) - 1);
      float v = e == 0 ? m * pow2(1 - bias - mantissa_bits)
                       : (pow2(mantissa_bits) + m) * pow2(e - bias - mantissa_bits);
      if (has_inf && e == top) v = m == 0 ? __builtin_inff() : __builtin_nanf("");
      if (!has_inf && mag == 0x7f) v = __builtin_nanf("");
      value[code] = code & 0x80 ? -v : v;
    }
  }
};
constexpr Fp8Table kE4m3{3, 7, false};
constexpr Fp8Table kE5m2{2, 15, true};

using ::dualop::to_f32;  // the float, bfloat16 and float16 overloads (common.h), beside these
DUALOP_INLINE float to_f32(e4m3 v) { return kE4m3.value[v.bits]; }
DUALOP_INLINE float to_f32(e5m2 v) { return kE5m2.value[v.bits]; }
constexpr int64_t kBlock = 32;  // KV positions whose K/V rows are converted and scored together

struct Shape {
  int64_t tokens, q_heads, kv_heads, head_dim, num_pages, page_size, pages_per_seq, max_seqs;
};

struct Options {
  float scale;       // sm_scale * k_scale
  int64_t window;    // 0: none
  float soft_cap;    // 0: none
  bool custom_mask;  // a mask value was given: masked positions below kv_len take it
  float mask_value;
  float v_scale;
  const float* sinks;  // [q_heads] float32, clipped to +-float32 max (NaN kept), or null: none
};

// Where a query head's online softmax starts: (max, sum) = (its sink, 1), the sink weighing no V
// row (paged_attention_math.sink_logits); without sinks (-inf, 0) (`none`: the max a path starts
// from, -inf or -FLT_MAX).
DUALOP_INLINE float start_max(const Options& o, int64_t q_head, float none) {
  return o.sinks ? o.sinks[q_head] : none;
}
DUALOP_INLINE float start_sum(const Options& o) { return o.sinks ? 1.0f : 0.0f; }

int64_t clamp64(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

// The scores q . k of one query vector against the first nb positions of a block: K of the block
// transposed (kt[i * kBlock + b]), each score one fused multiply-add chain over the head dim, the
// chains of the block's positions side by side (vectorised across positions). A chain whose sum
// overflows ends at +-inf (an FMA never takes it back), so a non-finite score is recomputed in
// double, where products and sums of float32 values cannot overflow: a score of finite inputs is
// the float32 rounding of its exact value (+-inf past float32's range), never NaN, whatever the
// summation order, as the native body's scores are (ops/attention.py, overflow_safe_scores).
void block_scores(const float* q, const float* kt, int64_t d, int64_t nb, float* out) {
  float acc[kBlock] = {};
  for (int64_t i = 0; i < d; ++i) {
    const float qi = q[i];
    const float* row = kt + i * kBlock;
    for (int64_t b = 0; b < kBlock; ++b) acc[b] = std::fma(qi, row[b], acc[b]);
  }
  for (int64_t b = 0; b < nb; ++b) {
    out[b] = acc[b];
    if (!std::isfinite(acc[b])) {
      double sum = 0.0;
      for (int64_t i = 0; i < d; ++i) sum += static_cast<double>(q[i]) * static_cast<double>(kt[i * kBlock + b]);
      out[b] = static_cast<float>(sum);
    }
  }
}

template <class T, class K>
void run_task(const T* q, const K* kv, const int32_t* pages, T* out, const Shape& s, const Options& o,
              int64_t seq, int64_t head, int64_t row0, int64_t row1, int64_t q_start, int64_t q_len, int64_t kv_len) {
  const int64_t d = s.head_dim, group = s.q_heads / s.kv_heads, n = (row1 - row0) * group;
  const int64_t combined = 2 * s.kv_heads;
  std::vector<float> qf(n * d), acc(n * d, 0.0f), kt(d * kBlock, 0.0f), vf(kBlock * d), sc(kBlock), dots(kBlock),
      m(n), l(n, start_sum(o));
  std::vector<int64_t> pos(n);
  for (int64_t r = row0; r < row1; ++r) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t j = (r - row0) * group + g;
      const T* src = q + (r * s.q_heads + head * group + g) * d;
      for (int64_t i = 0; i < d; ++i) qf[j * d + i] = to_f32(src[i]);
      pos[j] = kv_len - q_len + (r - q_start);
      m[j] = start_max(o, head * group + g, -INFINITY);
    }
  }
  const int64_t last = o.custom_mask ? kv_len - 1 : std::min(kv_len - 1, pos[n - 1]);
  // Blocks of kBlock positions: their K and V rows converted once, then per query vector the
  // block's scores, one rescale of the running sums (when the block raises the max) and the
  // weights by the vectorised exp_f32 (a masked position's -inf weighs exactly 0).
  for (int64_t p0 = 0; p0 <= last; p0 += kBlock) {
    const int64_t nb = std::min(kBlock, last + 1 - p0);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t p = p0 + b;
      const int64_t page = clamp64(pages[seq * s.pages_per_seq + p / s.page_size], 0, s.num_pages - 1);
      const K* krow = kv + ((page * s.page_size + p % s.page_size) * combined + 2 * head) * d;
      for (int64_t i = 0; i < d; ++i) kt[i * kBlock + b] = to_f32(krow[i]);
      for (int64_t i = 0; i < d; ++i) vf[b * d + i] = to_f32(krow[d + i]);
    }
    for (int64_t j = 0; j < n; ++j) {
      const float* qj = &qf[j * d];
      float block_max = -INFINITY;
      block_scores(qj, kt.data(), d, nb, dots.data());
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t p = p0 + b;
        const bool allowed = p <= pos[j] && (o.window == 0 || p > pos[j] - o.window);
        float score = o.custom_mask ? o.mask_value : -INFINITY;
        if (allowed) {
          score = dots[b] * o.scale;
          if (o.soft_cap != 0.0f) score = o.soft_cap * std::tanh(score / o.soft_cap);
        }
        sc[b] = score;
        block_max = std::max(block_max, score);
      }
      if (block_max == -INFINITY) continue;  // nothing in this block counts for this query
      float* aj = &acc[j * d];
      if (block_max > m[j]) {
        const float alpha = exp_f32(m[j] - block_max);  // exp(-inf) = 0 on the first block (no sink)
        for (int64_t i = 0; i < d; ++i) aj[i] *= alpha;
        l[j] *= alpha;
        m[j] = block_max;
      }
      const float mj = m[j];
      float total = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        sc[b] = exp_f32(sc[b] - mj);
        total += sc[b];
      }
      l[j] += total;
      for (int64_t b = 0; b < nb; ++b) {
        const float w = sc[b];
        const float* vb = &vf[b * d];
        for (int64_t i = 0; i < d; ++i) aj[i] += w * vb[i];
      }
    }
  }
  for (int64_t r = row0; r < row1; ++r) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t j = (r - row0) * group + g;
      const float norm = o.v_scale / l[j];
      T* dst = out + (r * s.q_heads + head * group + g) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = from_f32<T>(acc[j * d + i] * norm);
    }
  }
}

#ifdef DUALOP_RPA_AVX512
// --- AVX-512 ------------------------------------------------------------------------------------
//
// Layout. A row is read 32 elements (one "pair", two 16-lane vectors) at a time. For bfloat16 the
// 32 elements load as one 512-bit word whose 32-bit lanes hold pairs (2l, 2l+1): a shift gives the
// even elements as float32, a mask the odd ones, so a pair's vectors hold elements (0, 2, ..., 30)
// and (1, 3, ..., 31); float32 and float16 pairs are in element order. The float32 copies of the
// query vectors and the V accumulators are stored in that same order (storage order, `slot`), so
// every product pairs the same elements as the plain loop; the output is read back through `slot`.
// Elements past head_dim load as zeros, their memory never read (masked loads).
namespace v512 {

constexpr int64_t kPos = 16;  // KV positions per online-softmax block (one rescale per block)

// Where element i of a row lives in storage order.
template <class T> DUALOP_INLINE int64_t slot(int64_t i) {
  if constexpr (std::is_same_v<T, bf16>) return (i & ~int64_t{31}) + (i & 1) * 16 + ((i & 31) >> 1);
  else return i;
}

// 32 elements of a row (those of `mask`, the rest zero and not read) as two float32 vectors.
template <bool kMasked>
DUALOP_INLINE void load_pair(const float* p, __mmask32 mask, __m512& a, __m512& b) {
  if constexpr (kMasked) {
    a = _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask), p);
    b = _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask >> 16), p + 16);
  } else {
    a = _mm512_loadu_ps(p);
    b = _mm512_loadu_ps(p + 16);
  }
}
template <bool kMasked>
DUALOP_INLINE void load_pair(const bf16* p, __mmask32 mask, __m512& a, __m512& b) {
  const __m512i raw = kMasked ? _mm512_maskz_loadu_epi16(mask, p) : _mm512_loadu_si512(p);
  a = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  b = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
template <bool kMasked>
DUALOP_INLINE void load_pair(const f16* p, __mmask32 mask, __m512& a, __m512& b) {
  if constexpr (kMasked) {
    a = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>(mask), p));
    b = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>(mask >> 16), p + 16));
  } else {
    a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
  }
}

// exp_f32 (common.h) on 16 lanes, step for step (so the same values).
DUALOP_INLINE __m512 exp16(__m512 x) {
  const __m512 clamped = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 shifter = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(clamped, _mm512_set1_ps(1.44269504088896341f), shifter), shifter);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f),
                                   _mm512_fmadd_ps(n, _mm512_set1_ps(-1.42860682030941723212e-6f), clamped));
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.0f), _CMP_GT_OQ), _mm512_set1_ps(INFINITY));
  y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), _mm512_setzero_ps());
  return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

// Every lane l gets the max (kMax) or sum of the lanes l' with l' % NV == l % NV (the lanes of one
// query vector in a block's score layout).
template <int NV, bool kMax>
DUALOP_INLINE __m512 combine_lanes(__m512 x) {
  const auto op = [](__m512 a, __m512 b) { return kMax ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b); };
  x = op(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = op(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  if constexpr (NV <= 2) x = op(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
  if constexpr (NV == 1) x = op(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
  return x;
}

// The dot products of NV query vectors (rows of q, stride dp, storage order, zero past d) with
// 16 / NV K rows: lane b * NV + g holds row b's product with vector g (unscaled), each summed as 16
// lane-wise FMA chains then the tree of sum_lanes16.
template <class T, int NV>
DUALOP_INLINE __m512 dots16(const float* q, int64_t dp, const T* const* rows, int64_t pairs, __mmask32 tail) {
  constexpr int P = 16 / NV;
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const auto step = [&](int64_t c, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    __m512 qa[NV], qb[NV];
#pragma GCC unroll 4
    for (int g = 0; g < NV; ++g) {
      qa[g] = _mm512_loadu_ps(q + g * dp + c * 32);
      qb[g] = _mm512_loadu_ps(q + g * dp + c * 32 + 16);
    }
#pragma GCC unroll 16
    for (int b = 0; b < P; ++b) {
      __m512 ka, kb;
      load_pair<kMasked>(rows[b] + c * 32, tail, ka, kb);
#pragma GCC unroll 4
      for (int g = 0; g < NV; ++g) {
        acc[b * NV + g] = _mm512_fmadd_ps(qa[g], ka, acc[b * NV + g]);
        acc[b * NV + g] = _mm512_fmadd_ps(qb[g], kb, acc[b * NV + g]);
      }
    }
  };
  for (int64_t c = 0; c < pairs; ++c) step(c, std::false_type{});
  if (tail) step(pairs, std::true_type{});
  return avx512::sum_lanes16(acc);
}

// acc[g] (stride dp, storage order), pairs [c0, c0 + PC) of it: acc = acc * alpha[g] + sum over the
// block's first nb positions b of w[b * NV + g] * V row b. The accumulators stay in registers for
// the whole block (NV * 2 * PC of them).
template <class T, int NV, int PC, bool kMasked>
DUALOP_INLINE void accumulate(float* acc, int64_t dp, const T* const* rows, int64_t nb, const float* w,
                              const float* alpha, int64_t c0, __mmask32 tail) {
  __m512 a[NV][2 * PC];
#pragma GCC unroll 4
  for (int g = 0; g < NV; ++g) {
    const __m512 s = _mm512_set1_ps(alpha[g]);
#pragma GCC unroll 16
    for (int i = 0; i < 2 * PC; ++i) a[g][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * dp + c0 * 32 + i * 16), s);
  }
  for (int64_t b = 0; b < nb; ++b) {
    const T* v = rows[b] + c0 * 32;
    __m512 wb[NV];
#pragma GCC unroll 4
    for (int g = 0; g < NV; ++g) wb[g] = _mm512_set1_ps(w[b * NV + g]);
#pragma GCC unroll 8
    for (int c = 0; c < PC; ++c) {
      __m512 va, vb;
      load_pair<kMasked>(v + c * 32, tail, va, vb);
#pragma GCC unroll 4
      for (int g = 0; g < NV; ++g) {
        a[g][2 * c] = _mm512_fmadd_ps(wb[g], va, a[g][2 * c]);
        a[g][2 * c + 1] = _mm512_fmadd_ps(wb[g], vb, a[g][2 * c + 1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < NV; ++g)
#pragma GCC unroll 16
    for (int i = 0; i < 2 * PC; ++i) _mm512_storeu_ps(acc + g * dp + c0 * 32 + i * 16, a[g][i]);
}

// accumulate over `count` whole pairs from c0, in passes of PC pairs, then fewer.
template <class T, int NV, int PC>
DUALOP_INLINE void accumulate_passes(float* acc, int64_t dp, const T* const* rows, int64_t nb, const float* w,
                                     const float* alpha, int64_t c0, int64_t count, __mmask32 tail) {
  for (; count >= PC; c0 += PC, count -= PC) accumulate<T, NV, PC, false>(acc, dp, rows, nb, w, alpha, c0, tail);
  if constexpr (PC > 1)
    if (count > 0) accumulate_passes<T, NV, PC - 1>(acc, dp, rows, nb, w, alpha, c0, count, tail);
}

// One chunk of NV query vectors (q, acc: their rows, stride dp) over one block of positions
// [p0, p0 + kPos), of which the first nb have rows (K rows in krows, V rows in vrows; the rest
// point at zeros): scores, masks, the online softmax update (m, l: the chunk's 16 lanes of running
// max and sum, in the score layout) and the V accumulation.
struct Chunk {
  float* q;         // NV rows, storage order
  float* acc;       // NV rows, storage order
  float* m;         // 16 lanes
  float* l;         // 16 lanes
  int32_t* hi;      // 16 lanes: the lane's vector's position (it sees p <= hi)
  int32_t* lo;      // 16 lanes: it sees p > lo (window; -1 without)
  const void* const* qsrc;  // NV pointers to the vectors in q (for the double recompute)
  int64_t min_pos, max_pos;
};

template <class T, int NV>
void chunk_block(const Chunk& ch, int64_t dp, int64_t d, const T* const* krows, const T* const* vrows, int64_t p0,
                 int64_t nb, const Options& o, int64_t pairs, __mmask32 tail) {
  constexpr int P = 16 / NV;
  __m512 sc[NV];
  const __m512i iota = _mm512_set_epi32(15 / NV, 14 / NV, 13 / NV, 12 / NV, 11 / NV, 10 / NV, 9 / NV, 8 / NV,
                                        7 / NV, 6 / NV, 5 / NV, 4 / NV, 3 / NV, 2 / NV, 1 / NV, 0);
  const __m512i hi = _mm512_loadu_si512(ch.hi), lo = _mm512_loadu_si512(ch.lo);
  const __m512i end = _mm512_set1_epi32(static_cast<int32_t>(p0 + nb));
  const __m512 fill = _mm512_set1_ps(o.custom_mask ? o.mask_value : -INFINITY);
  __m512 mx = _mm512_set1_ps(-INFINITY);
#pragma GCC unroll 4
  for (int k = 0; k < NV; ++k) {
    if (k * P >= nb) {  // past the block's last row: nothing to score
      sc[k] = _mm512_set1_ps(-INFINITY);
      continue;
    }
    __m512 dots = dots16<T, NV>(ch.q, dp, krows + k * P, pairs, tail);
    const __m512i p = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(p0 + k * P)), iota);
    const __mmask16 valid = _mm512_cmplt_epi32_mask(p, end);
    const __mmask16 allowed = _mm512_mask_cmple_epi32_mask(_mm512_cmpgt_epi32_mask(p, lo), p, hi);
    // a non-finite sum (an overflowing partial sum, or a non-finite input) is recomputed in
    // double, as block_scores does: finite inputs then give their exact dot product's rounding
    const __mmask16 bad =
        valid & _mm512_cmp_ps_mask(_mm512_abs_ps(dots), _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);
    if (bad) [[unlikely]] {
      alignas(64) float tmp[16];
      _mm512_store_ps(tmp, dots);
      for (int lane = 0; lane < 16; ++lane) {
        if (!((bad >> lane) & 1)) continue;
        const T* qv = static_cast<const T*>(ch.qsrc[lane % NV]);
        const T* kv = krows[k * P + lane / NV];
        double sum = 0.0;
        for (int64_t i = 0; i < d; ++i) sum += static_cast<double>(to_f32(qv[i])) * static_cast<double>(to_f32(kv[i]));
        tmp[lane] = static_cast<float>(sum);
      }
      dots = _mm512_load_ps(tmp);
    }
    __m512 s = _mm512_mul_ps(dots, _mm512_set1_ps(o.scale));
    if (o.soft_cap != 0.0f) {
      alignas(64) float tmp[16];
      _mm512_store_ps(tmp, s);
      for (int lane = 0; lane < 16; ++lane) tmp[lane] = o.soft_cap * std::tanh(tmp[lane] / o.soft_cap);
      s = _mm512_load_ps(tmp);
    }
    s = _mm512_mask_mov_ps(fill, allowed, s);
    s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s);
    sc[k] = s;
    mx = _mm512_max_ps(mx, s);
  }
  mx = combine_lanes<NV, true>(mx);
  // nothing in this block counts for this chunk (every lane -inf): no weight, no V row read
  if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ) == 0) return;
  const __m512 m_old = _mm512_loadu_ps(ch.m);
  // m starts at -FLT_MAX, not -inf: a lane whose scores are all -inf so far keeps weights
  // exp(-inf) = 0 and alpha exp(0) = 1 (no inf - inf)
  const __m512 m_new = _mm512_max_ps(m_old, mx);
  const __m512 alpha = exp16(_mm512_sub_ps(m_old, m_new));
  alignas(64) float w[16 * NV];
  __m512 total = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int k = 0; k < NV; ++k) {
    const __m512 e = exp16(_mm512_sub_ps(sc[k], m_new));
    total = _mm512_add_ps(total, e);
    _mm512_store_ps(w + 16 * k, e);
  }
  _mm512_storeu_ps(ch.m, m_new);
  _mm512_storeu_ps(ch.l, _mm512_fmadd_ps(_mm512_loadu_ps(ch.l), alpha, total));
  alignas(64) float a[16];
  _mm512_store_ps(a, alpha);  // lane g: vector g's factor
  // V: pairs in passes of up to 16 / NV vectors per query vector (their accumulators in registers),
  // the masked tail last
  accumulate_passes<T, NV, NV == 4 ? 2 : (NV == 2 ? 4 : 8)>(ch.acc, dp, vrows, nb, w, a, 0, pairs, tail);
  if (tail) accumulate<T, NV, 1, true>(ch.acc, dp, vrows, nb, w, a, pairs, tail);
}

// out[e] = acc * norm for e < d, acc in storage order, rounded to T as from_f32 does.
template <class T>
DUALOP_INLINE void store_row(T* out, const float* acc, int64_t d, float norm) {
  int64_t e = 0;
  if constexpr (std::is_same_v<T, bf16>) {
    // a pair's even and odd elements: rounded to nearest even in the high 16 bits of each lane
    // (NaN made quiet), the even ones shifted down, the odd ones kept: 32 bfloat16 in order
    const __m512 scale = _mm512_set1_ps(norm);
    const auto round = [](__m512 v) {
      const __m512i u = _mm512_castps_si512(v);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
      return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                   _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    };
    for (; e + 32 <= d; e += 32) {
      const __m512i lo = round(_mm512_mul_ps(_mm512_loadu_ps(acc + e), scale));
      const __m512i hi = round(_mm512_mul_ps(_mm512_loadu_ps(acc + e + 16), scale));
      const __m512i packed = _mm512_or_si512(_mm512_srli_epi32(lo, 16),
                                             _mm512_and_si512(hi, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
      _mm512_storeu_si512(out + e, packed);
    }
  }
  for (; e < d; ++e) out[e] = from_f32<T>(acc[slot<T>(e)] * norm);
}

// Per-thread buffers of run_task_avx512, sized once per call (nothing allocated per task).
struct Scratch {
  std::vector<float> q, acc, m, l;  // q, acc: [n, dp]; m, l: 16 lanes per chunk
  std::vector<int32_t> hi, lo;      // 16 lanes per chunk
  std::vector<const void*> qsrc;    // [n]
  std::vector<Chunk> chunks;
  std::vector<int> widths;
  std::vector<int64_t> heads;
  std::vector<int64_t> rows;  // [n]
  std::vector<unsigned char> zeros;  // a zero K row (positions of a block past its last row)
  void size_for(int64_t n, int64_t dp, int64_t elem_bytes) {
    q.assign(n * dp, 0.0f);
    acc.assign(n * dp, 0.0f);
    m.assign(n * 16, 0.0f);
    l.assign(n * 16, 0.0f);
    hi.assign(n * 16, 0);
    lo.assign(n * 16, 0);
    qsrc.assign(n, nullptr);
    chunks.assign(n, Chunk{});
    widths.assign(n, 0);
    heads.assign(n, 0);
    rows.assign(n, 0);
    zeros.assign(dp * elem_bytes + 64, 0);
  }
};

template <class T>
void run_task_avx512(const T* q, const T* kv, const int32_t* pages, T* out, const Shape& s, const Options& o,
                     Scratch& sc, int64_t seq, int64_t head0, int64_t head1, int64_t row0, int64_t row1,
                     int64_t q_start, int64_t q_len, int64_t kv_len) {
  const int64_t d = s.head_dim, group = s.q_heads / s.kv_heads, per_head = (row1 - row0) * group;
  const int64_t n = (head1 - head0) * per_head;  // vector j: head head0 + j / per_head, then row, then group
  const int64_t combined = 2 * s.kv_heads, pairs = d / 32, rem = d % 32, dp = (d + 31) / 32 * 32;
  const __mmask32 tail = rem ? static_cast<__mmask32>((uint64_t{1} << rem) - 1) : 0;
  // vector j = (h - head0) * per_head + (r - row0) * group + g: query row r, query head h * group + g
  int64_t* row_of = sc.rows.data();  // [per_head]: each vector's query row (the same for every head)
  for (int64_t r = row0, k = 0; r < row1; ++r)
    for (int64_t g = 0; g < group; ++g, ++k) row_of[k] = r;
  // the query vectors in storage order (zero past d)
  for (int64_t h = head0, j = 0; h < head1; ++h) {
    for (int64_t k = 0; k < per_head; ++k, ++j) {
      const T* src = q + (row_of[k] * s.q_heads + h * group + k % group) * d;
      float* dst = sc.q.data() + j * dp;
      __m512 a, b;
      for (int64_t c = 0; c < pairs; ++c) {
        load_pair<false>(src + c * 32, 0, a, b);
        _mm512_storeu_ps(dst + c * 32, a);
        _mm512_storeu_ps(dst + c * 32 + 16, b);
      }
      if (tail) {
        load_pair<true>(src + pairs * 32, tail, a, b);
        _mm512_storeu_ps(dst + pairs * 32, a);
        _mm512_storeu_ps(dst + pairs * 32 + 16, b);
      }
      sc.qsrc[j] = src;
    }
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + n * dp, 0.0f);
  // per head, chunks of 4 query vectors, then 2, then 1; each lane of a chunk's state belongs to
  // vector lane % NV of the chunk
  int64_t count = 0, min_pos = INT64_MAX, max_pos = INT64_MIN;
  for (int64_t h = head0; h < head1; ++h) {
    const int64_t base = (h - head0) * per_head;
    for (int64_t k = 0; k < per_head; ++count) {
      const int nv = per_head - k >= 4 ? 4 : (per_head - k >= 2 ? 2 : 1);
      Chunk& c = sc.chunks[count];
      c = Chunk{sc.q.data() + (base + k) * dp, sc.acc.data() + (base + k) * dp, sc.m.data() + count * 16,
                sc.l.data() + count * 16, sc.hi.data() + count * 16, sc.lo.data() + count * 16,
                sc.qsrc.data() + base + k, INT64_MAX, INT64_MIN};
      for (int lane = 0; lane < 16; ++lane) {
        const int64_t pos = kv_len - q_len + (row_of[k + (lane & (nv - 1))] - q_start);
        c.min_pos = std::min(c.min_pos, pos);
        c.max_pos = std::max(c.max_pos, pos);
        c.hi[lane] = static_cast<int32_t>(pos);
        c.lo[lane] = o.window > 0 ? static_cast<int32_t>(std::max<int64_t>(pos - o.window, -1)) : -1;
        // the lane's vector: query head h * group + (k + lane % nv) % group; its sum is the
        // vector's lanes' total, so the sink's 1 goes in one of them
        c.m[lane] = start_max(o, h * group + (k + (lane & (nv - 1))) % group, -FLT_MAX);
        c.l[lane] = lane < nv ? start_sum(o) : 0.0f;
      }
      min_pos = std::min(min_pos, c.min_pos);
      max_pos = std::max(max_pos, c.max_pos);
      sc.widths[count] = nv;
      sc.heads[count] = h;
      k += nv;
    }
  }
  // positions [first, last]: past the last row's position (default mask) nothing counts, and
  // below the first row's window neither
  const int64_t last = o.custom_mask ? kv_len - 1 : std::min(kv_len - 1, max_pos);
  const int64_t first = !o.custom_mask && o.window > 0 ? std::max<int64_t>(0, min_pos - o.window + 1) : 0;
  const T* zero = reinterpret_cast<const T*>(sc.zeros.data());
  const int32_t* seq_pages = pages + seq * s.pages_per_seq;
  // the rows (combined head 0) of the nb positions from p0
  const auto locate = [&](int64_t p0, int64_t nb, const T** rows) {
    int64_t page_slot = p0 / s.page_size, offset = p0 % s.page_size;
    const T* base = kv + clamp64(seq_pages[page_slot], 0, s.num_pages - 1) * s.page_size * combined * d;
    for (int64_t b = 0; b < nb; ++b) {
      if (offset == s.page_size) {
        offset = 0;
        base = kv + clamp64(seq_pages[++page_slot], 0, s.num_pages - 1) * s.page_size * combined * d;
      }
      rows[b] = base + offset * combined * d;
      ++offset;
    }
  };
  // Each head's K and V rows of the next block are fetched into L2 while this block's rows of that
  // head are computed: the task reads a block head by head, a few hundred bytes every few
  // kilobytes, which the hardware's prefetchers do not follow.
  const int64_t head_bytes = 2 * d * static_cast<int64_t>(sizeof(T));
  const auto prefetch = [&](const T* const* rows, int64_t nb, int64_t h) {
    for (int64_t b = 0; b < nb; ++b) {
      const char* row = reinterpret_cast<const char*>(rows[b]) + h * head_bytes;
      for (int64_t at = 0; at < head_bytes; at += 64) _mm_prefetch(row + at, _MM_HINT_T1);
    }
  };
  const T* rows_a[kPos];
  const T* rows_b[kPos];
  const T** rows = rows_a;
  const T** next = rows_b;
  const T* krows[kPos];
  const T* vrows[kPos];
  if (first <= last) {
    locate(first, std::min(kPos, last + 1 - first), rows);
    for (int64_t h = head0; h < head1; ++h) prefetch(rows, std::min(kPos, last + 1 - first), h);
  }
  for (int64_t p0 = first; p0 <= last; p0 += kPos) {
    const int64_t nb = std::min(kPos, last + 1 - p0);
    const int64_t nb_next = p0 + kPos <= last ? std::min(kPos, last + 1 - p0 - kPos) : 0;
    if (nb_next > 0) locate(p0 + kPos, nb_next, next);
    int64_t current = -1;
    for (int64_t i = 0; i < count; ++i) {
      const Chunk& c = sc.chunks[i];
      if (!o.custom_mask && (p0 > c.max_pos || (o.window > 0 && p0 + nb - 1 <= c.min_pos - o.window))) continue;
      if (sc.heads[i] != current) {
        current = sc.heads[i];
        prefetch(next, nb_next, current);
        for (int64_t b = 0; b < nb; ++b) {
          krows[b] = rows[b] + 2 * current * d;
          vrows[b] = krows[b] + d;
        }
        for (int64_t b = nb; b < kPos; ++b) krows[b] = vrows[b] = zero;
      }
      switch (sc.widths[i]) {
        case 4: chunk_block<T, 4>(c, dp, d, krows, vrows, p0, nb, o, pairs, tail); break;
        case 2: chunk_block<T, 2>(c, dp, d, krows, vrows, p0, nb, o, pairs, tail); break;
        default: chunk_block<T, 1>(c, dp, d, krows, vrows, p0, nb, o, pairs, tail); break;
      }
    }
    std::swap(rows, next);
  }
  for (int64_t i = 0, j = 0; i < count; j += sc.widths[i], ++i) {
    const int nv = sc.widths[i];
    const int64_t h = sc.heads[i];
    for (int g = 0; g < nv; ++g) {
      float total = 0.0f;
      for (int lane = g; lane < 16; lane += nv) total += sc.chunks[i].l[lane];
      const float norm = o.v_scale / total;
      const int64_t k = j + g - (h - head0) * per_head;
      T* dst = out + (row_of[k] * s.q_heads + h * group + k % group) * d;
      store_row(dst, sc.acc.data() + (j + g) * dp, d, norm);
    }
  }
}

}  // namespace v512
#endif  // DUALOP_RPA_AVX512

struct Task {
  int64_t seq, head0, head1, row0, row1, start, end;  // rows [row0, row1) of the sequence's [start, end), KV heads [head0, head1)
};

// K: the cache's element type (T, or a float8 format: the portable tasks only).
template <class T, class K = T>
int run(const void* q, const void* kv, const int32_t* kv_lens, const int32_t* pages, const int32_t* cu,
        int32_t num_seqs, void* out, const Shape& s, const Options& o, int threads) {
  constexpr bool kVectorised =
#ifdef DUALOP_RPA_AVX512
      std::is_same_v<T, K>;
#else
      false;
#endif
  const int64_t count = clamp64(num_seqs, 0, s.max_seqs), span = s.pages_per_seq * s.page_size;
  std::vector<Task> tasks;
  // cu_q_lens clipped to [0, T] and made non-decreasing (a running max), as every path reads it
  int64_t end = count > 0 ? clamp64(cu[0], 0, s.tokens) : 0;
int64_t heads_per_task = 1;
#ifdef DUALOP_RPA_AVX512
  // A task takes a range of KV heads: all of them where there are tasks enough for the threads (8
  // per thread, so a thread held up elsewhere leaves little behind), so it reads each position's
  // K/V rows (the heads side by side) as one contiguous run; fewer where the threads need more tasks.
  int64_t row_tasks = 0;
  {
    int64_t e = end;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t start = e;
      e = std::max(start, clamp64(cu[i + 1], 0, s.tokens));
      if (clamp64(kv_lens[i], 0, span) >= e - start) row_tasks += (e - start + kRows - 1) / kRows;
    }
  }
  const int64_t splits = std::clamp<int64_t>((8 * threads + std::max<int64_t>(row_tasks, 1) - 1) / std::max<int64_t>(row_tasks, 1),
                                             1, s.kv_heads);
  if (kVectorised) heads_per_task = (s.kv_heads + splits - 1) / splits;
#endif
  for (int64_t i = 0; i < count; ++i) {
    const int64_t start = end;
    end = std::max(start, clamp64(cu[i + 1], 0, s.tokens));
    if (clamp64(kv_lens[i], 0, span) < end - start) continue;  // invalid (refused by the op): no row
    for (int64_t r = start; r < end; r += kRows)
      for (int64_t h = 0; h < s.kv_heads; h += heads_per_task)
        tasks.push_back({i, h, std::min(h + heads_per_task, s.kv_heads), r, std::min(r + kRows, end), start, end});
  }
  const auto* qt = static_cast<const T*>(q);
  const auto* kvt = static_cast<const K*>(kv);
  auto* ot = static_cast<T*>(out);
#ifdef DUALOP_RPA_AVX512
  if constexpr (kVectorised) {
  // longest first (the dynamic schedule then balances the threads' loads)
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    return clamp64(kv_lens[a.seq], 0, span) > clamp64(kv_lens[b.seq], 0, span);
  });
  int64_t rows = 0;
  for (const Task& task : tasks) rows = std::max(rows, task.row1 - task.row0);
  const int64_t most = rows * heads_per_task * (s.q_heads / s.kv_heads), dp = (s.head_dim + 31) / 32 * 32;
#pragma omp parallel num_threads(dualop_team_size(threads))
  {
    v512::Scratch scratch;
    scratch.size_for(most, dp, sizeof(T));
#pragma omp for schedule(dynamic)
    for (int64_t t = 0; t < static_cast<int64_t>(tasks.size()); ++t) {
      const Task& task = tasks[t];
      v512::run_task_avx512<T>(qt, kvt, pages, ot, s, o, scratch, task.seq, task.head0, task.head1, task.row0,
                               task.row1, task.start, task.end - task.start, clamp64(kv_lens[task.seq], 0, span));
    }
  }
  return 0;
  }
#endif
#pragma omp parallel for schedule(dynamic) num_threads(dualop_team_size(threads))
  for (int64_t t = 0; t < static_cast<int64_t>(tasks.size()); ++t) {
    const Task& task = tasks[t];
    run_task<T, K>(qt, kvt, pages, ot, s, o, task.seq, task.head0, task.row0, task.row1, task.start,
                   task.end - task.start, clamp64(kv_lens[task.seq], 0, span));
  }
  return 0;
}

// The cache formats of dualop_ragged_paged_attention_kv's kv_format.
namespace kv_formats {
constexpr int kAsQuery = 0;  // kv_pages in q's dtype
constexpr int kE4m3 = 1;     // float8_e4m3fn, passed as uint8
constexpr int kE5m2 = 2;     // float8_e5m2, passed as uint8
}  // namespace kv_formats

template <class T>
int run_format(int format, const void* q, const void* kv, const int32_t* lens, const int32_t* pages, const int32_t* cu,
               int32_t num_seqs, void* out, const Shape& s, const Options& o, int threads) {
  switch (format) {
    case kv_formats::kAsQuery: return run<T>(q, kv, lens, pages, cu, num_seqs, out, s, o, threads);
    case kv_formats::kE4m3: return run<T, e4m3>(q, kv, lens, pages, cu, num_seqs, out, s, o, threads);
    case kv_formats::kE5m2: return run<T, e5m2>(q, kv, lens, pages, cu, num_seqs, out, s, o, threads);
    default: return 1;
  }
}

}  // namespace
}  // namespace dualop

// q, out: row-major [tokens, q_heads, head_dim] of one float dtype; kv_pages: row-major [num_pages,
// page_size, 2 * kv_heads, head_dim] (K and V heads interleaved) of q's dtype (kv_format 0) or
// uint8 holding float8_e4m3fn (1) or float8_e5m2 (2) codes; kv_lens int32 [S], page_indices int32
// [S, pages_per_seq], cu_q_lens int32 [S + 1] (sequences past the shortest of them are not read).
// scale is sm_scale * k_scale; sinks: null or float32 [q_heads], each clipped to +-float32 max as
// paged_attention_math.sink_logits does. Returns 0, 1 for an unknown dtype or format, kBadArrays
// for arrays that disagree.
extern "C" int dualop_ragged_paged_attention_kv(const DualopArray* q, const DualopArray* kv_pages,
                                                const DualopArray* kv_lens, const DualopArray* page_indices,
                                                const DualopArray* cu_q_lens, int32_t num_seqs, const DualopArray* out,
                                                const DualopArray* sinks, float scale, int64_t window, float soft_cap,
                                                int custom_mask, float mask_value, float v_scale, int kv_format,
                                                int threads) {
  using namespace dualop;
  if (!q || q->ndim != 3 || !is_row_major(q) || !is_dense_like(out, q)) return kBadArrays;
  if (sinks && (!is_dense(sinks, dtype_code::float32, 1) || sinks->shape[0] != q->shape[1])) return kBadArrays;
  const int32_t kv_dtype = kv_format == kv_formats::kAsQuery ? q->dtype : dtype_code::uint8;
  if (!is_dense(kv_pages, kv_dtype, 4) || kv_pages->shape[3] != q->shape[2]) return kBadArrays;
  if (!is_dense(kv_lens, dtype_code::int32, 1) || !is_dense(page_indices, dtype_code::int32, 2) ||
      !is_dense(cu_q_lens, dtype_code::int32, 1))
    return kBadArrays;
  const int64_t max_seqs =
      std::min({page_indices->shape[0], kv_lens->shape[0], std::max<int64_t>(cu_q_lens->shape[0] - 1, 0)});
  const Shape s{q->shape[0],        q->shape[1],        kv_pages->shape[2] / 2,  q->shape[2],
                kv_pages->shape[0], kv_pages->shape[1], page_indices->shape[1], max_seqs};
  std::vector<float> sink_logits;  // clipped as paged_attention_math.sink_logits (NaN kept)
  if (sinks) {
    const auto* given = static_cast<const float*>(sinks->data);
    sink_logits.assign(given, given + sinks->shape[0]);
    for (float& v : sink_logits)
      if (!std::isnan(v)) v = std::clamp(v, -FLT_MAX, FLT_MAX);
  }
  const Options o{scale, window, soft_cap, custom_mask != 0, mask_value, v_scale,
                  sinks ? sink_logits.data() : nullptr};
  const auto* lens = static_cast<const int32_t*>(kv_lens->data);
  const auto* pages = static_cast<const int32_t*>(page_indices->data);
  const auto* cu = static_cast<const int32_t*>(cu_q_lens->data);
  switch (q->dtype) {
    case dtype_code::float32:
      return run_format<float>(kv_format, q->data, kv_pages->data, lens, pages, cu, num_seqs, out->data, s, o, threads);
    case dtype_code::bfloat16:
      return run_format<bf16>(kv_format, q->data, kv_pages->data, lens, pages, cu, num_seqs, out->data, s, o, threads);
    case dtype_code::float16:
      return run_format<f16>(kv_format, q->data, kv_pages->data, lens, pages, cu, num_seqs, out->data, s, o, threads);
    default: return 1;
  }
}

// dualop_ragged_paged_attention_kv with kv_pages in q's dtype.
extern "C" int dualop_ragged_paged_attention(const DualopArray* q, const DualopArray* kv_pages,
                                             const DualopArray* kv_lens, const DualopArray* page_indices,
                                             const DualopArray* cu_q_lens, int32_t num_seqs, const DualopArray* out,
                                             float scale, int64_t window, float soft_cap, int custom_mask,
                                             float mask_value, float v_scale, int threads) {
  return dualop_ragged_paged_attention_kv(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, out, nullptr, scale,
                                          window, soft_cap, custom_mask, mask_value, v_scale, 0, threads);
}
