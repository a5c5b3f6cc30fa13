// Fused CPU operators for the lean loop's prompt and decode steps: RMS norm, rotary embedding with the cache write,
// attention over the cache (one query, or a prompt's rows causally), SiLU x up, and the int8 quantization of
// activation rows and dequantization of W8A8's integer sums (kernels/native.py builds this file with
// matmul_kernels.cpp and bindings.cpp on first use; bindings.cpp registers the operators by name).
//
// A decode step of a small model is bound by operator count, not by arithmetic: each PyTorch operator costs
// 1-3 us of dispatch and allocation whatever its size, and a block runs dozens of them around its four GEMMs.
// Each function here does in one call, in plain loops over contiguous fp32 rows, what the eager loop does in
// several operators; for a prompt's rows the loops split over the threads, and attention runs on BLAS GEMMs.
// The W8A8 GEMM stays PyTorch's integer operator; this file quantizes its input rows and scales its output.

#include "common.h"
#include "row_ops.h"
#include "step_kinds.h"

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

// ==== BLAS ====

// The BLAS single-precision GEMM PyTorch's x86 and Arm builds carry (MKL / OpenBLAS) and export. Weak: where a
// build lacks it the symbol is null and causal_attention falls back to at::mm, so the module still loads.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace {

// ==== weighted sums (the row helpers norm, dot product and rotary are row_ops.h's) ====

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

// ==== GEMM on row-major buffers (BLAS, or at::mm) ====

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

}  // namespace

// ==== RMS norm ====

// x: [rows, width] fp32, weight: [width] fp32 -> y: [rows, width] fp32 (the step's form: raw rows, split over the
// team when called in one)
void rms_norm_into(const float* x, const float* weight, double eps, int64_t rows, int64_t width, float* y) {
  for_rows(rows, width, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      norm_row(x + r * width, weight, static_cast<float>(eps), width, y + r * width);
  });
}

// x: [..., width] fp32, weight: [width] fp32 -> y: [..., width] fp32
// RMS norm of each row of x [..., width] with weight [width].
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  const at::Tensor x = input(x_in, at::kFloat, "x");
  const at::Tensor weight = input(weight_in, at::kFloat, "weight");
  const int64_t width = weight.numel();
  TORCH_CHECK(x.size(-1) == width, "x has rows of ", x.size(-1), " values, the norm weight ", width);
  at::Tensor y = at::empty_like(x);
  rms_norm_into(x.data_ptr<float>(), weight.data_ptr<float>(), eps, x.numel() / width, width, y.data_ptr<float>());
  return y;
}

// ==== rotary embedding + cache write ====

// qkv: [rows, (heads + 2 * kv_heads) * dim] fp32 (leading dims: any, holding `rows` rows), cos, sin: [rows, dim]
// fp32, keys, values: [kv_heads, max, dim] fp32 contiguous (written in place at positions pos..pos+rows-1),
// q_norm, k_norm: [dim] fp32 or both absent -> q: [rows, heads, dim] fp32
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
          norm_row(qk.data() + h * dim, weight, eps, dim, qk.data() + h * dim);
        }
      }
      for (int64_t h = 0; h < heads + kv_heads; ++h)
        rope_row(qk.data() + h * dim, cos.data_ptr<float>() + r * dim, sin.data_ptr<float>() + r * dim, dim,
                 qk.data() + h * dim);
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

// ==== attention over the cache ====

// q: [heads, dim] or [1, heads, dim] fp32, keys, values: [kv_heads, max, dim] fp32 (positions 0..length-1 filled)
// -> out: [1, heads * dim] fp32
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

// q: [rows, heads, dim] fp32, keys, values: [kv_heads, max, dim] fp32 (positions 0..start+rows-1 filled)
// -> out: [rows, heads * dim] fp32
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

// wanted: bool -> bool (whether causal_attention now calls BLAS)
// Whether causal_attention calls BLAS directly from now on (where the build has it) or at::mm; returns which.
bool use_blas(bool wanted) {
  blas_wanted = wanted;
  return sgemm_ != nullptr && blas_wanted;
}

// ==== act(gate) x up ====

