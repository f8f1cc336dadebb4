// Rotary embedding on the CPU: query and key in one pass (OpenMP over tokens). Semantics are
// dualop.kernels.rope_math.rotate: per token, per head, the first rotary_dim channels rotate in
// pairs (neox: i with i + rotary_dim/2; GPT-J: 2i with 2i+1) by that token's cos/sin, in float32
// with one cast back; the remaining channels are copied. cos/sin rows are [half] floats of the
// token's row (token t uses row t % cos_rows: a batch of sequences sharing one table).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <omp.h>

#include "avx512.h"
#include "common.h"

namespace dualop {

#ifdef DUALOP_HAVE_AVX512
using avx512::Lanes;
#endif

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

// range(begin, end) over [0, tokens) split evenly across `threads` OpenMP threads (no OpenMP region
// for one thread).
template <class F>
static void split_tokens(int64_t tokens, int threads, const F& range) {
  threads = dualop_team_size(threads);
  if (threads <= 1 || tokens < 2) return range(0, tokens);
#pragma omp parallel num_threads(threads)  // the team asked for above
  {
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    range(tokens * me / team, tokens * (me + 1) / team);
  }
}

#ifdef DUALOP_HAVE_AVX512
// AVX-512 heads. A token's cos/sin are laid out once (Angles) in the order the steps read them;
// each step loads what it rotates whole before it stores (so out may be in), in float32, and rounds
// once. neox: a step is 32 pairs (i, i + half), x1 and x2 as avx512::Lanes; GPT-J, bfloat16: 32
// channels (16 pairs 2i, 2i + 1), whose even/odd Lanes are exactly x1 and x2; GPT-J, float32 and
// float16: 16 channels, out = x * (c, c) + swap(x) * (-s, s) per pair.
constexpr int64_t kMaxHalf = 1024;  // the entry points refuse rotary_dim / 2 above it

struct alignas(64) Angles {
  float c[2 * kMaxHalf + 32], s[2 * kMaxHalf + 32];

  // Whether every value laid out for a bfloat16 head is finite (x * 0 is 0 for finite x, NaN
  // otherwise; the padding is 0).
  bool finite_for_bf16(int64_t half, bool neox) const {
    const int64_t n = neox ? (half + 31) / 32 * 32 : (half + 15) / 16 * 16;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16)
      acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_add_ps(_mm512_load_ps(c + i), _mm512_load_ps(s + i)),
                                             _mm512_setzero_ps()));
    return _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q) == 0;
  }
};

// 16 values of a cos or sin row (the first n; the rest 0) as float32.
template <class C>
DUALOP_INLINE __m512 load_angles16(const C* p, int64_t n) {
  const __mmask16 m = avx512::first16(n);
  if constexpr (std::is_same_v<C, float>) return _mm512_maskz_loadu_ps(m, p);
  if constexpr (std::is_same_v<C, f16>) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  if constexpr (std::is_same_v<C, bf16>)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// One of a token's rows (half values of type C) laid out for heads of T.
template <class T, class C>
DUALOP_INLINE void lay_out_row(const C* row, int64_t half, bool neox, bool negate_even, float* out) {
  if (neox && Lanes<T>::kEvenOdd) {  // per step of 32: the even ones, then the odd ones
    for (int64_t i = 0; i < half; i += 32) {
      const __m512 lo = load_angles16(row + i, half - i), hi = load_angles16(row + i + 16, half - i - 16);
      _mm512_store_ps(out + i, _mm512_permutex2var_ps(lo, avx512::even_index(), hi));
      _mm512_store_ps(out + i + 16, _mm512_permutex2var_ps(lo, avx512::odd_index(), hi));
    }
  } else if (neox || Lanes<T>::kEvenOdd) {  // plain order
    for (int64_t i = 0; i < half; i += 16) _mm512_store_ps(out + i, load_angles16(row + i, half - i));
  } else {  // GPT-J in natural order: each value twice, the first negated for sin: (c, c), (-s, s)
    const __m512 sign = negate_even ? _mm512_castsi512_ps(_mm512_set1_epi64(0x80000000ll)) : _mm512_setzero_ps();
    const __m512i first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i second = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    for (int64_t i = 0; i < half; i += 16) {
      const __m512 v = load_angles16(row + i, half - i);
      _mm512_store_ps(out + 2 * i, _mm512_xor_ps(_mm512_permutexvar_ps(first, v), sign));
      _mm512_store_ps(out + 2 * i + 16, _mm512_xor_ps(_mm512_permutexvar_ps(second, v), sign));
    }
  }
}

// Fill angles from a token's cos and sin rows (half values each, element type C) for heads of T.
template <class T, class C>
DUALOP_INLINE void lay_out_angles(const C* cos_row, const C* sin_row, int64_t half, bool neox, Angles& a) {
  lay_out_row<T>(cos_row, half, neox, false, a.c);
  lay_out_row<T>(sin_row, half, neox, true, a.s);
}

// x1 * c - x2 * s and x2 * c + x1 * s, as the portable loop's contraction gives them.
DUALOP_INLINE void rotate_pair(__m512& x1, __m512& x2, __m512 c, __m512 s) {
  const __m512 y1 = _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s));
  const __m512 y2 = _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s));
  x1 = y1;
  x2 = y2;
}

