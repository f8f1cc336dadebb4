// Quantized linear layers on the CPU: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with w given as
// its quantized codes, scales and zero points (semantics: dualop.kernels.quant_math; the reference
// is dualop.ops.linear._native_gemm). The float weight is never materialised: each kernel turns a
// tile of codes into exact small numbers in registers (or a per-thread scratch of one column tile)
// and applies the scales to the partial sums of each scale group.
//
// dualop_quantized_linear: weight-only, codes in rows of K ([N, K]: int8, float8_e4m3fn, or int4 /
// int8 packed into int32 words along K). Every code is exact in bfloat16 (int8 and int4 codes, any
// e4m3 value), so with bfloat16 x the products run on
// AVX512-BF16's vdpbf16ps (exact products, float32 sums): for each scale period (a group, a block's
// K extent, or all of K) a fresh float32 accumulator per (row, column), added to the total times the
// period's scale. Zero points use sum_k x (q - z) = sum_k x q - z sum_k x: the period's sum of x is
// computed once per call. float32 x (float16 arrives as float32) takes the same codes widened to
// float32 and float32 FMAs. Decode (few rows) streams each weight row once for all rows, decoding in
// registers; more rows decode a column tile into a scratch once and run the row blocks over it
// (with bfloat16 x as outer products: lanes are 16 columns, so a period's scales apply to 16
// columns at once and no horizontal sums are left). The threads split N into tiles of
// kScratchCols weight rows; while a tile computes, the next one is fetched into L2 (Prefetch: the
// hardware prefetchers do not follow the tile's short runs of rows, and without it the loads wait
// on DRAM).
//
// dualop_quantized_linear_awq: AWQ's GEMM layout (codes and zero points packed along N, [K, N / 8]
// words; scales [K / g, N]). Outer-product form: lanes are 16 words' worth of output columns, each
// 32-bit lane a (k, k + 1) pair of codes, so one vdpbf16ps against a broadcast pair of x adds two
// products to 16 columns; a word's 8 nibbles give 8 such vectors (columns in AWQ's nibble order,
// which the scales and zero points are read in too).
//
// dualop_quantized_linear_w8a8: int8 weights with int8 activations (dynamic per-row scale
// max|x| / 127, or a static input scale; codes rounded half to even and clipped to [-128, 127], as
// quantize_activations does). The products are AVX512-VNNI's vpdpbusd (u8 x s8, int32 sums) on
// the weight's codes + 128 (as pack-quantized stores them) and x's codes; the 128 * sum(x) that adds
// is taken back per (row, period). Each period's int32 sum is scaled in float32 by its weight scale,
// and the row's by its x scale.
//
// dualop_quantized_linear_fp8_w8a8: float8_e4m3fn weights with fp8 activations: x quantized as
// quant_fp8's native body does (one scale for the tensor, or per row, or per row and period of a
// block weight; dynamic max(amax / 448, 1 / (448 * 512)) or the static one; codes rounded to e4m3,
// ties to even). Its codes, exact in bfloat16, run on dualop_quantized_linear's tiles with the fp8
// weight decoder, each period's partial sum scaled by the weight's scale times x's of the row.
//
// Everything else (a host without AVX-512 BF16 / VNNI, group sizes not a multiple of 32) runs a
// portable path: a weight row dequantised to float32 (the definition's w = (q - z) * s) and dotted
// with each row of x.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "avx512.h"
#include "common.h"

#if defined(DUALOP_HAVE_AVX512) && defined(__AVX512BF16__)
#define DUALOP_QLINEAR_BF16 1
#endif
#if defined(DUALOP_QLINEAR_BF16) && defined(__AVX512VNNI__)  // its helpers live beside the BF16 kernels
#define DUALOP_QLINEAR_VNNI 1
#endif

namespace dualop::qlinear {

// Code formats of weights stored in rows of K (the `format` argument).
enum Format { kInt8 = 0, kFp8 = 1, kInt4Packed = 2, kInt8Packed = 3 };
// How zero points are stored (the `zero_kind` argument): none, plain int8, plain int32 (shape of
// the scales), or int32 words packed along the scale rows (compressed-tensors' pack-quantized,
// 4 or 8 bits a code).
enum ZeroKind { kNoZero = 0, kZeroInt8 = 1, kZeroInt32 = 2, kZeroPacked4 = 3, kZeroPacked8 = 4 };

// Decode sizes: up to this many rows run on codes decoded in registers; more decode a column tile
// once into a scratch (pairs-major for bfloat16 x, rows of K bfloat16 for float32 x).
constexpr int64_t kDirectMaxRows = 8;
constexpr int64_t kScratchCols = 16;

DUALOP_INLINE int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

DUALOP_INLINE float fp8_e4m3fn_to_f32(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  float v;
  if (e == 0) v = std::ldexp(static_cast<float>(m), -9);
  else if (e == 15 && m == 7) v = NAN;
  else v = std::ldexp(1.0f + m / 8.0f, e - 7);
  return (b & 0x80) ? -v : v;
}

DUALOP_INLINE float load_f32(const void* p, int32_t dtype, int64_t i) {
  switch (dtype) {
    case dtype_code::bfloat16: return to_f32(static_cast<const bf16*>(p)[i]);
    case dtype_code::float16: return to_f32(static_cast<const f16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// The weight of one call: codes (rows of K, or AWQ's), scales, zero points and the scale grid.
struct Weight {
  int format = kInt8;
  const uint8_t* codes = nullptr;
  int64_t row_bytes = 0;  // bytes of one weight row (rows-of-K formats)
  int64_t n = 0, k = 0;
  const void* scale = nullptr;
  int32_t scale_dtype = dtype_code::float32;
  int64_t scale_cols = 1;  // scale[row, p]: row = n / group_n, p = k / group_k
  int64_t group_n = 1, group_k = 1;
  const void* zero = nullptr;
  int zero_kind = kNoZero;
  int64_t zero_cols = 1;

  int64_t periods() const { return k > 0 ? cdiv(k, group_k) : 0; }
  float scale_at(int64_t col, int64_t p) const { return load_f32(scale, scale_dtype, (col / group_n) * scale_cols + p); }
  // the zero point of (col, p) as the signed code value it is subtracted as
  float zero_at(int64_t col, int64_t p) const {
    const int64_t row = col / group_n;
    switch (zero_kind) {
      case kZeroInt8: return static_cast<const int8_t*>(zero)[row * zero_cols + p];
      case kZeroInt32: return static_cast<float>(static_cast<const int32_t*>(zero)[row * zero_cols + p]);
      case kZeroPacked4: {
        const uint32_t word = static_cast<const uint32_t*>(zero)[(row / 8) * zero_cols + p];
        return static_cast<float>(static_cast<int>((word >> (4 * (row % 8))) & 15u) - 8);
      }
      case kZeroPacked8: {
        const uint32_t word = static_cast<const uint32_t*>(zero)[(row / 4) * zero_cols + p];
        return static_cast<float>(static_cast<int>((word >> (8 * (row % 4))) & 255u) - 128);
      }
      default: return 0.0f;
    }
  }
  // code (n, k) as the signed value the definition multiplies (fp8: its value)
  float code_at(int64_t col, int64_t i) const {
    const uint8_t* row = codes + col * row_bytes;
    switch (format) {
      case kInt8: return static_cast<int8_t>(row[i]);
      case kFp8: return fp8_e4m3fn_to_f32(row[i]);
      case kInt4Packed: return static_cast<float>(static_cast<int>((row[i / 2] >> (4 * (i & 1))) & 15) - 8);
      default: return static_cast<float>(static_cast<int>(row[i]) - 128);  // kInt8Packed
    }
  }
};

// Where results go: out[m, n] = value + bias[n], rounded once to out's dtype.
struct Output {
  void* data = nullptr;
  int32_t dtype = dtype_code::float32;
  int64_t n = 0;
  const void* bias = nullptr;
  int32_t bias_dtype = dtype_code::float32;

  DUALOP_INLINE void put(int64_t m, int64_t col, float v) const {
    if (bias) v += load_f32(bias, bias_dtype, col);
    const int64_t i = m * n + col;
    switch (dtype) {
      case dtype_code::bfloat16: static_cast<bf16*>(data)[i] = from_f32<bf16>(v); break;
      case dtype_code::float16: static_cast<f16*>(data)[i] = from_f32<f16>(v); break;
      default: static_cast<float*>(data)[i] = v; break;
    }
  }
};

// x's rows as float32 [m, k].
static std::vector<float> rows_as_f32(const void* x, int32_t dtype, int64_t m, int64_t k) {
  std::vector<float> xf(static_cast<size_t>(m * k));
  for (int64_t i = 0; i < m * k; ++i) xf[i] = load_f32(x, dtype, i);
  return xf;
}

// Contiguous share [begin, end) of `units` for thread t of `team`.
DUALOP_INLINE void share(int64_t units, int t, int team, int64_t& begin, int64_t& end) {
  begin = units * t / team;
  end = units * (t + 1) / team;
}

// ---- portable path: a weight row dequantised to float32, dotted with every row ---------------------

static void rows_portable(const Weight& w, const float* xf, int64_t m, const Output& out, int threads) {
  const int64_t n = w.n, k = w.k, periods = w.periods();
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> row(static_cast<size_t>(k));
    int64_t begin, end;
    share(n, omp_get_thread_num(), omp_get_num_threads(), begin, end);
    for (int64_t col = begin; col < end; ++col) {
      for (int64_t p = 0; p < periods; ++p) {
        const float s = w.scale_at(col, p), z = w.zero_kind ? w.zero_at(col, p) : 0.0f;
        for (int64_t i = p * w.group_k; i < std::min(k, (p + 1) * w.group_k); ++i) row[i] = (w.code_at(col, i) - z) * s;
      }
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = xf + r * k;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < k; ++i) acc += xr[i] * row[i];
        out.put(r, col, acc);
      }
    }
  }
}


// ---- AWQ's layout, portable: one K row of a column tile dequantised at a time -------------------

constexpr int kAwqNibbleOf[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // quant_math.AWQ_NIBBLE_OF

struct Awq {
  const uint32_t* codes = nullptr;  // [k, n / 8]
  const uint32_t* zeros = nullptr;  // [periods, n / 8]
  const void* scale = nullptr;      // [periods, n]
  int32_t scale_dtype = dtype_code::float32;
  int64_t n = 0, k = 0, group_k = 1;

  DUALOP_INLINE static int code(const uint32_t* row, int64_t col) {
    return static_cast<int>((row[col / 8] >> (4 * kAwqNibbleOf[col % 8])) & 15u);
  }
  int64_t periods() const { return k > 0 ? cdiv(k, group_k) : 0; }
};

static void awq_portable(const Awq& w, const float* xf, int64_t m, const Output& out, int threads) {
  constexpr int64_t kTile = 64;
  const int64_t n = w.n, k = w.k, words = n / 8;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> acc(static_cast<size_t>(m * kTile)), wk(kTile);
    int64_t begin, end;
    share(cdiv(n, kTile), omp_get_thread_num(), omp_get_num_threads(), begin, end);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * kTile, cols = std::min(kTile, n - n0);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t i = 0; i < k; ++i) {
        const int64_t p = i / w.group_k;
        for (int64_t c = 0; c < cols; ++c) {
          const float z = static_cast<float>(Awq::code(w.zeros + p * words, n0 + c));
          wk[c] = (static_cast<float>(Awq::code(w.codes + i * words, n0 + c)) - z) *
                  load_f32(w.scale, w.scale_dtype, p * n + n0 + c);
        }
        for (int64_t r = 0; r < m; ++r) {
          const float xv = xf[r * k + i];
          float* a = acc.data() + r * kTile;
#pragma omp simd
          for (int64_t c = 0; c < cols; ++c) a[c] += xv * wk[c];
        }
      }
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < cols; ++c) out.put(r, n0 + c, acc[r * kTile + c]);
    }
  }
}

