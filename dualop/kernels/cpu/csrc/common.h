// Shared pieces of dualop's CPU kernels: element types, float32 conversions, and branch-free
// exp/erf/tanh that GCC vectorises (so the row loops below compile to AVX2/AVX-512 code).
//
// Conversions round to nearest even, as torch does; NaN stays NaN. The transcendental functions
// follow the usual Cody-Waite reduction plus a polynomial (exp, ~1 ulp) and piecewise fits (erf,
// ~1 ulp; see erf_f32), with the IEEE special values of the functions they replace (exp(+inf)=inf,
// exp(-inf)=0, erf(+-inf)=+-1, NaN in, NaN out).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#define DUALOP_INLINE inline __attribute__((always_inline))

// The most dimensions an array argument has (DualopArray::shape, ::strides).
#define DUALOP_MAX_DIMS 4

// One array argument of a C entry point: its data, element type (a dualop::dtype_code, stated in
// dualop/kernels/cpu/abi.py), rank, and shape and strides in elements (the first ndim entries).
// Mirrored field by field by abi.DualopArray (abi.ARRAY_FIELDS), which packs one per tensor.
struct DualopArray {
  void* data;
  int32_t dtype;
  int32_t ndim;
  int64_t shape[DUALOP_MAX_DIMS];
  int64_t strides[DUALOP_MAX_DIMS];
};

