// RMS norm over rows on the CPU (one pass over memory: a row stays in cache between its statistic
// and its output). Semantics are dualop.kernels.norm_math.rms_normalize, with the optional fused
// residual add of RMSNorm: s = x + residual (float32), residual_out = s in x's dtype, and s is what
// gets normalised.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "avx2.h"
#include "avx512.h"
#include "common.h"

namespace dualop {

enum WeightMode { kNoWeight = 0, kWeightAfterCast = 1, kWeightInF32 = 2 };

#ifdef DUALOP_HAVE_AVX2
// bfloat16 rows with AVX2, 16 elements a step; both return the index the portable tail starts at.
template <bool kResidual>
static int64_t sum_sq_bf16(const bf16* xr, const bf16* rr, int64_t hidden, float& sum_sq) {
  __m256 acc_lo = _mm256_setzero_ps(), acc_hi = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= hidden; i += 16) {
    __m256 lo, hi;
    avx2::load_bf16(xr + i, lo, hi);
    if constexpr (kResidual) {
      __m256 r_lo, r_hi;
      avx2::load_bf16(rr + i, r_lo, r_hi);
      lo = _mm256_add_ps(lo, r_lo);
      hi = _mm256_add_ps(hi, r_hi);
    }
    acc_lo = _mm256_fmadd_ps(lo, lo, acc_lo);
    acc_hi = _mm256_fmadd_ps(hi, hi, acc_hi);
  }
  sum_sq = avx2::sum(_mm256_add_ps(acc_lo, acc_hi));
  return i;
}

template <bool kResidual, int kWeight, bool kMayBeNaN>
static int64_t normalize_bf16(const bf16* xr, const bf16* rr, const float* weight, bf16* orow, bf16* ro,
                              int64_t hidden, float inv_rms) {
  const __m256 inv = _mm256_set1_ps(inv_rms);
  int64_t i = 0;
  for (; i + 16 <= hidden; i += 16) {
    __m256 lo, hi;
    avx2::load_bf16(xr + i, lo, hi);
    if constexpr (kResidual) {
      __m256 r_lo, r_hi;
      avx2::load_bf16(rr + i, r_lo, r_hi);
      lo = _mm256_add_ps(lo, r_lo);
      hi = _mm256_add_ps(hi, r_hi);
      avx2::store_bf16<true>(ro + i, lo, hi);
    }
    lo = _mm256_mul_ps(lo, inv);
    hi = _mm256_mul_ps(hi, inv);
    if constexpr (kWeight != kNoWeight) {
      if constexpr (kWeight == kWeightAfterCast) {
        lo = avx2::through_bf16<kMayBeNaN>(lo);
        hi = avx2::through_bf16<kMayBeNaN>(hi);
      }
      __m256 w_lo, w_hi;
      avx2::load_f32_as_bf16_order(weight + i, w_lo, w_hi);
      lo = _mm256_mul_ps(lo, w_lo);
      hi = _mm256_mul_ps(hi, w_hi);
    }
    avx2::store_bf16<kMayBeNaN>(orow + i, lo, hi);
  }
  return i;
}
#endif

// Scratch of a thread, one per use (kUse): at least n elements, 64-byte aligned (whole cache
// lines: a vector access never splits one), kept between calls.
enum ScratchUse { kWeightScratch = 0, kSumScratch = 1, kConvertScratch = 2 };
template <class E, ScratchUse kUse>
static E* aligned_scratch(int64_t n) {
  thread_local std::vector<E> store;
  const int64_t pad = 64 / sizeof(E);
  if (static_cast<int64_t>(store.size()) < n + pad) store.resize(n + pad);
  const auto address = reinterpret_cast<uintptr_t>(store.data());
  return reinterpret_cast<E*>((address + 63) & ~uintptr_t(63));
}

// The weight as the caller gave it (float32, bfloat16 or float16 [hidden], or null) plus an offset
// (Gemma's 1 + w): each thread reads it as float32 (weight_for_thread).
struct WeightIn {
  const void* data;
  int32_t dtype;
  float offset;
};

