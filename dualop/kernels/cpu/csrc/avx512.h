// Hand-vectorised AVX-512 (F + BW) pieces for the row kernels: bfloat16 read 32 at a time into two
// float32 vectors without any cross-lane shuffle ("even/odd order": one vector holds elements
// 0, 2, 4, ..., 30, the other 1, 3, ..., 31, which is simply the low and the high half of each
// 32-bit lane), and written back the same way. Rounding is torch's, done on the integers (nearest
// even, NaN stays a quiet NaN, denormals kept): not vcvtneps2bf16, which flushes denormals. Only
// compiled where the host has AVX-512 F and BW (-march=native); the AVX2 and portable loops in the
// kernels handle everything else.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define DUALOP_HAVE_AVX512 1
#include <immintrin.h>

#include <cstdint>

#include "common.h"

namespace dualop::avx512 {

#define DUALOP_AVX512_INLINE inline __attribute__((always_inline))

// The mask of the first n of 32 (16-bit) or 16 (32-bit) lanes, n clamped to the width.
DUALOP_AVX512_INLINE __mmask32 first32(int64_t n) { return n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1; }
DUALOP_AVX512_INLINE __mmask16 first16(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n < 0 ? 0 : n)) - 1);
}

// 32 bfloat16 bits (one vector) -> even elements (0, 2, ..., 30) and odd elements (1, 3, ..., 31).
DUALOP_AVX512_INLINE void unpack_bf16(__m512i raw, __m512& even, __m512& odd) {
  even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(int(0xffff0000u))));
}

DUALOP_AVX512_INLINE void load_bf16(const uint16_t* p, __m512& even, __m512& odd) {
  unpack_bf16(_mm512_loadu_si512(p), even, odd);
}

// The first n (< 32) of 32 bfloat16; the lanes past n read as 0.0 (and are not touched in memory).
DUALOP_AVX512_INLINE void load_bf16(const uint16_t* p, __m512& even, __m512& odd, __mmask32 m) {
  unpack_bf16(_mm512_maskz_loadu_epi16(m, p), even, odd);
}

// 16 bfloat16 in natural order -> 16 float32.
DUALOP_AVX512_INLINE __m512 load_bf16_16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
DUALOP_AVX512_INLINE __m512 load_bf16_16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// Round float32 to bfloat16 (nearest even; NaN becomes its quiet NaN, as torch), the result in the
// high 16 bits of each lane (the low 16 bits are garbage). Without kMayBeNaN the caller knows v has
// no NaN (infinities and denormals round correctly either way).
template <bool kMayBeNaN>
DUALOP_AVX512_INLINE __m512i round_to_bf16_high(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __mmask16 odd = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x10000));  // the kept part's last bit
  __m512i r = _mm512_add_epi32(u, _mm512_set1_epi32(0x7fff));
  r = _mm512_mask_add_epi32(r, odd, r, _mm512_set1_epi32(1));
  if constexpr (kMayBeNaN) {
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
  }
  return r;
}

// What float32 -> bfloat16 -> float32 gives (the cast to the output dtype and back).
template <bool kMayBeNaN>
DUALOP_AVX512_INLINE __m512 through_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_and_si512(round_to_bf16_high<kMayBeNaN>(v), _mm512_set1_epi32(int(0xffff0000u))));
}

// Even and odd elements (load_bf16's order) rounded -> 32 bfloat16 bits in natural order.
template <bool kMayBeNaN>
DUALOP_AVX512_INLINE __m512i pack_bf16(__m512 even, __m512 odd) {
  // one two-table permute takes the high 16 bits of each lane: 16-bit lane 2j from even's lane j,
  // 2j + 1 from odd's (cheaper than shifting one and blending)
  const __m512i index = _mm512_add_epi16(_mm512_set1_epi32(int(((32u + 1u) << 16) | 1u)),
                                         _mm512_setr_epi32(0, 2 << 16 | 2, 4 << 16 | 4, 6 << 16 | 6, 8 << 16 | 8,
                                                           10 << 16 | 10, 12 << 16 | 12, 14 << 16 | 14, 16 << 16 | 16,
                                                           18 << 16 | 18, 20 << 16 | 20, 22 << 16 | 22, 24 << 16 | 24,
                                                           26 << 16 | 26, 28 << 16 | 28, 30 << 16 | 30));
  return _mm512_permutex2var_epi16(round_to_bf16_high<kMayBeNaN>(even), index, round_to_bf16_high<kMayBeNaN>(odd));
}