// ---- W8A8: x quantized per row (or by the static scale), int32 dot products --------------------------

// x's rows as int8 codes (rows `stride` apart, the rest of a row left as is) and their scales, as
// quantize_activations: scale max|x| / 127 per row (1 for a row of zeros) or the static one; codes
// round(x / scale) half to even, clipped to [-128, 127].
static void quantize_rows(const void* x, int32_t dtype, int64_t m, int64_t k, const float* static_scale, uint8_t* q,
                          int64_t stride, float* scales, int threads) {
#pragma omp parallel num_threads(m * k >= parallel_min_elements ? threads : 1)
  {
    std::vector<float> row(static_cast<size_t>(k));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
      if (dtype == dtype_code::bfloat16) {  // one loop per dtype, so that each vectorises
        const bf16* src = static_cast<const bf16*>(x) + r * k;
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) row[i] = to_f32(src[i]);
      } else {
        for (int64_t i = 0; i < k; ++i) row[i] = load_f32(x, dtype, r * k + i);
      }
      float s;
      if (static_scale) {
        s = *static_scale;
      } else {
        float amax = 0.0f;
        for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
        s = amax > 0.0f ? amax / 127.0f : 1.0f;
      }
      scales[r] = s;
      uint8_t* qr = q + r * stride;
      int64_t i0 = 0;
#ifdef DUALOP_HAVE_AVX512
      // 16 at a time, the same operations as the loop below: divide, round to nearest even, NaN to
      // 0, clamp to [-128, 127]
      const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-128.0f), hi = _mm512_set1_ps(127.0f);
      for (; i0 + 16 <= k; i0 += 16) {
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(row.data() + i0), sv),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);
        v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + i0), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
      }
#endif
      for (int64_t i = i0; i < k; ++i) {
        float v = std::nearbyint(row[i] / s);
        v = v != v ? 0.0f : std::min(127.0f, std::max(-128.0f, v));
        qr[i] = static_cast<uint8_t>(static_cast<int8_t>(v));
      }
    }
  }
}

DUALOP_INLINE int int8_code_at(const Weight& w, int64_t col, int64_t i) {
  const uint8_t b = w.codes[col * w.row_bytes + i];
  return w.format == kInt8Packed ? static_cast<int>(b) - 128 : static_cast<int>(static_cast<int8_t>(b));
}

// The portable W8A8 loop: a weight row's codes (code(col, i), as T) dotted with each row of x's
// codes (x(r, i)) per period in T, each period's sum times period_scale(r, col, p) added up in
// float32, the row's total times row_scale(r) stored.
template <class T, class Code, class X, class PeriodScale, class RowScale>
static void w8a8_loop(const Weight& w, int64_t m, const Output& out, int threads, Code code, X x,
                      PeriodScale period_scale, RowScale row_scale) {
  const int64_t n = w.n, k = w.k, periods = w.periods();
#pragma omp parallel num_threads(threads)
  {
    std::vector<T> row(static_cast<size_t>(k));
    int64_t begin, end;
    share(n, omp_get_thread_num(), omp_get_num_threads(), begin, end);
    for (int64_t col = begin; col < end; ++col) {
      for (int64_t i = 0; i < k; ++i) row[i] = code(col, i);
      for (int64_t r = 0; r < m; ++r) {
        float total = 0.0f;
        for (int64_t p = 0; p < periods; ++p) {
          T sum = 0;
          for (int64_t i = p * w.group_k; i < std::min(k, (p + 1) * w.group_k); ++i) sum += x(r, i) * row[i];
          total += static_cast<float>(sum) * period_scale(r, col, p);
        }
        out.put(r, col, total * row_scale(r));
      }
    }
  }
}

static void w8a8_portable(const Weight& w, const uint8_t* xq, const float* xs, int64_t m, const Output& out,
                          int threads) {
  const int64_t k = w.k;
  w8a8_loop<int32_t>(
      w, m, out, threads, [&](int64_t col, int64_t i) { return int8_code_at(w, col, i); },
      [&](int64_t r, int64_t i) { return static_cast<int32_t>(static_cast<int8_t>(xq[r * k + i])); },
      [&](int64_t, int64_t col, int64_t p) { return w.scale_at(col, p); }, [&](int64_t r) { return xs[r]; });
}

// ---- fp8 W8A8: x quantized to float8_e4m3fn as quant_fp8 does ------------------------------------------

// How fp8 W8A8 scales x (the `x_groups` argument): one scale for the tensor (dynamic, or the static
// input scale), one per row, or one per row and period of group_k columns (block weights).
enum XGroups { kXPerTensor = 0, kXPerRow = 1, kXPerPeriod = 2 };

constexpr float kFp8Max = 448.0f;
constexpr float kFp8MinScale = 1.0f / (448.0f * 512.0f);  // the dynamic scale's floor

// max(amax, |v|) as torch's amax folds it: a NaN, once seen, stays.
DUALOP_INLINE float nan_max(float amax, float v) {
  const float a = std::fabs(v);
  return a > amax || a != a ? a : amax;
}

// y (clipped to [-448, 448], or NaN) rounded to the nearest float8_e4m3fn value, ties to even, as
// float32: normal values keep 3 fraction bits, below 2^-6 the subnormals' spacing is 2^-9.
DUALOP_INLINE float round_to_e4m3(float y) {
  if (y != y) return NAN;
  uint32_t b;
  std::memcpy(&b, &y, sizeof b);
  b = (b + 0x7ffffu + ((b >> 20) & 1u)) & 0xfff00000u;
  float normal;
  std::memcpy(&normal, &b, sizeof normal);
  const float subnormal = std::nearbyint(y * 512.0f) * (1.0f / 512.0f);
  return std::fabs(y) < 0x1p-6f ? subnormal : normal;
}

// x [m, k] quantized as quant_fp8's native body does: per group (the tensor, a row, or a row's
// period of group_k columns, per x_groups) scale = max(amax / 448, 1 / (448 * 512)) (amax / 448
// correctly rounded; a NaN in the group makes it NaN) or the static one, codes = e4m3(clip(x *
// (1 / scale), -448, 448)). The codes go to q_bf16 (rows `stride` apart, zero-padded to it) or
// q_f32 (rows of k), exact in either; the scales to xs [m, periods] (repeated over the periods one
// spans).
static void quantize_fp8_rows(const void* x, int32_t dtype, int64_t m, int64_t k, int x_groups,
                              const float* static_scale, int64_t group_k, int64_t periods, bf16* q_bf16, float* q_f32,
                              int64_t stride, float* xs, int threads) {
  const int team = m * k >= parallel_min_elements ? threads : 1;
  const int64_t span = x_groups == kXPerPeriod ? group_k : k;  // columns one dynamic scale covers in a row
  if (!static_scale) {  // each group's max |x| into xs
#pragma omp parallel for num_threads(team) schedule(static)
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t p = 0, k0 = 0; k0 < k; ++p, k0 += span) {
        float amax = 0.0f;
        for (int64_t i = k0; i < std::min(k, k0 + span); ++i) amax = nan_max(amax, load_f32(x, dtype, r * k + i));
        xs[r * periods + p] = amax;
      }
    }
    if (x_groups == kXPerTensor) {
      float amax = 0.0f;
      for (int64_t r = 0; r < m; ++r) amax = nan_max(amax, xs[r * periods]);
      for (int64_t r = 0; r < m; ++r) xs[r * periods] = amax;
    }
  }
#pragma omp parallel for num_threads(team) schedule(static)
  for (int64_t r = 0; r < m; ++r) {
    float* sr = xs + r * periods;
    if (static_scale) {
      sr[0] = *static_scale;
    } else {
      for (int64_t p = 0; p < (x_groups == kXPerPeriod ? periods : 1); ++p) {
        const float s = sr[p] / kFp8Max;
        sr[p] = s < kFp8MinScale ? kFp8MinScale : s;  // NaN stays
      }
    }
    if (x_groups != kXPerPeriod)
      for (int64_t p = 1; p < periods; ++p) sr[p] = sr[0];
    for (int64_t i = 0; i < k; ++i) {
      const float inv = 1.0f / sr[x_groups == kXPerPeriod ? i / group_k : 0];
      float y = load_f32(x, dtype, r * k + i) * inv;
      y = y > kFp8Max ? kFp8Max : (y < -kFp8Max ? -kFp8Max : y);
      const float code = round_to_e4m3(y);
      if (q_f32) {
        q_f32[r * k + i] = code;
      } else {
        uint32_t bits;
        std::memcpy(&bits, &code, sizeof bits);
        q_bf16[r * stride + i] = static_cast<bf16>(bits >> 16);  // exact: 4 significant bits
      }
    }
    if (q_bf16)
      for (int64_t i = k; i < stride; ++i) q_bf16[r * stride + i] = 0;
  }
}

// fp8 W8A8, portable: x's codes (float32 [m, k]) times a weight row's codes, each period's sum
// scaled by the weight's scale and x's.
static void fp8_w8a8_portable(const Weight& w, const float* xq, const float* xs, int64_t m, const Output& out,
                              int threads) {
  const int64_t k = w.k, periods = w.periods();
  w8a8_loop<float>(
      w, m, out, threads, [&](int64_t col, int64_t i) { return w.code_at(col, i); },
      [&](int64_t r, int64_t i) { return xq[r * k + i]; },
      [&](int64_t r, int64_t col, int64_t p) { return w.scale_at(col, p) * xs[r * periods + p]; },
      [](int64_t) { return 1.0f; });
}

// A growing buffer per thread and slot (OpenMP's threads persist between calls, so no call maps
// fresh pages). The calling thread is also thread 0 of the team: each use has its own slot.
enum BufferSlot {
  kScaleSlot = 0, kZeroSlot, kXSumSlot, kXSlot, kScratchSlot, kPairScaleSlot, kPairZeroSlot, kXInterleavedSlot, kSlots
};
template <class T>
static T* thread_buffer(int slot, size_t count) {
  thread_local std::vector<T> buffers[kSlots];
  std::vector<T>& b = buffers[slot];
  if (b.size() < count) b.resize(count);
  return b.data();
}

// x's rows (row_bytes apart, a multiple of 64) interleaved for the register tiles: each block of
// kInterleavedRows rows as [row_bytes / 64][kInterleavedRows][64 bytes], rows past m zeros, so that
// a K step's rows sit at fixed offsets from one pointer (a tile's loop then needs one address
// register for x, not one per row). The calling thread's buffer.
constexpr int64_t kInterleavedRows = 8;
static_assert(kDirectMaxRows <= kInterleavedRows, "a direct row block is one interleaved block");