// The weight as float32 for the calling thread: the caller's array when it is float32 without an
// offset, else converted into the thread's scratch (a copy one thread writes for all would cross
// cores on every call).
static const float* weight_for_thread(const WeightIn& w, int64_t hidden) {
  if (w.data == nullptr) return nullptr;
  if (w.dtype == dtype_code::float32 && w.offset == 0.0f) return static_cast<const float*>(w.data);
  float* __restrict to = aligned_scratch<float, kConvertScratch>(hidden);
  const float offset = w.offset;
  if (w.dtype == dtype_code::float32) {
    const float* __restrict from = static_cast<const float*>(w.data);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) to[i] = from[i] + offset;
  } else if (w.dtype == dtype_code::bfloat16) {
    const bf16* __restrict from = static_cast<const bf16*>(w.data);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) to[i] = to_f32(from[i]) + offset;
  } else {
    const f16* __restrict from = static_cast<const f16*>(w.data);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) to[i] = to_f32(from[i]) + offset;
  }
  return to;
}

#ifdef DUALOP_HAVE_AVX512
// AVX-512 rows: 32 elements a step as two float32 vectors (avx512::Lanes), whatever T; the last
// partial step masked (lanes past the row read as 0 and are not written), so no element takes a
// portable tail. A bfloat16 row's weight is rearranged once per call into the Lanes order.
using avx512::Lanes;

// The weight as a bfloat16 row reads it, made once per call into a scratch of whole steps (zero
// padded): each step's 32 values rearranged into its even then its odd ones (Lanes' order).
// (Packing a weight that bfloat16 holds exactly into bfloat16 instead was tried: unpacking it costs
// more than the smaller cache footprint saves.)
static const float* arrange_weight(const float* weight, int64_t hidden) {
  float* w = aligned_scratch<float, kWeightScratch>((hidden + 31) / 32 * 32);
  for (int64_t i = 0; i < hidden; i += 32) {
    __m512 even, odd;
    avx512::load_f32_even_odd(weight + i, even, odd, hidden - i);
    _mm512_store_ps(w + i, even);
    _mm512_store_ps(w + i + 16, odd);
  }
  return w;
}

// A step's weight in T's Lanes order: arranged for a bfloat16 row (whole steps), else the caller's
// weight (masked past the row).
template <class T, bool kPartial>
DUALOP_INLINE void load_weight(const float* w, __m512& a, __m512& b, int64_t n) {
  if constexpr (std::is_same_v<T, bf16> || !kPartial)
    Lanes<float>::load(w, a, b);
  else
    Lanes<float>::load(w, a, b, n);
}

// Where the output pass reads a row's values (x, or s = x + residual) from: x itself; residual_out
// (float32, which holds s exactly); or a float32 buffer (a 16-bit residual_out holds s rounded), in
// the Lanes order, whole steps. With a residual the first pass writes residual_out and the buffer
// (summing x and the residual again in the output pass instead was tried: slower).
enum Source { kFromX = 0, kFromResidualOut = 1, kFromBuffer = 2 };

template <class T, bool kResidual>
constexpr Source source_of() {
  if constexpr (!kResidual) return kFromX;
  if constexpr (std::is_same_v<T, float>) return kFromResidualOut;
  return kFromBuffer;
}

// x (+ residual) of a step, and (kStore) residual_out written, each step read before it writes.
template <class T, bool kResidual, bool kStore, bool kMayBeNaN, bool kPartial>
DUALOP_INLINE void load_sum(const T* xr, const T* rr, T* ro, int64_t i, int64_t n, __m512& a, __m512& b) {
  using L = Lanes<T>;
  if constexpr (kPartial) L::load(xr + i, a, b, n); else L::load(xr + i, a, b);
  if constexpr (kResidual) {
    __m512 ra, rb;
    if constexpr (kPartial) L::load(rr + i, ra, rb, n); else L::load(rr + i, ra, rb);
    a = _mm512_add_ps(a, ra);
    b = _mm512_add_ps(b, rb);
    if constexpr (kStore) {
      if constexpr (kPartial)
        L::template store<kMayBeNaN>(ro + i, a, b, n);
      else
        L::template store<kMayBeNaN>(ro + i, a, b);
    }
  }
}