template <bool kMayBeNaN>
DUALOP_AVX512_INLINE void store_bf16(uint16_t* p, __m512 even, __m512 odd) {
  _mm512_storeu_si512(p, pack_bf16<kMayBeNaN>(even, odd));
}
template <bool kMayBeNaN>
DUALOP_AVX512_INLINE void store_bf16(uint16_t* p, __m512 even, __m512 odd, __mmask32 m) {
  _mm512_mask_storeu_epi16(p, m, pack_bf16<kMayBeNaN>(even, odd));
}

// 16 float32 rounded -> 16 bfloat16 in natural order.
template <bool kMayBeNaN>
DUALOP_AVX512_INLINE __m256i pack_bf16_16(__m512 v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_to_bf16_high<kMayBeNaN>(v), 16));
}

// Permutation indices of two float32 vectors a (elements 0-15) and b (16-31): the even elements
// and the odd ones (load_bf16's order for 32 float32).
DUALOP_AVX512_INLINE __m512i even_index() {
  return _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
}
DUALOP_AVX512_INLINE __m512i odd_index() {
  return _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// 32 float32 of a plain array in load_bf16's order (the first n only, the rest 0, for n < 32).
DUALOP_AVX512_INLINE void load_f32_even_odd(const float* p, __m512& even, __m512& odd) {
  const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
  even = _mm512_permutex2var_ps(a, even_index(), b);
  odd = _mm512_permutex2var_ps(a, odd_index(), b);
}
DUALOP_AVX512_INLINE void load_f32_even_odd(const float* p, __m512& even, __m512& odd, int64_t n) {
  const __m512 a = _mm512_maskz_loadu_ps(first16(n), p), b = _mm512_maskz_loadu_ps(first16(n - 16), p + 16);
  even = _mm512_permutex2var_ps(a, even_index(), b);
  odd = _mm512_permutex2var_ps(a, odd_index(), b);
}

DUALOP_AVX512_INLINE float sum(__m512 v) { return _mm512_reduce_add_ps(v); }

// A step of 32 elements of T as two float32 vectors (a, b), loaded (lanes past n read as 0 and
// are not touched), rounded back and stored (kMayBeNaN: without it the caller knows no value is
// NaN), and T's round trip (through). bfloat16 keeps the even/odd order (kEvenOdd; a: elements
// 0, 2, ..., 30, b: 1, ..., 31); float32 and float16 are in natural order (a: elements 0-15, b:
// 16-31).
template <class T> struct Lanes;

template <> struct Lanes<bf16> {
  static constexpr bool kEvenOdd = true;
  static DUALOP_AVX512_INLINE void load(const bf16* p, __m512& a, __m512& b) { load_bf16(p, a, b); }
  static DUALOP_AVX512_INLINE void load(const bf16* p, __m512& a, __m512& b, int64_t n) {
    load_bf16(p, a, b, first32(n));
  }
  template <bool kMayBeNaN> static DUALOP_AVX512_INLINE void store(bf16* p, __m512 a, __m512 b) {
    store_bf16<kMayBeNaN>(p, a, b);
  }
  template <bool kMayBeNaN> static DUALOP_AVX512_INLINE void store(bf16* p, __m512 a, __m512 b, int64_t n) {
    store_bf16<kMayBeNaN>(p, a, b, first32(n));
  }
  template <bool kMayBeNaN> static DUALOP_AVX512_INLINE __m512 through(__m512 v) { return through_bf16<kMayBeNaN>(v); }
};

template <> struct Lanes<float> {
  static constexpr bool kEvenOdd = false;
  static DUALOP_AVX512_INLINE void load(const float* p, __m512& a, __m512& b) {
    a = _mm512_loadu_ps(p);
    b = _mm512_loadu_ps(p + 16);
  }
  static DUALOP_AVX512_INLINE void load(const float* p, __m512& a, __m512& b, int64_t n) {
    a = _mm512_maskz_loadu_ps(first16(n), p);
    b = _mm512_maskz_loadu_ps(first16(n - 16), p + 16);
  }
  template <bool> static DUALOP_AVX512_INLINE void store(float* p, __m512 a, __m512 b) {
    _mm512_storeu_ps(p, a);
    _mm512_storeu_ps(p + 16, b);
  }
  template <bool> static DUALOP_AVX512_INLINE void store(float* p, __m512 a, __m512 b, int64_t n) {
    _mm512_mask_storeu_ps(p, first16(n), a);
    _mm512_mask_storeu_ps(p + 16, first16(n - 16), b);
  }
  template <bool> static DUALOP_AVX512_INLINE __m512 through(__m512 v) { return v; }
};

// float16 by the F16C conversions (round to nearest even, denormals and NaN kept: the compiler's
// _Float16 casts).
template <> struct Lanes<f16> {
  static constexpr bool kEvenOdd = false;
  static DUALOP_AVX512_INLINE __m512 cvt(__m256i h) { return _mm512_cvtph_ps(h); }
  static DUALOP_AVX512_INLINE __m256i cvt(__m512 v) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static DUALOP_AVX512_INLINE void load(const f16* p, __m512& a, __m512& b) {
    a = cvt(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    b = cvt(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
  }
  static DUALOP_AVX512_INLINE void load(const f16* p, __m512& a, __m512& b, int64_t n) {
    a = cvt(_mm256_maskz_loadu_epi16(first16(n), p));
    b = cvt(_mm256_maskz_loadu_epi16(first16(n - 16), p + 16));
  }
  template <bool> static DUALOP_AVX512_INLINE void store(f16* p, __m512 a, __m512 b) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), cvt(a));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16), cvt(b));
  }
  template <bool> static DUALOP_AVX512_INLINE void store(f16* p, __m512 a, __m512 b, int64_t n) {
    _mm256_mask_storeu_epi16(p, first16(n), cvt(a));
    _mm256_mask_storeu_epi16(p + 16, first16(n - 16), cvt(b));
  }
  template <bool> static DUALOP_AVX512_INLINE __m512 through(__m512 v) { return cvt(cvt(v)); }
};

