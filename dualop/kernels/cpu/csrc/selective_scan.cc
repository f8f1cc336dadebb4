// Mamba-1's selective scan over packed sequences on the CPU (semantics:
// dualop.kernels.ssm_math.selective_scan_reference). OpenMP over (sequence, block of kBlock
// channels); a block's states [kBlock][N] stay in L1 across its sequence, the inner loop over N
// vectorised by GCC (exp_f32 is branch-free). Everything in float32; y is cast to x's dtype.
// The wrapper (kernels/cpu/selective_scan.py) gathers the initial states and stores the finals.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace dualop {

constexpr int64_t kScanBlock = 8;      // channels per work item
constexpr int64_t kScanMaxState = 256; // widest N the on-stack state holds

// delta: the step sizes [T, I] in float32, dt_bias and softplus already applied (by the wrapper).
template <class T>
static void scan_rows(const T* __restrict x, const float* __restrict delta, const T* __restrict z,
                      const float* __restrict A, const float* __restrict B, const float* __restrict C,
                      const float* __restrict D, const float* __restrict init, float* __restrict finals,
                      const int32_t* __restrict cu, const uint8_t* __restrict keep, T* __restrict y, int64_t dim,
                      int64_t n, int64_t seqs, int threads) {
  const int64_t blocks = (dim + kScanBlock - 1) / kScanBlock;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
  for (int64_t s = 0; s < seqs; ++s) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t i0 = blk * kScanBlock;
      const int64_t width = dim - i0 < kScanBlock ? dim - i0 : kScanBlock;
      const int64_t start = cu[s], end = cu[s + 1];
      if (!keep[s]) {  // padding sequence: zero outputs, no state
        for (int64_t t = start; t < end; ++t)
          for (int64_t c = 0; c < width; ++c) y[t * dim + i0 + c] = from_f32<T>(0.0f);
        continue;
      }
      alignas(64) float h[kScanBlock * kScanMaxState];
      for (int64_t c = 0; c < width; ++c)
        std::memcpy(h + c * n, init + (s * dim + i0 + c) * n, sizeof(float) * n);
      for (int64_t t = start; t < end; ++t) {
        const float* __restrict bt = B + t * n;
        const float* __restrict ct = C + t * n;
        for (int64_t c = 0; c < width; ++c) {
          const int64_t i = i0 + c;
          const float d = delta[t * dim + i];
          const float xv = to_f32(x[t * dim + i]);
          const float u = d * xv;
          const float* __restrict ai = A + i * n;
          float* __restrict hc = h + c * n;
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int64_t k = 0; k < n; ++k) {
            const float hk = exp_f32(d * ai[k]) * hc[k] + u * bt[k];
            hc[k] = hk;
            acc += hk * ct[k];
          }
          float out = acc + (D ? D[i] * xv : 0.0f);
          if (z) {
            const float zv = to_f32(z[t * dim + i]);
            out *= zv * sigmoid_f32(zv);
          }
          y[t * dim + i] = from_f32<T>(out);
        }
      }
      for (int64_t c = 0; c < width; ++c)
        std::memcpy(finals + (s * dim + i0 + c) * n, h + c * n, sizeof(float) * n);
    }
  }
}

}  // namespace dualop

// dtype: 0 float32, 1 bfloat16, 2 float16 (x, z, y); delta, A, B, C, D, init, finals float32.
// Returns 0, -1 for an unknown dtype, -2 for a state wider than the kernel holds.
extern "C" int dualop_selective_scan(int dtype, const void* x, const float* delta, const void* z, const float* A,
                                     const float* B, const float* C, const float* D, const float* init,
                                     float* finals, const int32_t* cu, const uint8_t* keep, void* y, int64_t dim,
                                     int64_t n, int64_t seqs, int threads) {
  using namespace dualop;
  if (n > kScanMaxState) return -2;
  switch (dtype) {
#define DUALOP_SCAN(T)                                                                                      \
  scan_rows<T>(static_cast<const T*>(x), delta, static_cast<const T*>(z), A, B, C, D, init, finals, cu, keep, \
               static_cast<T*>(y), dim, n, seqs, threads);                                                 \
  return 0;
    case 0: DUALOP_SCAN(float)
    case 1: DUALOP_SCAN(bf16)
    case 2: DUALOP_SCAN(f16)
#undef DUALOP_SCAN
    default: return -1;
  }
}
