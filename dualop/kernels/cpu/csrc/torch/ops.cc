// torch operators in front of the hottest CPU kernels (namespace dualop_cpu), for the ops' eager
// calls on small inputs, where a Python wrapper around a ctypes call costs more than the kernel.
//
// Each operator takes the call as the op received it and either runs the kernel (returning the
// results) or takes nothing: it returns undefined tensors (None in Python) without touching any
// element, and the op's Python path then checks the call, says what is wrong, or serves it. An
// operator takes only calls the op's own checks accept: CPU tensors of one float dtype, row-major,
// of the shapes the op states, outputs that are the inputs they replace or memory apart from
// everything else, and nothing autograd records. The error messages stay with the Python checks.
//
// Built per torch version against torch's headers (dualop/kernels/cpu/torch_ops.py), linked to the
// kernel library, whose entry points (dualop_api.h, force-included) it calls as the ctypes side
// does. Registered for CPU and AutogradCPU, so a call reaches it without autograd's fallback: it
// declines while autograd records instead.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// The kernels' dtype code of a tensor's element type, or -1.
int32_t code_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return dualop::dtype_code::float32;
    case at::kBFloat16: return dualop::dtype_code::bfloat16;
    case at::kHalf: return dualop::dtype_code::float16;
    case at::kInt: return dualop::dtype_code::int32;
    case at::kLong: return dualop::dtype_code::int64;
    default: return -1;
  }
}

bool is_float_code(int32_t code) {
  return code == dualop::dtype_code::float32 || code == dualop::dtype_code::bfloat16 ||
         code == dualop::dtype_code::float16;
}

// A strided CPU tensor that autograd does not record.
bool readable(const Tensor& t) {
  return t.defined() && t.layout() == at::kStrided && t.device().is_cpu() &&
         !(t.requires_grad() && c10::GradMode::is_enabled());
}

// A tensor the kernels read as it lies: readable and row-major.
bool plain(const Tensor& t) { return readable(t) && t.is_contiguous(); }

bool plain_like(const Tensor& t, const Tensor& like) {
  return plain(t) && t.scalar_type() == like.scalar_type() && t.sizes() == like.sizes();
}

// [start, end) of the bytes a non-empty strided tensor's elements lie in (non-negative strides).
std::pair<uintptr_t, uintptr_t> span(const Tensor& t) {
  const auto start = reinterpret_cast<uintptr_t>(t.data_ptr());
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {start, start + (last + 1) * t.element_size()};
}

bool apart(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0) return true;
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a1 <= b0 || b1 <= a0;
}

bool same_memory(const Tensor& a, const Tensor& b) {
  return a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type();
}

// An output the fast path writes: absent, the input it replaces itself (in place), or memory apart
// from every other argument.
bool writable(const OptTensor& out, const Tensor& replaces, std::initializer_list<const Tensor*> others) {
  if (!out.has_value()) return true;
  if (!plain_like(*out, replaces)) return false;
  const bool in_place = replaces.defined() && same_memory(*out, replaces);
  if (!in_place && !apart(*out, replaces)) return false;
  for (const Tensor* other : others)
    if (other->defined() && !apart(*out, *other)) return false;
  return true;
}

// A row-major tensor (or float32 data) as a DualopArray of the given shape (as many elements).
DualopArray array_of(void* data, int32_t dtype, std::initializer_list<int64_t> shape) {
  DualopArray a{};
  a.data = data;
  a.dtype = dtype;
  a.ndim = static_cast<int32_t>(shape.size());
  int32_t d = 0;
  for (int64_t size : shape) a.shape[d++] = size;
  int64_t stride = 1;
  for (d = a.ndim - 1; d >= 0; --d) {
    a.strides[d] = stride;
    stride *= a.shape[d];
  }
  return a;
}

DualopArray array_of(const Tensor& t, std::initializer_list<int64_t> shape) {
  return array_of(t.data_ptr(), code_of(t), shape);
}

// One thread below this many elements: waking the OpenMP team costs more than the work.
int threads_for(int64_t elements) {
  return elements < dualop::parallel_min_elements ? 1 : at::get_num_threads();
}