// The first pass: the sum of squares of x (+ residual). Where the output pass does not read x and
// the residual again it writes residual_out here (kFromResidualOut, kFromBuffer; bfloat16 rounded
// without the NaN rule: the caller redoes a row holding NaN from the buffer), and the buffer.
template <class T, bool kResidual, Source kSource, bool kPartial>
DUALOP_INLINE void first_step(const T* xr, const T* rr, T* ro, float* buffer, int64_t i, int64_t n, __m512& acc_a,
                              __m512& acc_b) {
  constexpr bool kStore = kSource == kFromResidualOut || kSource == kFromBuffer;
  __m512 a, b;
  load_sum<T, kResidual, kStore, false, kPartial>(xr, rr, ro, i, n, a, b);
  if constexpr (kSource == kFromBuffer) {
    _mm512_store_ps(buffer + i, a);
    _mm512_store_ps(buffer + i + 16, b);
  }
  acc_a = _mm512_fmadd_ps(a, a, acc_a);
  acc_b = _mm512_fmadd_ps(b, b, acc_b);
}

template <class T, bool kResidual, Source kSource>
static float first_pass(const T* xr, const T* rr, T* ro, float* buffer, int64_t hidden) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps(),
         acc3 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= hidden; i += 64) {  // two steps in flight (four accumulators)
    first_step<T, kResidual, kSource, false>(xr, rr, ro, buffer, i, 32, acc0, acc1);
    first_step<T, kResidual, kSource, false>(xr, rr, ro, buffer, i + 32, 32, acc2, acc3);
  }
  if (i + 32 <= hidden) {
    first_step<T, kResidual, kSource, false>(xr, rr, ro, buffer, i, 32, acc0, acc1);
    i += 32;
  }
  if (i < hidden) first_step<T, kResidual, kSource, true>(xr, rr, ro, buffer, i, hidden - i, acc2, acc3);
  return avx512::sum(_mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc2, acc3)));
}

// One step of the output pass (n < 32 for the masked last step): each step reads (x, residual)
// before it writes (out, residual_out), so out may be x and residual_out the residual.
template <class T, bool kResidual, int kWeight, Source kSource, bool kMayBeNaN, bool kPartial>
DUALOP_INLINE void output_step(const T* xr, const T* rr, const float* buffer, const float* weight, T* orow, T* ro,
                               int64_t i, int64_t n, __m512 inv) {
  using L = Lanes<T>;
  __m512 a, b;
  if constexpr (kSource == kFromBuffer) {
    a = _mm512_load_ps(buffer + i);
    b = _mm512_load_ps(buffer + i + 16);
  } else if constexpr (kSource == kFromResidualOut) {
    if constexpr (kPartial) L::load(ro + i, a, b, n); else L::load(ro + i, a, b);
  } else {
    if constexpr (kPartial) L::load(xr + i, a, b, n); else L::load(xr + i, a, b);
  }
  a = _mm512_mul_ps(a, inv);
  b = _mm512_mul_ps(b, inv);
  if constexpr (kWeight != kNoWeight) {
    if constexpr (kWeight == kWeightAfterCast) {
      a = L::template through<kMayBeNaN>(a);
      b = L::template through<kMayBeNaN>(b);
    }
    __m512 wa, wb;
    load_weight<T, kPartial>(weight + i, wa, wb, n);
    a = _mm512_mul_ps(a, wa);
    b = _mm512_mul_ps(b, wb);
  }
  if constexpr (kPartial) L::template store<kMayBeNaN>(orow + i, a, b, n); else L::template store<kMayBeNaN>(orow + i, a, b);
}

// The output pass. next_x / next_r (or null) are the next row's, fetched into L2 meanwhile (this
// pass reads only what the first pass brought in, so memory would otherwise idle). A float32
// residual row is not prefetched: with four lines a step (x's and the residual's) the prefetches
// slowed the fused add down (measured at 4096 x 4096; L1 as the target was slower too).
template <class T, bool kResidual, int kWeight, Source kSource, bool kMayBeNaN>
static void output_pass(const T* xr, const T* rr, const float* buffer, const float* weight, T* orow, T* ro,
                        int64_t hidden, float inv_rms, const T* next_x, const T* next_r) {
  const __m512 inv = _mm512_set1_ps(inv_rms);
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  constexpr bool kPrefetchResidual = kResidual && sizeof(T) == 2;
  int64_t i = 0;
  for (; i + 32 <= hidden; i += 32) {
    if (next_x != nullptr) {
#pragma GCC unroll 2
      for (int64_t j = 0; j < 32; j += kLine) {
        _mm_prefetch(reinterpret_cast<const char*>(next_x + i + j), _MM_HINT_T1);
        if constexpr (kPrefetchResidual) _mm_prefetch(reinterpret_cast<const char*>(next_r + i + j), _MM_HINT_T1);
      }
    }
    output_step<T, kResidual, kWeight, kSource, kMayBeNaN, false>(xr, rr, buffer, weight, orow, ro, i, 32, inv);
  }
  if (i < hidden)
    output_step<T, kResidual, kWeight, kSource, kMayBeNaN, true>(xr, rr, buffer, weight, orow, ro, i, hidden - i,
                                                                    inv);
}