static const uint8_t* interleave_rows(const void* x, int64_t m, int64_t row_bytes) {
  const int64_t steps = row_bytes / 64, blocks = cdiv(m, kInterleavedRows);
  uint8_t* xi = thread_buffer<uint8_t>(kXInterleavedSlot, static_cast<size_t>(blocks * kInterleavedRows * row_bytes));
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t r = 0; r < kInterleavedRows; ++r) {
        uint8_t* dst = xi + ((b * steps + s) * kInterleavedRows + r) * 64;
        const int64_t row = b * kInterleavedRows + r;
        if (row < m) std::memcpy(dst, static_cast<const uint8_t*>(x) + row * row_bytes + s * 64, 64);
        else std::memset(dst, 0, 64);
      }
  return xi;
}

// The scale (times `factor`) and zero point of each period of columns [n0, n0 + cols), as
// float32 [cols][periods]; columns past n repeat the last.
static void tile_scales(const Weight& w, int64_t n0, int64_t cols, float factor, float* sc, float* zc) {
  const int64_t periods = w.periods();
  for (int64_t c = 0; c < cols; ++c) {
    const int64_t col = std::min(n0 + c, w.n - 1);
    float* s = sc + c * periods;
    if (w.group_n == 1 && w.scale_dtype == dtype_code::float32) {
      const float* row = static_cast<const float*>(w.scale) + col * w.scale_cols;
#pragma omp simd
      for (int64_t p = 0; p < periods; ++p) s[p] = row[p] * factor;
    } else if (w.group_n == 1 && w.scale_dtype == dtype_code::bfloat16) {
      const bf16* row = static_cast<const bf16*>(w.scale) + col * w.scale_cols;
#pragma omp simd
      for (int64_t p = 0; p < periods; ++p) s[p] = to_f32(row[p]) * factor;
    } else {
      for (int64_t p = 0; p < periods; ++p) s[p] = w.scale_at(col, p) * factor;
    }
    if (w.zero_kind != kNoZero) {
      float* z = zc + c * periods;
      if (w.zero_kind == kZeroPacked4) {
        const uint32_t* words = static_cast<const uint32_t*>(w.zero) + (col / w.group_n / 8) * w.zero_cols;
        const int shift = static_cast<int>(4 * ((col / w.group_n) % 8));
#pragma omp simd
        for (int64_t p = 0; p < periods; ++p) z[p] = static_cast<float>(static_cast<int>((words[p] >> shift) & 15u) - 8);
      } else {
        for (int64_t p = 0; p < periods; ++p) z[p] = w.zero_at(col, p);
      }
    }
  }
}

}  // namespace dualop::qlinear

// ---- AVX-512 BF16 / VNNI paths ------------------------------------------------------------------------

#ifdef DUALOP_QLINEAR_BF16
namespace dualop::qlinear::fast {

#define QL_INLINE inline __attribute__((always_inline))

// f(std::integral_constant<int, R>{}) for R = rows, a register tile's row count chosen at run time
// (1 to kMax; more rows take kMax).
template <int R, int kMax, class F>
QL_INLINE void with_rows_from(int64_t rows, F& f) {
  if constexpr (R == kMax) {
    f(std::integral_constant<int, R>{});
  } else if (rows == R) {
    f(std::integral_constant<int, R>{});
  } else {
    with_rows_from<R + 1, kMax>(rows, f);
  }
}

template <int kMax, class F>
QL_INLINE void with_rows(int64_t rows, F&& f) {
  with_rows_from<1, kMax>(rows, f);
}

QL_INLINE float hsum(__m512 v) {
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(v),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

QL_INLINE __mmask32 first_bytes(int64_t len) { return len >= 32 ? ~__mmask32(0) : (__mmask32(1) << len) - 1; }
QL_INLINE __mmask16 first_bytes16(int64_t len) { return len >= 16 ? __mmask16(0xffff) : __mmask16((1u << len) - 1); }

// 32 bfloat16 values as the vdpbf16ps operand type.
QL_INLINE __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// acc += the pairwise products of a's and b's bfloat16 values (vdpbf16ps), on the accumulator in
// place: GCC's intrinsic gives the result its own register and copies it back into the
// accumulator's, about one move per product in the tiles' loops (dpbusd below likewise).
QL_INLINE __m512 dpbf16(__m512 acc, __m512i a, __m512i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// Decoders: 32 codes of a weight row from K index i (a multiple of 32) as bfloat16 bits, in the
// order kXOrder says x is laid out in (the same permutation of the 32 K positions); load_tail reads
// only the first len codes' bytes (the rest of the lanes are zero or finite).
enum XOrder { kNatural = 0, kEvenThenOdd = 1 };  // kEvenThenOdd: positions 0, 2, ..., 30, then 1, 3, ..., 31

struct Int8Codes {
  static constexpr int kOrder = kNatural;
  static constexpr float kFactor = 1.0f;
  QL_INLINE static __m512i widen(__m128i lo, __m128i hi) {
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
  }
  QL_INLINE __m512i load(const uint8_t* row, int64_t i) const {
    const __m128i* p = reinterpret_cast<const __m128i*>(row + i);
    return widen(_mm_loadu_si128(p), _mm_loadu_si128(p + 1));
  }
  QL_INLINE __m512i load_tail(const uint8_t* row, int64_t i, int64_t len) const {
    const __m256i v = _mm256_maskz_loadu_epi8(first_bytes(len), row + i);
    return widen(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  }
};

// int8 codes packed into words (compressed-tensors, 8 bits): bytes stored + 128.
struct Int8PackedCodes {
  static constexpr int kOrder = kNatural;
  static constexpr float kFactor = 1.0f;
  QL_INLINE static __m512i widen(__m256i v) {
    v = _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));
    return Int8Codes::widen(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  }
  QL_INLINE __m512i load(const uint8_t* row, int64_t i) const {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i)));
  }
  QL_INLINE __m512i load_tail(const uint8_t* row, int64_t i, int64_t len) const {
    // lanes past len: 0x80 ^ 0x80 = code 0
    return widen(_mm256_mask_loadu_epi8(_mm256_set1_epi8(static_cast<char>(0x80)), first_bytes(len), row + i));
  }
};

// float8_e4m3fn by table: a byte's low 6 bits index the bfloat16 magnitudes of the 64 codes with
// exponent bit 3 clear (one two-register vpermt2w) and of the 64 with it set (a second), bit 6
// picks one, and the sign is the byte's (sign-extended into bit 15). Every e4m3 value (subnormals,
// NaN) is a bfloat16, so the decode is exact; about half the cost of widening through float16.
struct Fp8Codes {
  static constexpr int kOrder = kNatural;
  static constexpr float kFactor = 1.0f;
  __m512i low0, low1, high0, high1;  // magnitudes of codes 0-31, 32-63, 64-95, 96-127
  Fp8Codes() {
    alignas(64) uint16_t t[128];
    for (int i = 0; i < 128; ++i) t[i] = from_f32<bf16>(fp8_e4m3fn_to_f32(static_cast<uint8_t>(i)));
    low0 = _mm512_load_si512(t);
    low1 = _mm512_load_si512(t + 32);
    high0 = _mm512_load_si512(t + 64);
    high1 = _mm512_load_si512(t + 96);
  }
  QL_INLINE __m512i widen(__m256i bytes) const {
    const __m512i h = _mm512_cvtepi8_epi16(bytes);
    const __m512i low = _mm512_permutex2var_epi16(low0, h, low1);
    const __m512i high = _mm512_permutex2var_epi16(high0, h, high1);
    const __m512i magnitude = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(h, _mm512_set1_epi16(0x40)), low, high);
    return _mm512_ternarylogic_epi32(magnitude, h, _mm512_set1_epi16(static_cast<short>(0x8000)), 0xF8);  // a | (b & c)
  }
  QL_INLINE __m512i load(const uint8_t* row, int64_t i) const {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i)));
  }
  QL_INLINE __m512i load_tail(const uint8_t* row, int64_t i, int64_t len) const {
    return widen(_mm256_maskz_loadu_epi8(first_bytes(len), row + i));
  }
};

// bfloat16 bits of (i & 15) - `offset` for each 5-bit index i (a vpermw table; bit 4 ignored).
QL_INLINE __m512i nibble_table(int offset) {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = from_f32<bf16>(static_cast<float>((i & 15) - offset));
  return _mm512_load_si512(t);
}

// int4 codes packed 8 to a word along K (code i of a word in bits 4i..4i+3, stored + 8): 16 bytes
// hold 32 codes, the low nibbles (even K) then the high nibbles (odd K) after one table lookup.
struct Int4Codes {
  static constexpr int kOrder = kEvenThenOdd;
  static constexpr float kFactor = 1.0f;
  __m512i table = nibble_table(8);
  QL_INLINE __m512i widen(__m128i bytes) const {
    const __m256i v = _mm256_cvtepu8_epi16(bytes);
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    return _mm512_permutexvar_epi16(both, table);
  }
  QL_INLINE __m512i load(const uint8_t* row, int64_t i) const {
    return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i / 2)));
  }
  QL_INLINE __m512i load_tail(const uint8_t* row, int64_t i, int64_t len) const {
    return widen(_mm_maskz_loadu_epi8(first_bytes16((len + 1) / 2), row + i / 2));
  }
};

// A column tile already decoded: rows of bfloat16 codes, zero-padded to a multiple of 32.
struct ScratchCodes {
  QL_INLINE __m512i load(const uint8_t* row, int64_t i) const {
    return _mm512_loadu_si512(reinterpret_cast<const bf16*>(row) + i);
  }
  QL_INLINE __m512i load_tail(const uint8_t* row, int64_t i, int64_t) const { return load(row, i); }
};

