// Fused CPU operators for the lean loop's prompt and decode steps, and weight-only matmuls (kernels/native.py
// builds this file on first use).
//
// A decode step of a small model is bound by operator count, not by arithmetic: each PyTorch operator costs
// 1-3 us of dispatch and allocation whatever its size, and a block runs dozens of them around its four GEMMs.
// Each function here does in one call, in plain loops over contiguous fp32 rows, what the eager loop does in
// several operators; for a prompt's rows the loops split over the threads, and attention runs on BLAS GEMMs.
// The W8A8 GEMM stays PyTorch's integer operator; the W8A16 and W4A16 matmuls here keep fp32 activations where
// PyTorch's weight-only operators round them to bf16.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

// The BLAS single-precision GEMM PyTorch's x86 and Arm builds carry (MKL / OpenBLAS) and export. Weak: where a
// build lacks it the symbol is null and causal_attention falls back to at::mm, so the module still loads.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace {

using Vec = at::vec::Vectorized<float>;

// Tensors written in place must already be contiguous; inputs are made so (no copy when they are).
void check_cpu(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", c10::toString(dtype), ", got ",
              c10::toString(t.scalar_type()));
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

at::Tensor input(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  at::Tensor dense = t.contiguous();
  check_cpu(dense, dtype, name);
  return dense;
}

// Runs body(first, last) over row ranges, split over the threads where the rows hold enough values to pay for it
// (a prompt's rows); a decode step's single row runs inline.
template <typename Body>
void for_rows(int64_t rows, int64_t width, const Body& body) {
  constexpr int64_t kValuesPerTask = 16384;
  at::parallel_for(0, rows, std::max<int64_t>(1, kValuesPerTask / std::max<int64_t>(1, width)), body);
}

// y = weight * (x / sqrt(mean(x^2) + eps)) over one row of `width` values.
void rms_norm_row(const float* x, const float* weight, float eps, int64_t width, float* y) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < width; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(width) + eps);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) y[i] = weight[i] * (x[i] * inv);
}

float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.0f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// out[j, :dim] = sum_t weights[j, t] * rows[t, :dim] for j < sums, weights [sums, count], rows [count, dim].
// Up to kRegisterVecs vectors of sums stay in registers over the whole pass, so each row is read once and no
// partial sum goes back to memory between rows.
constexpr int64_t kRegisterVecs = 24;
void weighted_sums(const float* weights, int64_t sums, const float* rows, int64_t count, int64_t dim, float* out) {
  const int64_t vecs = dim / Vec::size();
  if (dim % Vec::size() != 0 || sums * vecs > kRegisterVecs) {
    std::fill_n(out, sums * dim, 0.0f);
    for (int64_t t = 0; t < count; ++t)
      for (int64_t j = 0; j < sums; ++j)
        for (int64_t i = 0; i < dim; ++i) out[j * dim + i] += weights[j * count + t] * rows[t * dim + i];
    return;
  }
  Vec acc[kRegisterVecs];
  for (int64_t k = 0; k < sums * vecs; ++k) acc[k] = Vec(0.0f);
  for (int64_t t = 0; t < count; ++t) {
    const float* row = rows + t * dim;
    for (int64_t j = 0; j < sums; ++j) {
      const Vec w(weights[j * count + t]);
      for (int64_t k = 0; k < vecs; ++k)
        acc[j * vecs + k] = at::vec::fmadd(w, Vec::loadu(row + k * Vec::size()), acc[j * vecs + k]);
    }
  }
  for (int64_t k = 0; k < sums * vecs; ++k) acc[k].store(out + k * Vec::size());
}

// sums[j] = sum_i float(w[j * stride + i]) * x[i] for kWeightRows rows of int8 weights: the int8 codes widened to
// fp32 in registers (exact), fp32 products and sums. Four rows share each load of x. `next` (the rows that follow,
// or null) is prefetched a cache line at a time: decode reads every weight once, from memory, and the hardware
// prefetcher alone left a third of the bandwidth unused.
constexpr int64_t kWeightRows = 4;
constexpr int64_t kCacheLine = 64;
void prefetch_rows(const int8_t* next, int64_t stride, int64_t i) {
  if (next != nullptr && i % kCacheLine == 0)
    for (int64_t j = 0; j < kWeightRows; ++j) __builtin_prefetch(next + j * stride + i, 0, 3);
}