// One row by AVX-512 (see Lanes): the first pass, then the output pass. buffer: float32 scratch of
// whole steps (for kFromBuffer).
template <class T, bool kResidual, int kWeight>
static void rms_norm_row_avx512(const T* xr, const T* rr, const float* weight, T* orow, T* ro, int64_t hidden,
                                float eps, bool weight_finite, float* buffer, const T* next_x, const T* next_r) {
  constexpr Source kSource = source_of<T, kResidual>();
  const float sum_sq = first_pass<T, kResidual, kSource>(xr, rr, ro, buffer, hidden);
  if constexpr (kSource == kFromBuffer && std::is_same_v<T, bf16>) {
    if (std::isnan(sum_sq)) {  // a NaN in the sum: residual_out again, with the NaN rule
      for (int64_t i = 0; i < hidden; i += 32)
        avx512::store_bf16<true>(ro + i, _mm512_load_ps(buffer + i), _mm512_load_ps(buffer + i + 16),
                                 avx512::first32(hidden - i));
    }
  }
  const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
  // A row with only finite values (and a finite weight) cannot produce NaN: skip its check.
  if (std::isfinite(sum_sq) && std::isfinite(inv_rms) && weight_finite)
    output_pass<T, kResidual, kWeight, kSource, false>(xr, rr, buffer, weight, orow, ro, hidden, inv_rms, next_x,
                                                       next_r);
  else
    output_pass<T, kResidual, kWeight, kSource, true>(xr, rr, buffer, weight, orow, ro, hidden, inv_rms, next_x,
                                                      next_r);
}

// Rows [begin, end) of one thread. Each row's successor is prefetched while the row is written
// where the rows are too many to stay in the caches anyway.
template <class T, bool kResidual, int kWeight>
static void rms_norm_range_avx512(const T* x, const T* residual, const WeightIn& given, T* out, T* residual_out,
                                  int64_t begin, int64_t end, int64_t hidden, float eps, bool weight_finite) {
  const float* weight = weight_for_thread(given, hidden);
  const int64_t row_bytes = hidden * static_cast<int64_t>(sizeof(T)) * (kResidual ? 2 : 1);
  const bool prefetch = (end - begin) * row_bytes > (int64_t(1) << 20);
  // each thread arranges its own copy: one the caller's thread wrote would cross cores every call
  if constexpr (std::is_same_v<T, bf16> && kWeight != kNoWeight) weight = arrange_weight(weight, hidden);
  float* buffer = source_of<T, kResidual>() == kFromBuffer ? aligned_scratch<float, kSumScratch>((hidden + 31) / 32 * 32) : nullptr;
  for (int64_t row = begin; row < end; ++row) {
    const bool more = prefetch && row + 1 < end;
    rms_norm_row_avx512<T, kResidual, kWeight>(
        x + row * hidden, kResidual ? residual + row * hidden : nullptr, weight, out + row * hidden,
        kResidual ? residual_out + row * hidden : nullptr, hidden, eps, weight_finite, buffer,
        more ? x + (row + 1) * hidden : nullptr, more && kResidual ? residual + (row + 1) * hidden : nullptr);
  }
}

// One thread takes the rows itself (no OpenMP region for small work); more split them in
// contiguous blocks.
template <class T, bool kResidual, int kWeight>
static void rms_norm_rows_avx512(const T* x, const T* residual, const WeightIn& weight, T* out, T* residual_out,
                                 int64_t rows, int64_t hidden, float eps, bool weight_finite, int threads) {
  threads = dualop_team_size(threads);
  if (threads <= 1 || rows < 2)
    return rms_norm_range_avx512<T, kResidual, kWeight>(x, residual, weight, out, residual_out, 0, rows, hidden,
                                                           eps, weight_finite);
  if (threads > rows) threads = static_cast<int>(rows);
#pragma omp parallel num_threads(threads)  // the team asked for above
  {
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    rms_norm_range_avx512<T, kResidual, kWeight>(x, residual, weight, out, residual_out, rows * me / team,
                                                    rows * (me + 1) / team, hidden, eps, weight_finite);
  }
}
#endif

