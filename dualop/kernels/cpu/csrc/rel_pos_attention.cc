// rel_pos_attention's attention on the CPU: per (image x head, query) row, the float32 scores
// against every key of the image with the relative-position bias added as they are made
// (rel_h[i, j / W] + rel_w[i, j % W], from the per-query terms: the S x S bias is never stored),
// the softmax, and P @ V, as the native body computes them (the max propagates NaN, so a row
// holding one is NaN, as softmax gives). Rows split over OpenMP threads, one score buffer each.
#include <cmath>
#include <limits>
#include <vector>

#include "common.h"

extern "C" int dualop_rel_pos_attention(const float* q, const float* k, const float* v, const float* rel_h,
                                        const float* rel_w, float* out, int64_t images, int64_t seq_len,
                                        int64_t height, int64_t width, int64_t head_dim, float scale, int threads) {
  using namespace dualop;
  if (seq_len != height * width || head_dim <= 0 || (rel_h == nullptr) != (rel_w == nullptr)) return -1;
  const int64_t rows = images * seq_len;
#pragma omp parallel num_threads(dualop_team_size(threads))
  {
    std::vector<float> scores(static_cast<size_t>(seq_len));
    std::vector<float> acc(static_cast<size_t>(head_dim));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t image = r / seq_len;
      const float* q_row = q + r * head_dim;
      const float* keys = k + image * seq_len * head_dim;
      const float* values = v + image * seq_len * head_dim;
      for (int64_t j = 0; j < seq_len; ++j) {
        const float* key = keys + j * head_dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < head_dim; ++c) dot += q_row[c] * key[c];
        scores[j] = dot * scale;
      }
      if (rel_h != nullptr) {  // key j is image cell (j / W, j % W)
        const float* bias_h = rel_h + r * height;
        const float* bias_w = rel_w + r * width;
        for (int64_t kh = 0; kh < height; ++kh) {
          float* row = scores.data() + kh * width;
#pragma omp simd
          for (int64_t kw = 0; kw < width; ++kw) row[kw] = row[kw] + bias_h[kh] + bias_w[kw];
        }
      }
      float top = -std::numeric_limits<float>::infinity();
      bool nan = false;
      for (int64_t j = 0; j < seq_len; ++j) {
        nan |= std::isnan(scores[j]);
        top = scores[j] > top ? scores[j] : top;
      }
      if (nan) top = std::numeric_limits<float>::quiet_NaN();
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < seq_len; ++j) {
        scores[j] = exp_f32(scores[j] - top);
        total += scores[j];
      }
      for (int64_t c = 0; c < head_dim; ++c) acc[c] = 0.0f;
      for (int64_t j = 0; j < seq_len; ++j) {
        const float p = scores[j];
        const float* value = values + j * head_dim;
#pragma omp simd
        for (int64_t c = 0; c < head_dim; ++c) acc[c] += p * value[c];
      }
      float* o = out + r * head_dim;
      for (int64_t c = 0; c < head_dim; ++c) o[c] = acc[c] / total;
    }
  }
  return 0;
}
