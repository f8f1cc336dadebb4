// Absorbed MLA decode over a paged latent cache on the CPU. Semantics: dualop/ops/mla.py
// (forward_native); the caller (kernels/cpu/ragged_paged_mla_attention.py) hands over the
// sequences with few query rows (decode) and runs longer ones as GEMMs.
//
// One task is a sequence: its R query rows x H heads (R * H query vectors, float32, scaled) walk
// the sequence's cached latent rows once, a block of kBlock positions at a time: float32 rows read
// in their pages, 16-bit ones converted into a per-thread buffer (no gathered copy of the cache),
// each vector's scores (dot products over the whole latent + rope width; bfloat16 ones by
// vdpbf16ps on the rows in their pages where the host has AVX512-BF16), an online softmax
// in float32 (one rescale per block, the weights by exp_f32 over the block) and the output
// accumulated from the rows' first L channels. Positions past a query row's own (causal) and from
// kv_len on are never read. Sequences run in parallel (OpenMP). Metadata was validated by the op;
// here it is clamped anyway (cu_q_lens to [0, T], kv_lens to the page table's span, page ids to
// [0, num_pages)), so no value reads out of bounds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "avx512.h"  // DUALOP_HAVE_AVX512 where the host has it
#include "common.h"

namespace dualop {
namespace {

constexpr int64_t kBlock = 16;  // KV positions converted and scored together
constexpr int64_t kMaxRows = 8;  // query rows of one sequence this kernel takes
constexpr int64_t kChunk = 64;   // output channels accumulated in registers at a time

int64_t clamp64(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

struct Task {
  int64_t first_row, q_len, kv_len;
  const int32_t* table;  // the sequence's page ids
};

struct Dims {
  int64_t heads, width, latent, num_pages, page_size;
};

// scores[j] = q . rows[j] for the block's first n rows (kBlock float32 rows of width).
#ifdef DUALOP_HAVE_AVX512
// Sixteen rows at once: a lane-wise FMA chain per row (one load of q per 16 FMAs), then the 16
// chains' sums by avx512::sum_lanes16. Rows past n hold an earlier block's values (or zeros), never
// used.
static_assert(kBlock == 16, "block_scores sums one row per lane");
DUALOP_INLINE void block_scores(const float* q, const float* rows, int64_t width, int64_t n, float* scores) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= width; i += 16) {
    const __m512 qi = _mm512_loadu_ps(q + i);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(rows + j * width + i), acc[j]);
  }
  if (i < width) {
    const __mmask16 tail = avx512::first16(width - i);
    const __m512 qi = _mm512_maskz_loadu_ps(tail, q + i);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j)
      acc[j] = _mm512_fmadd_ps(qi, _mm512_maskz_loadu_ps(tail, rows + j * width + i), acc[j]);
  }
  _mm512_mask_storeu_ps(scores, avx512::first16(n), avx512::sum_lanes16(acc));
}
#else
DUALOP_INLINE void block_scores(const float* q, const float* rows, int64_t width, int64_t n, float* scores) {
  for (int64_t j = 0; j < n; ++j) {
    const float* __restrict row = rows + j * width;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < width; ++i) dot += q[i] * row[i];
    scores[j] = dot;
  }
}
#endif

#if defined(DUALOP_HAVE_AVX512) && defined(__AVX512BF16__)
#define DUALOP_MLA_BF16_DOT 1
// scores[j] = scale * (q . rows[j]) for bfloat16 q and rows, read where they lie: vdpbf16ps takes
// 32 element pairs per instruction (products exact in float32, sums in float32, as the native
// body's float32 einsum), half the instructions of converting and using float32 FMAs. Row
// pointers past n repeat row 0 (their scores are never used).
DUALOP_INLINE void block_scores_bf16(const bf16* q, const bf16* const (&rows)[16], int64_t width, int64_t n,
                                     float scale, float* scores) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= width; i += 32) {
    const __m512bh qi = (__m512bh)_mm512_loadu_si512(q + i);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], qi, (__m512bh)_mm512_loadu_si512(rows[j] + i));
  }
  if (i < width) {
    const __mmask32 tail = avx512::first32(width - i);  // lanes past the width read as +0.0
    const __m512bh qi = (__m512bh)_mm512_maskz_loadu_epi16(tail, q + i);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], qi, (__m512bh)_mm512_maskz_loadu_epi16(tail, rows[j] + i));
  }
  _mm512_mask_storeu_ps(scores, avx512::first16(n), _mm512_mul_ps(avx512::sum_lanes16(acc), _mm512_set1_ps(scale)));
}
#endif