template <class T, bool kMayBeNaN, bool kPartial>
DUALOP_INLINE void neox_step(const T* in, T* out, const Angles& a, int64_t half, int64_t i, int64_t n) {
  using L = Lanes<T>;
  __m512 x1a, x1b, x2a, x2b;
  if constexpr (kPartial) {
    L::load(in + i, x1a, x1b, n);
    L::load(in + half + i, x2a, x2b, n);
  } else {
    L::load(in + i, x1a, x1b);
    L::load(in + half + i, x2a, x2b);
  }
  rotate_pair(x1a, x2a, _mm512_load_ps(a.c + i), _mm512_load_ps(a.s + i));
  rotate_pair(x1b, x2b, _mm512_load_ps(a.c + i + 16), _mm512_load_ps(a.s + i + 16));
  if constexpr (kPartial) {
    L::template store<kMayBeNaN>(out + i, x1a, x1b, n);
    L::template store<kMayBeNaN>(out + half + i, x2a, x2b, n);
  } else {
    L::template store<kMayBeNaN>(out + i, x1a, x1b);
    L::template store<kMayBeNaN>(out + half + i, x2a, x2b);
  }
}

template <bool kMayBeNaN, bool kPartial>
DUALOP_INLINE void gptj_step_bf16(const bf16* in, bf16* out, const Angles& a, int64_t i, int64_t n) {
  __m512 x1, x2;  // even and odd channels of 32: 16 pairs
  if constexpr (kPartial) avx512::load_bf16(in + i, x1, x2, avx512::first32(n)); else avx512::load_bf16(in + i, x1, x2);
  rotate_pair(x1, x2, _mm512_loadu_ps(a.c + i / 2), _mm512_loadu_ps(a.s + i / 2));
  if constexpr (kPartial)
    avx512::store_bf16<kMayBeNaN>(out + i, x1, x2, avx512::first32(n));
  else
    avx512::store_bf16<kMayBeNaN>(out + i, x1, x2);
}