// Lane i of the result is the sum of v[i]'s 16 lanes: a transposing tree of adds (45 operations
// for 16 sums).
DUALOP_AVX512_INLINE __m512 sum_lanes16(const __m512 (&v)[16]) {
  __m512 t[4];
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    const __m512 s0 = _mm512_add_ps(_mm512_unpacklo_ps(v[4 * q], v[4 * q + 1]), _mm512_unpackhi_ps(v[4 * q], v[4 * q + 1]));
    const __m512 s1 =
        _mm512_add_ps(_mm512_unpacklo_ps(v[4 * q + 2], v[4 * q + 3]), _mm512_unpackhi_ps(v[4 * q + 2], v[4 * q + 3]));
    t[q] = _mm512_add_ps(_mm512_shuffle_ps(s0, s1, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(s0, s1, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(t[2], t[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// exp(-g) for silu's sigmoid at a bfloat16 result's precision, 16 lanes: 2^n exp(r) with
// n = round(-g / ln2), r = -g - n ln2 in one fused step (float32's ln2 is 1.9e-9 off, so r is off
// by at most 2.4e-7 for |n| <= 128), and exp(r) by a degree-4 minimax fit on |r| <= ln2/2 (relative
// error 2.6e-6, under a hundredth of a bfloat16 ulp). g is clamped to |g| <= 89 first (one vrangeps:
// the smaller magnitude, g's sign), so the reduction stays exact; at -g = 89 the result overflows to
// inf, as exp does past 88.7 (silu then gives g * 0, and NaN for g = -inf). NaN propagates.
DUALOP_AVX512_INLINE __m512 exp_of_negated(__m512 g) {
#ifdef __AVX512DQ__
  const __m512 clamped = _mm512_range_ps(g, _mm512_set1_ps(89.0f), 0x02);
#else  // every AVX-512 BW host has DQ; kept for a compiler told otherwise
  const __m512 clamped = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-89.0f), g));
#endif
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(-1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmsub_ps(n, _mm512_set1_ps(0.693147180559945309f), clamped);  // -(n ln2) - g
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0414586067199707f), r, _mm512_set1_ps(0.16790908575057983f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5000435709953308f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.9999634027481079f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.9999992847442627f));
  return _mm512_scalef_ps(p, n);  // p * 2^n, finite up to exp's own overflow (n = 128 included)
}

// silu(g) = g / (1 + exp(-g)) for a bfloat16 result: the division as the 14-bit reciprocal
// estimate (relative error below 2^-14, a thirty-second of the half-ulp a bfloat16 result rounds
// by, so the result is the float32 silu's rounding but within 2^-14 of a rounding boundary; a
// Newton step would cost a tenth of the kernel's time). Where exp(-g) overflows (g < -88.7) the
// estimate of 1 / inf is 0, so g * 0: -0 for finite g and NaN for g = -inf, as the native
// g * sigmoid(g).
DUALOP_AVX512_INLINE __m512 silu_for_bf16(__m512 g) {
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp_of_negated(g));
  return _mm512_mul_ps(g, _mm512_rcp14_ps(d));
}

#undef DUALOP_AVX512_INLINE

}  // namespace dualop::avx512
#endif
