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
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(dualop_team_size(threads))
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

// x, y, and z (or absent): row-major [tokens, dim] of one float dtype; delta float32 [tokens, dim];
// A float32 [dim, n]; B, C float32 [tokens, n] or [tokens, groups, n]; D float32 [dim] or absent;
// cache [slots, dim, n] in any float dtype, updated in place; cu int32 [seqs + 1]; slots int32 and
// has_init uint8, one per sequence. Returns 0, -1 for an unknown dtype, -2 for a state wider than
// the kernel holds, -3 for groups that do not divide the channels, kBadArrays for arrays that
// disagree.
extern "C" int dualop_selective_scan(const DualopArray* x, const DualopArray* delta, const DualopArray* z,
                                     const DualopArray* A, const DualopArray* B, const DualopArray* C,
                                     const DualopArray* D, const DualopArray* cache, const DualopArray* slots,
                                     const DualopArray* has_init, const DualopArray* cu, const DualopArray* y,
                                     int threads) {
  using namespace dualop;
  if (!x || x->ndim != 2 || !is_row_major(x) || !is_dense_like(y, x) || (z && !is_dense_like(z, x))) return kBadArrays;
  const int64_t tokens = x->shape[0], dim = x->shape[1];
  if (!is_dense(delta, dtype_code::float32, 2) || delta->shape[0] != tokens || delta->shape[1] != dim) return kBadArrays;
  if (!is_dense(A, dtype_code::float32, 2) || A->shape[0] != dim) return kBadArrays;
  const int64_t n = A->shape[1];
  if (!B || (B->ndim != 2 && B->ndim != 3) || !is_dense(B, dtype_code::float32, B->ndim) || !is_dense_like(C, B) ||
      B->shape[0] != tokens || B->shape[B->ndim - 1] != n)
    return kBadArrays;
  const int64_t groups = B->ndim == 2 ? 1 : B->shape[1];
  if (!is_absent_or_dense(D, dtype_code::float32, 1) || (D && D->shape[0] != dim)) return kBadArrays;
  if (!cache || cache->ndim != 3 || !is_row_major(cache) || cache->shape[1] != dim || cache->shape[2] != n)
    return kBadArrays;
  if (!is_dense(cu, dtype_code::int32, 1) || cu->shape[0] < 1) return kBadArrays;
  const int64_t seqs = cu->shape[0] - 1;
  if (!is_dense(slots, dtype_code::int32, 1) || slots->shape[0] < seqs || !is_dense(has_init, dtype_code::uint8, 1) ||
      has_init->shape[0] < seqs)
    return kBadArrays;
  if (n > kScanMaxState) return -2;
  if (groups < 1 || dim % groups) return -3;
  const int32_t dtype = x->dtype, state_dtype = cache->dtype;
  if (dtype < 0 || dtype > 2 || state_dtype < 0 || state_dtype > 2) return -1;
  const auto run = [&](auto x_type, auto state_type) {
    using T = decltype(x_type);
    using S = decltype(state_type);
    scan_rows<T, S>(static_cast<const T*>(x->data), static_cast<const float*>(delta->data),
                    static_cast<const T*>(data_of(z)), static_cast<const float*>(A->data),
                    static_cast<const float*>(B->data), static_cast<const float*>(C->data),
                    static_cast<const float*>(data_of(D)), static_cast<S*>(cache->data),
                    static_cast<const int32_t*>(slots->data), static_cast<const uint8_t*>(has_init->data),
                    static_cast<const int32_t*>(cu->data), static_cast<T*>(y->data), dim, n, groups, seqs, threads);
  };
  const auto with_state = [&](auto x_type) {
    switch (state_dtype) {
      case dtype_code::float32: run(x_type, float{}); break;
      case dtype_code::bfloat16: run(x_type, bf16{}); break;
      default: run(x_type, f16{}); break;
    }
  };
  switch (dtype) {
    case dtype_code::float32: with_state(float{}); break;
    case dtype_code::bfloat16: with_state(bf16{}); break;
    default: with_state(f16{}); break;
  }
  return 0;
}