// The next tile's codes, fetched into L2 while this tile computes: a weight streamed from memory
// is read in short runs (C rows of K at a time, a tile's rows in turn), which the hardware
// prefetchers do not follow across rows and pages, so the loads would wait on DRAM. `lines` per
// step spreads the range over the first pass of the tile.
struct Prefetch {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t lines = 0;
  // spread what is left over `steps` steps
  QL_INLINE void pace(int64_t steps) {
    lines = next < end && steps > 0 ? cdiv((end - next + 63) / 64, steps) : 0;
  }
  QL_INLINE void step() {
    for (int64_t j = 0; j < lines && next < end; ++j, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// The codes of the tile after [n0, n0 + cols) in [n0, limit) columns (none past the thread's share).
QL_INLINE Prefetch next_tile(const Weight& w, int64_t n0, int64_t cols, int64_t limit) {
  Prefetch pf;
  const int64_t b = n0 + cols, e = std::min(limit, b + kScratchCols);
  if (b < e) {
    pf.next = reinterpret_cast<const char*>(w.codes + b * w.row_bytes);
    pf.end = reinterpret_cast<const char*>(w.codes + e * w.row_bytes);
  }
  return pf;
}

// The register tile: R rows of x by C weight rows, over all of K. Per period (a scale group, or all
// of K when !kGrouped), acc = sum x * code, less z * (the period's sum of x) where there are zero
// points, and total += acc * scale (times x's scale of the row and period where xscale is given:
// W8A8, x its codes). x is bfloat16 (kF32X: float32, each 32 positions as the even positions' 16
// values then the odd ones', so that a decoded bfloat16 vector's two halves line up), padded with
// zeros to whole 32s.
template <int R, int C, bool kGrouped, bool kF32X, class Src>
QL_INLINE void register_tile(const Src& src, const uint8_t* const* rows, const void* x, int64_t x_stride, int64_t k0,
                             int64_t k1, int64_t k, int64_t period, const float* sc, const float* zc,
                             const float* xsum, const float* xscale, int64_t periods, Prefetch& pf,
                             __m512 (&state)[R][C], float (&res)[R][C]) {
  __m512 acc[R][C];
  const bf16* xb = static_cast<const bf16*>(x);
  const float* xf = static_cast<const float*>(x);
  auto step = [&](int64_t i, int64_t len) __attribute__((always_inline)) {
    pf.step();
    __m512i wv[C];
    for (int c = 0; c < C; ++c) wv[c] = len >= 32 ? src.load(rows[c], i) : src.load_tail(rows[c], i, len);
    if constexpr (kF32X) {
      __m512 we[C], wo[C];
      for (int c = 0; c < C; ++c) avx512::unpack_bf16(wv[c], we[c], wo[c]);
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_loadu_ps(xf + r * x_stride + i), b = _mm512_loadu_ps(xf + r * x_stride + i + 16);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(b, wo[c], _mm512_fmadd_ps(a, we[c], acc[r][c]));
      }
    } else {
      const bf16* xi = xb + i * kInterleavedRows;  // interleaved (interleave_rows): step i / 32's rows
      for (int r = 0; r < R; ++r) {
        const __m512i a = _mm512_loadu_si512(xi + r * 32);
        for (int c = 0; c < C; ++c) acc[r][c] = dpbf16(acc[r][c], a, wv[c]);
      }
    }
  };
  // the sums of [p0, p1) into acc, less z * (the period's sum of x) where there are zero points
  // (applied once, with the period's last positions)
  auto span_sums = [&](int64_t p, int64_t p0, int64_t p1) __attribute__((always_inline)) {
    int64_t i = p0;
    for (; i + 32 <= p1; i += 32) step(i, 32);
    if (i < p1) step(i, p1 - i);
    if (zc && p1 == std::min(k, (p + 1) * period)) {
      for (int r = 0; r < R; ++r) {
        const __m512 xs = _mm512_zextps128_ps512(_mm_set_ss(xsum[r * periods + p]));  // lane 0 only
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fnmadd_ps(_mm512_set1_ps(zc[c * periods + p]), xs, acc[r][c]);
      }
    }
  };
  if constexpr (!kGrouped) {  // one period: the running sums wait in `state` between chunks
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = k0 == 0 ? _mm512_setzero_ps() : state[r][c];
    span_sums(0, k0, k1);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        if (k1 < k) state[r][c] = acc[r][c];
        else res[r][c] = hsum(acc[r][c]) * sc[c] * (xscale ? xscale[r * periods] : 1.0f);
      }
  } else {
    // a chunk holds whole periods; the running totals stay in `state` (memory: touched once a
    // period, their registers would spill the tile)
    if (k0 == 0)
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) state[r][c] = _mm512_setzero_ps();
    for (int64_t p0 = k0; p0 < k1; p0 += period) {
      const int64_t p = p0 / period;
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
      span_sums(p, p0, std::min(k1, p0 + period));
      for (int r = 0; r < R; ++r) {
        const float xs = xscale ? xscale[r * periods + p] : 1.0f;
        for (int c = 0; c < C; ++c)
          state[r][c] = _mm512_fmadd_ps(acc[r][c], _mm512_set1_ps(sc[c * periods + p] * xs), state[r][c]);
      }
    }
    if (k1 == k)
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) res[r][c] = hsum(state[r][c]);
  }
}

// Bytes of each x row a pass over a tile's column groups takes (K in chunks of whole periods): 8
// rows of it (16 KiB) stay in L1 while every group reads them.
constexpr int64_t kTileChunkBytes = 2048;

// Columns a register tile of R rows takes: about 16-24 of the 32 vector registers (a grouped
// tile's totals wait in `state`, so they take none; float32 x needs two registers per code vector).
template <bool kGrouped, bool kF32X>
constexpr int tile_cols(int rows) {
  if (rows == 1) return 8;
  if (rows == 2) return 4;
  if (rows <= 4) return kF32X ? 2 : 4;
  return kF32X ? 1 : 2;  // 5-8 rows: codes decoded in registers serve every row
}

// One call of register_tile for `rows` rows (1-8) of x from row m0, on columns [c0, c0 + cols) of a
// column tile whose scales/zeros are sc/zc, writing the results.
struct TileArgs {
  const void* x;
  int64_t x_stride, k, period, periods;
  const float* sc;
  const float* zc;
  const float* xsum;
  const float* xscale;  // W8A8: x's scale per (row, period), [m, periods]; else null
  const Output* out;
};

template <int R, bool kGrouped, bool kF32X, class Src>
static void run_rows(const Src& src, const uint8_t* const* tile_rows, int64_t tile_n0, int64_t tile_cols_count,
                     int64_t m0, const TileArgs& a, Prefetch& pf) {
  constexpr int C = tile_cols<kGrouped, kF32X>(R);
  const size_t x_elem = kF32X ? sizeof(float) : sizeof(bf16);
  const void* x = static_cast<const char*>(a.x) + m0 * a.x_stride * x_elem;
  const float* xsum = a.xsum ? a.xsum + m0 * a.periods : nullptr;
  const float* xscale = a.xscale ? a.xscale + m0 * a.periods : nullptr;
  pf.pace(cdiv(tile_cols_count, C) * cdiv(a.k, 32));
  constexpr int64_t kGroups = kScratchCols / C;
  __m512 state[kGroups][R][C];  // each column group's running sums (or totals) between K chunks
  const int64_t chunk_k = kTileChunkBytes / static_cast<int64_t>(x_elem);
  const int64_t chunk = kGrouped ? std::max<int64_t>(1, chunk_k / a.period) * a.period : chunk_k;
  for (int64_t k0 = 0; k0 < a.k; k0 += chunk) {
    const int64_t k1 = std::min(a.k, k0 + chunk);
    for (int64_t c0 = 0; c0 < tile_cols_count; c0 += C) {
      const uint8_t* rows[C];
      for (int c = 0; c < C; ++c) rows[c] = tile_rows[std::min<int64_t>(c0 + c, tile_cols_count - 1)];
      float res[R][C];
      register_tile<R, C, kGrouped, kF32X>(src, rows, x, a.x_stride, k0, k1, a.k, a.period, a.sc + c0 * a.periods,
                                            a.zc ? a.zc + c0 * a.periods : nullptr, xsum, xscale, a.periods, pf,
                                            state[c0 / C], res);
      if (k1 < a.k) continue;
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C && c0 + c < tile_cols_count; ++c) a.out->put(m0 + r, tile_n0 + c0 + c, res[r][c]);
    }
  }
}

template <bool kGrouped, bool kF32X, class Src>
static void run_row_block(int rows, const Src& src, const uint8_t* const* tile_rows, int64_t n0, int64_t cols,
                          int64_t m0, const TileArgs& a, Prefetch& pf) {
  with_rows<8>(rows, [&](auto r) {
    run_rows<decltype(r)::value, kGrouped, kF32X>(src, tile_rows, n0, cols, m0, a, pf);
  });
}

// ---- many rows of bfloat16 x: outer products over a column tile decoded pairs-major -----------------
//
// A tile's codes are decoded once into `pairs`: vector q holds, in 32-bit lane j, column n0 + j's
// codes at the q-th pair of K positions (in the decoder's order, which x is laid out in). Each row
// of x then multiplies one vector of 16 columns per pair step against its broadcast pair of x
// (vdpbf16ps), so every lane is one column's dot product: the scales and zero points of a period
// apply to 16 columns at once and no horizontal sums are left.

// v[c] lane j -> v[j] lane c, for 16 vectors of 16 32-bit lanes.
QL_INLINE void transpose16x16(__m512i (&v)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  // u[4b + j]: rows 4b..4b+3 at columns j, j + 4, j + 8, j + 12 (one column per 128 bits)
  for (int b = 0; b < 4; ++b) {
    u[4 * b + 0] = _mm512_unpacklo_epi64(t[4 * b], t[4 * b + 2]);
    u[4 * b + 1] = _mm512_unpackhi_epi64(t[4 * b], t[4 * b + 2]);
    u[4 * b + 2] = _mm512_unpacklo_epi64(t[4 * b + 1], t[4 * b + 3]);
    u[4 * b + 3] = _mm512_unpackhi_epi64(t[4 * b + 1], t[4 * b + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i a = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
    const __m512i b = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i d = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    v[j] = _mm512_shuffle_i32x4(a, c, 0x88);
    v[j + 8] = _mm512_shuffle_i32x4(a, c, 0xDD);
    v[j + 4] = _mm512_shuffle_i32x4(b, d, 0x88);
    v[j + 12] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
}

// The tile's codes (cols columns; the last repeated to 16) over K padded to kp as kp / 2 pair
// vectors, and its scales and zero points as [periods][16] (from tile_scales' [cols][periods]).
template <class Src>
static void decode_pairs(const Src& src, const uint8_t* const* rows, int64_t cols, int64_t k, int64_t kp,
                         const float* sc, const float* zc, int64_t periods, __m512i* pairs, float* sc_t, float* zc_t,
                         Prefetch& pf) {
  for (int64_t i = 0; i < kp; i += 32) {
    pf.step();
    __m512i v[16];
    for (int c = 0; c < 16; ++c) {
      const uint8_t* row = rows[std::min<int64_t>(c, cols - 1)];
      v[c] = i + 32 <= k ? src.load(row, i) : src.load_tail(row, i, std::max<int64_t>(k - i, 0));
    }
    transpose16x16(v);
    for (int j = 0; j < 16; ++j) _mm512_storeu_si512(pairs + i / 2 + j, v[j]);
  }
  for (int64_t p = 0; p < periods; ++p)
    for (int c = 0; c < 16; ++c) {
      const int64_t from = std::min<int64_t>(c, cols - 1) * periods + p;
      sc_t[p * 16 + c] = sc[from];
      if (zc) zc_t[p * 16 + c] = zc[from];
    }
}

// R rows of x (bfloat16, rows x_stride apart, in the decoder's order, zero past K) times the tile's
// pairs: per period, acc = sum over its pairs, less z * (the period's sum of x), total += acc *
// scale (times x's scale of the row and period: W8A8). out[r][j]: column j's result for row r.
template <int R>
static void pairs_rows(const __m512i* pairs, const bf16* x, int64_t x_stride, int64_t k, int64_t kp, int64_t period,
                       int64_t periods, const float* sc_t, const float* zc_t, const float* xsum, const float* xscale,
                       float (*out)[16]) {
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < periods; ++p) {
    const int64_t q0 = p * period / 2, q1 = p + 1 == periods ? kp / 2 : std::min(k, (p + 1) * period) / 2;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t q = q0; q < q1; ++q) {
      const __m512i w = _mm512_loadu_si512(pairs + q);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * x_stride + 2 * q, sizeof pair);
        acc[r] = dpbf16(acc[r], w, _mm512_set1_epi32(pair));
      }
    }
    const __m512 s = _mm512_loadu_ps(sc_t + p * 16);
    if (zc_t) {
      const __m512 z = _mm512_loadu_ps(zc_t + p * 16);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fnmadd_ps(z, _mm512_set1_ps(xsum[r * periods + p]), acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 scale = xscale ? _mm512_mul_ps(s, _mm512_set1_ps(xscale[r * periods + p])) : s;
      total[r] = _mm512_fmadd_ps(acc[r], scale, total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], total[r]);
}

constexpr int64_t kPairsRows = 8;  // rows a pass over the tile's pairs takes

static void run_pairs_rows(int rows, const __m512i* pairs, const bf16* x, int64_t x_stride, int64_t k, int64_t kp,
                           int64_t period, int64_t periods, const float* sc_t, const float* zc_t, const float* xsum,
                           const float* xscale, float (*out)[16]) {
  with_rows<8>(rows, [&](auto r) {
    pairs_rows<decltype(r)::value>(pairs, x, x_stride, k, kp, period, periods, sc_t, zc_t, xsum, xscale, out);
  });
}

// x prepared for the tiles: its rows in the decoder's order of each 32 positions, zero-padded to kp
// (bfloat16 x as bfloat16; float32 / float16 x as float32 in even/odd halves; xp null: none), and
// where zero points need it (xsum not null) each period's sum of x (float32).
static void prepare_x(const void* x, int32_t dtype, int64_t m, int64_t k, int64_t kp, int order, bool f32, void* xp,
                      int64_t group_k, int64_t periods, float* xsum) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i0 = 0; xp && i0 < kp; i0 += 32) {
      for (int j = 0; j < 32; ++j) {
        // the K position of slot j of this chunk
        const int64_t i = i0 + (order == kEvenThenOdd ? (j < 16 ? 2 * j : 2 * (j - 16) + 1) : j);
        const int64_t slot = f32 ? i0 + (j % 2 ? 16 + j / 2 : j / 2) : i0 + j;
        if (f32) {
          static_cast<float*>(xp)[r * kp + slot] = i < k ? load_f32(x, dtype, r * k + i) : 0.0f;
        } else {
          static_cast<bf16*>(xp)[r * kp + slot] = i < k ? static_cast<const bf16*>(x)[r * k + i] : bf16{0};
        }
      }
    }
    if (xsum) {
      for (int64_t p = 0; p < periods; ++p) {
        float s = 0.0f;
        for (int64_t i = p * group_k; i < std::min(k, (p + 1) * group_k); ++i) s += load_f32(x, dtype, r * k + i);
        xsum[r * periods + p] = s;
      }
    }
  }
}

