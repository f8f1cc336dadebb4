// Ragged paged attention on the CPU. Semantics: dualop/ops/attention.py (forward_native).
//
// One task is (sequence, KV head, block of up to kRows query rows): it walks the sequence's KV
// positions once, reading each K and V row of its head straight from its page (no gathered copy),
// and updates an online softmax in float32 for the block's G * rows query vectors (G = Hq / Hkv,
// the query heads sharing that KV head), a block of KV positions at a time (one rescale per block,
// the weights by a vectorised exp; the block's scores by block_scores). So decode reads every
// cached K/V row once. Tasks run in parallel (OpenMP). Metadata is validated by the op; here it
// is clamped anyway (num_seqs to [0, S], cu_q_lens to [0, T] and non-decreasing, kv_lens to
// [0, pages_per_seq * page_size], page ids to [0, num_pages)), so no value reads out of bounds. Rows outside every
// sequence are left alone (the caller zeroes the padding rows); positions from kv_len on are
// never read.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace dualop {
namespace {

constexpr int64_t kRows = 8;
constexpr int64_t kBlock = 32;  // KV positions whose K/V rows are converted and scored together

struct Shape {
  int64_t tokens, q_heads, kv_heads, head_dim, num_pages, page_size, pages_per_seq, max_seqs;
};

struct Options {
  float scale;       // sm_scale * k_scale
  int64_t window;    // 0: none
  float soft_cap;    // 0: none
  bool custom_mask;  // a mask value was given: masked positions below kv_len take it
  float mask_value;
  float v_scale;
};

int64_t clamp64(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

// The scores q . k of one query vector against the first nb positions of a block: K of the block
// transposed (kt[i * kBlock + b]), each score one fused multiply-add chain over the head dim, the
// chains of the block's positions side by side (vectorised across positions). A chain whose sum
// overflows ends at +-inf (an FMA never takes it back), so a non-finite score is recomputed in
// double, where products and sums of float32 values cannot overflow: a score of finite inputs is
// the float32 rounding of its exact value (+-inf past float32's range), never NaN, whatever the
// summation order, as the native body's scores are (ops/attention.py, overflow_safe_scores).
void block_scores(const float* q, const float* kt, int64_t d, int64_t nb, float* out) {
  float acc[kBlock] = {};
  for (int64_t i = 0; i < d; ++i) {
    const float qi = q[i];
    const float* row = kt + i * kBlock;
    for (int64_t b = 0; b < kBlock; ++b) acc[b] = std::fma(qi, row[b], acc[b]);
  }
  for (int64_t b = 0; b < nb; ++b) {
    out[b] = acc[b];
    if (!std::isfinite(acc[b])) {
      double sum = 0.0;
      for (int64_t i = 0; i < d; ++i) sum += static_cast<double>(q[i]) * static_cast<double>(kt[i * kBlock + b]);
      out[b] = static_cast<float>(sum);
    }
  }
}

template <class T>
void run_task(const T* q, const T* kv, const int32_t* pages, T* out, const Shape& s, const Options& o,
              int64_t seq, int64_t head, int64_t row0, int64_t row1, int64_t q_start, int64_t q_len, int64_t kv_len) {
  const int64_t d = s.head_dim, group = s.q_heads / s.kv_heads, n = (row1 - row0) * group;
  const int64_t combined = 2 * s.kv_heads;
  std::vector<float> qf(n * d), acc(n * d, 0.0f), kt(d * kBlock, 0.0f), vf(kBlock * d), sc(kBlock), dots(kBlock),
      m(n, -INFINITY), l(n, 0.0f);
  std::vector<int64_t> pos(n);
  for (int64_t r = row0; r < row1; ++r) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t j = (r - row0) * group + g;
      const T* src = q + (r * s.q_heads + head * group + g) * d;
      for (int64_t i = 0; i < d; ++i) qf[j * d + i] = to_f32(src[i]);
      pos[j] = kv_len - q_len + (r - q_start);
    }
  }
  const int64_t last = o.custom_mask ? kv_len - 1 : std::min(kv_len - 1, pos[n - 1]);
  // Blocks of kBlock positions: their K and V rows converted once, then per query vector the
  // block's scores, one rescale of the running sums (when the block raises the max) and the
  // weights by the vectorised exp_f32 (a masked position's -inf weighs exactly 0).
  for (int64_t p0 = 0; p0 <= last; p0 += kBlock) {
    const int64_t nb = std::min(kBlock, last + 1 - p0);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t p = p0 + b;
      const int64_t page = clamp64(pages[seq * s.pages_per_seq + p / s.page_size], 0, s.num_pages - 1);
      const T* krow = kv + ((page * s.page_size + p % s.page_size) * combined + 2 * head) * d;
      for (int64_t i = 0; i < d; ++i) kt[i * kBlock + b] = to_f32(krow[i]);
      for (int64_t i = 0; i < d; ++i) vf[b * d + i] = to_f32(krow[d + i]);
    }
    for (int64_t j = 0; j < n; ++j) {
      const float* qj = &qf[j * d];
      float block_max = -INFINITY;
      block_scores(qj, kt.data(), d, nb, dots.data());
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t p = p0 + b;
        const bool allowed = p <= pos[j] && (o.window == 0 || p > pos[j] - o.window);
        float score = o.custom_mask ? o.mask_value : -INFINITY;
        if (allowed) {
          score = dots[b] * o.scale;
          if (o.soft_cap != 0.0f) score = o.soft_cap * std::tanh(score / o.soft_cap);
        }
        sc[b] = score;
        block_max = std::max(block_max, score);
      }
      if (block_max == -INFINITY) continue;  // nothing in this block counts for this query
      float* aj = &acc[j * d];
      if (block_max > m[j]) {
        const float alpha = exp_f32(m[j] - block_max);  // exp(-inf) = 0 on the first block
        for (int64_t i = 0; i < d; ++i) aj[i] *= alpha;
        l[j] *= alpha;
        m[j] = block_max;
      }
      const float mj = m[j];
      float total = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        sc[b] = exp_f32(sc[b] - mj);
        total += sc[b];
      }
      l[j] += total;
      for (int64_t b = 0; b < nb; ++b) {
        const float w = sc[b];
        const float* vb = &vf[b * d];
        for (int64_t i = 0; i < d; ++i) aj[i] += w * vb[i];
      }
    }
  }
  for (int64_t r = row0; r < row1; ++r) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t j = (r - row0) * group + g;
      const float norm = o.v_scale / l[j];
      T* dst = out + (r * s.q_heads + head * group + g) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = from_f32<T>(acc[j * d + i] * norm);
    }
  }
}