// RMSNorm's call op(x, weight, residual, out=, residual_out=) with a weight of [hidden_size]:
// (out, residual_out), results written where given (in place when they are x / residual), or two
// undefined tensors when the call is not one this takes. weight_mode: the kernel's (1 weight after
// the cast, 2 weight in float32).
std::tuple<Tensor, Tensor> rms_norm(const Tensor& x, const Tensor& weight, const OptTensor& residual,
                                    const OptTensor& out, const OptTensor& residual_out, int64_t hidden_size,
                                    double eps, double weight_offset, int64_t weight_mode) {
  const Tensor none;
  if (!plain(x) || x.dim() < 1 || x.size(-1) != hidden_size || !is_float_code(code_of(x))) return {none, none};
  if (!plain(weight) || weight.dim() != 1 || weight.size(0) != hidden_size || !is_float_code(code_of(weight)))
    return {none, none};
  const Tensor& res = residual.has_value() ? *residual : none;
  if (res.defined() && !plain_like(res, x)) return {none, none};
  if (residual_out.has_value() && !res.defined()) return {none, none};
  const Tensor& given_out = out.has_value() ? *out : none;
  const Tensor& given_res_out = residual_out.has_value() ? *residual_out : none;
  if (!writable(out, x, {&res, &weight, &given_res_out}) || !writable(residual_out, res, {&x, &weight, &given_out}))
    return {none, none};
  Tensor y = given_out.defined() ? given_out : at::empty_like(x);
  Tensor r = !res.defined() ? none : given_res_out.defined() ? given_res_out : at::empty_like(x);
  const int64_t rows = hidden_size ? x.numel() / hidden_size : 0;
  if (x.numel()) {
    const DualopArray xa = array_of(x, {rows, hidden_size}), ya = array_of(y, {rows, hidden_size});
    const DualopArray wa = array_of(weight, {hidden_size});  // any float dtype: each thread reads it as float32
    DualopArray ra{}, roa{};
    if (res.defined()) ra = array_of(res, {rows, hidden_size}), roa = array_of(r, {rows, hidden_size});
    const int status = dualop_rms_norm(&xa, res.defined() ? &ra : nullptr, &wa, &ya, res.defined() ? &roa : nullptr,
                                       static_cast<float>(eps), static_cast<float>(weight_offset),
                                       static_cast<int>(weight_mode), threads_for(x.numel()));
    TORCH_CHECK(status == 0, "dualop_rms_norm returned ", status, " for arrays checked before the call");
  }
  return {y, r};
}

