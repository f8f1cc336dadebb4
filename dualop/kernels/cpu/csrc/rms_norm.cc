// RMS norm over rows on the CPU (one pass over memory: a row stays in cache between its statistic
// and its output). Semantics are dualop.kernels.norm_math.rms_normalize, with the optional fused
// residual add of RMSNorm: s = x + residual (float32), residual_out = s in x's dtype, and s is what
// gets normalised.
#include <cstddef>

#include "common.h"

namespace dualop {

enum WeightMode { kNoWeight = 0, kWeightAfterCast = 1, kWeightInF32 = 2 };

template <class T, bool kResidual, int kWeight>
static void rms_norm_rows(const T* __restrict x, const T* __restrict residual, const float* __restrict weight,
                          T* __restrict out, T* __restrict residual_out, int64_t rows, int64_t hidden, float eps,
                          int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t row = 0; row < rows; ++row) {
    const T* __restrict xr = x + row * hidden;
    const T* __restrict rr = kResidual ? residual + row * hidden : nullptr;
    T* __restrict orow = out + row * hidden;
    T* __restrict ro = kResidual ? residual_out + row * hidden : nullptr;
    float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < hidden; ++i) {
      float v = to_f32(xr[i]);
      if constexpr (kResidual) {
        v += to_f32(rr[i]);
        ro[i] = from_f32<T>(v);
      }
      sum_sq = std::fma(v, v, sum_sq);
    }
    const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) {
      float v = to_f32(xr[i]);
      if constexpr (kResidual) v += to_f32(rr[i]);
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
  switch (weight_mode) {
    case kNoWeight: return rms_norm_rows<T, kResidual, kNoWeight>(xt, rt, weight, ot, rot, rows, hidden, eps, threads);
    case kWeightAfterCast:
      return rms_norm_rows<T, kResidual, kWeightAfterCast>(xt, rt, weight, ot, rot, rows, hidden, eps, threads);
    default: return rms_norm_rows<T, kResidual, kWeightInF32>(xt, rt, weight, ot, rot, rows, hidden, eps, threads);
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

}  // namespace dualop

// dtype: 0 float32, 1 bfloat16, 2 float16. weight: float32 (hidden,) with any offset already added,
// or null. residual/residual_out: both null or both set. Returns 0, or -1 for an unknown dtype.
extern "C" int dualop_rms_norm(int dtype, const void* x, const void* residual, const float* weight, void* out,
                               void* residual_out, int64_t rows, int64_t hidden, float eps, int weight_mode,
                               int threads) {
  using namespace dualop;
  switch (dtype) {
    case 0: by_residual<float>(x, residual, weight, out, residual_out, rows, hidden, eps, weight_mode, threads); return 0;
    case 1: by_residual<bf16>(x, residual, weight, out, residual_out, rows, hidden, eps, weight_mode, threads); return 0;
    case 2: by_residual<f16>(x, residual, weight, out, residual_out, rows, hidden, eps, weight_mode, threads); return 0;
    default: return -1;
  }
}
