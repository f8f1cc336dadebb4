// RMS norm over rows on the CPU (one pass over memory: a row stays in cache between its statistic
// and its output). Semantics are dualop.kernels.norm_math.rms_normalize, with the optional fused
// residual add of RMSNorm: s = x + residual (float32), residual_out = s in x's dtype, and s is what
// gets normalised.
#include <cstddef>
#include <type_traits>
#include <vector>

#include "avx2.h"
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

// The first pass over a row only reads (its statistic); the second reads x and residual again and
// writes out and residual_out, element by element after reading: so out may be x and residual_out
// may be residual (the in-place fused add-norm), and no pointer here is restrict.
template <class T, bool kResidual, int kWeight>
static void rms_norm_rows(const T* x, const T* residual, const float* weight, T* out, T* residual_out, int64_t rows,
                          int64_t hidden, float eps, bool weight_finite, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t row = 0; row < rows; ++row) {
    const T* xr = x + row * hidden;
    const T* rr = kResidual ? residual + row * hidden : nullptr;
    T* orow = out + row * hidden;
    T* ro = kResidual ? residual_out + row * hidden : nullptr;
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
}

template <class T, bool kResidual>
static void by_weight(const void* x, const void* residual, const float* weight, void* out, void* residual_out,
                      int64_t rows, int64_t hidden, float eps, int weight_mode, int threads) {
  const T* xt = static_cast<const T*>(x);
  const T* rt = static_cast<const T*>(residual);
  T* ot = static_cast<T*>(out);
  T* rot = static_cast<T*>(residual_out);
  bool weight_finite = true;
  for (int64_t i = 0; weight != nullptr && i < hidden; ++i) weight_finite = weight_finite && std::isfinite(weight[i]);
  switch (weight_mode) {
    case kNoWeight: return rms_norm_rows<T, kResidual, kNoWeight>(xt, rt, weight, ot, rot, rows, hidden, eps, weight_finite, threads);
    case kWeightAfterCast:
      return rms_norm_rows<T, kResidual, kWeightAfterCast>(xt, rt, weight, ot, rot, rows, hidden, eps, weight_finite, threads);
    default: return rms_norm_rows<T, kResidual, kWeightInF32>(xt, rt, weight, ot, rot, rows, hidden, eps, weight_finite, threads);
  }
}

template <class T>
static void by_residual(const void* x, const void* residual, const float* weight, void* out, void* residual_out,
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
#pragma omp parallel num_threads(threads)
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
                               const DualopArray* out, const DualopArray* residual_out, float eps, int weight_mode,
                               int threads) {
  using namespace dualop;
  if (!x || x->ndim < 1 || !is_row_major(x) || !is_dense_like(out, x)) return kBadArrays;
  if (residual ? !is_dense_like(residual, x) || !is_dense_like(residual_out, x) : residual_out != nullptr)
    return kBadArrays;
  const int64_t hidden = x->shape[x->ndim - 1], rows = hidden ? element_count(x) / hidden : 0;
  if (!is_absent_or_dense(weight, dtype_code::float32, 1) || (weight && weight->shape[0] != hidden)) return kBadArrays;
  const void* r = data_of(residual);
  void* ro = data_of(residual_out);
  const auto* w = static_cast<const float*>(data_of(weight));
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