// One row, portably (AVX2 for bfloat16's bulk where there is AVX2). The first pass only reads (its
// statistic); the second reads x and residual again and writes out and residual_out, element by
// element after reading: so out may be x and residual_out may be residual (the in-place fused
// add-norm), and no pointer here is restrict.
template <class T, bool kResidual, int kWeight>
DUALOP_INLINE void rms_norm_row(const T* xr, const T* rr, const float* weight, T* orow, T* ro, int64_t hidden,
                                float eps, bool weight_finite) {
  float sum_sq = 0.0f;
  int64_t start = 0;
#ifdef DUALOP_HAVE_AVX2
  if constexpr (std::is_same_v<T, bf16>) start = sum_sq_bf16<kResidual>(xr, rr, hidden, sum_sq);
#endif
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t i = start; i < hidden; ++i) {
    float v = to_f32(xr[i]);
    if constexpr (kResidual) v += to_f32(rr[i]);
    sum_sq = std::fma(v, v, sum_sq);
  }
  const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
  start = 0;
#ifdef DUALOP_HAVE_AVX2
  if constexpr (std::is_same_v<T, bf16>) {
    // A row with only finite values (and a finite weight) cannot produce NaN: skip its check.
    if (std::isfinite(sum_sq) && std::isfinite(inv_rms) && weight_finite)
      start = normalize_bf16<kResidual, kWeight, false>(xr, rr, weight, orow, ro, hidden, inv_rms);
    else
      start = normalize_bf16<kResidual, kWeight, true>(xr, rr, weight, orow, ro, hidden, inv_rms);
  }
#endif
#pragma omp simd
  for (int64_t i = start; i < hidden; ++i) {
    float v = to_f32(xr[i]);
    if constexpr (kResidual) {
      v += to_f32(rr[i]);
      ro[i] = from_f32<T>(v);
    }
    const float y = v * inv_rms;
    if constexpr (kWeight == kNoWeight) orow[i] = from_f32<T>(y);
    if constexpr (kWeight == kWeightInF32) orow[i] = from_f32<T>(y * weight[i]);
    if constexpr (kWeight == kWeightAfterCast) orow[i] = from_f32<T>(through<T>(y) * weight[i]);
  }
}

// Rows [begin, end) of one thread, portably.
template <class T, bool kResidual, int kWeight>
static void rms_norm_range(const T* x, const T* residual, const float* weight, T* out, T* residual_out,
                           int64_t begin, int64_t end, int64_t hidden, float eps, bool weight_finite) {
  for (int64_t row = begin; row < end; ++row)
    rms_norm_row<T, kResidual, kWeight>(x + row * hidden, kResidual ? residual + row * hidden : nullptr, weight,
                                        out + row * hidden, kResidual ? residual_out + row * hidden : nullptr,
                                        hidden, eps, weight_finite);
}

template <class T, bool kResidual, int kWeight>
static void rms_norm_rows(const T* x, const T* residual, const WeightIn& given, T* out, T* residual_out, int64_t rows,
                          int64_t hidden, float eps, bool weight_finite, int threads) {
#ifdef DUALOP_HAVE_AVX512
  return rms_norm_rows_avx512<T, kResidual, kWeight>(x, residual, given, out, residual_out, rows, hidden,
                                                            eps, weight_finite, threads);
#else
  const float* weight = weight_for_thread(given, hidden);  // float32 once, shared by the threads
  threads = dualop_team_size(threads);
  if (threads <= 1 || rows < 2)
    return rms_norm_range<T, kResidual, kWeight>(x, residual, weight, out, residual_out, 0, rows, hidden, eps,
                                                 weight_finite);
  if (threads > rows) threads = static_cast<int>(rows);
#pragma omp parallel num_threads(threads)  // the team asked for above
  {
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    rms_norm_range<T, kResidual, kWeight>(x, residual, weight, out, residual_out, rows * me / team,
                                          rows * (me + 1) / team, hidden, eps, weight_finite);
  }
#endif
}

