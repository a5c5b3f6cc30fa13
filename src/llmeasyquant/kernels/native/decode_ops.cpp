// Fused CPU operators for a batch-1 decode step (kernels/native.py builds this file on first use).
//
// A decode step of a small model is bound by operator count, not by arithmetic: each PyTorch operator costs
// 1-3 us of dispatch and allocation whatever its size, and a block runs dozens of them around its four GEMMs.
// Each function here does in one call, in plain loops over contiguous fp32 rows, what the eager decode loop
// does in several operators. The GEMMs stay PyTorch's integer operators, but for one: the W8A16 matmul at the end,
// which keeps fp32 activations where PyTorch's int8 operator rounds them to bf16.

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
  for (int64_t r = 0; r < x.numel() / width; ++r)
    rms_norm_row(px + r * width, pw, static_cast<float>(eps), width, py + r * width);
  return y;
}

// One token's attention inputs: qkv [1, (heads + 2 kv_heads) * dim] (queries, keys, values side by side).
// Optionally RMS-normalises each query and key head (Qwen3), rotates queries and keys by the position's
// cos/sin [dim], writes the key and value to position `pos` of the layer's cache keys/values [kv_heads, max, dim],
// and returns the rotated queries [heads, dim].
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
  TORCH_CHECK(qkv.numel() == (heads + 2 * kv_heads) * dim, "qkv has ", qkv.numel(), " values, expected ",
              (heads + 2 * kv_heads) * dim);
  TORCH_CHECK(cos.numel() == dim && sin.numel() == dim, "cos and sin must hold one position's ", dim, " values");
  TORCH_CHECK(pos >= 0 && pos < max_tokens, "position ", pos, " is outside the cache of ", max_tokens);
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "give both query and key norms or neither");
  const float* src = qkv.data_ptr<float>();
  std::vector<float> qk(src, src + (heads + kv_heads) * dim);
  if (q_norm.has_value()) {
    check_cpu(*q_norm, at::kFloat, "q_norm");
    check_cpu(*k_norm, at::kFloat, "k_norm");
    TORCH_CHECK(q_norm->numel() == dim && k_norm->numel() == dim, "q/k norm weights must have ", dim, " values");
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      const float* weight = (h < heads ? q_norm : k_norm)->data_ptr<float>();
      const float eps = static_cast<float>(h < heads ? q_eps : k_eps);
      rms_norm_row(qk.data() + h * dim, weight, eps, dim, qk.data() + h * dim);
    }
  }
  for (int64_t h = 0; h < heads + kv_heads; ++h) rope_head(qk.data() + h * dim, cos.data_ptr<float>(),
                                                           sin.data_ptr<float>(), dim);
  float* pk = keys.data_ptr<float>();
  float* pv = values.data_ptr<float>();
  const float* v = src + (heads + kv_heads) * dim;
  for (int64_t h = 0; h < kv_heads; ++h) {
    std::copy_n(qk.data() + (heads + h) * dim, dim, pk + (h * max_tokens + pos) * dim);
    std::copy_n(v + h * dim, dim, pv + (h * max_tokens + pos) * dim);
  }
  at::Tensor q = at::empty({heads, dim}, qkv.options());
  std::copy_n(qk.data(), heads * dim, q.data_ptr<float>());
  return q;
}

// Attention of one query token over the first `length` cached positions: q [heads, dim], keys/values
// [kv_heads, max, dim] (grouped-query: query head h reads kv head h / (heads / kv_heads)). Returns
// softmax(scale * q k^T) v as [1, heads * dim], heads side by side (the o projection's input).
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values, int64_t length,
                            double scale) {
  const at::Tensor q = input(q_in, at::kFloat, "q");
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

// silu(gate) * up for gate_up [rows, 2 * width] (gate then up, as the fused gate/up GEMM gives them).
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  const at::Tensor gate_up = input(gate_up_in, at::kFloat, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 * width]");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = src + r * 2 * width;
    at::vec::map2([](Vec g, Vec u) { return g / (Vec(1.0f) + g.neg().exp()) * u; }, dst + r * width, gate,
                  gate + width, width);
  }
  return out;
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
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = px + r * width;
    float top = 0.0f;  // max is exact in any order, so the vectorised reduction changes nothing
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < width; ++i) top = std::max(top, std::fabs(row[i]));
    const float scale = std::max(top / 127.0f, static_cast<float>(min_scale));
    ps[r] = scale;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) pc[r * width + i] = static_cast<int8_t>(std::nearbyint(row[i] / scale));
  }
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
  for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) po[r * width + i] = static_cast<float>(pa[r * width + i]) * pr[r] * pc[i];
  }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_weight_matmul", &int8_weight_matmul);
  m.def("rms_norm", &rms_norm);
  m.def("rope_store", &rope_store);
  m.def("decode_attention", &decode_attention);
  m.def("silu_mul", &silu_mul);
  m.def("quantize_rows", &quantize_rows);
  m.def("dequantize_rows", &dequantize_rows);
}
