// Gated activations on the CPU: out[r, i] = act(gate[r, i]) * up[r, i] in float32, where gate and
// up are the two halves of row r of x (N, 2d). Semantics are dualop.kernels.gate_math for the
// silu, exact gelu and tanh gelu activations, gate on either half.
#include <type_traits>

#include "avx2.h"
#include "avx512.h"
#include "common.h"

namespace dualop {

enum Activation { kSilu = 0, kGelu = 1, kGeluTanh = 2 };

template <int kAct>
DUALOP_INLINE float activate(float g) {
  if constexpr (kAct == kSilu) return g * sigmoid_f32(g);
  if constexpr (kAct == kGelu) return 0.5f * g * (1.0f + erf_f32(g * 0.70710678118654752f));
  if constexpr (kAct == kGeluTanh) {
    const float inner = 0.79788456080286536f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (1.0f + tanh_f32(inner));
  }
}

// The next row's gate, up and output lines, fetched into L2 while this row is computed. A row's
// halves are short streams (a 4096-wide bfloat16 row is one 4 KB page each), and the hardware
// prefetchers stop at page boundaries, so without this every row began with misses (measured: 4096 x
// 4096 bfloat16 from memory, 2.0 -> 1.55 ms at 2 threads). Only where the rows outgrow the caches.
template <class T>
struct NextRow {
  const T* gate = nullptr;
  const T* up = nullptr;
  T* out = nullptr;

  // at element `at` of each stream, once per 64-byte line
  DUALOP_INLINE void fetch(int64_t at) const {
    if (gate == nullptr || at % (64 / static_cast<int64_t>(sizeof(T))) != 0) return;
    __builtin_prefetch(gate + at, 0, 2);  // read, into L2
    __builtin_prefetch(up + at, 0, 2);
    __builtin_prefetch(out + at, 1, 2);  // to be written: fetched for ownership
  }
};

// Whether rows [0, rows) split over `threads` are too many to stay in the caches between calls.
template <class T>
static bool rows_outgrow_caches(int64_t rows, int64_t d, int threads) {
  return rows / (threads > 0 ? threads : 1) * 3 * d * static_cast<int64_t>(sizeof(T)) > (int64_t(1) << 20);
}

template <class T, int kAct>
static void gated_rows(const T* __restrict x, T* __restrict out, int64_t rows, int64_t d, bool act_on_first,
                       int threads) {
  const int64_t gate_col = act_on_first ? 0 : d;
  const int64_t up_col = act_on_first ? d : 0;
  threads = dualop_team_size(threads);
  const bool prefetch = rows_outgrow_caches<T>(rows, d, threads);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t row = 0; row < rows; ++row) {
    const T* __restrict gate = x + row * 2 * d + gate_col;
    const T* __restrict up = x + row * 2 * d + up_col;
    T* __restrict o = out + row * d;
    NextRow<T> next;
    if (prefetch && row + 1 < rows) next = {gate + 2 * d, up + 2 * d, o + d};
    int64_t start = 0;
#ifdef DUALOP_HAVE_AVX512
    if constexpr (kAct == kSilu && std::is_same_v<T, bf16>) {
      for (; start + 32 <= d; start += 32) {  // gate, up and out all in load_bf16's even/odd order
        next.fetch(start);
        __m512 g_even, g_odd, u_even, u_odd;
        avx512::load_bf16(gate + start, g_even, g_odd);
        avx512::load_bf16(up + start, u_even, u_odd);
        // no NaN check in the rounding: a NaN here is a bfloat16 input's, or the default NaN of
        // -inf * 0, and passes on with its low 16 bits zero, so rounding cannot carry out of it
        avx512::store_bf16<false>(o + start, _mm512_mul_ps(avx512::silu_for_bf16(g_even), u_even),
                                  _mm512_mul_ps(avx512::silu_for_bf16(g_odd), u_odd));
      }
    }
#endif
#ifdef DUALOP_HAVE_AVX2
    if constexpr (kAct == kSilu && std::is_same_v<T, bf16>) {
      for (; start + 16 <= d; start += 16) {
        next.fetch(start);
        __m256 g_lo, g_hi, u_lo, u_hi;
        avx2::load_bf16(gate + start, g_lo, g_hi);
        avx2::load_bf16(up + start, u_lo, u_hi);
        avx2::store_bf16<true>(o + start, _mm256_mul_ps(avx2::silu(g_lo), u_lo), _mm256_mul_ps(avx2::silu(g_hi), u_hi));
      }
    }
    if constexpr (kAct == kSilu && std::is_same_v<T, float>) {
      for (; start + 8 <= d; start += 8) {
        next.fetch(start);
        _mm256_storeu_ps(o + start, _mm256_mul_ps(avx2::silu(_mm256_loadu_ps(gate + start)), _mm256_loadu_ps(up + start)));
      }
    }
    if constexpr (kAct == kGelu && std::is_same_v<T, float>) {
      for (; start + 8 <= d; start += 8) {
        next.fetch(start);
        _mm256_storeu_ps(o + start, _mm256_mul_ps(avx2::gelu(_mm256_loadu_ps(gate + start)), _mm256_loadu_ps(up + start)));
      }
    }
#endif
#pragma omp simd
    for (int64_t i = start; i < d; ++i) o[i] = from_f32<T>(activate<kAct>(to_f32(gate[i])) * to_f32(up[i]));
  }
}