// Whether every weight plus the offset is finite. For |offset| <= 1 that is whether every weight
// is (adding at most 1 cannot overflow a finite float), read from the exponent bits as an integer
// max (no chain of dependent float adds); other offsets check w * 0 == 0 on the sums.
template <class W, class Bits>
static bool all_finite(const W* weight, float offset, int64_t n, Bits exponent) {
  if (std::fabs(offset) <= 1.0f) {
    const Bits* bits = reinterpret_cast<const Bits*>(weight);
    Bits top = 0;
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < n; ++i) top = std::max<Bits>(top, static_cast<Bits>(bits[i] & exponent));
    return top != exponent;
  }
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += (to_f32(weight[i]) + offset) * 0.0f;
  return acc == 0.0f;
}

static bool all_finite(const WeightIn& w, int64_t n) {
  switch (w.dtype) {
    case dtype_code::float32: return all_finite(static_cast<const float*>(w.data), w.offset, n, uint32_t{0x7f800000u});
    case dtype_code::bfloat16: return all_finite(static_cast<const bf16*>(w.data), w.offset, n, uint16_t{0x7f80u});
    default: return all_finite(static_cast<const f16*>(w.data), w.offset, n, uint16_t{0x7c00u});
  }
}

template <class T, bool kResidual>
static void by_weight(const void* x, const void* residual, const WeightIn& weight, void* out, void* residual_out,
                      int64_t rows, int64_t hidden, float eps, int weight_mode, int threads) {
  const T* xt = static_cast<const T*>(x);
  const T* rt = static_cast<const T*>(residual);
  T* ot = static_cast<T*>(out);
  T* rot = static_cast<T*>(residual_out);
  // only bfloat16's rounding treats NaN apart (the check a row of finite values skips): other
  // dtypes need not scan the weight
  const bool weight_finite = !std::is_same_v<T, bf16> || weight.data == nullptr || all_finite(weight, hidden);
  switch (weight_mode) {
    case kNoWeight: return rms_norm_rows<T, kResidual, kNoWeight>(xt, rt, weight, ot, rot, rows, hidden, eps, weight_finite, threads);
    case kWeightAfterCast:
      return rms_norm_rows<T, kResidual, kWeightAfterCast>(xt, rt, weight, ot, rot, rows, hidden, eps, weight_finite, threads);
    default: return rms_norm_rows<T, kResidual, kWeightInF32>(xt, rt, weight, ot, rot, rows, hidden, eps, weight_finite, threads);
  }
}

template <class T>
static void by_residual(const void* x, const void* residual, const WeightIn& weight, void* out, void* residual_out,
                        int64_t rows, int64_t hidden, float eps, int weight_mode, int threads) {
  if (residual != nullptr)
    by_weight<T, true>(x, residual, weight, out, residual_out, rows, hidden, eps, weight_mode, threads);
  else
    by_weight<T, false>(x, residual, weight, out, residual_out, rows, hidden, eps, weight_mode, threads);
}


// Gated group RMS norm (rms_norm_gated, mixer2_gated_rms_norm; semantics
// dualop.ops.gated_norm's forward_native): per row, g = silu(z) in float32; h = x * g unless
// norm_before_gate; each group of `group` values scaled by 1 / sqrt(mean(h^2) + eps); rounded
// through x's dtype when cast_before_weight; times weight; times g when norm_before_gate. A row's
// gated values stay in a per-thread buffer between the statistic and the output (one exp each).
template <class T>
static void rms_norm_gated_rows(const T* __restrict x, const T* __restrict z, const float* __restrict weight,
                                T* __restrict out, int64_t rows, int64_t hidden, int64_t group, float eps,
                                bool norm_before_gate, bool cast_before_weight, int threads) {
#pragma omp parallel num_threads(dualop_team_size(threads))
  {
    std::vector<float> h_buffer(hidden), g_buffer(hidden);
    float* __restrict h = h_buffer.data();
    float* __restrict g = g_buffer.data();
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const T* __restrict xr = x + row * hidden;
      const T* __restrict zr = z ? z + row * hidden : nullptr;
      T* __restrict orow = out + row * hidden;
      if (zr) {
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) {
          const float zv = to_f32(zr[i]);
          g[i] = zv * sigmoid_f32(zv);
        }
      }
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) h[i] = zr && !norm_before_gate ? to_f32(xr[i]) * g[i] : to_f32(xr[i]);
      for (int64_t g0 = 0; g0 < hidden; g0 += group) {
        float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t i = g0; i < g0 + group; ++i) sum_sq = std::fma(h[i], h[i], sum_sq);
        const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(group) + eps);