// gate_up: [rows, 2 * width] fp32 -> out: [rows, width] fp32 (the step's form); activation: step_kinds.h's
void gate_mul_into(int64_t activation, const float* gate_up, int64_t rows, int64_t width, float* out) {
  TORCH_CHECK(activation >= 0 && activation < kGateActivations, "unknown gate activation ", activation);
  for_rows(rows, 2 * width, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* gate = gate_up + r * 2 * width;
      if (activation == kSilu) {
        at::vec::map2([](Vec g, Vec u) { return g / (Vec(1.0f) + g.neg().exp()) * u; }, out + r * width, gate,
                      gate + width, width);
      } else {
        const Vec half(0.5f), one(1.0f), root(0.7978845608028654f), cubic(0.044715f);  // root: sqrt(2 / pi)
        at::vec::map2(
            [&](Vec g, Vec u) { return half * g * (one + (root * (g + cubic * g * g * g)).tanh()) * u; },
            out + r * width, gate, gate + width, width);
      }
    }
  });
}

// gate_up: [rows, 2 * width] fp32, activation -> out: [rows, width] fp32
// act(gate) * up for gate_up [rows, 2 * width] (gate then up, as the fused gate/up GEMM gives them).
at::Tensor gate_mul(const at::Tensor& gate_up_in, int64_t activation) {
  const at::Tensor gate_up = input(gate_up_in, at::kFloat, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 * width]");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  gate_mul_into(activation, gate_up.data_ptr<float>(), rows, width, out.data_ptr<float>());
  return out;
}

// ==== activation rows: int8 quantize / dequantize (W8A8) ====

// x: [width] fp32, scale: fp32 -> codes: [width] int8
// codes[i] = round(x[i] / scale), ties to even, for |x[i] / scale| <= qmax + 0.5: IEEE division and the current
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

// x: [rows, in] fp32 -> codes: [rows, in] int8, scales: [rows] fp32 (quantize_rows' step form)
void quantize_rows_into(const float* x, int64_t rows, int64_t width, double min_scale, int64_t qmax, int8_t* codes,
                        float* scales) {
  for_rows(rows, width, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* row = x + r * width;
      float top = 0.0f;  // max is exact in any order, so the vectorised reduction changes nothing
#pragma omp simd reduction(max : top)
      for (int64_t i = 0; i < width; ++i) top = std::max(top, std::fabs(row[i]));
      const float scale = std::max(top / static_cast<float>(qmax), static_cast<float>(min_scale));
      scales[r] = scale;
      codes_of_row(row, scale, width, codes + r * width);
    }
  });
}