namespace dualop {

// bfloat16 is stored as its bits (a plain uint16_t, which GCC vectorises; a wrapper struct it
// does not); float16 is the compiler's _Float16.
using bf16 = uint16_t;
using f16 = _Float16;

// What an entry point returns when its array arguments disagree with what it reads (element type,
// rank or shape): it refuses before touching any element.
constexpr int kBadArrays = -10;

// An optional array's data, null when the array is absent.
DUALOP_INLINE void* data_of(const DualopArray* a) { return a ? a->data : nullptr; }

// Whether an array's elements are laid out row-major without gaps (what the row loops read).
DUALOP_INLINE bool is_row_major(const DualopArray* a) {
  int64_t expected = 1;
  for (int32_t d = a->ndim - 1; d >= 0; --d) {
    if (a->shape[d] == 0) return true;
    if (a->shape[d] != 1 && a->strides[d] != expected) return false;
    expected *= a->shape[d];
  }
  return true;
}

// Whether an array is present, of this element type and rank, and row-major.
DUALOP_INLINE bool is_dense(const DualopArray* a, int32_t dtype, int32_t ndim) {
  return a && a->dtype == dtype && a->ndim == ndim && is_row_major(a);
}

// Whether an optional array is absent, or present as is_dense says.
DUALOP_INLINE bool is_absent_or_dense(const DualopArray* a, int32_t dtype, int32_t ndim) {
  return !a || is_dense(a, dtype, ndim);
}

// Whether two arrays have one rank and shape.
DUALOP_INLINE bool same_shape(const DualopArray* a, const DualopArray* b) {
  if (a->ndim != b->ndim) return false;
  for (int32_t d = 0; d < a->ndim; ++d)
    if (a->shape[d] != b->shape[d]) return false;
  return true;
}

// Whether b is present, row-major, and of a's element type, rank and shape.
DUALOP_INLINE bool is_dense_like(const DualopArray* b, const DualopArray* a) {
  return is_dense(b, a->dtype, a->ndim) && same_shape(a, b);
}

// How many elements an array holds.
DUALOP_INLINE int64_t element_count(const DualopArray* a) {
  int64_t count = 1;
  for (int32_t d = 0; d < a->ndim; ++d) count *= a->shape[d];
  return count;
}

DUALOP_INLINE float to_f32(float v) { return v; }
DUALOP_INLINE float to_f32(f16 v) { return static_cast<float>(v); }
DUALOP_INLINE float to_f32(bf16 v) { return std::bit_cast<float>(static_cast<uint32_t>(v) << 16); }

template <class T> DUALOP_INLINE T from_f32(float v);
template <> DUALOP_INLINE float from_f32<float>(float v) { return v; }
template <> DUALOP_INLINE f16 from_f32<f16>(float v) { return static_cast<f16>(v); }
template <> DUALOP_INLINE bf16 from_f32<bf16>(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<bf16>(v != v ? quiet_nan : rounded);
}

// Round a float32 through T and back (what casting to the output dtype and reading it does).
template <class T> DUALOP_INLINE float through(float v) { return to_f32(from_f32<T>(v)); }

// exp(x) for float32: x = n*ln2 + r, |r| <= ln2/2, exp(r) by a degree-7 polynomial, 2^n by bits.
DUALOP_INLINE float exp_f32(float x) {
  // ternary clamps (std::fmin/fmax's NaN rules keep GCC from vectorising); NaN is handled last
  float clamped = x < -87.0f ? -87.0f : x;
  clamped = clamped > 88.0f ? 88.0f : clamped;
  // round to nearest integer by the 1.5 * 2^23 shifter (|x * log2(e)| < 2^22, so exact)
  const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = std::fma(n, -0.693145751953125f, std::fma(n, -1.42860682030941723212e-6f, clamped));
  float p = 1.0f / 5040.0f;  // Taylor to degree 7: truncation < 6e-9 relative on |r| <= ln2/2
  p = std::fma(p, r, 1.0f / 720.0f);
  p = std::fma(p, r, 1.0f / 120.0f);
  p = std::fma(p, r, 1.0f / 24.0f);
  p = std::fma(p, r, 1.0f / 6.0f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const float scale = std::bit_cast<float>(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  float y = p * scale;
  y = x > 88.0f ? INFINITY : y;  // 2^128 overflows the scale; exp(x) > 1.6e38 there
  y = x < -87.0f ? 0.0f : y;  // below float32's normal range: flushed, as |exp(x)| < 1.7e-38 there
  return x != x ? x : y;
}

DUALOP_INLINE float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

// Polynomial in Horner form, highest coefficient first.
template <int N>
DUALOP_INLINE float horner(const float (&c)[N], float t) {
  float p = c[0];
#pragma GCC unroll 16
  for (int k = 1; k < N; ++k) p = std::fma(p, t, c[k]);  // unrolled, so the caller's loop vectorises
  return p;
}

// erf for float32, max error ~1.2 ulp (98% of results correctly rounded), from fits made for
// dualop (least squares on Chebyshev nodes, relative error): erf(x) = x + x * R(x^2) below 0.875;
// above, 1 - exp(-x^2) * Q(x) with Q = erfc(x) * exp(x^2) on [0.875, 2.25] and [2.25, 4]; 1 from 4
// (erf(4) rounds to 1 in float32). exp(-x^2) keeps x^2's rounding error (fma) as a factor.
DUALOP_INLINE float erf_f32(float x) {
  static constexpr float kSmall[] = {8.671101280e-05f, -8.210109188e-04f, 5.206660757e-03f, -2.686154979e-02f,
                                     1.128373236e-01f, -3.761263602e-01f, 1.283791669e-01f};
  static constexpr float kMid[] = {1.006916012e-05f, -4.553677185e-05f, 1.707523025e-04f,
                                   -6.859192242e-04f, 2.652659602e-03f, -9.677651801e-03f,
                                   3.321732900e-02f,  -1.062030445e-01f, 3.116486067e-01f};
  static constexpr float kTail[] = {1.463037968e-06f, -7.129386275e-06f, 3.012932832e-05f,
                                    -1.368658687e-04f, 6.088605831e-04f, -2.623193713e-03f,
                                    1.095855286e-02f,  -4.427671030e-02f, 1.724443519e-01f};
  const float a = std::fabs(x);
  const float s = a * a;
  const float small = std::fma(a, horner(kSmall, s), a);
  const float s_err = std::fma(a, a, -s);  // a*a = s + s_err exactly
  const bool mid = a < 2.25f;
  const float t = mid ? (a - 1.5625f) * (1.0f / 0.6875f) : (a - 3.125f) * (1.0f / 0.875f);
  float q = mid ? kMid[0] : kTail[0];  // one Horner pass, each coefficient picked per lane (a blend, no branch)
#pragma GCC unroll 16
  for (int k = 1; k < 9; ++k) q = std::fma(q, t, mid ? kMid[k] : kTail[k]);
  const float large = 1.0f - exp_f32(-s) * (q * (1.0f - s_err));
  float y = a < 0.875f ? small : large;
  y = a >= 4.0f ? 1.0f : y;
  y = x != x ? x : y;
  return std::copysign(y, x);
}

// tanh by 1 - 2 / (exp(2|x|) + 1), sign restored.
DUALOP_INLINE float tanh_f32(float x) {
  const float a = std::fabs(x);
  const float y = 1.0f - 2.0f / (exp_f32(2.0f * a) + 1.0f);
  return std::copysign(y, x);
}

}  // namespace dualop