template <class T>
static int by_activation(int activation, const void* x, void* out, int64_t rows, int64_t d, bool first, int threads) {
  const T* xt = static_cast<const T*>(x);
  T* ot = static_cast<T*>(out);
  switch (activation) {
    case kSilu: gated_rows<T, kSilu>(xt, ot, rows, d, first, threads); return 0;
    case kGelu: gated_rows<T, kGelu>(xt, ot, rows, d, first, threads); return 0;
    case kGeluTanh: gated_rows<T, kGeluTanh>(xt, ot, rows, d, first, threads); return 0;
    default: return -1;
  }
}

// 16-bit inputs have 65536 possible gate values, so act(gate) comes from a float32 table indexed by
// the gate's bits (built by the caller from the native formula): one lookup instead of the
// transcendental, and the same act(gate) the native body computes.
template <class T>
static void gated_table_rows(const float* __restrict table, const T* __restrict x, T* __restrict out, int64_t rows,
                             int64_t d, bool act_on_first, int threads) {
  const int64_t gate_col = act_on_first ? 0 : d;
  const int64_t up_col = act_on_first ? d : 0;
  threads = dualop_team_size(threads);
  const bool prefetch = rows_outgrow_caches<T>(rows, d, threads);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t row = 0; row < rows; ++row) {
    const T* __restrict gate = x + row * 2 * d + gate_col;
    const T* __restrict up = x + row * 2 * d + up_col;
    T* __restrict o = out + row * d;
    NextRow<T> next;
    if (prefetch && row + 1 < rows) next = {gate + 2 * d, up + 2 * d, o + d};
    int64_t start = 0;
#ifdef DUALOP_HAVE_AVX2
    if constexpr (std::is_same_v<T, bf16>) {
      const __m256i zero = _mm256_setzero_si256();
      for (; start + 16 <= d; start += 16) {
        next.fetch(start);
        const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gate + start));
        const __m256 a_lo = _mm256_i32gather_ps(table, _mm256_unpacklo_epi16(bits, zero), 4);
        const __m256 a_hi = _mm256_i32gather_ps(table, _mm256_unpackhi_epi16(bits, zero), 4);
        __m256 u_lo, u_hi;
        avx2::load_bf16(up + start, u_lo, u_hi);
        // No NaN check in the rounding: a NaN here is a bfloat16 input's or one torch computed
        // into the table (the default NaN), and a product passes one operand's payload on, so its
        // low 16 bits are zero and rounding cannot carry out of the payload (it stays NaN).
        avx2::store_bf16<false>(o + start, _mm256_mul_ps(a_lo, u_lo), _mm256_mul_ps(a_hi, u_hi));
      }
    }