// x: [rows, in] fp32, min_scale: double, qmax: 127 (int8 codes) or 7 (4-bit codes in int8)
// -> (codes: [rows, in] int8, scales: [rows, 1] fp32)
// Dynamic symmetric per-row codes and scales [rows, 1] of x [rows, in], bit for bit what kernels/cpu.py's
// quantize_rows_symmetric computes: scale = max(max|x| / qmax, min_scale), codes = round(x / scale) with ties to even
// (the same IEEE division and rounding).
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x_in, double min_scale, int64_t qmax) {
  TORCH_CHECK(qmax >= 1 && qmax <= 127, "qmax must lie in [1, 127], got ", qmax);
  const at::Tensor x = input(x_in, at::kFloat, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor codes = at::empty({rows, width}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({rows, 1}, x.options());
  quantize_rows_into(x.data_ptr<float>(), rows, width, min_scale, qmax, codes.data_ptr<int8_t>(),
                     scales.data_ptr<float>());
  return {codes, scales};
}

// x: [rows, in] fp32, min_scale: double, qmin < 0 < qmax: the code range (-128..127 or -8..7)
// -> (codes: [rows, in] int8, scales: [rows, 1] fp32, zeros: [rows, 1] int32)
// Dynamic asymmetric per-row codes, bit for bit what primitives.py's choose_qparams (asymmetric, no scale rounding)
// and quantize compute: lo = min(min x, 0), hi = max(max x, 0), scale = max((hi - lo) / (qmax - qmin), min_scale),
// zero = clamp(round(qmin - lo / scale), qmin, qmax), codes = clamp(round(x / scale) + zero, qmin, qmax), rounding
// ties to even (the same IEEE operations in the same order). One pass for what is eight PyTorch operators.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_asym(const at::Tensor& x_in, double min_scale,
                                                                  int64_t qmin, int64_t qmax) {
  TORCH_CHECK(qmin < 0 && qmax > 0 && qmin >= -128 && qmax <= 127, "the code range must hold zero and fit int8, got [",
              qmin, ", ", qmax, "]");
  const at::Tensor x = input(x_in, at::kFloat, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor codes = at::empty({rows, width}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({rows, 1}, x.options());
  at::Tensor zeros = at::empty({rows, 1}, x.options().dtype(at::kInt));
  const float* px = x.data_ptr<float>();
  int8_t* pc = codes.data_ptr<int8_t>();
  float* ps = scales.data_ptr<float>();
  int32_t* pz = zeros.data_ptr<int32_t>();
  const float low_code = static_cast<float>(qmin), high_code = static_cast<float>(qmax);
  for_rows(rows, width, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* row = px + r * width;
      float lo = 0.0f, hi = 0.0f;  // min and max are exact in any order
#pragma omp simd reduction(min : lo) reduction(max : hi)
      for (int64_t i = 0; i < width; ++i) {
        lo = std::min(lo, row[i]);
        hi = std::max(hi, row[i]);
      }
      const float scale = std::max((hi - lo) / static_cast<float>(qmax - qmin), static_cast<float>(min_scale));
      const float zero = std::min(std::max(std::nearbyint(low_code - lo / scale), low_code), high_code);
      ps[r] = scale;
      pz[r] = static_cast<int32_t>(zero);
      int8_t* out = pc + r * width;
      for (int64_t i = 0; i < width; ++i)
        out[i] = static_cast<int8_t>(std::min(std::max(std::nearbyint(row[i] / scale) + zero, low_code), high_code));
    }
  });
  return {codes, scales, zeros};
}

// acc: [rows, out] int32, row_scales: [rows, 1] fp32, column_scales: [out] fp32 -> out: [rows, out] fp32
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

// ==== online Hadamard transform (rotate's down_proj input) ====

namespace {

// a[k], b[k] <- a[k] + b[k], a[k] - b[k] for k < span: one butterfly of the Walsh-Hadamard transform.
void butterfly(float* a, float* b, int64_t span) {
  int64_t k = 0;
  for (; k + Vec::size() <= span; k += Vec::size()) {
    const Vec u = Vec::loadu(a + k), v = Vec::loadu(b + k);
    (u + v).store(a + k);
    (u - v).store(b + k);
  }
  for (; k < span; ++k) {
    const float u = a[k], v = b[k];
    a[k] = u + v;
    b[k] = u - v;
  }
}

}  // namespace

// x: [rows, width] fp32, signs: [width] fp32, odd: [m, m] fp32 with width = 2^a * m -> [rows, width] fp32
// Each row x becomes x Q with Q = diag(signs) (H ⊗ odd) / sqrt(2^a), H the Walsh-Hadamard matrix of order 2^a
// (methods/rotate.py's rotation_matrix): the row is read as X [2^a, m], multiplied by `odd` on the right (m^2
// products per group of m), then H runs down the 2^a groups in log2(2^a) butterfly stages, each over contiguous
// spans of h * m values (vectorised once the span holds a vector), and the last scale is one multiply per value.
// kernels/hadamard.py's hadamard_reference does the same stages in PyTorch operators.
at::Tensor hadamard_transform(const at::Tensor& x_in, const at::Tensor& signs_in, const at::Tensor& odd_in) {
  const at::Tensor x = input(x_in, at::kFloat, "x");
  const at::Tensor signs = input(signs_in, at::kFloat, "signs");
  const at::Tensor odd = input(odd_in, at::kFloat, "odd");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, width]");
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(odd.dim() == 2 && odd.size(0) == odd.size(1) && odd.size(0) >= 1, "odd must be [m, m]");
  const int64_t m = odd.size(0), power = width / std::max<int64_t>(1, m);
  TORCH_CHECK(power >= 1 && power * m == width && (power & (power - 1)) == 0,
              "width must be a power of two times odd's order, got ", width, " and ", m);
  TORCH_CHECK(signs.numel() == width, "signs must hold width values");
  at::Tensor out = at::empty({rows, width}, x.options());
  const float* px = x.data_ptr<float>();
  const float* ps = signs.data_ptr<float>();
  const float* po = odd.data_ptr<float>();
  float* py = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(power));
  for_rows(rows, width, [&](int64_t first, int64_t last) {
    std::vector<float> signed_row(m > 1 ? width : 0);
    for (int64_t r = first; r < last; ++r) {
      const float* src = px + r * width;
      float* dst = py + r * width;
      if (m == 1) {
        at::vec::map2([](Vec a, Vec b) { return a * b; }, dst, src, ps, width);
      } else {
        float* tmp = signed_row.data();
        at::vec::map2([](Vec a, Vec b) { return a * b; }, tmp, src, ps, width);
        for (int64_t p = 0; p < power; ++p) {
          const float* group = tmp + p * m;
          float* outg = dst + p * m;
          for (int64_t c = 0; c < m; ++c) {
            float sum = 0.0f;
            for (int64_t k = 0; k < m; ++k) sum += group[k] * po[k * m + c];
            outg[c] = sum;
          }
        }
      }
      for (int64_t h = 1; h < power; h *= 2) {
        const int64_t span = h * m;
        for (int64_t i = 0; i < power; i += 2 * h) butterfly(dst + i * m, dst + i * m + span, span);
      }
      at::vec::map([scale](Vec a) { return a * Vec(scale); }, dst, dst, width);
    }
  });
  return out;
}