// RotaryEmbedding's call op(positions, query, key, query_out=, key_out=) for a rope whose angles
// are rows of cos_sin_cache [max_position, >= rotary_dim] (cos half, sin half; query's dtype) picked
// by position: (query, key) rotated, written where given, or two undefined tensors when the call is
// not one this takes (a position outside [0, max_position) among them: checked before any write).
std::tuple<Tensor, Tensor> rotary_by_position(const Tensor& positions, const Tensor& query, const OptTensor& key,
                                              const Tensor& cos_sin_cache, const OptTensor& query_out,
                                              const OptTensor& key_out, int64_t head_size, int64_t rotary_dim,
                                              int64_t max_position, bool is_neox) {
  const Tensor none;
  const int32_t pos_code = code_of(positions);
  if (!plain(positions) || (pos_code != dualop::dtype_code::int32 && pos_code != dualop::dtype_code::int64))
    return {none, none};
  const int64_t tokens = positions.numel();
  if (tokens == 0 || head_size < 1 || rotary_dim > head_size || rotary_dim / 2 > 1024) return {none, none};
  // [..., H*D] or [..., H, D] holding tokens x H heads of head_size (the op's own rule, heads_of);
  // a strided one (q and k as column slices of one qkv matrix) is read from a row-major copy when
  // its result goes to new memory, and the copy is rotated in place
  auto heads = [&](const Tensor& t, bool given_out) -> int64_t {
    if (!readable(t) || t.dim() < 1 || t.size(-1) % head_size || t.numel() % (tokens * head_size) ||
        (given_out && !t.is_contiguous()))
      return -1;
    return t.numel() / (tokens * head_size);
  };
  const int64_t q_heads = heads(query, query_out.has_value());
  if (q_heads < 0 || !is_float_code(code_of(query))) return {none, none};
  const Tensor& k_given_in = key.has_value() ? *key : none;
  const int64_t k_heads = k_given_in.defined() ? heads(k_given_in, key_out.has_value()) : 0;
  if (k_heads < 0 || (k_given_in.defined() && k_given_in.scalar_type() != query.scalar_type())) return {none, none};
  if (key_out.has_value() && !k_given_in.defined()) return {none, none};
  if (!plain(cos_sin_cache) || cos_sin_cache.scalar_type() != query.scalar_type() || cos_sin_cache.dim() != 2 ||
      cos_sin_cache.size(0) < max_position || cos_sin_cache.size(1) < rotary_dim || max_position < 1)
    return {none, none};
  const Tensor& q_out = query_out.has_value() ? *query_out : none;
  const Tensor& k_given = key_out.has_value() ? *key_out : none;
  if (!writable(query_out, query, {&positions, &k_given_in, &cos_sin_cache, &k_given}) ||
      !writable(key_out, k_given_in, {&positions, &query, &cos_sin_cache, &q_out}))
    return {none, none};
  // positions in range, before anything is written (the op's check says which one is not)
  if (pos_code == dualop::dtype_code::int64) {
    const int64_t* p = positions.const_data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t)
      if (p[t] < 0 || p[t] >= max_position) return {none, none};
  } else {
    const int32_t* p = positions.const_data_ptr<int32_t>();
    for (int64_t t = 0; t < tokens; ++t)
      if (p[t] < 0 || p[t] >= max_position) return {none, none};
  }
  // a strided input's row-major copy is both the kernel's input and its output
  const Tensor q = query.is_contiguous() ? query : query.contiguous();
  const Tensor k = k_given_in.defined() && !k_given_in.is_contiguous() ? k_given_in.contiguous() : k_given_in;
  Tensor qo = q_out.defined() ? q_out : q.is_same(query) ? at::empty_like(query) : q;
  Tensor ko = !k.defined() ? none : k_given.defined() ? k_given : k.is_same(k_given_in) ? at::empty_like(k) : k;
  const DualopArray pa = array_of(positions, {tokens}), qa = array_of(q, {tokens, q_heads, head_size}),
                    qoa = array_of(qo, {tokens, q_heads, head_size}),
                    ca = array_of(cos_sin_cache, {cos_sin_cache.size(0), cos_sin_cache.size(1)});
  DualopArray ka{}, koa{};
  if (k.defined()) ka = array_of(k, {tokens, k_heads, head_size}), koa = array_of(ko, {tokens, k_heads, head_size});
  const int status = dualop_rotary_by_position(&pa, &qa, k.defined() ? &ka : nullptr, &ca, &qoa,
                                               k.defined() ? &koa : nullptr, rotary_dim, is_neox ? 1 : 0,
                                               threads_for(query.numel() + (k.defined() ? k.numel() : 0)));
  TORCH_CHECK(status == 0, "dualop_rotary_by_position returned ", status, " for arrays checked before the call");
  return {qo, ko};
}

// The gated activations' call op(x, out=) (act(gate) * up over x's halves): the result, written
// into out when given, or an undefined tensor when the call is not one this takes. table: act(g) in
// float32 for every bit pattern g of a 16-bit x (the kernel's lookup, bit-exact with the native
// formula), else undefined; activation: the kernel's code (0 silu, 1 gelu, 2 gelu tanh).
Tensor gated_activation(const Tensor& x, const OptTensor& table, const OptTensor& out, int64_t activation,
                        bool act_on_first) {
  const Tensor none;
  const int32_t code = code_of(x);
  if (!plain(x) || x.dim() < 1 || x.size(-1) % 2 || !is_float_code(code)) return none;
  const int64_t d = x.size(-1) / 2, rows = d ? x.numel() / (2 * d) : 0;
  const bool by_table = dualop_gated_table_pays(static_cast<int>(activation), code, rows * d) != 0;
  if (by_table && (!table.has_value() || !plain(*table) || table->scalar_type() != at::kFloat ||
                   table->numel() != 65536))
    return none;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = d;
  if (out.has_value()) {
    const Tensor& o = *out;
    if (!plain(o) || o.scalar_type() != x.scalar_type() || o.sizes() != at::IntArrayRef(shape) || !apart(o, x) ||
        (table.has_value() && !apart(o, *table)))
      return none;
  }
  Tensor y = out.has_value() ? *out : at::empty(shape, x.options());
  if (y.numel() == 0) return y;
  const DualopArray xa = array_of(x, {rows, 2 * d}), ya = array_of(y, {rows, d});
  const int threads = threads_for(x.numel());
  int status;
  if (by_table) {
    const DualopArray ta = array_of(*table, {65536});
    status = dualop_gated_table(&ta, &xa, &ya, act_on_first ? 1 : 0, threads);
  } else {
    status = dualop_gated_activation(&xa, &ya, static_cast<int>(activation), act_on_first ? 1 : 0, threads);
  }
  TORCH_CHECK(status == 0, "dualop_gated_activation returned ", status, " for arrays checked before the call");
  return y;
}

