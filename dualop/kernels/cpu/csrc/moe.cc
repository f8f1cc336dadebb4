// Mixture-of-experts pieces on the CPU (semantics: dualop.kernels.moe_math).
//
// dualop_moe_grouped_linear: out[r, n] = sum_k x[r, k] * w[e(r), n, k] in float32, for rows r
// grouped by expert (rows group_start[g] .. group_end[g] - 1 use expert group_expert[g]; rows of
// no group are left untouched). x is
// float32 (the token rows, or the float32 activation: it is never rounded to 16 bits); the weights
// stay in their dtype and are widened in registers, so a 16-bit layer's weights are read once, at
// their own size (decode is weight-bandwidth bound). Each weight row is used for four token rows
// at a time while it is in L1.
//
// dualop_grouped_topk: moe_math.route per row: softmax or sigmoid scores, optional correction bias,
// optional expert groups, top-k with ties to the lower index, renormalisation and scaling.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"

namespace dualop {

template <class T>
DUALOP_INLINE void dot4(const float* __restrict x0, const float* __restrict x1, const float* __restrict x2,
                        const float* __restrict x3, const T* __restrict w, int64_t k, float* out, int64_t stride) {
  float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t i = 0; i < k; ++i) {
    const float wi = to_f32(w[i]);
    a0 += x0[i] * wi;
    a1 += x1[i] * wi;
    a2 += x2[i] * wi;
    a3 += x3[i] * wi;
  }
  out[0] = a0;
  out[stride] = a1;
  out[2 * stride] = a2;
  out[3 * stride] = a3;
}

template <class T>
DUALOP_INLINE float dot1(const float* __restrict x, const T* __restrict w, int64_t k) {
  float a = 0.0f;
#pragma omp simd reduction(+ : a)
  for (int64_t i = 0; i < k; ++i) a += x[i] * to_f32(w[i]);
  return a;
}

// Work items: (group, block of kBlockN output columns); each thread takes whole items.
constexpr int64_t kBlockN = 16;

template <class T>
static void grouped_linear(const float* x, const T* w, const int64_t* group_expert, const int64_t* group_start,
                           const int64_t* group_end, int64_t groups, float* out, int64_t n, int64_t k, int threads) {
  const int64_t blocks = (n + kBlockN - 1) / kBlockN;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t item = 0; item < groups * blocks; ++item) {
    const int64_t g = item / blocks, n0 = (item % blocks) * kBlockN;
    const int64_t n1 = n0 + kBlockN < n ? n0 + kBlockN : n;
    const T* we = w + group_expert[g] * n * k;
    const int64_t r0 = group_start[g], r1 = group_end[g];
    for (int64_t col = n0; col < n1; ++col) {
      const T* wr = we + col * k;
      int64_t r = r0;
      for (; r + 4 <= r1; r += 4)
        dot4(x + r * k, x + (r + 1) * k, x + (r + 2) * k, x + (r + 3) * k, wr, k, out + r * n + col, n);
      for (; r < r1; ++r) out[r * n + col] = dot1(x + r * k, wr, k);
    }
  }
}

template <class T>
DUALOP_INLINE float score_of(T logit, int scoring) {
  const float v = to_f32(logit);
  return scoring == 1 ? sigmoid_f32(v) : v;  // softmax is finished per row below
}

// Index of the largest value among the not-taken entries; ties (and -inf) go to the lower index.
DUALOP_INLINE int64_t arg_max_free(const float* v, const uint8_t* taken, int64_t count) {
  int64_t best = -1;
  for (int64_t i = 0; i < count; ++i) {
    if (taken[i]) continue;
    if (best < 0 || v[i] > v[best]) best = i;
  }
  return best;
}