// The rows-of-K weight-only GEMM on decoder Src: the threads split N into tiles of kScratchCols
// columns; a tile runs on codes decoded in registers (few rows, bfloat16 x) or decoded once into the
// thread's scratch. xscale: W8A8's x scales per (row, period) (x its codes), or null.
template <bool kGrouped, bool kF32X, class Src>
static void rows_fast(const Weight& w, const Src& src, const void* xp, int64_t kp, const float* xsum,
                      const float* xscale, int64_t m, const Output& out, int threads) {
  const int64_t n = w.n, periods = w.periods();
  const bool direct = !kF32X && m <= kDirectMaxRows;
  if (direct) xp = interleave_rows(xp, m, kp * static_cast<int64_t>(sizeof(bf16)));  // the register tiles read it so
#pragma omp parallel num_threads(threads)
  {
    float* sc = thread_buffer<float>(kScaleSlot, kScratchCols * periods);
    float* zc = w.zero_kind ? thread_buffer<float>(kZeroSlot, kScratchCols * periods) : nullptr;
    bf16* scratch = direct ? nullptr : thread_buffer<bf16>(kScratchSlot, kScratchCols * kp);
    TileArgs a{xp, kp, w.k, w.group_k, periods, sc, zc, xsum, xscale, &out};
    int64_t begin, end;
    share(cdiv(n, kScratchCols), omp_get_thread_num(), omp_get_num_threads(), begin, end);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * kScratchCols, cols = std::min(kScratchCols, n - n0);
      tile_scales(w, n0, cols, Src::kFactor, sc, zc);
      const uint8_t* rows[kScratchCols];
      for (int64_t c = 0; c < cols; ++c) rows[c] = w.codes + (n0 + c) * w.row_bytes;
      Prefetch pf = next_tile(w, n0, cols, std::min(n, end * kScratchCols));
      if (direct) {
        run_row_block<kGrouped, kF32X>(static_cast<int>(m), src, rows, n0, cols, 0, a, pf);
        continue;
      }
      if constexpr (!kF32X) {  // more rows of bfloat16 x: outer products over the tile's pairs
        __m512i* pairs = reinterpret_cast<__m512i*>(thread_buffer<bf16>(kScratchSlot, 16 * kp + 32));
        float* sc_t = thread_buffer<float>(kPairScaleSlot, 16 * periods);
        float* zc_t = zc ? thread_buffer<float>(kPairZeroSlot, 16 * periods) : nullptr;
        pf.pace(kp / 32);  // the next tile, while this one decodes
        decode_pairs(src, rows, cols, w.k, kp, sc, zc, periods, pairs, sc_t, zc_t, pf);
        const bf16* xb = static_cast<const bf16*>(xp);
        for (int64_t m0 = 0; m0 < m; m0 += kPairsRows) {
          const int rows_now = static_cast<int>(std::min(kPairsRows, m - m0));
          float res[kPairsRows][16];
          run_pairs_rows(rows_now, pairs, xb + m0 * kp, kp, w.k, kp, w.group_k, periods, sc_t, zc_t,
                         xsum ? xsum + m0 * periods : nullptr, xscale ? xscale + m0 * periods : nullptr, res);
          for (int r = 0; r < rows_now; ++r)
            for (int64_t c = 0; c < cols; ++c) out.put(m0 + r, n0 + c, res[r][c]);
        }
        continue;
      }
      const uint8_t* scratch_rows[kScratchCols];
      for (int64_t c = 0; c < cols; ++c) {
        bf16* dst = scratch + c * kp;
        for (int64_t i = 0; i < kp; i += 32) {
          const __m512i v = i + 32 <= w.k ? src.load(rows[c], i) : src.load_tail(rows[c], i, std::max<int64_t>(w.k - i, 0));
          _mm512_storeu_si512(dst + i, v);
        }
        scratch_rows[c] = reinterpret_cast<const uint8_t*>(dst);
      }
      for (int64_t m0 = 0; m0 < m; m0 += 4)  // the first row block fetches the next tile
        run_row_block<kGrouped, kF32X>(static_cast<int>(std::min<int64_t>(4, m - m0)), ScratchCodes{}, scratch_rows,
                                       n0, cols, m0, a, pf);
    }
  }
}


// ---- AWQ: outer product over 128-column tiles ---------------------------------------------------------

// AWQ's nibble s of a word holds the word's column kAwqColumnOf[s] (the inverse of AWQ_NIBBLE_OF).
constexpr int kAwqColumnOf[8] = {0, 2, 4, 6, 1, 3, 5, 7};
constexpr int64_t kAwqWords = 16;  // words (of 8 columns) a tile spans: one vector of them
constexpr int64_t kAwqFetchAhead = 16;  // K rows ahead the decode-in-registers path prefetches

// The codes of K rows kk and kk + 1 of a tile's words (b: zero past K) as 8 vectors, vector s holding
// in 32-bit lane j the (kk, kk + 1) pair of nibble s of word j, in bfloat16 (unsigned codes):
// body(s, vector) for s = 0..7.
template <class Body>
QL_INLINE void awq_pairs(__m512i a, __m512i b, __m512i table, const Body& body) {
  const __mmask32 high = 0xAAAAAAAAu;
  const __m512i low_halves = _mm512_mask_blend_epi16(high, a, _mm512_slli_epi32(b, 16));
  const __m512i high_halves = _mm512_mask_blend_epi16(high, _mm512_srli_epi32(a, 16), b);
  body(0, _mm512_permutexvar_epi16(low_halves, table));
  body(1, _mm512_permutexvar_epi16(_mm512_srli_epi16(low_halves, 4), table));
  body(2, _mm512_permutexvar_epi16(_mm512_srli_epi16(low_halves, 8), table));
  body(3, _mm512_permutexvar_epi16(_mm512_srli_epi16(low_halves, 12), table));
  body(4, _mm512_permutexvar_epi16(high_halves, table));
  body(5, _mm512_permutexvar_epi16(_mm512_srli_epi16(high_halves, 4), table));
  body(6, _mm512_permutexvar_epi16(_mm512_srli_epi16(high_halves, 8), table));
  body(7, _mm512_permutexvar_epi16(_mm512_srli_epi16(high_halves, 12), table));
}

// Scales of period p for the tile's columns in awq_pairs' order: s[v] lane j = scale[p, 8 (w0 + j) +
// kAwqColumnOf[v]] (16-bit scales gathered as the aligned 32-bit pair holding them, never past the
// word's 8 columns).
QL_INLINE void awq_scales(const Awq& w, int64_t p, int64_t w0, __mmask16 words, __m512 (&s)[8]) {
  const __m512i j8 = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(8));
  const int64_t base = p * w.n + 8 * w0;
  for (int v = 0; v < 8; ++v) {
    const int col = kAwqColumnOf[v];
    if (w.scale_dtype == dtype_code::float32) {
      s[v] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), words, _mm512_add_epi32(j8, _mm512_set1_epi32(col)),
                                      static_cast<const float*>(w.scale) + base, 4);
      continue;
    }
    const __m512i pair = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), words,
                                                     _mm512_add_epi32(j8, _mm512_set1_epi32(col & ~1)),
                                                     static_cast<const uint16_t*>(w.scale) + base, 2);
    const __m512i half = (col & 1) ? _mm512_srli_epi32(pair, 16) : _mm512_and_si512(pair, _mm512_set1_epi32(0xffff));
    s[v] = w.scale_dtype == dtype_code::bfloat16 ? _mm512_castsi512_ps(_mm512_slli_epi32(half, 16))
                                                 : _mm512_cvtph_ps(_mm512_cvtepi32_epi16(half));
  }
}

