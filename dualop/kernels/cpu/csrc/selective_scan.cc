// Mamba-1's selective scan over packed sequences on the CPU (semantics:
// dualop.kernels.ssm_math.selective_scan_reference). OpenMP over (sequence, block of kBlock
// channels); a block's states [kBlock][N] stay in L1 across its sequence, the inner loop over N
// vectorised by GCC (exp_f32 is branch-free). Everything in float32; y is cast to x's dtype.
// Each work item reads its channels' starting state straight from the cache slot of its sequence
// (zeros without an initial state) and writes the final state back into the same slot, in the
// cache's dtype: a decode step moves each state once, with no gather, select or scatter around the
// loop. Slots are distinct (ops/ssm_batch.py checks), so no two items touch the same state.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace dualop {

constexpr int64_t kScanBlock = 8;      // channels per work item
constexpr int64_t kScanMaxState = 256; // widest N the on-stack state holds

// delta: the step sizes [T, I] in float32, dt_bias and softplus already applied (by the wrapper).
// B, C: [T, groups, N]; channel i reads group i / (I / groups) (Mamba-1: one group; Mamba-2's SSD
// decode step runs here as I = H * P channels, each head's decay and step repeated over its P).
// cache: [slots, I, N] contiguous, in S; slots[s] is sequence s's slot (-1: padding, skipped);
// has_init[s] says whether the sequence starts from its slot's state (else from zeros).
template <class T, class S>
static void scan_rows(const T* __restrict x, const float* __restrict delta, const T* __restrict z,
                      const float* __restrict A, const float* __restrict B, const float* __restrict C,
                      const float* __restrict D, S* __restrict cache, const int32_t* __restrict slots,
                      const uint8_t* __restrict has_init, const int32_t* __restrict cu, T* __restrict y,
                      int64_t dim, int64_t n, int64_t groups, int64_t seqs, int threads) {
  const int64_t per_group = dim / groups;
  const int64_t blocks = (dim + kScanBlock - 1) / kScanBlock;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
  for (int64_t s = 0; s < seqs; ++s) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t i0 = blk * kScanBlock;
      const int64_t width = dim - i0 < kScanBlock ? dim - i0 : kScanBlock;
      const int64_t start = cu[s], end = cu[s + 1];
      if (slots[s] < 0) {  // padding sequence: zero outputs, no state
        for (int64_t t = start; t < end; ++t)
          for (int64_t c = 0; c < width; ++c) y[t * dim + i0 + c] = from_f32<T>(0.0f);
        continue;
      }
      S* __restrict slot_state = cache + (static_cast<int64_t>(slots[s]) * dim + i0) * n;  // [width][N]
      alignas(64) float h[kScanBlock * kScanMaxState];
      if (has_init[s])
        for (int64_t k = 0; k < width * n; ++k) h[k] = to_f32(slot_state[k]);
      else
        std::memset(h, 0, sizeof(float) * width * n);
      for (int64_t t = start; t < end; ++t) {
        for (int64_t c = 0; c < width; ++c) {
          const int64_t i = i0 + c;
          const float* __restrict bt = B + (t * groups + i / per_group) * n;
          const float* __restrict ct = C + (t * groups + i / per_group) * n;
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
      for (int64_t k = 0; k < width * n; ++k) slot_state[k] = from_f32<S>(h[k]);
    }
  }
}

}  // namespace dualop

// dtype, state_dtype: 0 float32, 1 bfloat16, 2 float16 (dtype: x, z, y; state_dtype: the cache);
// delta, A, B, C, D float32. Returns 0, -1 for an unknown dtype, -2 for a state wider than the
// kernel holds, -3 for groups that do not divide the channels.
extern "C" int dualop_selective_scan(int dtype, int state_dtype, const void* x, const float* delta, const void* z,
                                     const float* A, const float* B, const float* C, const float* D, void* cache,
                                     const int32_t* slots, const uint8_t* has_init, const int32_t* cu, void* y,
                                     int64_t dim, int64_t n, int64_t groups, int64_t seqs, int threads) {
  using namespace dualop;
  if (n > kScanMaxState) return -2;
  if (groups < 1 || dim % groups) return -3;
  if (dtype < 0 || dtype > 2 || state_dtype < 0 || state_dtype > 2) return -1;
  const auto run = [&](auto x_type, auto state_type) {
    using T = decltype(x_type);
    using S = decltype(state_type);
    scan_rows<T, S>(static_cast<const T*>(x), delta, static_cast<const T*>(z), A, B, C, D, static_cast<S*>(cache),
                    slots, has_init, cu, static_cast<T*>(y), dim, n, groups, seqs, threads);
  };
  const auto with_state = [&](auto x_type) {
    switch (state_dtype) {
      case 0: run(x_type, float{}); break;
      case 1: run(x_type, bf16{}); break;
      default: run(x_type, f16{}); break;
    }
  };
  switch (dtype) {
    case 0: with_state(float{}); break;
    case 1: with_state(bf16{}); break;
    default: with_state(f16{}); break;
  }
  return 0;
}