// ==== searched activation clipping (--act-clip search) ====

// x: [rows, width] fp32, bits: the activation width, symmetric, fractions: [F] fp32 (F <= 16), min_scale: double
// -> [rows, width] fp32
// Each row clamped to the fraction f of its range, among `fractions`, whose dynamic rounding leaves the least
// squared error (the first such f on a tie): symmetric codes in [-2^(b-1), 2^(b-1) - 1] on max|x| f / qmax, or
// asymmetric ones with a zero point on [f min(x, 0), f max(x, 0)], each value rounded as the kernel rounds the
// clamped row (ties to even). One vectorised pass over the row per fraction; kernels/clipping.py's
// search_clip_reference is the same in PyTorch operators (its error sums run in another order).
at::Tensor search_clip_rows(const at::Tensor& x_in, int64_t bits, bool symmetric, const at::Tensor& fractions_in,
                            double min_scale) {
  TORCH_CHECK(bits >= 2 && bits <= 8, "bits must lie in [2, 8], got ", bits);
  const at::Tensor x = input(x_in, at::kFloat, "x");
  const at::Tensor fractions = input(fractions_in, at::kFloat, "fractions");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, width]");
  const int64_t count = fractions.numel();
  TORCH_CHECK(count >= 1 && count <= 16, "fractions must hold 1 to 16 values");
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor out = at::empty({rows, width}, x.options());
  const float* px = x.data_ptr<float>();
  const float* pf = fractions.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const float qmin = -static_cast<float>(1 << (bits - 1)), qmax = static_cast<float>((1 << (bits - 1)) - 1);
  const float floor_scale = static_cast<float>(min_scale);
  for_rows(rows, width * count, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* row = px + r * width;
      float low = 0.0f, high = 0.0f;  // the range always holds zero, as the kernels' scales do
#pragma omp simd reduction(min : low) reduction(max : high)
      for (int64_t i = 0; i < width; ++i) {
        low = std::min(low, row[i]);
        high = std::max(high, row[i]);
      }
      float best_error = std::numeric_limits<float>::infinity(), best_lo = low, best_hi = high;
      for (int64_t f = 0; f < count; ++f) {
        float lo, hi, scale, zero = 0.0f;
        if (symmetric) {
          hi = std::max(-low, high) * pf[f];
          lo = -hi;
          scale = std::max(hi / qmax, floor_scale);
        } else {
          lo = low * pf[f];
          hi = high * pf[f];
          scale = std::max((hi - lo) / (qmax - qmin), floor_scale);
          zero = std::min(std::max(std::nearbyint(qmin - lo / scale), qmin), qmax);
        }
        // Times the reciprocal, where the kernels divide: the estimate may round a value lying exactly between
        // two codes the other way, which moves the error by a hair and never the clipping that follows.
        const float inverse = 1.0f / scale;
        const Vec v_lo(lo), v_hi(hi), v_inverse(inverse), v_scale(scale), v_zero(zero), v_qmin(qmin), v_qmax(qmax);
        Vec sums(0.0f);
        int64_t i = 0;
        for (; i + Vec::size() <= width; i += Vec::size()) {
          const Vec value = Vec::loadu(row + i);
          const Vec code = at::vec::clamp((at::vec::clamp(value, v_lo, v_hi) * v_inverse).round() + v_zero, v_qmin,
                                          v_qmax);
          const Vec miss = (code - v_zero) * v_scale - value;
          sums = at::vec::fmadd(miss, miss, sums);
        }
        float error = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sums);
        for (; i < width; ++i) {
          const float clamped = std::min(std::max(row[i], lo), hi);
          const float code = std::min(std::max(std::nearbyint(clamped * inverse) + zero, qmin), qmax);
          const float miss = (code - zero) * scale - row[i];
          error += miss * miss;
        }
        if (error < best_error) {
          best_error = error;
          best_lo = lo;
          best_hi = hi;
        }
      }
      float* dst = po + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) dst[i] = std::min(std::max(row[i], best_lo), best_hi);
    }
  });
  return out;
}