// R rows of x (bfloat16, K padded to even, kp2 per row) times a tile of `words_count` words from w0,
// nibble vectors [V0, V0 + NV): per period of [p_begin, p_end), sums of x pairs times code pairs,
// less z * (the period's sum of x), times the scale, into tot_out[r][v] (lane j: word w0 + j; added
// to what it holds with `accumulate`). Codes decoded in registers, or read from `scratch` (one
// period's decoded pairs, p_end = p_begin + 1) where given.
template <int R, int V0, int NV>
static void awq_rows(const Awq& w, int64_t w0, int64_t words_count, const bf16* xp, int64_t kp2, const float* xsum,
                     const __m512i* scratch, int64_t p_begin, int64_t p_end, bool accumulate, float (*tot_out)[8][16]) {
  const int64_t words = w.n / 8, periods = w.periods();
  const __mmask16 mask = static_cast<__mmask16>(words_count >= 16 ? 0xffff : (1u << words_count) - 1);
  const __m512i table = nibble_table(0);
  __m512 total[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) total[r][v] = accumulate ? _mm512_loadu_ps(tot_out[r][V0 + v]) : _mm512_setzero_ps();
  for (int64_t p = p_begin; p < p_end; ++p) {
    const int64_t k0 = p * w.group_k, k1 = std::min(w.k, k0 + w.group_k);
    __m512 acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t kk = k0; kk < k1; kk += 2) {
      __m512i xb[R];
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, xp + r * kp2 + kk, sizeof pair);
        xb[r] = _mm512_set1_epi32(pair);
      }
      auto use = [&](int v, __m512i pairs) __attribute__((always_inline)) {
        if (v < V0 || v >= V0 + NV) return;
        for (int r = 0; r < R; ++r) acc[r][v - V0] = dpbf16(acc[r][v - V0], pairs, xb[r]);
      };
      if (scratch) {
        const __m512i* row = scratch + ((kk - k0) / 2) * 8;  // the one period decoded
        for (int v = V0; v < V0 + NV; ++v) use(v, _mm512_load_si512(row + v));
      } else {
        // the tile reads one line of each K row, rows n / 8 words apart: the prefetchers do not
        // follow, so the rows kAwqFetchAhead ahead are fetched here (clamped into the array)
        const int64_t ahead = std::min(kk + kAwqFetchAhead, w.k - 2);
        _mm_prefetch(reinterpret_cast<const char*>(w.codes + ahead * words + w0), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w.codes + (ahead + 1) * words + w0), _MM_HINT_T0);
        const __m512i a = _mm512_maskz_loadu_epi32(mask, w.codes + kk * words + w0);
        const __m512i b = kk + 1 < k1 ? _mm512_maskz_loadu_epi32(mask, w.codes + (kk + 1) * words + w0)
                                      : _mm512_setzero_si512();
        awq_pairs(a, b, table, use);
      }
    }
    __m512 sv[8];
    awq_scales(w, p, w0, mask, sv);
    const __m512i zw = _mm512_maskz_loadu_epi32(mask, w.zeros + p * words + w0);
    for (int v = 0; v < NV; ++v) {
      const int nib = V0 + v;
      const __m512 z = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(zw, 4 * nib), _mm512_set1_epi32(15)));
      for (int r = 0; r < R; ++r) {
        const __m512 corrected = _mm512_fnmadd_ps(z, _mm512_set1_ps(xsum[r * periods + p]), acc[r][v]);
        total[r][v] = _mm512_fmadd_ps(corrected, sv[nib], total[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(tot_out[r][V0 + v], total[r][v]);
}

// A period's decoded pairs of a tile: [pairs][8] vectors (kAwqScratchPairs pairs at most). The
// next period's K rows of the tile (a line each, rows n / 8 words apart, which the prefetchers do
// not follow) are fetched meanwhile, so they arrive while the row blocks run over this one.
static void awq_decode_period(const Awq& w, int64_t p, int64_t w0, __mmask16 mask, __m512i* scratch) {
  const int64_t words = w.n / 8, k0 = p * w.group_k, k1 = std::min(w.k, k0 + w.group_k);
  const __m512i table = nibble_table(0);
  for (int64_t kk = k0; kk < k1; kk += 2) {
    for (int64_t ahead = kk + w.group_k; ahead < std::min(w.k, kk + w.group_k + 2); ++ahead)
      _mm_prefetch(reinterpret_cast<const char*>(w.codes + ahead * words + w0), _MM_HINT_T0);
    const __m512i a = _mm512_maskz_loadu_epi32(mask, w.codes + kk * words + w0);
    const __m512i b = kk + 1 < k1 ? _mm512_maskz_loadu_epi32(mask, w.codes + (kk + 1) * words + w0) : _mm512_setzero_si512();
    __m512i* row = scratch + ((kk - k0) / 2) * 8;
    awq_pairs(a, b, table, [&](int v, __m512i pairs) __attribute__((always_inline)) { _mm512_storeu_si512(row + v, pairs); });
  }
}

static void awq_fast(const Awq& w, const bf16* xp, int64_t kp2, const float* xsum, int64_t m, const Output& out,
                     int threads) {
  const int64_t words = w.n / 8, periods = w.periods();
#pragma omp parallel num_threads(threads)
  {
    float (*tot)[8][16] = reinterpret_cast<float (*)[8][16]>(thread_buffer<float>(kScaleSlot, 4 * 8 * 16));
    int64_t begin, end;
    share(cdiv(words, kAwqWords), omp_get_thread_num(), omp_get_num_threads(), begin, end);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t w0 = tile * kAwqWords, count = std::min(kAwqWords, words - w0);
      auto emit = [&](int64_t m0, int rows) {
        for (int r = 0; r < rows; ++r)
          for (int v = 0; v < 8; ++v)
            for (int64_t j = 0; j < count; ++j) out.put(m0 + r, 8 * (w0 + j) + kAwqColumnOf[v], tot[r][v][j]);
      };
      if (m <= 2) {
        if (m == 1) awq_rows<1, 0, 8>(w, w0, count, xp, kp2, xsum, nullptr, 0, periods, false, tot);
        else awq_rows<2, 0, 8>(w, w0, count, xp, kp2, xsum, nullptr, 0, periods, false, tot);
        emit(0, static_cast<int>(m));
        continue;
      }
      // more rows: one period's codes decoded once into pairs (group_k / 2 x 8 vectors, in L1/L2),
      // then row blocks of 4 over them, half the nibble vectors at a time (4 x 4 accumulators),
      // each row's totals kept in `all` between periods
      const int64_t pairs_per_period = (w.group_k + 1) / 2;
      float* raw = thread_buffer<float>(kScratchSlot, static_cast<size_t>(pairs_per_period * 8 * 16 + 16));
      __m512i* scratch = reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(raw) + 63) & ~uintptr_t(63));
      float (*all)[8][16] = reinterpret_cast<float (*)[8][16]>(thread_buffer<float>(kZeroSlot, static_cast<size_t>(m * 8 * 16)));
      const __mmask16 mask = static_cast<__mmask16>(count >= 16 ? 0xffff : (1u << count) - 1);
      for (int64_t p = 0; p < periods; ++p) {
        awq_decode_period(w, p, w0, mask, scratch);
        for (int64_t m0 = 0; m0 < m; m0 += 4) {
          const int rows = static_cast<int>(std::min<int64_t>(4, m - m0));
          const bf16* xr = xp + m0 * kp2;
          const float* xs = xsum + m0 * periods;
          float (*t)[8][16] = all + m0;
          const bool more = p > 0;
          switch (rows) {
            case 1: awq_rows<1, 0, 8>(w, w0, count, xr, kp2, xs, scratch, p, p + 1, more, t); break;
            case 2: awq_rows<2, 0, 8>(w, w0, count, xr, kp2, xs, scratch, p, p + 1, more, t); break;
            case 3:
              awq_rows<3, 0, 4>(w, w0, count, xr, kp2, xs, scratch, p, p + 1, more, t);
              awq_rows<3, 4, 4>(w, w0, count, xr, kp2, xs, scratch, p, p + 1, more, t);
              break;
            default:
              awq_rows<4, 0, 4>(w, w0, count, xr, kp2, xs, scratch, p, p + 1, more, t);
              awq_rows<4, 4, 4>(w, w0, count, xr, kp2, xs, scratch, p, p + 1, more, t);
              break;
          }
        }
      }
      for (int64_t r = 0; r < m; ++r)
        for (int v = 0; v < 8; ++v)
          for (int64_t j = 0; j < count; ++j) out.put(r, 8 * (w0 + j) + kAwqColumnOf[v], all[r][v][j]);
    }
  }
}

#ifdef DUALOP_QLINEAR_VNNI
// ---- int8 W8A8 on VNNI --------------------------------------------------------------------------------

QL_INLINE __mmask64 first_bytes64(int64_t len) { return len >= 64 ? ~__mmask64(0) : (__mmask64(1) << len) - 1; }

// 64 weight codes of a row from K index i as unsigned bytes, code + 128 (packed int8 is stored so);
// lanes past len 0.
template <bool kPacked>
QL_INLINE __m512i uint8_codes(const uint8_t* row, int64_t i, int64_t len) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  if (len >= 64) {
    const __m512i v = _mm512_loadu_si512(row + i);
    return kPacked ? v : _mm512_xor_si512(v, flip);
  }
  const __mmask64 m = first_bytes64(len);
  const __m512i v = _mm512_maskz_loadu_epi8(m, row + i);
  return kPacked ? v : _mm512_maskz_mov_epi8(m, _mm512_xor_si512(v, flip));
}

QL_INLINE int32_t hsum_epi32(__m512i v) { return _mm512_reduce_add_epi32(v); }

