// Vocabulary-parallel embedding lookup for the torch CPU path (ops/embedding.py): one pass over the
// tokens, each copying its row of this rank's shard (the shard mask fused) or writing a zero row.
// The row bytes are copied as they are, so one loop serves every dtype. A first pass checks every id
// against the vocabulary (the op's id validation for torch CPU tensors) before anything is written.
#include <cstdint>
#include <cstring>

namespace {

template <class Id>
void lookup(const Id* ids, const char* weight, int64_t weight_row_stride, char* out, int64_t tokens, int64_t row_bytes,
            int64_t org_start, int64_t org_end, int64_t added_start, int64_t added_end, int64_t added_offset,
            int threads) {
#pragma omp parallel for num_threads(dualop_team_size(threads)) schedule(static) if (threads > 1)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t id = static_cast<int64_t>(ids[t]);
    char* dst = out + t * row_bytes;
    int64_t row = -1;
    if (id >= org_start && id < org_end) row = id - org_start;
    else if (id >= added_start && id < added_end) row = id - added_offset;
    if (row < 0) std::memset(dst, 0, row_bytes);
    else std::memcpy(dst, weight + row * weight_row_stride, row_bytes);
  }
}

template <class Id>
bool ids_in_range(const Id* ids, int64_t tokens, int64_t num_embeddings) {
  bool ok = true;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t id = static_cast<int64_t>(ids[t]);
    ok &= (id >= 0) & (id < num_embeddings);
  }
  return ok;
}

}  // namespace

// Returns 0, or 2 (nothing written) when an id is negative or >= num_embeddings.
// ids: int32 (ids_are_64 = 0) or int64; weight rows weight_row_stride bytes apart, row_bytes each;
// out: tokens contiguous rows. The bounds are this rank's (ops/embedding.py _shard_bounds).
extern "C" int dualop_vocab_embedding(int ids_are_64, const void* ids, const void* weight, int64_t weight_row_stride,
                                      void* out, int64_t tokens, int64_t row_bytes, int64_t org_start, int64_t org_end,
                                      int64_t added_start, int64_t added_end, int64_t added_offset, int threads,
                                      int64_t num_embeddings) {
  const char* w = static_cast<const char*>(weight);
  char* o = static_cast<char*>(out);
  const bool valid = ids_are_64 ? ids_in_range(static_cast<const int64_t*>(ids), tokens, num_embeddings)
                                : ids_in_range(static_cast<const int32_t*>(ids), tokens, num_embeddings);
  if (!valid) return 2;
  if (ids_are_64) {
    lookup(static_cast<const int64_t*>(ids), w, weight_row_stride, o, tokens, row_bytes, org_start, org_end,
           added_start, added_end, added_offset, threads);
  } else {
    lookup(static_cast<const int32_t*>(ids), w, weight_row_stride, o, tokens, row_bytes, org_start, org_end,
           added_start, added_end, added_offset, threads);
  }
  return 0;
}
