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

// Polynomials by Estrin's scheme (pairs, then pairs of pairs): the same value as Horner's to within
// rounding, but a dependency chain of log2(degree) steps instead of degree, so more of the loop
// overlaps in the out-of-order window. Coefficients highest degree first.
inline __attribute__((always_inline)) __m256 poly5(__m256 t, __m256 t2, const float (&c)[6]) {
  const __m256 hi = _mm256_fmadd_ps(_mm256_set1_ps(c[0]), t, _mm256_set1_ps(c[1]));
  const __m256 mid = _mm256_fmadd_ps(_mm256_set1_ps(c[2]), t, _mm256_set1_ps(c[3]));
  const __m256 lo = _mm256_fmadd_ps(_mm256_set1_ps(c[4]), t, _mm256_set1_ps(c[5]));
  return _mm256_fmadd_ps(_mm256_fmadd_ps(hi, t2, mid), t2, lo);
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
  static constexpr float kExp[] = {8.333837950e-03f, 4.189857794e-02f, 1.666688638e-01f, 4.999914257e-01f, 1.0f, 1.0f};
  const __m256 p = poly5(r, _mm256_mul_ps(r, r), kExp);
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

// gelu(g) = 0.5 g (1 + erf(g / sqrt 2)), as the native body rounds it: erf(z) = sign(z) (1 - erfc(|z|))
// in float32, then 1 + erf. erfc(a) = exp(-a^2) Q(t), t = 1 / (1 + a/2), with Q a degree-10 fit in t
// made here (relative error 7e-9 on a in [0, 10]; past 10 erfc underflows, so a is clamped there).
// One formula for every a: no branch pieces, no blends. -inf gives NaN and +inf gives inf, as the
// native formula does.
inline __attribute__((always_inline)) __m256 gelu(__m256 g) {
  static constexpr float kQ[] = {4.599197428e-06f, -1.798114012e-05f, -3.355059666e-05f, 2.459425207e-04f,
                                 8.701986243e-05f, -2.923667578e-03f, -1.104542312e-03f, 4.599041399e-02f,
                                 1.954433141e-01f, 4.286347937e-01f,  3.336736544e-01f};
  const __m256 z = _mm256_mul_ps(g, _mm256_set1_ps(0.70710678118654752f));
  const __m256 sign = _mm256_and_ps(z, _mm256_set1_ps(-0.0f));
  const __m256 a = _mm256_min_ps(_mm256_set1_ps(10.0f), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), z));  // NaN kept
  const __m256 d = _mm256_fmadd_ps(a, _mm256_set1_ps(0.5f), _mm256_set1_ps(1.0f));
  __m256 t = _mm256_rcp_ps(d);
  t = _mm256_mul_ps(t, _mm256_fnmadd_ps(d, t, _mm256_set1_ps(2.0f)));
  const __m256 u = _mm256_mul_ps(_mm256_sub_ps(t, _mm256_set1_ps(0.58333333333333333f)), _mm256_set1_ps(2.4f));
  // Q(u) by Estrin: u^8 (c0 u^2 + c1 u + c2) + u^4 (c3 u^3 + c4 u^2 + c5 u + c6) + (c7 u^3 + ... + c10)
  const __m256 u2 = _mm256_mul_ps(u, u);
  const __m256 u4 = _mm256_mul_ps(u2, u2);
  const auto c = [](int k) { return _mm256_set1_ps(kQ[k]); };
  const __m256 q8 = _mm256_fmadd_ps(_mm256_fmadd_ps(c(0), u, c(1)), u, c(2));
  const __m256 q4 = _mm256_fmadd_ps(_mm256_fmadd_ps(c(3), u, c(4)), u2, _mm256_fmadd_ps(c(5), u, c(6)));
  const __m256 q0 = _mm256_fmadd_ps(_mm256_fmadd_ps(c(7), u, c(8)), u2, _mm256_fmadd_ps(c(9), u, c(10)));
  const __m256 q = _mm256_fmadd_ps(_mm256_fmadd_ps(q8, u4, q4), u4, q0);
  const __m256 s = _mm256_mul_ps(a, a);
  const __m256 s_err = _mm256_fmsub_ps(a, a, s);  // a*a = s + s_err exactly; exp(-a^2) ~ exp(-s)(1 - s_err)
  const __m256 e = _mm256_mul_ps(exp_clamped(_mm256_sub_ps(_mm256_setzero_ps(), s)),
                                 _mm256_sub_ps(_mm256_set1_ps(1.0f), s_err));
  const __m256 erf = _mm256_or_ps(_mm256_fnmadd_ps(e, q, _mm256_set1_ps(1.0f)), sign);
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(_mm256_set1_ps(1.0f), erf));
}

inline __attribute__((always_inline)) float sum(__m256 v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

}  // namespace dualop::avx2
#endif