// acc += the dword sums of a's unsigned bytes times b's signed ones (vpdpbusd). Written as one
// instruction on the accumulator in place: GCC's intrinsic gives the result its own register and
// copies it back, about one move per product in the tiles' loops (measured: a third of the time).
QL_INLINE __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// R rows of x (int8 codes, interleaved by interleave_rows, zero-padded) by C weight rows over K positions
// [k0, k1) of K, a chunk of whole periods (or of the one period when ungrouped): per period the
// int32 sum of (w + 128) * x less 128 * (the period's sum of x's codes, xsum), scaled by the period's
// weight scale (kGrouped; else one int32 sum over K, scaled once). Between chunks the running sums
// wait in `state` (the int32 sums ungrouped, the float32 totals grouped); the last chunk writes res.
template <int R, int C, bool kGrouped, bool kPacked>
QL_INLINE void w8a8_tile(const uint8_t* const* rows, const uint8_t* x, int64_t k0, int64_t k1, int64_t k,
                         int64_t period, const float* sc, int64_t periods, const int32_t* xsum, Prefetch& pf,
                         __m512i (&state)[R][C], float (&res)[R][C]) {
  __m512 total[R][C];
  __m512i acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      if constexpr (kGrouped) total[r][c] = k0 == 0 ? _mm512_setzero_ps() : _mm512_castsi512_ps(state[r][c]);
      else acc[r][c] = k0 == 0 ? _mm512_setzero_si512() : state[r][c];
    }
  const int64_t span = kGrouped ? period : k1 - k0;
  for (int64_t p0 = k0; p0 < k1; p0 += span) {
    const int64_t p1 = std::min(k1, p0 + span), p = kGrouped ? p0 / period : 0;
    if constexpr (kGrouped)
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
    // whole 64-byte steps, then the period's ragged end: no length test in the main loop
    auto step = [&](int64_t i, int64_t len) __attribute__((always_inline)) {
      __m512i wv[C];
      for (int c = 0; c < C; ++c) wv[c] = uint8_codes<kPacked>(rows[c], i, len);
      const uint8_t* xi = x + i * kInterleavedRows;  // step i / 64's rows, 64 bytes apart
      for (int r = 0; r < R; ++r) {
        const __m512i a = _mm512_loadu_si512(xi + r * 64);
        for (int c = 0; c < C; ++c) acc[r][c] = dpbusd(acc[r][c], wv[c], a);
      }
    };
    int64_t i = p0;
    for (; i + 64 <= p1; i += 64) {
      pf.step();
      step(i, 64);
    }
    if (i < p1) step(i, p1 - i);
    if constexpr (kGrouped) {
      for (int r = 0; r < R; ++r) {
        const int32_t offset = 128 * xsum[r * periods + p];
        for (int c = 0; c < C; ++c) {
          const __m512i exact = _mm512_mask_sub_epi32(acc[r][c], 1, acc[r][c], _mm512_set1_epi32(offset));
          total[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(sc[c * periods + p]), total[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      if (k1 < k) {
        state[r][c] = kGrouped ? _mm512_castps_si512(total[r][c]) : acc[r][c];
      } else if constexpr (kGrouped) {
        res[r][c] = hsum(total[r][c]);
      } else {
        res[r][c] = static_cast<float>(hsum_epi32(acc[r][c]) - 128 * xsum[r * periods]) * sc[c * periods];
      }
    }
}

// K positions a pass over a tile's column groups takes: 8 rows of x's codes over it (16 KiB) stay
// in L1 while every group reads them (a whole K of a wide layer's x would not: measured on
// 2048 x 5632 at 8 rows, the weights streamed from memory at 17 GB/s where 5632 x 2048's did at 27).
constexpr int64_t kW8a8ChunkK = 2048;

// Columns of a register tile of R rows: R * C int32 accumulators (and as many float32 totals when
// grouped) within the 32 vector registers. Ungrouped weights take up to 8 rows a pass (a weight
// vector serves 8 rows), grouped ones 4.
template <bool kGrouped>
constexpr int w8a8_cols(int rows) {
  if (rows == 1) return 8;
  if (rows == 2) return 4;
  if (rows <= 4) return kGrouped ? 2 : 4;
  return 2;
}
template <bool kGrouped>
constexpr int64_t kW8a8MaxRows = kGrouped ? 4 : 8;

template <int R, bool kGrouped, bool kPacked>
static void w8a8_rows(const uint8_t* const* tile_rows, int64_t n0, int64_t cols, int64_t m0, const uint8_t* xq,
                      int64_t kp, const float* xs, const int32_t* xsum, int64_t k, int64_t period, const float* sc,
                      int64_t periods, const Output& out, Prefetch& pf) {
  constexpr int C = w8a8_cols<kGrouped>(R);
  constexpr int64_t kGroups = kScratchCols / C;
  __m512i state[kGroups][R][C];  // each column group's running sums between K chunks
  const int64_t chunk = kGrouped ? std::max<int64_t>(1, kW8a8ChunkK / period) * period : kW8a8ChunkK;
  const uint8_t* x = xq + (m0 / kInterleavedRows) * kp * kInterleavedRows + (m0 % kInterleavedRows) * 64;  // interleaved
  pf.pace(cdiv(cols, C) * cdiv(k, 64));
  for (int64_t k0 = 0; k0 < k; k0 += chunk) {
    const int64_t k1 = std::min(k, k0 + chunk);
    for (int64_t c0 = 0; c0 < cols; c0 += C) {
      const uint8_t* rows[C];
      for (int c = 0; c < C; ++c) rows[c] = tile_rows[std::min<int64_t>(c0 + c, cols - 1)];
      float res[R][C];
      w8a8_tile<R, C, kGrouped, kPacked>(rows, x, k0, k1, k, period, sc + c0 * periods, periods, xsum + m0 * periods,
                                           pf, state[c0 / C], res);
      if (k1 < k) continue;
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C && c0 + c < cols; ++c) out.put(m0 + r, n0 + c0 + c, res[r][c] * xs[m0 + r]);
    }
  }
}

template <bool kGrouped, bool kPacked>
static void w8a8_fast(const Weight& w, const uint8_t* xq, int64_t kp, const float* xs, const int32_t* xsum, int64_t m,
                      const Output& out, int threads) {
  const int64_t n = w.n, periods = w.periods();
#pragma omp parallel num_threads(threads)
  {
    float* sc = thread_buffer<float>(kScaleSlot, kScratchCols * periods);
    int64_t begin, end;
    share(cdiv(n, kScratchCols), omp_get_thread_num(), omp_get_num_threads(), begin, end);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * kScratchCols, cols = std::min(kScratchCols, n - n0);
      tile_scales(w, n0, cols, 1.0f, sc, nullptr);
      const uint8_t* rows[kScratchCols];
      for (int64_t c = 0; c < cols; ++c) rows[c] = w.codes + (n0 + c) * w.row_bytes;
      Prefetch pf = next_tile(w, n0, cols, std::min(n, end * kScratchCols));  // during the first row block
      for (int64_t m0 = 0; m0 < m; m0 += kW8a8MaxRows<kGrouped>) {
        with_rows<kW8a8MaxRows<kGrouped>>(m - m0, [&](auto r) {
          w8a8_rows<decltype(r)::value, kGrouped, kPacked>(rows, n0, cols, m0, xq, kp, xs, xsum, w.k, w.group_k, sc,
                                                           periods, out, pf);
        });
      }
    }
  }
}
#endif  // DUALOP_QLINEAR_VNNI
}  // namespace dualop::qlinear::fast
#endif  // DUALOP_QLINEAR_BF16

// ---- entry points ---------------------------------------------------------------------------------------

namespace dualop::qlinear {
namespace {

bool is_float(int32_t dtype) {
  return dtype == dtype_code::float32 || dtype == dtype_code::bfloat16 || dtype == dtype_code::float16;
}

// x [m, k] of a float dtype, out [m, n] of x's dtype or float32, bias absent or [n] of a float dtype;
// sets m, k, n and the output.
bool read_io(const DualopArray* x, const DualopArray* bias, const DualopArray* out, int64_t& m, int64_t& k, int64_t& n,
             Output& o) {
  if (!x || x->ndim != 2 || !is_float(x->dtype) || !is_row_major(x)) return false;
  if (!out || out->ndim != 2 || !is_row_major(out) || (out->dtype != x->dtype && out->dtype != dtype_code::float32))
    return false;
  m = x->shape[0];
  k = x->shape[1];
  n = out->shape[1];
  if (out->shape[0] != m) return false;
  if (bias && (!is_dense(bias, bias->dtype, 1) || !is_float(bias->dtype) || bias->shape[0] != n)) return false;
  o = Output{out->data, out->dtype, n, data_of(bias), bias ? bias->dtype : dtype_code::float32};
  return true;
}

// scale [ceil(n / group_n), ceil(k / group_k)] of a float dtype.
bool read_scale(const DualopArray* scale, int64_t n, int64_t k, int64_t group_n, int64_t group_k, Weight& w) {
  if (group_n <= 0 || group_k <= 0 || !scale || scale->ndim != 2 || !is_float(scale->dtype) || !is_row_major(scale))
    return false;
  if (scale->shape[0] != cdiv(n, group_n) || scale->shape[1] != std::max<int64_t>(cdiv(k, group_k), 1)) return false;
  w.scale = scale->data;
  w.scale_dtype = scale->dtype;
  w.scale_cols = scale->shape[1];
  w.group_n = group_n;
  w.group_k = group_k;
  return true;
}

// codes [n, k] bytes (int8, fp8) or [n, words] int32 (packed) for `format`.
bool read_codes(const DualopArray* codes, int format, int64_t n, int64_t k, Weight& w) {
  if (!codes || codes->ndim != 2 || !is_row_major(codes) || codes->shape[0] != n) return false;
  w.format = format;
  w.codes = static_cast<const uint8_t*>(codes->data);
  w.n = n;
  w.k = k;
  switch (format) {
    case kInt8:
    case kFp8:
      w.row_bytes = k;
      return codes->dtype == dtype_code::uint8 && codes->shape[1] == k;
    case kInt4Packed:
      w.row_bytes = 4 * codes->shape[1];
      return codes->dtype == dtype_code::int32 && codes->shape[1] == cdiv(k, 8);
    case kInt8Packed:
      w.row_bytes = 4 * codes->shape[1];
      return codes->dtype == dtype_code::int32 && codes->shape[1] == cdiv(k, 4);
    default: return false;
  }
}

bool read_zero(const DualopArray* zero, int zero_kind, Weight& w) {
  w.zero_kind = zero_kind;
  if (zero_kind == kNoZero) return zero == nullptr;
  if (!zero || zero->ndim != 2 || !is_row_major(zero)) return false;
  const int64_t rows = cdiv(w.n, w.group_n), cols = std::max<int64_t>(cdiv(w.k, w.group_k), 1);
  w.zero = zero->data;
  w.zero_cols = zero->shape[1];
  if (zero->shape[1] != cols) return false;
  switch (zero_kind) {
    case kZeroInt8: return zero->dtype == dtype_code::uint8 && zero->shape[0] == rows;
    case kZeroInt32: return zero->dtype == dtype_code::int32 && zero->shape[0] == rows;
    case kZeroPacked4: return zero->dtype == dtype_code::int32 && zero->shape[0] == cdiv(rows, 8);
    case kZeroPacked8: return zero->dtype == dtype_code::int32 && zero->shape[0] == cdiv(rows, 4);
    default: return false;
  }
}

void write_bias_only(const Output& o, int64_t m) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < o.n; ++c) o.put(r, c, 0.0f);
}

// True when an [m, k] x [k, n] call has nothing to multiply: no rows or columns, or k = 0 (the
// output then holds the bias alone, written here).
bool nothing_to_multiply(const Output& o, int64_t m, int64_t n, int64_t k) {
  if (m == 0 || n == 0) return true;
  if (k == 0) write_bias_only(o, m);
  return k == 0;
}

#ifdef DUALOP_QLINEAR_BF16
template <bool kGrouped, class Src>
void rows_fast_for(const Weight& w, const Src& src, const void* x, int32_t x_dtype, int64_t m, const Output& out,
                   int threads) {
  const int64_t kp = cdiv(w.k, 32) * 32, periods = w.periods();
  const bool f32 = x_dtype != dtype_code::bfloat16;
  void* xp = f32 ? static_cast<void*>(thread_buffer<float>(kXSlot, m * kp)) : static_cast<void*>(thread_buffer<bf16>(kXSlot, m * kp));
  float* xsum = w.zero_kind ? thread_buffer<float>(kXSumSlot, m * periods) : nullptr;
  fast::prepare_x(x, x_dtype, m, w.k, kp, Src::kOrder, f32, xp, w.group_k, periods, xsum);
  if (f32) fast::rows_fast<kGrouped, true>(w, src, xp, kp, xsum, nullptr, m, out, threads);
  else fast::rows_fast<kGrouped, false>(w, src, xp, kp, xsum, nullptr, m, out, threads);
}

template <class Src>
void rows_fast_by_grouping(const Weight& w, const Src& src, const void* x, int32_t x_dtype, int64_t m,
                           const Output& out, int threads) {
  if (w.periods() > 1) rows_fast_for<true>(w, src, x, x_dtype, m, out, threads);
  else rows_fast_for<false>(w, src, x, x_dtype, m, out, threads);
}
#endif

}  // namespace
}  // namespace dualop::qlinear