void int8_dot_rows(const int8_t* w, const int8_t* next, int64_t stride, const float* x, int64_t width, float* sums) {
  int64_t i = 0;
  for (int64_t j = 0; j < kWeightRows; ++j) sums[j] = 0.0f;
#if defined(CPU_CAPABILITY_AVX512)
  __m512 acc[kWeightRows];
  for (int64_t j = 0; j < kWeightRows; ++j) acc[j] = _mm512_setzero_ps();
  for (; i + 16 <= width; i += 16) {
    prefetch_rows(next, stride, i);
    const __m512 xv = _mm512_loadu_ps(x + i);
    for (int64_t j = 0; j < kWeightRows; ++j) {
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * stride + i));
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), xv, acc[j]);
    }
  }
  for (int64_t j = 0; j < kWeightRows; ++j) sums[j] = _mm512_reduce_add_ps(acc[j]);
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 acc[kWeightRows];
  for (int64_t j = 0; j < kWeightRows; ++j) acc[j] = _mm256_setzero_ps();
  for (; i + 8 <= width; i += 8) {
    prefetch_rows(next, stride, i);
    const __m256 xv = _mm256_loadu_ps(x + i);
    for (int64_t j = 0; j < kWeightRows; ++j) {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + j * stride + i));
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), xv, acc[j]);
    }
  }
  for (int64_t j = 0; j < kWeightRows; ++j) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[j]);
    for (float lane : lanes) sums[j] += lane;
  }
#endif
  for (; i < width; ++i)
    for (int64_t j = 0; j < kWeightRows; ++j) sums[j] += static_cast<float>(w[j * stride + i]) * x[i];
}

bool blas_wanted = true;  // false: the at::mm path, for the tests

// Row-major c [m, n] (row stride ldc) = a [m, k] (row stride lda) times b^T or b, where b is [n, k] (row stride
// ldb) when b_transposed, else [k, n]. BLAS is column-major, so it computes c^T = op(b) a^T.
void gemm_rows(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
               bool b_transposed, float* c, int64_t ldc) {
  if (sgemm_ != nullptr && blas_wanted) {
    const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
    const int ldai = static_cast<int>(lda), ldbi = static_cast<int>(ldb), ldci = static_cast<int>(ldc);
    const float one = 1.0f, zero = 0.0f;
    sgemm_(b_transposed ? "T" : "N", "N", &ni, &mi, &ki, &one, b, &ldbi, a, &ldai, &zero, c, &ldci);
    return;
  }
  const auto options = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor ta = at::from_blob(const_cast<float*>(a), {m, k}, {lda, 1}, options);
  const at::Tensor tb = b_transposed ? at::from_blob(const_cast<float*>(b), {n, k}, {ldb, 1}, options).t()
                                     : at::from_blob(const_cast<float*>(b), {k, n}, {ldb, 1}, options);
  at::from_blob(c, {m, n}, {ldc, 1}, options).copy_(at::mm(ta, tb));
}

// The weights of one group of int4 codes, dequantized as the reference does: (float(u - 8) - zero) * scale, one
// rounding, u the stored nibble (kernels' layout: even column in the low nibble). AVX-512 turns 16 nibbles into
// their weights with one permute of a 16-entry table made per group, so the table holds exactly those values.
struct Int4Group {
  float scale, zero;
  float value(uint8_t nibble) const { return (static_cast<float>(static_cast<int>(nibble) - 8) - zero) * scale; }
#if defined(CPU_CAPABILITY_AVX512)
  __m512 table() const {
    const __m512 codes = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
    return _mm512_mul_ps(_mm512_sub_ps(codes, _mm512_set1_ps(zero)), _mm512_set1_ps(scale));
  }
#endif
};

uint8_t nibble(const uint8_t* packed, int64_t column) {
  return column % 2 == 0 ? packed[column / 2] & 0x0F : packed[column / 2] >> 4;
}

#if defined(CPU_CAPABILITY_AVX512)
// The 16 weights of columns column..column+15 (column even) from the group's table.
__m512 int4_weights(const uint8_t* packed, int64_t column, __m512 table) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + column / 2));
  const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
  return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high)), table);
}