template <class T>
void decode_sequence(const T* q, const T* pages, T* out, const Task& task, const Dims& d, float scale) {
  const int64_t vectors = task.q_len * d.heads, width = d.width, latent = d.latent;
  thread_local std::vector<float> q_store, rows_store, acc_store, stat_store;
  q_store.resize(vectors * width);
  rows_store.resize(kBlock * width);
  acc_store.resize(vectors * latent);
  stat_store.resize(vectors * (2 + kBlock));
  float* __restrict qf = q_store.data();
  float* __restrict converted = rows_store.data();  // the block's rows as float32, when not read in place
  // float32 rows are read in their page when every block lies in one page (blocks start at
  // multiples of kBlock); others are converted (or copied) into the buffer first
  const bool in_place = std::is_same_v<T, float> && d.page_size % kBlock == 0;
  float* __restrict acc = acc_store.data();
  float* __restrict m = stat_store.data();           // running max per vector
  float* __restrict l = m + vectors;                  // running denominator per vector
  float* __restrict s = l + vectors;                  // a block's scores, kBlock per vector
  for (int64_t v = 0; v < vectors; ++v) {
    const T* src = q + (task.first_row * d.heads + v) * width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) qf[v * width + i] = to_f32(src[i]) * scale;
    m[v] = -INFINITY;
    l[v] = 0.0f;
  }
  std::fill(acc, acc + vectors * latent, 0.0f);
  // the output reads the rows' first latent channels; the scores read all width of them, from
  // this buffer unless bfloat16 dot products read them in the page
#ifdef DUALOP_MLA_BF16_DOT
  const int64_t converted_width = std::is_same_v<T, bf16> ? latent : width;
#else
  const int64_t converted_width = width;
#endif
  for (int64_t p0 = 0; p0 < task.kv_len; p0 += kBlock) {
    const int64_t n = std::min(kBlock, task.kv_len - p0);
    const float* rows = converted;  // [kBlock][width]; rows past n: an earlier block's, never used
#ifdef DUALOP_MLA_BF16_DOT
    // bfloat16: the block's rows where they lie, for the scores (block_scores_bf16)
    const bf16* row_at[kBlock];
    if constexpr (std::is_same_v<T, bf16>) {
      for (int64_t j = 0; j < kBlock; ++j) {
        const int64_t pos = p0 + (j < n ? j : 0);
        const int64_t page = clamp64(task.table[pos / d.page_size], 0, d.num_pages - 1);
        row_at[j] = pages + (page * d.page_size + pos % d.page_size) * width;
      }
    }
#endif
    if (in_place) {
      const int64_t page = clamp64(task.table[p0 / d.page_size], 0, d.num_pages - 1);
      rows = reinterpret_cast<const float*>(pages + (page * d.page_size + p0 % d.page_size) * width);
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = p0 + j;
        const int64_t page = clamp64(task.table[pos / d.page_size], 0, d.num_pages - 1);
        const T* src = pages + (page * d.page_size + pos % d.page_size) * width;
        float* __restrict dst = converted + j * width;
#pragma omp simd
        for (int64_t i = 0; i < converted_width; ++i) dst[i] = to_f32(src[i]);
      }
    }
    for (int64_t r = 0; r < task.q_len; ++r) {
      const int64_t q_pos = task.kv_len - task.q_len + r;  // the row's own position: it sees up to it
      const int64_t seen = std::min(n, q_pos - p0 + 1);
      if (seen <= 0) continue;
      for (int64_t h = 0; h < d.heads; ++h) {
        const int64_t v = r * d.heads + h;
        const float* __restrict qv = qf + v * width;
        float* __restrict sv = s + v * kBlock;
#ifdef DUALOP_MLA_BF16_DOT
        if constexpr (std::is_same_v<T, bf16>)
          block_scores_bf16(q + (task.first_row * d.heads + v) * width, row_at, width, seen, scale, sv);
        else
          block_scores(qv, rows, width, seen, sv);
#else
        block_scores(qv, rows, width, seen, sv);
#endif
        float block_max = -INFINITY;
        for (int64_t j = 0; j < seen; ++j) block_max = sv[j] > block_max ? sv[j] : block_max;
        // NaN scores: the block's max ignores them and their weights stay NaN, as in the native softmax
        const float m_new = block_max > m[v] ? block_max : m[v];
        const float correction = m[v] == -INFINITY ? 0.0f : exp_f32(m[v] - m_new);
        const float shift = m_new == -INFINITY ? 0.0f : m_new;
        float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
        for (int64_t j = 0; j < seen; ++j) {
          const float w = exp_f32(sv[j] - shift);
          sv[j] = w;
          block_sum += w;
        }
        l[v] = l[v] * correction + block_sum;
        m[v] = m_new;
        float* __restrict av = acc + v * latent;  // rescaled by correction as each chunk is loaded
        // the block's weighted rows added kChunk output channels at a time, the chunk held in
        // registers over the block's positions
        int64_t c0 = 0;
        for (; c0 + kChunk <= latent; c0 += kChunk) {
          float a[kChunk];
#pragma omp simd
          for (int64_t c = 0; c < kChunk; ++c) a[c] = av[c0 + c] * correction;
          for (int64_t j = 0; j < seen; ++j) {
            const float w = sv[j];
            const float* __restrict row = rows + j * width + c0;
#pragma omp simd
            for (int64_t c = 0; c < kChunk; ++c) a[c] += w * row[c];
          }
#pragma omp simd
          for (int64_t c = 0; c < kChunk; ++c) av[c0 + c] = a[c];
        }
        if (c0 < latent) {
#pragma omp simd
          for (int64_t c = c0; c < latent; ++c) av[c] *= correction;
        }
        for (int64_t j = 0; j < seen && c0 < latent; ++j) {
          const float w = sv[j];
          const float* __restrict row = rows + j * width;
#pragma omp simd
          for (int64_t c = c0; c < latent; ++c) av[c] += w * row[c];
        }
      }
    }
  }
  for (int64_t v = 0; v < vectors; ++v) {
    T* dst = out + (task.first_row * d.heads + v) * latent;
    const float inv = 1.0f / l[v];
    const float* __restrict av = acc + v * latent;
#pragma omp simd
    for (int64_t c = 0; c < latent; ++c) dst[c] = from_f32<T>(av[c] * inv);
  }
}

