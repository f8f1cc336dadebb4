// Hand-vectorised AVX2 pieces for the loops GCC's vectoriser handles poorly: bfloat16 loads and
// stores (16 at a time, in the lane order unpack/pack agree on, so no cross-lane shuffles) and a
// cheaper sigmoid for silu. Only compiled where the host has AVX2 and FMA (-march=native); the
// portable loops in the kernels handle everything else (other CPUs, tails, float16).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#define DUALOP_HAVE_AVX2 1
#include <immintrin.h>

#include <cstdint>

namespace dualop::avx2 {

// 16 bfloat16 -> two float32 vectors: lo holds elements 0-3 and 8-11, hi 4-7 and 12-15 (the order
// of unpacklo/unpackhi within 128-bit lanes; store_bf16 below undoes exactly this order).
inline __attribute__((always_inline)) void load_bf16(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
}

// 16 float32 of a plain array, arranged in load_bf16's order.
inline __attribute__((always_inline)) void load_f32_as_bf16_order(const float* p, __m256& lo, __m256& hi) {
  const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
  lo = _mm256_permute2f128_ps(a, b, 0x20);  // 0-3 | 8-11
  hi = _mm256_permute2f128_ps(a, b, 0x31);  // 4-7 | 12-15
}

// Round float32 to bfloat16 (nearest even; NaN stays a quiet NaN), left in the high 16 bits.
template <bool kMayBeNaN>
inline __attribute__((always_inline)) __m256i round_to_bf16_high(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  if constexpr (kMayBeNaN) {
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                             _mm256_castsi256_ps(_mm256_or_si256(u, _mm256_set1_epi32(0x400000))), nan));
  }
  return r;
}

// What float32 -> bfloat16 -> float32 gives (the cast to the output dtype and back).
template <bool kMayBeNaN>
inline __attribute__((always_inline)) __m256 through_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_and_si256(round_to_bf16_high<kMayBeNaN>(v), _mm256_set1_epi32(int(0xffff0000u))));
}

// Two float32 vectors in load_bf16's order -> 16 bfloat16 in natural order.
template <bool kMayBeNaN>
inline __attribute__((always_inline)) void store_bf16(uint16_t* p, __m256 lo, __m256 hi) {
  const __m256i a = _mm256_srli_epi32(round_to_bf16_high<kMayBeNaN>(lo), 16);
  const __m256i b = _mm256_srli_epi32(round_to_bf16_high<kMayBeNaN>(hi), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_packus_epi32(a, b));
}

// exp(x) for silu's sigmoid: clamped to [-87.3, 88] (so 1 + exp(-g) stays finite and its
// reciprocal is 0 rather than NaN for g < -88), ~2e-7 relative error inside. NaN propagates.
inline __attribute__((always_inline)) __m256 exp_clamped(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));  // NaN kept
  const __m256 shifter = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), shifter), shifter);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  // degree 5, fitted here for relative error on |r| <= ln2/2 (1.2e-7, ~2 ulp): enough for sigmoid
  __m256 p = _mm256_set1_ps(8.333837950e-03f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.189857794e-02f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.666688638e-01f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.999914257e-01f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// silu(g) = g / (1 + exp(-g)), the division as a reciprocal estimate plus one Newton step (~2 ulp).
// g = -inf gives -inf * 0 = NaN, as the native g * sigmoid(g) does.
inline __attribute__((always_inline)) __m256 silu(__m256 g) {
  const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.0f), exp_clamped(_mm256_sub_ps(_mm256_setzero_ps(), g)));
  __m256 r = _mm256_rcp_ps(d);
  r = _mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(2.0f)));
  return _mm256_mul_ps(g, r);
}

// common.h's erf_f32, eight lanes at a time (same fits, same pieces, same special values).
inline __attribute__((always_inline)) __m256 erf(__m256 x) {
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 s = _mm256_mul_ps(a, a);
  __m256 p = _mm256_set1_ps(8.671101280e-05f);
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(-8.210109188e-04f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(5.206660757e-03f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(-2.686154979e-02f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(1.128373236e-01f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(-3.761263602e-01f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(1.283791669e-01f));
  const __m256 small = _mm256_fmadd_ps(a, p, a);
  const __m256 s_err = _mm256_fmsub_ps(a, a, s);
  const __m256 mid = _mm256_cmp_ps(a, _mm256_set1_ps(2.25f), _CMP_LT_OQ);
  const __m256 t = _mm256_blendv_ps(_mm256_mul_ps(_mm256_sub_ps(a, _mm256_set1_ps(3.125f)), _mm256_set1_ps(1.0f / 0.875f)),
                                    _mm256_mul_ps(_mm256_sub_ps(a, _mm256_set1_ps(1.5625f)), _mm256_set1_ps(1.0f / 0.6875f)),
                                    mid);
  static constexpr float kMid[] = {1.006916012e-05f, -4.553677185e-05f, 1.707523025e-04f,
                                   -6.859192242e-04f, 2.652659602e-03f, -9.677651801e-03f,
                                   3.321732900e-02f,  -1.062030445e-01f, 3.116486067e-01f};
  static constexpr float kTail[] = {1.463037968e-06f, -7.129386275e-06f, 3.012932832e-05f,
                                    -1.368658687e-04f, 6.088605831e-04f, -2.623193713e-03f,
                                    1.095855286e-02f,  -4.427671030e-02f, 1.724443519e-01f};
  __m256 q = _mm256_blendv_ps(_mm256_set1_ps(kTail[0]), _mm256_set1_ps(kMid[0]), mid);
#pragma GCC unroll 16
  for (int k = 1; k < 9; ++k)
    q = _mm256_fmadd_ps(q, t, _mm256_blendv_ps(_mm256_set1_ps(kTail[k]), _mm256_set1_ps(kMid[k]), mid));
  // exp(-s) matters only below a = 4 (s < 16; above, erf is 1): no special values to handle
  const __m256 e = exp_clamped(_mm256_sub_ps(_mm256_setzero_ps(), s));
  const __m256 large = _mm256_fnmadd_ps(e, _mm256_mul_ps(q, _mm256_sub_ps(_mm256_set1_ps(1.0f), s_err)),
                                        _mm256_set1_ps(1.0f));
  __m256 y = _mm256_blendv_ps(large, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.875f), _CMP_LT_OQ));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(1.0f), _mm256_cmp_ps(a, _mm256_set1_ps(4.0f), _CMP_GE_OQ));
  y = _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_or_ps(y, sign);
}

// gelu(g) = 0.5 g (1 + erf(g / sqrt 2)), the native formula's order of operations.
inline __attribute__((always_inline)) __m256 gelu(__m256 g) {
  const __m256 e = erf(_mm256_mul_ps(g, _mm256_set1_ps(0.70710678118654752f)));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

inline __attribute__((always_inline)) float sum(__m256 v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

}  // namespace dualop::avx2
#endif