// The 32 weights of columns column..column+31 (column even) from 16 bytes: those of the even columns, then those of
// the odd ones. The permute reads the low 4 bits of each index, so the low nibble needs no mask.
void int4_weights32(const uint8_t* packed, int64_t column, __m512 table, __m512& even, __m512& odd) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + column / 2)));
  even = _mm512_permutexvar_ps(bytes, table);
  odd = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
#endif

// Calls body(first, last, group) for each group's column range of a row of `width` columns.
template <typename Body>
void for_groups(int64_t width, int64_t group_size, const Body& body) {
  for (int64_t g = 0, first = 0; first < width; ++g, first += group_size)
    body(first, std::min(width, first + group_size), g);
}

// Rotary embedding of one head in place: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).
void rope_head(float* x, const float* cos, const float* sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] + (-b) * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

}  // namespace

// RMS norm of each row of x [..., width] with weight [width].
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  const at::Tensor x = input(x_in, at::kFloat, "x");
  const at::Tensor weight = input(weight_in, at::kFloat, "weight");
  const int64_t width = weight.numel();
  TORCH_CHECK(x.size(-1) == width, "x has rows of ", x.size(-1), " values, the norm weight ", width);
  at::Tensor y = at::empty_like(x);
  const float* px = x.data_ptr<float>();
  const float* pw = weight.data_ptr<float>();
  float* py = y.data_ptr<float>();
  for_rows(x.numel() / width, width, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      rms_norm_row(px + r * width, pw, static_cast<float>(eps), width, py + r * width);
  });
  return y;
}

// Attention inputs of `rows` tokens at positions pos..pos+rows-1: qkv [rows, (heads + 2 kv_heads) * dim] (queries,
// keys, values side by side), cos/sin [rows, dim]. Optionally RMS-normalises each query and key head (Qwen3), rotates
// queries and keys, writes keys and values to their positions of the layer's cache keys/values [kv_heads, max, dim],
// and returns the rotated queries [rows, heads, dim].
at::Tensor rope_store(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in, at::Tensor keys,
                      at::Tensor values, int64_t pos, int64_t heads, const c10::optional<at::Tensor>& q_norm,
                      const c10::optional<at::Tensor>& k_norm, double q_eps, double k_eps) {
  const at::Tensor qkv = input(qkv_in, at::kFloat, "qkv");
  const at::Tensor cos = input(cos_in, at::kFloat, "cos");
  const at::Tensor sin = input(sin_in, at::kFloat, "sin");
  check_cpu(keys, at::kFloat, "keys");
  check_cpu(values, at::kFloat, "values");
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes(), "keys and values must be [kv_heads, max, dim]");
  const int64_t kv_heads = keys.size(0), max_tokens = keys.size(1), dim = keys.size(2);
  const int64_t width = (heads + 2 * kv_heads) * dim;
  TORCH_CHECK(qkv.dim() >= 1 && qkv.size(-1) == width, "qkv has rows of ", qkv.size(-1), " values, expected ", width);
  const int64_t rows = qkv.numel() / width;
  TORCH_CHECK(cos.numel() == rows * dim && sin.numel() == rows * dim, "cos and sin must hold ", rows,
              " positions of ", dim, " values");
  TORCH_CHECK(pos >= 0 && pos + rows <= max_tokens, "positions ", pos, "..", pos + rows - 1,
              " are outside the cache of ", max_tokens);
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "give both query and key norms or neither");
  if (q_norm.has_value()) {
    check_cpu(*q_norm, at::kFloat, "q_norm");
    check_cpu(*k_norm, at::kFloat, "k_norm");
    TORCH_CHECK(q_norm->numel() == dim && k_norm->numel() == dim, "q/k norm weights must have ", dim, " values");
  }
  at::Tensor q = at::empty({rows, heads, dim}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  float* pq = q.data_ptr<float>();
  float* pk = keys.data_ptr<float>();
  float* pv = values.data_ptr<float>();
  for_rows(rows, width, [&](int64_t first, int64_t last) {
    std::vector<float> qk((heads + kv_heads) * dim);
    for (int64_t r = first; r < last; ++r) {
      const float* row = src + r * width;
      std::copy_n(row, qk.size(), qk.data());
      if (q_norm.has_value()) {
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
          const float* weight = (h < heads ? q_norm : k_norm)->data_ptr<float>();
          const float eps = static_cast<float>(h < heads ? q_eps : k_eps);
          rms_norm_row(qk.data() + h * dim, weight, eps, dim, qk.data() + h * dim);
        }
      }
      for (int64_t h = 0; h < heads + kv_heads; ++h)
        rope_head(qk.data() + h * dim, cos.data_ptr<float>() + r * dim, sin.data_ptr<float>() + r * dim, dim);
      const float* v = row + (heads + kv_heads) * dim;
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::copy_n(qk.data() + (heads + h) * dim, dim, pk + (h * max_tokens + pos + r) * dim);
        std::copy_n(v + h * dim, dim, pv + (h * max_tokens + pos + r) * dim);
      }
      std::copy_n(qk.data(), heads * dim, pq + r * heads * dim);
    }
  });
  return q;
}