template <class T>
void run(const DualopArray* q, const DualopArray* pages, const int32_t* lens, const int32_t* table, const int32_t* cu,
         const int64_t* seqs, int64_t count, T* out, const Dims& d, int64_t pages_per_seq, float scale, int threads) {
  const int64_t tokens = q->shape[0], span = pages_per_seq * d.page_size;
  std::vector<Task> tasks;
  tasks.reserve(count);
  for (int64_t k = 0; k < count; ++k) {
    const int64_t i = seqs[k];
    const int64_t begin = clamp64(cu[i], 0, tokens), end = clamp64(cu[i + 1], begin, tokens);
    const int64_t kv_len = clamp64(lens[i], 0, span), q_len = end - begin;
    if (q_len <= 0 || q_len > kMaxRows || kv_len < q_len) continue;
    tasks.push_back(Task{begin, q_len, kv_len, table + i * pages_per_seq});
  }
  const T* qd = static_cast<const T*>(q->data);
  const T* pd = static_cast<const T*>(pages->data);
  const int64_t n = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(dualop_team_size(static_cast<int>(std::min<int64_t>(threads, n))))
  for (int64_t k = 0; k < n; ++k) decode_sequence<T>(qd, pd, out, tasks[k], d, scale);
}

}  // namespace
}  // namespace dualop

// q [T, H, W] and latent_pages [P, S, W] of one float dtype; out [T, H, L] of that dtype, L <= W;
// kv_lens [max_seqs], page_indices [max_seqs, pages_per_seq], cu_q_lens [max_seqs + 1] int32;
// seqs int64 [count]: the sequences to decode (each with 1 to 8 query rows and kv_len >= q_len;
// others are skipped). Writes those sequences' rows of out. Returns 0, -1 for an unknown dtype,
// kBadArrays for arrays that disagree.
extern "C" int dualop_mla_decode(const DualopArray* q, const DualopArray* latent_pages, const DualopArray* kv_lens,
                                 const DualopArray* page_indices, const DualopArray* cu_q_lens,
                                 const DualopArray* seqs, const DualopArray* out, float scale, int threads) {
  using namespace dualop;
  if (!q || q->ndim != 3 || !is_row_major(q) || !is_dense(latent_pages, q->dtype, 3) ||
      latent_pages->shape[2] != q->shape[2] || !is_dense(out, q->dtype, 3) || out->shape[0] != q->shape[0] ||
      out->shape[1] != q->shape[1] || out->shape[2] > q->shape[2])
    return kBadArrays;
  if (!is_dense(kv_lens, dtype_code::int32, 1) || !is_dense(page_indices, dtype_code::int32, 2) ||
      !is_dense(cu_q_lens, dtype_code::int32, 1) || !is_dense(seqs, dtype_code::int64, 1))
    return kBadArrays;
  const int64_t max_seqs = page_indices->shape[0];
  if (kv_lens->shape[0] < max_seqs || cu_q_lens->shape[0] < max_seqs + 1 || latent_pages->shape[0] < 1) return kBadArrays;
  const auto* ids = static_cast<const int64_t*>(seqs->data);
  for (int64_t k = 0; k < seqs->shape[0]; ++k)
    if (ids[k] < 0 || ids[k] >= max_seqs) return kBadArrays;
  const Dims d{q->shape[1], q->shape[2], out->shape[2], latent_pages->shape[0], latent_pages->shape[1]};
  const auto* lens = static_cast<const int32_t*>(kv_lens->data);
  const auto* table = static_cast<const int32_t*>(page_indices->data);
  const auto* cu = static_cast<const int32_t*>(cu_q_lens->data);
  const int64_t pages_per_seq = page_indices->shape[1];
#define DUALOP_MLA(T)                                                                                            \
  run<T>(q, latent_pages, lens, table, cu, ids, seqs->shape[0], static_cast<T*>(out->data), d, pages_per_seq,     \
         scale, threads);                                                                                        \
  return 0;
  switch (q->dtype) {
    case dtype_code::float32: DUALOP_MLA(float)
    case dtype_code::bfloat16: DUALOP_MLA(bf16)
    case dtype_code::float16: DUALOP_MLA(f16)
    default: return -1;
  }
#undef DUALOP_MLA
}
