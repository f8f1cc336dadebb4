// Rotary embedding on the CPU: query and key in one pass (OpenMP over tokens). Semantics are
// dualop.kernels.rope_math.rotate: per token, per head, the first rotary_dim channels rotate in
// pairs (neox: i with i + rotary_dim/2; GPT-J: 2i with 2i+1) by that token's cos/sin, in float32
// with one cast back; the remaining channels are copied. cos/sin rows are [half] floats of the
// token's row (token t uses row t % cos_rows: a batch of sequences sharing one table).
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace dualop {

template <class C>
static void load_row(const void* base, int64_t row, int64_t stride, int64_t half, float* out) {
  const C* p = static_cast<const C*>(base) + row * stride;
  for (int64_t i = 0; i < half; ++i) out[i] = to_f32(p[i]);
}

// One head: in -> out (both head_size long). out may be in (in place): each step reads the pair it
// writes before writing it, so neither pointer is restrict.
template <class T>
DUALOP_INLINE void rotate_head(const T* in, T* out, const float* __restrict c, const float* __restrict s,
                               int64_t head_size, int64_t half, bool neox) {
  if (neox) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_f32(in[i]), x2 = to_f32(in[i + half]);
      out[i] = from_f32<T>(x1 * c[i] - x2 * s[i]);
      out[i + half] = from_f32<T>(x2 * c[i] + x1 * s[i]);
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_f32(in[2 * i]), x2 = to_f32(in[2 * i + 1]);
      out[2 * i] = from_f32<T>(x1 * c[i] - x2 * s[i]);
      out[2 * i + 1] = from_f32<T>(x2 * c[i] + x1 * s[i]);
    }
  }
  const int64_t rotary = 2 * half;
  if (rotary < head_size && out != in) std::memcpy(out + rotary, in + rotary, (head_size - rotary) * sizeof(T));
}

// Every head of one token by that token's cos/sin.
template <class T>
DUALOP_INLINE void rotate_token(const T* q, const T* k, T* q_out, T* k_out, int64_t t, const float* c, const float* s,
                                int64_t q_heads, int64_t k_heads, int64_t head_size, int64_t half, bool neox) {
  const int64_t qw = q_heads * head_size, kw = k_heads * head_size;
  for (int64_t h = 0; h < q_heads; ++h)
    rotate_head(q + t * qw + h * head_size, q_out + t * qw + h * head_size, c, s, head_size, half, neox);
  if (k != nullptr)
    for (int64_t h = 0; h < k_heads; ++h)
      rotate_head(k + t * kw + h * head_size, k_out + t * kw + h * head_size, c, s, head_size, half, neox);
}

// The engine's rope: token t takes row positions[t] of the cache (cos half, then sin half), which
// the caller has checked lies in [0, cache_rows) (clamped here all the same, so nothing reads out of
// bounds).
template <class T, class C, class P>
static void rotary_by_position(const P* positions, const C* cache, int64_t cache_rows, int64_t cache_stride,
                               const T* q, const T* k, T* q_out, T* k_out, int64_t tokens, int64_t q_heads,
                               int64_t k_heads, int64_t head_size, int64_t half, bool neox, int threads) {
#pragma omp parallel num_threads(threads)
  {
    float c[1024], s[1024];  // half <= 1024 (checked by the caller)
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      int64_t row = static_cast<int64_t>(positions[t]);
      row = row < 0 ? 0 : (row >= cache_rows ? cache_rows - 1 : row);
      const C* base = cache + row * cache_stride;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        c[i] = to_f32(base[i]);
        s[i] = to_f32(base[half + i]);
      }
      rotate_token(q, k, q_out, k_out, t, c, s, q_heads, k_heads, head_size, half, neox);
    }
  }
}

template <class T>
static void rotary_tokens(int cos_dtype, const T* q, const T* k, const void* cos, const void* sin, T* q_out,
                          T* k_out, int64_t tokens, int64_t cos_rows, int64_t cos_stride, int64_t q_heads,
                          int64_t k_heads, int64_t head_size, int64_t half, bool neox, int threads) {
#pragma omp parallel num_threads(threads)
  {
    float c[1024], s[1024];  // half <= 1024 (checked by the caller)
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t row = t % cos_rows;
      switch (cos_dtype) {
        case 0: load_row<float>(cos, row, cos_stride, half, c); load_row<float>(sin, row, cos_stride, half, s); break;
        case 1: load_row<bf16>(cos, row, cos_stride, half, c); load_row<bf16>(sin, row, cos_stride, half, s); break;
        default: load_row<f16>(cos, row, cos_stride, half, c); load_row<f16>(sin, row, cos_stride, half, s); break;
      }
      rotate_token(q, k, q_out, k_out, t, c, s, q_heads, k_heads, head_size, half, neox);
    }
  }
}

// q, q_out row-major [tokens, q_heads, head_size] of one float dtype; k, k_out the same with k_heads
// (or both absent).
static bool query_and_key_agree(const DualopArray* q, const DualopArray* k, const DualopArray* q_out,
                                const DualopArray* k_out) {
  if (!q || q->ndim != 3 || !is_row_major(q) || !is_dense_like(q_out, q)) return false;
  if (k == nullptr) return k_out == nullptr;
  return is_dense(k, q->dtype, 3) && k->shape[0] == q->shape[0] && k->shape[2] == q->shape[2] &&
         is_dense_like(k_out, k);
}

}  // namespace dualop