// 16 channels of float32 / float16 (8 pairs), natural order.
template <class T>
DUALOP_INLINE void gptj_step_16(const T* in, T* out, const Angles& a, int64_t i, int64_t n) {
  const __mmask16 m = avx512::first16(n);
  __m512 x;
  if constexpr (std::is_same_v<T, float>)
    x = _mm512_maskz_loadu_ps(m, in + i);
  else
    x = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, in + i));
  const __m512 swapped = _mm512_permute_ps(x, 0xb1);  // (x2, x1) of each pair
  // (x1 c - x2 s, x2 c + x1 s): the product with c rounded, the one with s fused
  const __m512 y = _mm512_fmadd_ps(swapped, _mm512_load_ps(a.s + i), _mm512_mul_ps(x, _mm512_load_ps(a.c + i)));
  if constexpr (std::is_same_v<T, float>)
    _mm512_mask_storeu_ps(out + i, m, y);
  else
    _mm256_mask_storeu_epi16(out + i, m, _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// One head. bfloat16's rounding needs its NaN rule only where the angles hold a NaN or infinity
// (finite_angles false): a NaN of a bfloat16 input widens to a float32 NaN whose low 16 bits are 0,
// and arithmetic passes on an input NaN (quieted, which sets bit 22) or makes the default NaN
// (0xffc00000), so with finite angles every NaN reaching the rounding has its low 16 bits 0, where
// the rounding's carry never reaches the exponent: NaN stays NaN (infinities round correctly).
template <class T, bool kMayBeNaN>
DUALOP_INLINE void rotate_channels_avx512(const T* in, T* out, const Angles& a, int64_t half, bool neox) {
  if (neox) {
    int64_t i = 0;
    for (; i + 32 <= half; i += 32) neox_step<T, kMayBeNaN, false>(in, out, a, half, i, 32);
    if (i < half) neox_step<T, kMayBeNaN, true>(in, out, a, half, i, half - i);
  } else if constexpr (std::is_same_v<T, bf16>) {
    int64_t i = 0;
    for (; i + 32 <= 2 * half; i += 32) gptj_step_bf16<kMayBeNaN, false>(in, out, a, i, 32);
    if (i < 2 * half) gptj_step_bf16<kMayBeNaN, true>(in, out, a, i, 2 * half - i);
  } else {
    for (int64_t i = 0; i < 2 * half; i += 16) gptj_step_16<T>(in, out, a, i, 2 * half - i);
  }
}

template <class T>
DUALOP_INLINE void rotate_head_avx512(const T* in, T* out, const Angles& a, int64_t head_size, int64_t half,
                                      bool neox, bool finite_angles) {
  if (std::is_same_v<T, bf16> && finite_angles)
    rotate_channels_avx512<T, false>(in, out, a, half, neox);
  else
    rotate_channels_avx512<T, true>(in, out, a, half, neox);
  const int64_t rotary = 2 * half;
  if (rotary < head_size && out != in) std::memcpy(out + rotary, in + rotary, (head_size - rotary) * sizeof(T));
}

// neox heads whose rotated half is kSteps whole steps (half = 32 kSteps: rotary_dim 64 or 128):
// the token's angles stay in registers for all of them (the NaN rule as rotate_head_avx512's).
template <class T, int kSteps>
static void neox_heads(const T* in, T* out, int64_t heads, int64_t head_size, const Angles& a, bool finite_angles) {
  using L = Lanes<T>;
  constexpr int64_t half = 32 * kSteps;
  __m512 c[kSteps][2], s[kSteps][2];
  for (int k = 0; k < kSteps; ++k)
    for (int j = 0; j < 2; ++j) {
      c[k][j] = _mm512_load_ps(a.c + 32 * k + 16 * j);
      s[k][j] = _mm512_load_ps(a.s + 32 * k + 16 * j);
    }
  for (int64_t h = 0; h < heads; ++h) {
    const T* hi = in + h * head_size;
    T* ho = out + h * head_size;
    __m512 x1[kSteps][2], x2[kSteps][2];
    for (int k = 0; k < kSteps; ++k) {
      L::load(hi + 32 * k, x1[k][0], x1[k][1]);
      L::load(hi + half + 32 * k, x2[k][0], x2[k][1]);
    }
    for (int k = 0; k < kSteps; ++k)
      for (int j = 0; j < 2; ++j) rotate_pair(x1[k][j], x2[k][j], c[k][j], s[k][j]);
    if (!std::is_same_v<T, bf16> || finite_angles) {
      for (int k = 0; k < kSteps; ++k) {
        L::template store<false>(ho + 32 * k, x1[k][0], x1[k][1]);
        L::template store<false>(ho + half + 32 * k, x2[k][0], x2[k][1]);
      }
    } else {
      for (int k = 0; k < kSteps; ++k) {
        L::template store<true>(ho + 32 * k, x1[k][0], x1[k][1]);
        L::template store<true>(ho + half + 32 * k, x2[k][0], x2[k][1]);
      }
    }
    if (2 * half < head_size && ho != hi) std::memcpy(ho + 2 * half, hi + 2 * half, (head_size - 2 * half) * sizeof(T));
  }
}

// heads consecutive heads of one token.
template <class T>
DUALOP_INLINE void rotate_heads_avx512(const T* in, T* out, int64_t heads, const Angles& a, int64_t head_size,
                                       int64_t half, bool neox, bool finite_angles) {
  if (neox && half == 64) return neox_heads<T, 2>(in, out, heads, head_size, a, finite_angles);
  if (neox && half == 32) return neox_heads<T, 1>(in, out, heads, head_size, a, finite_angles);
  for (int64_t h = 0; h < heads; ++h)
    rotate_head_avx512(in + h * head_size, out + h * head_size, a, head_size, half, neox, finite_angles);
}

// Every head of one token.
template <class T>
DUALOP_INLINE void rotate_token_avx512(const T* q, const T* k, T* q_out, T* k_out, int64_t t, const Angles& a,
                                       int64_t q_heads, int64_t k_heads, int64_t head_size, int64_t half, bool neox) {
  const int64_t qw = q_heads * head_size, kw = k_heads * head_size;
  bool finite_angles = true;
  if constexpr (std::is_same_v<T, bf16>) finite_angles = a.finite_for_bf16(half, neox);
  rotate_heads_avx512(q + t * qw, q_out + t * qw, q_heads, a, head_size, half, neox, finite_angles);
  if (k != nullptr) rotate_heads_avx512(k + t * kw, k_out + t * kw, k_heads, a, head_size, half, neox, finite_angles);
}
#endif

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
  const auto row_of = [&](int64_t t) {
    const int64_t row = static_cast<int64_t>(positions[t]);
    return cache + (row < 0 ? 0 : (row >= cache_rows ? cache_rows - 1 : row)) * cache_stride;
  };
#ifdef DUALOP_HAVE_AVX512
  // Tokens [begin, end), the cache row two tokens ahead prefetched (positions are anyone's: rows
  // come from anywhere in the cache).
  const auto range = [&](int64_t begin, int64_t end) {
    Angles angles;
    for (int64_t t = begin; t < end; ++t) {
      if (t + 2 < end) {
        const char* ahead = reinterpret_cast<const char*>(row_of(t + 2));
        for (int64_t b = 0; b < 2 * half * static_cast<int64_t>(sizeof(C)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
      }
      const C* base = row_of(t);
      lay_out_angles<T>(base, base + half, half, neox, angles);
      rotate_token_avx512(q, k, q_out, k_out, t, angles, q_heads, k_heads, head_size, half, neox);
    }
  };
  split_tokens(tokens, threads, range);
#else
#pragma omp parallel num_threads(dualop_team_size(threads))
  {
    float c[1024], s[1024];  // half <= 1024 (checked by the caller)
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const C* base = row_of(t);
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        c[i] = to_f32(base[i]);
        s[i] = to_f32(base[half + i]);
      }
      rotate_token(q, k, q_out, k_out, t, c, s, q_heads, k_heads, head_size, half, neox);
    }
  }
#endif
}