// ReshapeAndCache's call op(key, value, kv_pages, slot_mapping): token t's key and value rows
// [H, D] written into slot slot_mapping[t] of kv_pages [P, S, 2H, D] (K and V heads interleaved),
// negative slots skipped, a later token winning a slot written twice; returns kv_pages, or an
// undefined tensor when the call is not one this takes (a slot >= P * S among them: checked
// before any write).
Tensor reshape_and_cache(const Tensor& key, const Tensor& value, const Tensor& kv_pages, const Tensor& slot_mapping) {
  const Tensor none;
  // key and value may be strided over tokens and heads (the columns of a fused QKV projection's
  // output): each head's row is copied whole, so only its last dim need be unit-strided
  auto rows_readable = [](const Tensor& t) {
    return readable(t) && t.dim() == 3 && t.stride(2) == 1 && t.stride(1) >= 0 && t.stride(0) >= 0;
  };
  if (!rows_readable(key) || !is_float_code(code_of(key)) || !rows_readable(value) ||
      value.scalar_type() != key.scalar_type() || value.sizes() != key.sizes())
    return none;
  const int64_t tokens = key.size(0), heads = key.size(1), head_dim = key.size(2);
  if (!plain(kv_pages) || kv_pages.dim() != 4 || kv_pages.scalar_type() != key.scalar_type() ||
      kv_pages.size(2) != 2 * heads || kv_pages.size(3) != head_dim)
    return none;
  // an inference tensor is written only in inference mode (torch's rule, which the op states)
  if (kv_pages.is_inference() && !c10::InferenceMode::is_enabled()) return none;
  const int32_t slot_code = code_of(slot_mapping);
  if (!plain(slot_mapping) || slot_mapping.dim() != 1 || slot_mapping.size(0) != tokens ||
      (slot_code != dualop::dtype_code::int32 && slot_code != dualop::dtype_code::int64))
    return none;
  if (!apart(kv_pages, key) || !apart(kv_pages, value) || !apart(kv_pages, slot_mapping)) return none;
  const int64_t capacity = kv_pages.size(0) * kv_pages.size(1);
  auto slot = [&](int64_t t) -> int64_t {
    return slot_code == dualop::dtype_code::int64 ? slot_mapping.const_data_ptr<int64_t>()[t]
                                                  : slot_mapping.const_data_ptr<int32_t>()[t];
  };
  for (int64_t t = 0; t < tokens; ++t)
    if (slot(t) >= capacity) return none;
  const int64_t item = key.element_size(), row_bytes = head_dim * item;
  const auto* k = static_cast<const char*>(key.const_data_ptr());
  const auto* v = static_cast<const char*>(value.const_data_ptr());
  auto* cache = static_cast<char*>(kv_pages.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {  // in token order: the last writer of a slot wins
    const int64_t s = slot(t);
    if (s < 0) continue;
    char* dst = cache + s * 2 * heads * row_bytes;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(dst + 2 * h * row_bytes, k + (t * key.stride(0) + h * key.stride(1)) * item, row_bytes);
      std::memcpy(dst + (2 * h + 1) * row_bytes, v + (t * value.stride(0) + h * value.stride(1)) * item, row_bytes);
    }
  }
  return kv_pages;
}