// Attention of one query token over the first `length` cached positions: q [heads, dim] or [1, heads, dim],
// keys/values [kv_heads, max, dim] (grouped-query: query head h reads kv head h / (heads / kv_heads)). Returns
// softmax(scale * q k^T) v as [1, heads * dim], heads side by side (the o projection's input).
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values, int64_t length,
                            double scale) {
  const at::Tensor q = input(q_in, at::kFloat, "q").reshape({-1, q_in.size(-1)});
  check_cpu(keys, at::kFloat, "keys");
  check_cpu(values, at::kFloat, "values");
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes(), "keys and values must be [kv_heads, max, dim]");
  const int64_t heads = q.size(0), dim = q.size(1), kv_heads = keys.size(0), max_tokens = keys.size(1);
  TORCH_CHECK(keys.size(2) == dim, "queries have ", dim, " values per head, keys ", keys.size(2));
  TORCH_CHECK(heads % kv_heads == 0, heads, " query heads do not group over ", kv_heads, " kv heads");
  TORCH_CHECK(length >= 1 && length <= max_tokens, "length ", length, " is outside 1..", max_tokens);
  at::Tensor out = at::empty({1, heads * dim}, q.options());
  const float* pq = q.data_ptr<float>();
  const float* pk = keys.data_ptr<float>();
  const float* pv = values.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const int64_t group = heads / kv_heads;
  const float s = static_cast<float>(scale);
  // The query heads of one kv head are done together, so each cached key and value row is read once for all of
  // them (at long contexts the reads, not the arithmetic, are the cost). kv heads are split over the threads once
  // there is enough work to pay for it.
  const int64_t grain = length * dim * group >= 8192 ? 1 : kv_heads;
  at::parallel_for(0, kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * length);  // [group, length]
    for (int64_t g = begin; g < end; ++g) {
      const float* qg = pq + g * group * dim;
      const float* kg = pk + g * max_tokens * dim;
      for (int64_t t = 0; t < length; ++t)
        for (int64_t j = 0; j < group; ++j) scores[j * length + t] = dot(qg + j * dim, kg + t * dim, dim) * s;
      for (int64_t j = 0; j < group; ++j) {
        float* row = scores.data() + j * length;
        const float top = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, row,
                                                     length);
        at::vec::map([top](Vec x) { return (x - Vec(top)).exp(); }, row, row, length);
        const float total = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, row, length);
        const Vec inv(1.0f / total);
        at::vec::map([inv](Vec x) { return x * inv; }, row, row, length);
      }
      weighted_sums(scores.data(), group, pv + g * max_tokens * dim, length, dim, po + g * group * dim);
    }
  });
  return out;
}