template <class T>
static void grouped_topk(const T* logits, const float* bias, float* weights, int32_t* ids, int64_t tokens,
                         int64_t experts, int top_k, bool renormalize, int64_t groups, int topk_group, int scoring,
                         float scale, int threads) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> score(experts), choice(experts), group_score(groups > 1 ? groups : 1);
    std::vector<uint8_t> taken(experts), group_taken(groups > 1 ? groups : 1);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const T* row = logits + t * experts;
      for (int64_t e = 0; e < experts; ++e) score[e] = score_of(row[e], scoring);
      if (scoring == 0) {
        float m = neg_inf, sum = 0.0f;
        for (int64_t e = 0; e < experts; ++e) m = score[e] > m ? score[e] : m;
        for (int64_t e = 0; e < experts; ++e) {
          score[e] = exp_f32(score[e] - m);
          sum += score[e];
        }
        for (int64_t e = 0; e < experts; ++e) score[e] /= sum;
      }
      for (int64_t e = 0; e < experts; ++e) {
        choice[e] = bias ? score[e] + bias[e] : score[e];
        taken[e] = 0;
      }
      if (groups > 1) {
        const int64_t per = experts / groups;
        for (int64_t g = 0; g < groups; ++g) {
          const float* c = choice.data() + g * per;
          float best = neg_inf, second = neg_inf;
          for (int64_t i = 0; i < per; ++i) {
            if (c[i] > best) {
              second = best;
              best = c[i];
            } else if (c[i] > second) {
              second = c[i];
            }
          }
          group_score[g] = (bias && per > 1) ? best + second : best;
          group_taken[g] = 0;
        }
        const int keep = topk_group < groups ? topk_group : static_cast<int>(groups);
        for (int j = 0; j < keep; ++j) group_taken[arg_max_free(group_score.data(), group_taken.data(), groups)] = 1;
        for (int64_t e = 0; e < experts; ++e)
          if (!group_taken[e / per]) choice[e] = neg_inf;
      }
      float* w = weights + t * top_k;
      int32_t* id = ids + t * top_k;
      float total = 0.0f;
      for (int j = 0; j < top_k; ++j) {
        const int64_t e = arg_max_free(choice.data(), taken.data(), experts);
        taken[e] = 1;
        id[j] = static_cast<int32_t>(e);
        w[j] = bias ? score[e] : choice[e];
        total += w[j];
      }
      for (int j = 0; j < top_k; ++j) {
        float v = renormalize ? w[j] / total : w[j];
        if (scale != 1.0f) v *= scale;
        w[j] = v;
      }
    }
  }
}

}  // namespace dualop

extern "C" int dualop_moe_grouped_linear(int dtype, const float* x, const void* w, const int64_t* group_expert,
                                         const int64_t* group_start, const int64_t* group_end, int64_t groups,
                                         float* out, int64_t n, int64_t k, int threads) {
  using namespace dualop;
  switch (dtype) {
    case 0: grouped_linear(x, static_cast<const float*>(w), group_expert, group_start, group_end, groups, out, n, k, threads); return 0;
    case 1: grouped_linear(x, static_cast<const bf16*>(w), group_expert, group_start, group_end, groups, out, n, k, threads); return 0;
    case 2: grouped_linear(x, static_cast<const f16*>(w), group_expert, group_start, group_end, groups, out, n, k, threads); return 0;
    default: return -1;
  }
}

extern "C" int dualop_grouped_topk(int dtype, const void* logits, const float* bias, float* weights, int32_t* ids,
                                   int64_t tokens, int64_t experts, int top_k, int renormalize, int64_t groups,
                                   int topk_group, int scoring, float scale, int threads) {
  using namespace dualop;
  if (top_k < 1 || top_k > experts || (groups > 1 && experts % groups != 0)) return -2;
  switch (dtype) {
    case 0: grouped_topk(static_cast<const float*>(logits), bias, weights, ids, tokens, experts, top_k, renormalize,
                         groups, topk_group, scoring, scale, threads); return 0;
    case 1: grouped_topk(static_cast<const bf16*>(logits), bias, weights, ids, tokens, experts, top_k, renormalize,
                         groups, topk_group, scoring, scale, threads); return 0;
    case 2: grouped_topk(static_cast<const f16*>(logits), bias, weights, ids, tokens, experts, top_k, renormalize,
                         groups, topk_group, scoring, scale, threads); return 0;
    default: return -1;
  }
}