// q, q_out row-major [tokens, q_heads, head_size] of one float dtype; k, k_out the same with k_heads
// (or both absent). cos, sin: [cos_rows, >= rotary_dim / 2] of one float dtype (any of the three),
// unit last stride and one row stride. Returns 0, -1 for an unknown dtype, -2 for
// rotary_dim / 2 > 1024, kBadArrays for arrays that disagree.
extern "C" int dualop_rotary(const DualopArray* q, const DualopArray* k, const DualopArray* cos,
                             const DualopArray* sin, const DualopArray* q_out, const DualopArray* k_out,
                             int64_t rotary_dim, int is_neox, int threads) {
  using namespace dualop;
  const int64_t half = rotary_dim / 2;
  if (half > 1024) return -2;
  if (!query_and_key_agree(q, k, q_out, k_out)) return kBadArrays;
  const int64_t tokens = q->shape[0], q_heads = q->shape[1], head_size = q->shape[2];
  const int64_t k_heads = k ? k->shape[1] : 0;
  if (!cos || !sin || cos->ndim != 2 || sin->ndim != 2 || sin->dtype != cos->dtype || sin->shape[0] != cos->shape[0] ||
      sin->shape[1] != cos->shape[1] || cos->shape[1] < half || cos->shape[0] < 1)
    return kBadArrays;
  const int64_t cos_rows = cos->shape[0];
  // one row: its stride is never used to step (row t % 1 == 0), whatever the view says
  const int64_t cos_stride = cos_rows > 1 ? cos->strides[0] : cos->shape[1];
  if (half > 1 && (cos->strides[1] != 1 || sin->strides[1] != 1)) return kBadArrays;
  if (cos_rows > 1 && sin->strides[0] != cos_stride) return kBadArrays;
  const int cos_dtype = cos->dtype;
  if (cos_dtype < 0 || cos_dtype > 2) return -1;
  switch (q->dtype) {
#define DUALOP_ROTARY_CASE(code, T)                                                                            \
  case code:                                                                                                   \
    rotary_tokens<T>(cos_dtype, static_cast<const T*>(q->data), static_cast<const T*>(data_of(k)), cos->data,  \
                     sin->data, static_cast<T*>(q_out->data), static_cast<T*>(data_of(k_out)), tokens,         \
                     cos_rows, cos_stride, q_heads, k_heads, head_size, half, is_neox != 0, threads);          \
    return 0;
    DUALOP_ROTARY_CASE(dtype_code::float32, float)
    DUALOP_ROTARY_CASE(dtype_code::bfloat16, bf16)
    DUALOP_ROTARY_CASE(dtype_code::float16, f16)
#undef DUALOP_ROTARY_CASE
    default: return -1;
  }
}

// The engine's rope, cos/sin gathered in the kernel: positions int32 or int64 [tokens]; q, q_out
// (k, k_out, or both absent) as dualop_rotary's, where q_out may be q and k_out k (in place);
// cos_sin_cache [cache_rows, >= rotary_dim] of q's dtype, unit last stride, a row the cos half then
// the sin half. Returns 0, -1 for an unknown dtype, -2 for rotary_dim / 2 > 1024, kBadArrays for
// arrays that disagree.
extern "C" int dualop_rotary_by_position(const DualopArray* positions, const DualopArray* q, const DualopArray* k,
                                         const DualopArray* cos_sin_cache, const DualopArray* q_out,
                                         const DualopArray* k_out, int64_t rotary_dim, int is_neox, int threads) {
  using namespace dualop;
  const int64_t half = rotary_dim / 2;
  if (half > 1024) return -2;
  if (!query_and_key_agree(q, k, q_out, k_out)) return kBadArrays;
  const int64_t tokens = q->shape[0], q_heads = q->shape[1], head_size = q->shape[2];
  if (!positions || positions->ndim != 1 || positions->shape[0] != tokens || !is_row_major(positions) ||
      (positions->dtype != dtype_code::int32 && positions->dtype != dtype_code::int64))
    return kBadArrays;
  const DualopArray* cache = cos_sin_cache;
  if (!cache || cache->ndim != 2 || cache->dtype != q->dtype || cache->shape[0] < 1 || cache->shape[1] < 2 * half ||
      (half > 0 && cache->strides[1] != 1) || 2 * half > head_size)
    return kBadArrays;
  const int64_t k_heads = k ? k->shape[1] : 0, rows = cache->shape[0], stride = cache->strides[0];
#define DUALOP_BY_POSITION(T, P)                                                                                  \
  rotary_by_position<T, T, P>(static_cast<const P*>(positions->data), static_cast<const T*>(cache->data), rows,   \
                              stride, static_cast<const T*>(q->data), static_cast<const T*>(data_of(k)),          \
                              static_cast<T*>(q_out->data), static_cast<T*>(data_of(k_out)), tokens, q_heads,     \
                              k_heads, head_size, half, is_neox != 0, threads);                                   \
  return 0;
#define DUALOP_BY_INDEX(T)                                                   \
  if (positions->dtype == dtype_code::int32) { DUALOP_BY_POSITION(T, int32_t) } \
  DUALOP_BY_POSITION(T, int64_t)
  switch (q->dtype) {
    case dtype_code::float32: DUALOP_BY_INDEX(float)
    case dtype_code::bfloat16: DUALOP_BY_INDEX(bf16)
    case dtype_code::float16: DUALOP_BY_INDEX(f16)
    default: return -1;
  }
#undef DUALOP_BY_INDEX
#undef DUALOP_BY_POSITION
}