// Causal attention of `rows` query tokens at positions start..start+rows-1 over the cache: q [rows, heads, dim],
// keys/values [kv_heads, max, dim] holding positions 0..start+rows-1 (grouped-query as above). Returns
// softmax(scale * q k^T) v [rows, heads * dim], each token seeing the positions up to its own.
// A task is one kv head and a block of query tokens. Per query head: one BLAS GEMM for the scores, one softmax pass
// per row, one GEMM for the output (queries read and output written in place through their strides).
at::Tensor causal_attention(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                            double scale) {
  const at::Tensor q = input(q_in, at::kFloat, "q");
  check_cpu(keys, at::kFloat, "keys");
  check_cpu(values, at::kFloat, "values");
  TORCH_CHECK(q.dim() == 3, "q must be [rows, heads, dim]");
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes(), "keys and values must be [kv_heads, max, dim]");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = keys.size(0),
                max_tokens = keys.size(1);
  TORCH_CHECK(keys.size(2) == dim, "queries have ", dim, " values per head, keys ", keys.size(2));
  TORCH_CHECK(heads % kv_heads == 0, heads, " query heads do not group over ", kv_heads, " kv heads");
  TORCH_CHECK(start >= 0 && start + rows <= max_tokens, "positions ", start, "..", start + rows - 1,
              " are outside the cache of ", max_tokens);
  at::Tensor out = at::empty({rows, heads * dim}, q.options());
  const float* pq = q.data_ptr<float>();
  const float* pk = keys.data_ptr<float>();
  const float* pv = values.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const int64_t group = heads / kv_heads, stride = heads * dim;
  const float s = static_cast<float>(scale);
  constexpr int64_t kBlock = 64;  // query tokens a task: its scores (group x 64 x length floats) stay in L2
  const int64_t blocks = (rows + kBlock - 1) / kBlock;
  // Later blocks see more keys. Tasks alternate between the last and the first remaining block, so that the
  // contiguous ranges parallel_for hands to the threads hold about the same work.
  at::parallel_for(0, blocks * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t turn = task / kv_heads, g = task % kv_heads;
      const int64_t b = turn % 2 == 0 ? blocks - 1 - turn / 2 : turn / 2;
      const int64_t first = b * kBlock, count = std::min(kBlock, rows - first), length = start + first + count;
      const float* kg = pk + g * max_tokens * dim;
      const float* vg = pv + g * max_tokens * dim;
      scores.resize(count * length);
      for (int64_t j = 0; j < group; ++j) {
        const int64_t head = g * group + j;
        // scores [count, length] = this head's queries [count, dim] k^T
        gemm_rows(count, length, dim, pq + first * stride + head * dim, stride, kg, dim, true, scores.data(), length);
        for (int64_t i = 0; i < count; ++i) {
          float* row = scores.data() + i * length;
          const int64_t seen = start + first + i + 1;  // keys up to this token's own position
          const float top = s * at::vec::reduce_all<float>(
              [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, row, seen);
          at::vec::map([s, top](Vec x) { return (x * Vec(s) - Vec(top)).exp(); }, row, row, seen);
          const float total = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, row, seen);
          const Vec inv(1.0f / total);
          at::vec::map([inv](Vec x) { return x * inv; }, row, row, seen);
          std::fill(row + seen, row + length, 0.0f);
        }
        // out rows [count, dim] of this head = probabilities [count, length] v [length, dim].
        gemm_rows(count, dim, length, scores.data(), length, vg, dim, false, po + first * stride + head * dim, stride);
      }
    }
  });
  return out;
}

// silu(gate) * up for gate_up [rows, 2 * width] (gate then up, as the fused gate/up GEMM gives them).
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  const at::Tensor gate_up = input(gate_up_in, at::kFloat, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 * width]");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for_rows(rows, 2 * width, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* gate = src + r * 2 * width;
      at::vec::map2([](Vec g, Vec u) { return g / (Vec(1.0f) + g.neg().exp()) * u; }, dst + r * width, gate,
                    gate + width, width);
    }
  });
  return out;
}

// codes[i] = round(x[i] / scale), ties to even, for |x[i] / scale| <= 127.5: IEEE division and the current
// (nearest-even) rounding mode, as PyTorch's div and round.
void codes_of_row(const float* x, float scale, int64_t width, int8_t* codes) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 divisor = _mm512_set1_ps(scale);
  for (; i + 16 <= width; i += 16) {
    const __m512 rounded = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), divisor),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(rounded)));
  }
#endif
  for (; i < width; ++i) codes[i] = static_cast<int8_t>(std::nearbyint(x[i] / scale));
}

// Dynamic symmetric per-row int8 codes and scales [rows, 1] of x [rows, in], bit for bit what
// kernels/cpu.py's quantize_rows_symmetric computes: scale = max(max|x| / 127, min_scale), codes = round(x / scale)
// with ties to even (the same IEEE division and rounding).
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x_in, double min_scale) {
  const at::Tensor x = input(x_in, at::kFloat, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor codes = at::empty({rows, width}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({rows, 1}, x.options());
  const float* px = x.data_ptr<float>();
  int8_t* pc = codes.data_ptr<int8_t>();
  float* ps = scales.data_ptr<float>();
  for_rows(rows, width, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* row = px + r * width;
      float top = 0.0f;  // max is exact in any order, so the vectorised reduction changes nothing
#pragma omp simd reduction(max : top)
      for (int64_t i = 0; i < width; ++i) top = std::max(top, std::fabs(row[i]));
      const float scale = std::max(top / 127.0f, static_cast<float>(min_scale));
      ps[r] = scale;
      codes_of_row(row, scale, width, pc + r * width);
    }
  });
  return {codes, scales};
}