#endif
    for (int64_t i = start; i < d; ++i) o[i] = from_f32<T>(table[std::bit_cast<uint16_t>(gate[i])] * to_f32(up[i]));
  }
}

}  // namespace dualop

namespace dualop {
namespace {

// Whether x is row-major [..., 2 * d] of a float dtype and out row-major [..., d] of x's dtype and
// leading shape; sets rows and d.
bool gated_operands_agree(const DualopArray* x, const DualopArray* out, int64_t& rows, int64_t& d) {
  if (!x || x->ndim < 1 || !is_row_major(x) || !is_dense(out, x->dtype, x->ndim)) return false;
  const int32_t last = x->ndim - 1;
  for (int32_t i = 0; i < last; ++i)
    if (out->shape[i] != x->shape[i]) return false;
  d = out->shape[last];
  if (x->shape[last] != 2 * d) return false;
  rows = d ? element_count(out) / d : 0;
  return true;
}

}  // namespace
}  // namespace dualop

// Whether a 16-bit input of this many gates reads act(gate) from the table (dualop_gated_table)
// rather than computing it (dualop_gated_activation). Not below 32768 gates: a decode step's few rows
// would find the 256 KB table evicted by the step's weights (measured: 37 µs for one row of 2816
// gates in the engine, against 7 µs computed). Not for bfloat16 silu where AVX-512 computes it:
// 16 lanes of the vector silu are cheaper than the table's gathers.
extern "C" int dualop_gated_table_pays(int activation, int dtype, int64_t gates) {
  using namespace dualop;
  if (dtype != dtype_code::bfloat16 && dtype != dtype_code::float16) return 0;
  if (gates < (int64_t{1} << 15)) return 0;
#ifdef DUALOP_HAVE_AVX512
  if (activation == kSilu && dtype == dtype_code::bfloat16) return 0;
#endif
  return 1;
}

// x [..., 2 * d] and out [..., d] of a 16-bit dtype (bfloat16, float16); table float32 [65536]: act
// of every gate bit pattern. Returns 0, -1 for another dtype, kBadArrays for arrays that disagree.
extern "C" int dualop_gated_table(const DualopArray* table, const DualopArray* x, const DualopArray* out,
                                  int act_on_first, int threads) {
  using namespace dualop;
  int64_t rows = 0, d = 0;
  if (!gated_operands_agree(x, out, rows, d)) return kBadArrays;
  if (!is_dense(table, dtype_code::float32, 1) || table->shape[0] != 65536) return kBadArrays;
  const auto* t = static_cast<const float*>(table->data);
  switch (x->dtype) {
    case dtype_code::bfloat16:
      gated_table_rows<bf16>(t, static_cast<const bf16*>(x->data), static_cast<bf16*>(out->data), rows, d,
                             act_on_first != 0, threads);
      return 0;
    case dtype_code::float16:
      gated_table_rows<f16>(t, static_cast<const f16*>(x->data), static_cast<f16*>(out->data), rows, d,
                            act_on_first != 0, threads);
      return 0;
    default: return -1;
  }
}

// x [..., 2 * d] and out [..., d] of one float dtype; activation: 0 silu, 1 gelu (erf), 2 gelu
// (tanh). Returns 0, -1 for an unknown dtype or activation, kBadArrays for arrays that disagree.
extern "C" int dualop_gated_activation(const DualopArray* x, const DualopArray* out, int activation, int act_on_first,
                                       int threads) {
  using namespace dualop;
  int64_t rows = 0, d = 0;
  if (!gated_operands_agree(x, out, rows, d)) return kBadArrays;
  switch (x->dtype) {
    case dtype_code::float32: return by_activation<float>(activation, x->data, out->data, rows, d, act_on_first != 0, threads);
    case dtype_code::bfloat16: return by_activation<bf16>(activation, x->data, out->data, rows, d, act_on_first != 0, threads);
    case dtype_code::float16: return by_activation<f16>(activation, x->data, out->data, rows, d, act_on_first != 0, threads);
    default: return -1;
  }
}