// Weight-only GEMM on codes in rows of K: x [m, k] (float32, bfloat16, float16); codes [n, k] uint8
// (format 0 int8, 1 float8_e4m3fn: their bytes) or [n, words] int32 (2: int4 packed, 3: int8
// packed); scale [ceil(n / group_n), ceil(k / group_k)] float; zero_point per zero_kind (0 none,
// 1 int8 bytes and 2 int32 of the scale's shape, 3 / 4 int32 words of 4- / 8-bit codes packed along
// the scale's rows); bias [n] or absent; out [m, n] of x's dtype or float32. Returns 0, kBadArrays for
// arrays that disagree.
extern "C" int dualop_quantized_linear(const DualopArray* x, const DualopArray* codes, const DualopArray* scale,
                                       const DualopArray* zero_point, const DualopArray* bias, const DualopArray* out,
                                       int format, int zero_kind, int64_t group_n, int64_t group_k, int threads) {
  using namespace dualop;
  using namespace dualop::qlinear;
  int64_t m, k, n;
  Output o;
  Weight w;
  if (!read_io(x, bias, out, m, k, n, o) || !read_codes(codes, format, n, k, w) ||
      !read_scale(scale, n, k, group_n, group_k, w) || !read_zero(zero_point, zero_kind, w))
    return kBadArrays;
  if (nothing_to_multiply(o, m, n, k)) return 0;
  threads = dualop_team_size(threads);
#ifdef DUALOP_QLINEAR_BF16
  if (w.periods() == 1 || w.group_k % 32 == 0) {
    switch (format) {
      case kInt8: rows_fast_by_grouping(w, fast::Int8Codes{}, x->data, x->dtype, m, o, threads); return 0;
      case kFp8: rows_fast_by_grouping(w, fast::Fp8Codes{}, x->data, x->dtype, m, o, threads); return 0;
      case kInt4Packed: rows_fast_by_grouping(w, fast::Int4Codes{}, x->data, x->dtype, m, o, threads); return 0;
      case kInt8Packed: rows_fast_by_grouping(w, fast::Int8PackedCodes{}, x->data, x->dtype, m, o, threads); return 0;
      default: break;
    }
  }
#endif
  const std::vector<float> xf = rows_as_f32(x->data, x->dtype, m, k);
  rows_portable(w, xf.data(), m, o, threads);
  return 0;
}

// AWQ's GEMM layout: x [m, k]; codes [k, n / 8] and zero_point [ceil(k / group_k), n / 8] int32;
// scale [ceil(k / group_k), n] float; bias, out as for dualop_quantized_linear.
extern "C" int dualop_quantized_linear_awq(const DualopArray* x, const DualopArray* codes, const DualopArray* scale,
                                           const DualopArray* zero_point, const DualopArray* bias,
                                           const DualopArray* out, int64_t group_k, int threads) {
  using namespace dualop;
  using namespace dualop::qlinear;
  int64_t m, k, n;
  Output o;
  if (!read_io(x, bias, out, m, k, n, o) || group_k <= 0 || n % 8) return kBadArrays;
  const int64_t periods = cdiv(k, group_k);
  if (!is_dense(codes, dtype_code::int32, 2) || codes->shape[0] != k || codes->shape[1] != n / 8) return kBadArrays;
  if (!is_dense(zero_point, dtype_code::int32, 2) || zero_point->shape[0] != periods || zero_point->shape[1] != n / 8)
    return kBadArrays;
  if (!scale || scale->ndim != 2 || !is_float(scale->dtype) || !is_row_major(scale) || scale->shape[0] != periods ||
      scale->shape[1] != n)
    return kBadArrays;
  if (nothing_to_multiply(o, m, n, k)) return 0;
  Awq w{static_cast<const uint32_t*>(codes->data), static_cast<const uint32_t*>(zero_point->data), scale->data,
        scale->dtype, n, k, group_k};
  threads = dualop_team_size(threads);
#ifdef DUALOP_QLINEAR_BF16
  if (x->dtype == dtype_code::bfloat16 && group_k % 2 == 0) {
    const int64_t kp2 = k + (k & 1);
    bf16* xp = thread_buffer<bf16>(kXSlot, static_cast<size_t>(m * kp2));
    float* xsum = thread_buffer<float>(kXSumSlot, static_cast<size_t>(m * periods));
    fast::prepare_x(x->data, x->dtype, m, k, kp2, fast::kNatural, false, nullptr, group_k, periods, xsum);
    const bf16* xb = static_cast<const bf16*>(x->data);
    for (int64_t r = 0; r < m; ++r) {
      std::memcpy(xp + r * kp2, xb + r * k, static_cast<size_t>(k) * sizeof(bf16));
      if (k & 1) xp[r * kp2 + k] = 0;
    }
    fast::awq_fast(w, xp, kp2, xsum, m, o, threads);
    return 0;
  }
#endif
  const std::vector<float> xf = rows_as_f32(x->data, x->dtype, m, k);
  awq_portable(w, xf.data(), m, o, threads);
  return 0;
}

// int8 W8A8: x [m, k] quantized per row (input_scale absent) or by input_scale (one float element);
// codes [n, k] int8 bytes (format 0) or [n, k / 4] int32 words (3: int8 packed, + 128); scale
// [ceil(n / group_n), ceil(k / group_k)] float; bias, out as for dualop_quantized_linear.
extern "C" int dualop_quantized_linear_w8a8(const DualopArray* x, const DualopArray* codes, const DualopArray* scale,
                                            const DualopArray* input_scale, const DualopArray* bias,
                                            const DualopArray* out, int format, int64_t group_n, int64_t group_k,
                                            int threads) {
  using namespace dualop;
  using namespace dualop::qlinear;
  int64_t m, k, n;
  Output o;
  Weight w;
  if (format != kInt8 && format != kInt8Packed) return kBadArrays;
  if (!read_io(x, bias, out, m, k, n, o) || !read_codes(codes, format, n, k, w) ||
      !read_scale(scale, n, k, group_n, group_k, w))
    return kBadArrays;
  if (input_scale && (!is_float(input_scale->dtype) || element_count(input_scale) != 1)) return kBadArrays;
  if (nothing_to_multiply(o, m, n, k)) return 0;
  float static_scale = 0.0f;
  if (input_scale) static_scale = load_f32(input_scale->data, input_scale->dtype, 0);
  const float* given = input_scale ? &static_scale : nullptr;
  threads = dualop_team_size(threads);
  float* xs = thread_buffer<float>(kXSumSlot, static_cast<size_t>(m));
#ifdef DUALOP_QLINEAR_VNNI
  {
    // x's codes as signed bytes, rows padded with zeros past every 64-byte step a period may take,
    // and each (row, period)'s sum of codes
    const int64_t kp = cdiv(k, 64) * 64 + 64, periods = w.periods();
    uint8_t* xq = reinterpret_cast<uint8_t*>(thread_buffer<float>(kXSlot, static_cast<size_t>(m * kp / 4)));
    std::memset(xq, 0, static_cast<size_t>(m * kp));
    quantize_rows(x->data, x->dtype, m, k, given, xq, kp, xs, threads);
    int32_t* xsum = reinterpret_cast<int32_t*>(thread_buffer<float>(kZeroSlot, static_cast<size_t>(m * periods)));
    for (int64_t r = 0; r < m; ++r)
      for (int64_t p = 0; p < periods; ++p) {
        int32_t sum = 0;
        for (int64_t i = p * w.group_k; i < std::min(k, (p + 1) * w.group_k); ++i) sum += static_cast<int8_t>(xq[r * kp + i]);
        xsum[r * periods + p] = sum;
      }
    const uint8_t* xi = interleave_rows(xq, m, kp);
    const bool grouped = periods > 1, packed = format == kInt8Packed;
    if (grouped && packed) fast::w8a8_fast<true, true>(w, xi, kp, xs, xsum, m, o, threads);
    else if (grouped) fast::w8a8_fast<true, false>(w, xi, kp, xs, xsum, m, o, threads);
    else if (packed) fast::w8a8_fast<false, true>(w, xi, kp, xs, xsum, m, o, threads);
    else fast::w8a8_fast<false, false>(w, xi, kp, xs, xsum, m, o, threads);
    return 0;
  }
#endif
  std::vector<uint8_t> xq(static_cast<size_t>(m * k));
  quantize_rows(x->data, x->dtype, m, k, given, xq.data(), k, xs, threads);
  w8a8_portable(w, xq.data(), xs, m, o, threads);
  return 0;
}

// fp8 W8A8: x [m, k] quantized to float8_e4m3fn by x_groups (0: one scale, input_scale's (one float
// element) where given, else dynamic; 1: per row; 2: per row and group_k columns, as quant_fp8
// does) and multiplied as its codes; codes [n, k] float8_e4m3fn bytes; scale [ceil(n / group_n),
// ceil(k / group_k)] float; bias, out as for dualop_quantized_linear.
extern "C" int dualop_quantized_linear_fp8_w8a8(const DualopArray* x, const DualopArray* codes,
                                                const DualopArray* scale, const DualopArray* input_scale,
                                                const DualopArray* bias, const DualopArray* out, int x_groups,
                                                int64_t group_n, int64_t group_k, int threads) {
  using namespace dualop;
  using namespace dualop::qlinear;
  int64_t m, k, n;
  Output o;
  Weight w;
  if (!read_io(x, bias, out, m, k, n, o) || !read_codes(codes, kFp8, n, k, w) ||
      !read_scale(scale, n, k, group_n, group_k, w))
    return kBadArrays;
  if (x_groups < kXPerTensor || x_groups > kXPerPeriod || (input_scale && x_groups != kXPerTensor)) return kBadArrays;
  if (input_scale && (!is_float(input_scale->dtype) || element_count(input_scale) != 1)) return kBadArrays;
  if (nothing_to_multiply(o, m, n, k)) return 0;
  float static_scale = 0.0f;
  if (input_scale) static_scale = load_f32(input_scale->data, input_scale->dtype, 0);
  const float* given = input_scale ? &static_scale : nullptr;
  threads = dualop_team_size(threads);
  const int64_t periods = w.periods();
  float* xs = thread_buffer<float>(kXSumSlot, static_cast<size_t>(m * periods));
#ifdef DUALOP_QLINEAR_BF16
  if (periods == 1 || group_k % 32 == 0) {  // x's codes as bfloat16 (whatever x's dtype) on the weight-only tiles
    const int64_t kp = cdiv(k, 32) * 32;
    bf16* xq = thread_buffer<bf16>(kXSlot, static_cast<size_t>(m * kp));
    quantize_fp8_rows(x->data, x->dtype, m, k, x_groups, given, group_k, periods, xq, nullptr, kp, xs, threads);
    if (periods > 1) fast::rows_fast<true, false>(w, fast::Fp8Codes{}, xq, kp, nullptr, xs, m, o, threads);
    else fast::rows_fast<false, false>(w, fast::Fp8Codes{}, xq, kp, nullptr, xs, m, o, threads);
    return 0;
  }
#endif
  std::vector<float> xq(static_cast<size_t>(m * k));
  quantize_fp8_rows(x->data, x->dtype, m, k, x_groups, given, group_k, periods, nullptr, xq.data(), k, xs, threads);
  fp8_w8a8_portable(w, xq.data(), xs, m, o, threads);
  return 0;
}