// float(acc) * row_scale * column_scale for acc [rows, out] int32, row_scales [rows, 1], column_scales [out]:
// the W8A8 kernel's epilogue in its order, bit for bit.
at::Tensor dequantize_rows(const at::Tensor& acc_in, const at::Tensor& row_scales_in,
                           const at::Tensor& column_scales_in) {
  const at::Tensor acc = input(acc_in, at::kInt, "acc");
  const at::Tensor row_scales = input(row_scales_in, at::kFloat, "row_scales");
  const at::Tensor column_scales = input(column_scales_in, at::kFloat, "column_scales");
  TORCH_CHECK(acc.dim() == 2 && row_scales.numel() == acc.size(0) && column_scales.numel() == acc.size(1),
              "acc [rows, out] needs row_scales [rows, 1] and column_scales [out]");
  const int64_t rows = acc.size(0), width = acc.size(1);
  at::Tensor out = at::empty({rows, width}, acc.options().dtype(at::kFloat));
  const int32_t* pa = acc.data_ptr<int32_t>();
  const float* pr = row_scales.data_ptr<float>();
  const float* pc = column_scales.data_ptr<float>();
  float* po = out.data_ptr<float>();
  for_rows(rows, width, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) po[r * width + i] = static_cast<float>(pa[r * width + i]) * pr[r] * pc[i];
    }
  });
  return out;
}

// x [rows, in] fp32 times int8 weights q [out, in] (per-output-channel codes) scaled by scales [out]:
// y[r, o] = scales[o] * sum_i q[o, i] * x[r, i], in fp32 throughout. For W8A16 decode: PyTorch's int8 operator
// takes bf16 activations and rounds its output to bf16; this one keeps fp32 and streams the weights as fast.
at::Tensor int8_weight_matmul(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& scales_in) {
  const at::Tensor x = input(x_in, at::kFloat, "x");
  const at::Tensor q = input(q_in, at::kChar, "q");
  const at::Tensor scales = input(scales_in, at::kFloat, "scales");
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "x [rows, in] and q [out, in] must share in");
  TORCH_CHECK(scales.numel() == q.size(0), "scales must have one value per output channel");
  const int64_t rows = x.size(0), width = x.size(1), out = q.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  const float* px = x.data_ptr<float>();
  const int8_t* pq = q.data_ptr<int8_t>();
  const float* ps = scales.data_ptr<float>();
  float* py = y.data_ptr<float>();
  const int64_t blocks = (out + kWeightRows - 1) / kWeightRows;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    float sums[kWeightRows];
    std::vector<int8_t> last;  // a last block of fewer rows, zero-padded to kWeightRows
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * kWeightRows, count = std::min(kWeightRows, out - first);
      const int8_t* w = pq + first * width;
      if (count < kWeightRows) {
        last.assign(kWeightRows * width, 0);
        std::copy_n(w, count * width, last.data());
        w = last.data();
      }
      // The next block's rows, where this thread goes on to them; a short last block is never read past.
      const int8_t* next = b + 1 < end && first + 2 * kWeightRows <= out ? w + kWeightRows * width : nullptr;
      for (int64_t r = 0; r < rows; ++r) {
        int8_dot_rows(w, r == 0 ? next : nullptr, width, px + r * width, width, sums);
        for (int64_t j = 0; j < count; ++j) py[r * out + first + j] = sums[j] * ps[first + j];
      }
    }
  });
  return y;
}

// Weights of W4A16 layers: packed [out, ceil(in / 2)] uint8 nibbles (u = code + 8, even column low), scales and
// zeros [out, groups] fp32 (zeros absent: symmetric), `group_size` columns a group (even, or one group a row).
struct Int4Weights {
  const uint8_t* packed;
  const float* scales;
  const float* zeros;
  int64_t out, width, groups, group_size, row_bytes;