// RaggedPagedAttention's call op(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
// sm_scale=) without the other options: [T, Hq, D] (rows past cu_q_lens[num_seqs] zero), or an
// undefined tensor when the call is not one this takes. The metadata's values are checked as the
// op's check_metadata_values does, before the kernel runs.
Tensor ragged_paged_attention(const Tensor& q, const Tensor& kv_pages, const Tensor& kv_lens,
                              const Tensor& page_indices, const Tensor& cu_q_lens, const Tensor& num_seqs,
                              double sm_scale) {
  const Tensor none;
  if (!plain(q) || q.dim() != 3 || !is_float_code(code_of(q)) || !(sm_scale > 0.0) || !std::isfinite(sm_scale))
    return none;
  const int64_t tokens = q.size(0), q_heads = q.size(1), head_dim = q.size(2);
  if (!plain(kv_pages) || kv_pages.dim() != 4 || kv_pages.scalar_type() != q.scalar_type() ||
      kv_pages.size(3) != head_dim)
    return none;
  const int64_t num_pages = kv_pages.size(0), page_size = kv_pages.size(1), combined = kv_pages.size(2);
  if (combined == 0 || combined % 2 || q_heads == 0 || q_heads % (combined / 2) || page_size == 0) return none;
  auto int32_array = [](const Tensor& t, int64_t dim) {
    return plain(t) && t.scalar_type() == at::kInt && t.dim() == dim;
  };
  if (!int32_array(page_indices, 2)) return none;
  const int64_t max_seqs = page_indices.size(0), pages_per_seq = page_indices.size(1);
  if (!int32_array(kv_lens, 1) || kv_lens.size(0) != max_seqs || !int32_array(cu_q_lens, 1) ||
      cu_q_lens.size(0) != max_seqs + 1 || !int32_array(num_seqs, 1) || num_seqs.size(0) != 1)
    return none;
  const int32_t count = num_seqs.const_data_ptr<int32_t>()[0];
  const int32_t* cu = cu_q_lens.const_data_ptr<int32_t>();
  const int32_t* lens = kv_lens.const_data_ptr<int32_t>();
  const int32_t* pages = page_indices.const_data_ptr<int32_t>();
  if (count < 0 || count > max_seqs || cu[0] != 0 || cu[count] > tokens) return none;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t q_len = int64_t{cu[i + 1]} - cu[i], kv_len = lens[i];
    if (q_len < 0 || kv_len < q_len || kv_len > pages_per_seq * page_size) return none;
    const int64_t used = (kv_len + page_size - 1) / page_size;
    for (int64_t j = 0; j < used; ++j) {
      const int32_t page = pages[i * pages_per_seq + j];
      if (page < 0 || page >= num_pages) return none;
    }
  }
  Tensor out = at::zeros_like(q);
  if (tokens == 0) return out;
  const DualopArray qa = array_of(q, {tokens, q_heads, head_dim}), oa = array_of(out, {tokens, q_heads, head_dim}),
                    pa = array_of(kv_pages, {num_pages, page_size, combined, head_dim}),
                    la = array_of(kv_lens, {max_seqs}), ia = array_of(page_indices, {max_seqs, pages_per_seq}),
                    ca = array_of(cu_q_lens, {max_seqs + 1});
  const int status = dualop_ragged_paged_attention(&qa, &pa, &la, &ia, &ca, count, &oa, static_cast<float>(sm_scale),
                                                   0, 0.0f, 0, 0.0f, 1.0f, at::get_num_threads());
  TORCH_CHECK(status == 0, "dualop_ragged_paged_attention returned ", status, " for arrays checked before the call");
  return out;
}

}  // namespace

TORCH_LIBRARY(dualop_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, Tensor? residual, Tensor(a!)? out, Tensor(b!)? residual_out, "
        "int hidden_size, float eps, float weight_offset, int weight_mode) -> (Tensor, Tensor)");
  m.def("rotary_by_position(Tensor positions, Tensor query, Tensor? key, Tensor cos_sin_cache, "
        "Tensor(a!)? query_out, Tensor(b!)? key_out, int head_size, int rotary_dim, int max_position, "
        "bool is_neox) -> (Tensor, Tensor)");
  m.def("gated_activation(Tensor x, Tensor? table, Tensor(a!)? out, int activation, bool act_on_first) -> Tensor");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_pages, Tensor slot_mapping) -> Tensor");
  m.def("ragged_paged_attention(Tensor q, Tensor kv_pages, Tensor kv_lens, Tensor page_indices, Tensor cu_q_lens, "
        "Tensor num_seqs, float sm_scale) -> Tensor");
}

// The same kernels for plain CPU tensors and for those autograd would otherwise wrap in its
// fallback (each operator declines while autograd records).
static void implementations(torch::Library& m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_by_position", &rotary_by_position);
  m.impl("gated_activation", &gated_activation);
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("ragged_paged_attention", &ragged_paged_attention);
}

TORCH_LIBRARY_IMPL(dualop_cpu, CPU, m) { implementations(m); }
TORCH_LIBRARY_IMPL(dualop_cpu, AutogradCPU, m) { implementations(m); }