#pragma omp simd
        for (int64_t i = g0; i < g0 + group; ++i) {
          float y = h[i] * inv_rms;
          if (cast_before_weight) y = through<T>(y);
          y *= weight[i];
          if (zr && norm_before_gate) y *= g[i];
          orow[i] = from_f32<T>(y);
        }
      }
    }
  }
}

}  // namespace dualop

// x, out, and residual, residual_out (both absent or both present): row-major [..., hidden] of one
// float dtype, read as [rows, hidden]; out may be x and residual_out residual (in place). weight:
// float32 [hidden] with any offset already added, or absent (weight_mode 0). Returns 0, -1 for an unknown dtype, kBadArrays for arrays that disagree.
extern "C" int dualop_rms_norm(const DualopArray* x, const DualopArray* residual, const DualopArray* weight,
                               const DualopArray* out, const DualopArray* residual_out, float eps, float weight_offset,
                               int weight_mode, int threads) {
  using namespace dualop;
  if (!x || x->ndim < 1 || !is_row_major(x) || !is_dense_like(out, x)) return kBadArrays;
  if (residual ? !is_dense_like(residual, x) || !is_dense_like(residual_out, x) : residual_out != nullptr)
    return kBadArrays;
  const int64_t hidden = x->shape[x->ndim - 1], rows = hidden ? element_count(x) / hidden : 0;
  if (weight && (weight->ndim != 1 || !is_row_major(weight) || weight->shape[0] != hidden ||
                 (weight->dtype != dtype_code::float32 && weight->dtype != dtype_code::bfloat16 &&
                  weight->dtype != dtype_code::float16)))
    return kBadArrays;
  const void* r = data_of(residual);
  void* ro = data_of(residual_out);
  const WeightIn w{data_of(weight), weight ? weight->dtype : dtype_code::float32, weight_offset};
  switch (x->dtype) {
    case dtype_code::float32: by_residual<float>(x->data, r, w, out->data, ro, rows, hidden, eps, weight_mode, threads); return 0;
    case dtype_code::bfloat16: by_residual<bf16>(x->data, r, w, out->data, ro, rows, hidden, eps, weight_mode, threads); return 0;
    case dtype_code::float16: by_residual<f16>(x->data, r, w, out->data, ro, rows, hidden, eps, weight_mode, threads); return 0;
    default: return -1;
  }
}

// Gated group RMS norm: x, out, and z (or absent) row-major [..., hidden] of one float dtype;
// weight float32 [hidden]; group divides hidden. Returns 0, -1 for an unknown dtype, -2 for a group
// that does not divide, kBadArrays for arrays that disagree.
extern "C" int dualop_rms_norm_gated(const DualopArray* x, const DualopArray* z, const DualopArray* weight,
                                     const DualopArray* out, int64_t group, float eps, int norm_before_gate,
                                     int cast_before_weight, int threads) {
  using namespace dualop;
  if (!x || x->ndim < 1 || !is_row_major(x) || !is_dense_like(out, x) || (z && !is_dense_like(z, x)))
    return kBadArrays;
  const int64_t hidden = x->shape[x->ndim - 1], rows = hidden ? element_count(x) / hidden : 0;
  if (!is_dense(weight, dtype_code::float32, 1) || weight->shape[0] != hidden) return kBadArrays;
  if (group < 1 || hidden % group) return -2;
  const auto* w = static_cast<const float*>(weight->data);
#define DUALOP_GATED(T)                                                                                          \
  rms_norm_gated_rows<T>(static_cast<const T*>(x->data), static_cast<const T*>(data_of(z)), w,                    \
                         static_cast<T*>(out->data), rows, hidden, group, eps, norm_before_gate != 0,             \
                         cast_before_weight != 0, threads);                                                       \
  return 0;
  switch (x->dtype) {
    case dtype_code::float32: DUALOP_GATED(float)
    case dtype_code::bfloat16: DUALOP_GATED(bf16)
    case dtype_code::float16: DUALOP_GATED(f16)
    default: return -1;
  }
#undef DUALOP_GATED
}