  Int4Weights(const at::Tensor& packed_t, const at::Tensor& scales_t, const c10::optional<at::Tensor>& zeros_t,
              int64_t in_features, int64_t group_size_in)
      : packed(packed_t.data_ptr<uint8_t>()), scales(scales_t.data_ptr<float>()),
        zeros(zeros_t.has_value() ? zeros_t->data_ptr<float>() : nullptr), out(packed_t.size(0)),
        width(in_features), groups(scales_t.size(1)), group_size(group_size_in), row_bytes(packed_t.size(1)) {
    TORCH_CHECK(packed_t.dim() == 2 && row_bytes == (width + 1) / 2, "packed must be [out, ceil(in / 2)] = [", out,
                ", ", (width + 1) / 2, "]");
    TORCH_CHECK(group_size > 0 && (group_size % 2 == 0 || group_size >= width),
                "group size must be even or cover the row, got ", group_size);
    TORCH_CHECK(scales_t.dim() == 2 && scales_t.size(0) == out && groups == (width + group_size - 1) / group_size,
                "scales must be [out, groups] = [", out, ", ", (width + group_size - 1) / group_size, "]");
    TORCH_CHECK(!zeros_t.has_value() || zeros_t->sizes() == scales_t.sizes(), "zeros must match scales");
  }

  Int4Group group(int64_t row, int64_t g) const {
    return {scales[row * groups + g], zeros != nullptr ? zeros[row * groups + g] : 0.0f};
  }

  // The fp32 weights of output channel `row` into w [width].
  void dequantize_row(int64_t row, float* w) const {
    const uint8_t* p = packed + row * row_bytes;
    for_groups(width, group_size, [&](int64_t first, int64_t last, int64_t g) {
      const Int4Group q = group(row, g);
      int64_t i = first;
#if defined(CPU_CAPABILITY_AVX512)
      const __m512 table = q.table();
      for (; i + 16 <= last; i += 16) _mm512_storeu_ps(w + i, int4_weights(p, i, table));
#endif
      for (; i < last; ++i) w[i] = q.value(nibble(p, i));
    });
  }
};

Int4Weights int4_weights_of(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                            int64_t in_features, int64_t group_size) {
  check_cpu(packed, at::kByte, "packed");
  check_cpu(scales, at::kFloat, "scales");
  if (zeros.has_value()) check_cpu(*zeros, at::kFloat, "zeros");
  TORCH_CHECK(packed.dim() == 2 && scales.dim() == 2,
              "packed [out, ceil(in / 2)] and scales [out, groups] must be 2-D");
  return Int4Weights(packed, scales, zeros, in_features, group_size);
}

// The fp32 weight [out, in] of a W4A16 layer, equal bit for bit to the reference kernel's dequantization: for many
// rows the kernel multiplies by it with PyTorch's fp32 GEMM, as the reference does, in one pass instead of five.
at::Tensor dequantize_int4(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                           int64_t in_features, int64_t group_size) {
  const Int4Weights weights = int4_weights_of(packed, scales, zeros, in_features, group_size);
  at::Tensor w = at::empty({weights.out, in_features}, scales.options());
  float* pw = w.data_ptr<float>();
  for_rows(weights.out, in_features, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) weights.dequantize_row(r, pw + r * in_features);
  });
  return w;
}

constexpr int64_t kPrefetchChannels = 4;

// Activation rows [rows, width] with each full block of 32 columns reordered as its 16 even columns, then its 16 odd
// ones: the order int4_weights32 gives the weights in. Only blocks that start on a multiple of 32 are read so,
// which every block inside a group is when groups are multiples of 32 wide or span the row.
std::vector<float> split_even_odd(const float* x, int64_t rows, int64_t width) {
  std::vector<float> split(x, x + rows * width);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c + 32 <= width; c += 32)
      for (int64_t k = 0; k < 16; ++k) {
        split[r * width + c + k] = x[r * width + c + 2 * k];
        split[r * width + c + 16 + k] = x[r * width + c + 2 * k + 1];
      }
  return split;
}