struct Task {
  int64_t seq, head, row0, row1, start, end;  // rows [row0, row1) of the sequence's [start, end)
};

template <class T>
int run(const void* q, const void* kv, const int32_t* kv_lens, const int32_t* pages, const int32_t* cu,
        int32_t num_seqs, void* out, const Shape& s, const Options& o, int threads) {
  const int64_t count = clamp64(num_seqs, 0, s.max_seqs), span = s.pages_per_seq * s.page_size;
  std::vector<Task> tasks;
  // cu_q_lens clipped to [0, T] and made non-decreasing (a running max), as every path reads it
  int64_t end = count > 0 ? clamp64(cu[0], 0, s.tokens) : 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t start = end;
    end = std::max(start, clamp64(cu[i + 1], 0, s.tokens));
    if (clamp64(kv_lens[i], 0, span) < end - start) continue;  // invalid (refused by the op): no row
    for (int64_t r = start; r < end; r += kRows)
      for (int64_t h = 0; h < s.kv_heads; ++h) tasks.push_back({i, h, r, std::min(r + kRows, end), start, end});
  }
  const auto* qt = static_cast<const T*>(q);
  const auto* kvt = static_cast<const T*>(kv);
  auto* ot = static_cast<T*>(out);
#pragma omp parallel for schedule(dynamic) num_threads(threads)
  for (int64_t t = 0; t < static_cast<int64_t>(tasks.size()); ++t) {
    const Task& task = tasks[t];
    run_task<T>(qt, kvt, pages, ot, s, o, task.seq, task.head, task.row0, task.row1, task.start,
                task.end - task.start, clamp64(kv_lens[task.seq], 0, span));
  }
  return 0;
}

}  // namespace
}  // namespace dualop

// q, out: row-major [tokens, q_heads, head_dim] of one float dtype; kv_pages: row-major [num_pages,
// page_size, 2 * kv_heads, head_dim] of q's dtype (K and V heads interleaved); kv_lens int32 [S],
// page_indices int32 [S, pages_per_seq], cu_q_lens int32 [S + 1] (sequences past the shortest of
// them are not read). Returns 0, 1 for an unknown dtype, kBadArrays for arrays that disagree.
extern "C" int dualop_ragged_paged_attention(const DualopArray* q, const DualopArray* kv_pages,
                                             const DualopArray* kv_lens, const DualopArray* page_indices,
                                             const DualopArray* cu_q_lens, int32_t num_seqs, const DualopArray* out,
                                             float scale, int64_t window, float soft_cap, int custom_mask,
                                             float mask_value, float v_scale, int threads) {
  using namespace dualop;
  if (!q || q->ndim != 3 || !is_row_major(q) || !is_dense_like(out, q)) return kBadArrays;
  if (!is_dense(kv_pages, q->dtype, 4) || kv_pages->shape[3] != q->shape[2]) return kBadArrays;
  if (!is_dense(kv_lens, dtype_code::int32, 1) || !is_dense(page_indices, dtype_code::int32, 2) ||
      !is_dense(cu_q_lens, dtype_code::int32, 1))
    return kBadArrays;
  const int64_t max_seqs =
      std::min({page_indices->shape[0], kv_lens->shape[0], std::max<int64_t>(cu_q_lens->shape[0] - 1, 0)});
  const Shape s{q->shape[0],        q->shape[1],        kv_pages->shape[2] / 2,  q->shape[2],
                kv_pages->shape[0], kv_pages->shape[1], page_indices->shape[1], max_seqs};
  const Options o{scale, window, soft_cap, custom_mask != 0, mask_value, v_scale};
  const auto* lens = static_cast<const int32_t*>(kv_lens->data);
  const auto* pages = static_cast<const int32_t*>(page_indices->data);
  const auto* cu = static_cast<const int32_t*>(cu_q_lens->data);
  switch (q->dtype) {
    case dtype_code::float32: return run<float>(q->data, kv_pages->data, lens, pages, cu, num_seqs, out->data, s, o, threads);
    case dtype_code::bfloat16: return run<bf16>(q->data, kv_pages->data, lens, pages, cu, num_seqs, out->data, s, o, threads);
    case dtype_code::float16: return run<f16>(q->data, kv_pages->data, lens, pages, cu, num_seqs, out->data, s, o, threads);
    default: return 1;
  }
}