template <class T>
static void rotary_tokens(int cos_dtype, const T* q, const T* k, const void* cos, const void* sin, T* q_out,
                          T* k_out, int64_t tokens, int64_t cos_rows, int64_t cos_stride, int64_t q_heads,
                          int64_t k_heads, int64_t head_size, int64_t half, bool neox, int threads) {
#ifdef DUALOP_HAVE_AVX512
  const auto range = [&](int64_t begin, int64_t end) {
    Angles angles;
    for (int64_t t = begin; t < end; ++t) {
      // a row shared by consecutive tokens (cos_rows == 1: one angle for all) is laid out once
      const int64_t row = t % cos_rows;
      if (t == begin || cos_rows > 1) {
        switch (cos_dtype) {
#define DUALOP_ANGLES(code, C)                                                                                    \
  case code:                                                                                                      \
    lay_out_angles<T>(static_cast<const C*>(cos) + row * cos_stride, static_cast<const C*>(sin) + row * cos_stride, \
                      half, neox, angles);                                                                        \
    break;
          DUALOP_ANGLES(0, float)
          DUALOP_ANGLES(1, bf16)
          DUALOP_ANGLES(2, f16)
#undef DUALOP_ANGLES
        }
      }
      rotate_token_avx512(q, k, q_out, k_out, t, angles, q_heads, k_heads, head_size, half, neox);
    }
  };
  split_tokens(tokens, threads, range);
#else
#pragma omp parallel num_threads(dualop_team_size(threads))
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
#endif
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