// sums[r] = x[r] . (weights of output channel o) for R rows of x [.., width] (split: the same rows reordered by
// split_even_odd, or null): each weight dequantized in registers as dequantize_int4 does, once for the R rows,
// multiplied with fp32 activations in fp32. Even and odd columns sum apart: two independent chains of FMAs.
template <int64_t R>
void int4_channel(const Int4Weights& weights, int64_t o, const float* x, const float* split, float* sums) {
  const uint8_t* p = weights.packed + o * weights.row_bytes;
  const int64_t width = weights.width;
  if (o + kPrefetchChannels < weights.out)  // a later channel's bytes, requested now: decode reads them from memory
    for (int64_t b = 0; b < weights.row_bytes; b += kCacheLine)
      __builtin_prefetch(p + kPrefetchChannels * weights.row_bytes + b, 0, 3);
  for (int64_t r = 0; r < R; ++r) sums[r] = 0.0f;
#if defined(CPU_CAPABILITY_AVX512)
  __m512 acc[R], acc_odd[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = acc_odd[r] = _mm512_setzero_ps();
#endif
  for_groups(width, weights.group_size, [&](int64_t first, int64_t last, int64_t g) {
    const Int4Group q = weights.group(o, g);
    int64_t i = first;
#if defined(CPU_CAPABILITY_AVX512)
    const __m512 table = q.table();
    if (split != nullptr) {
      for (; i + 32 <= last; i += 32) {
        __m512 even, odd;
        int4_weights32(p, i, table, even, odd);
        for (int64_t r = 0; r < R; ++r) {
          acc[r] = _mm512_fmadd_ps(even, _mm512_loadu_ps(split + r * width + i), acc[r]);
          acc_odd[r] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(split + r * width + i + 16), acc_odd[r]);
        }
      }
    }
    for (; i + 16 <= last; i += 16) {
      const __m512 w = int4_weights(p, i, table);
      for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * width + i), acc[r]);
    }
#endif
    for (; i < last; ++i) {
      const float w = q.value(nibble(p, i));
      for (int64_t r = 0; r < R; ++r) sums[r] += w * x[r * width + i];
    }
  });
#if defined(CPU_CAPABILITY_AVX512)
  for (int64_t r = 0; r < R; ++r) sums[r] += _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc_odd[r]));
#endif
}

// y [rows, out] = x [rows, in] times the W4A16 weights, for a few rows (decode; dequantize_int4 and a GEMM serve
// a prompt): rows four at a time, so each dequantized weight serves four activation rows.
at::Tensor int4_weight_matmul(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, int64_t group_size) {
  const at::Tensor x = input(x_in, at::kFloat, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  const int64_t rows = x.size(0), width = x.size(1);
  const Int4Weights weights = int4_weights_of(packed, scales, zeros, width, group_size);
  at::Tensor y = at::empty({rows, weights.out}, x.options());
  const float* px = x.data_ptr<float>();
  float* py = y.data_ptr<float>();
  std::vector<float> split;
  if (group_size % 32 == 0 || group_size >= width) split = split_even_odd(px, rows, width);
  const float* ps = split.empty() ? nullptr : split.data();
  at::parallel_for(0, weights.out, 16, [&](int64_t begin, int64_t end) {
    float sums[4];
    for (int64_t o = begin; o < end; ++o) {
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) {
        int4_channel<4>(weights, o, px + r * width, ps == nullptr ? nullptr : ps + r * width, sums);
        for (int64_t k = 0; k < 4; ++k) py[(r + k) * weights.out + o] = sums[k];
      }
      for (; r < rows; ++r) {
        int4_channel<1>(weights, o, px + r * width, ps == nullptr ? nullptr : ps + r * width, sums);
        py[r * weights.out + o] = sums[0];
      }
    }
  });
  return y;
}

// Whether causal_attention calls BLAS directly from now on (where the build has it) or at::mm; returns which.
bool use_blas(bool wanted) {
  blas_wanted = wanted;
  return sgemm_ != nullptr && blas_wanted;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("use_blas", &use_blas);
  m.def("dequantize_int4", &dequantize_int4);
  m.def("int4_weight_matmul", &int4_weight_matmul);
  m.def("int8_weight_matmul", &int8_weight_matmul);
  m.def("rms_norm", &rms_norm);
  m.def("rope_store", &rope_store);
  m.def("decode_attention", &decode_attention);
  m.def("causal_attention", &causal_attention);
  m.def("silu_mul", &silu_mul);
  m.def("quantize_rows", &quantize_rows);
  m.def("dequantize_rows", &dequantize_rows);
}
