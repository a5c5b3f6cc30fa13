// The engine's step over a model's blocks in one native call (runtime/native_step.py builds the program, runtime/
// batch.py runs it for every step's rows: decode rows of many sequences and prompt chunks together). Each block is
// the operators the Python forward of runtime/batch.py calls, in its order: RMS norm, the q/k/v projection, rotary
// embedding with the pool write (float or SimQuant codes), paged attention, the o projection and residual, RMS norm,
// gate/up, SiLU x up, down and residual; each projection as its chosen kernel runs it (step_kinds.h). The same
// operators in the same order give the Python forward's logits bit for bit; what goes is the interpreter between
// them (module calls, kernel dispatch, tensor views), some two hundred calls a step.

#include "native_step.h"

#include "operators.h"

#include <utility>

namespace {

// [rows or 1, groups] -> [rows, cols], each group's value over its columns (primitives.expand_groups).
at::Tensor expand_groups(const at::Tensor& params, int64_t width, int64_t rows, int64_t cols) {
  if (params.size(1) == 1) return params.expand({rows, cols});
  return params.repeat_interleave(width, 1).slice(1, 0, cols).expand({rows, cols});
}

// y - x.sum(1) * zero_times_scale: the rank-1 term of asymmetric int8 weights (kernels/cpu.py _minus_zero_term).
at::Tensor minus_zero_term(const at::Tensor& y, const at::Tensor& x, const at::Tensor& zero_times_scale) {
  if (!zero_times_scale.defined()) return y;
  return y - x.sum(1, /*keepdim=*/true) * zero_times_scale.unsqueeze(0);
}

c10::optional<at::Tensor> optional(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// W4A8 / W4A4: activation codes per token (or per token per group), the integer matmul, the zero points' term.
at::Tensor int4_int8_linear(const StepLinear& l, const at::Tensor& x, double min_scale) {
  const int64_t rows = x.size(0);
  const at::Tensor grouped = l.act_group > 0 ? x.reshape({-1, l.act_group}) : x;
  at::Tensor codes, scales, zeros;
  if (l.d.defined()) {
    std::tie(codes, scales, zeros) = quantize_rows_asym(grouped, min_scale, l.act_qmin, l.act_qmax);
    zeros = zeros.reshape({rows, -1});
  } else {
    std::tie(codes, scales) = quantize_rows(grouped, min_scale, l.act_qmax);
  }
  codes = codes.reshape(x.sizes());
  scales = scales.reshape({rows, -1});
  const at::Tensor y = int4_int8_matmul(codes, scales, l.a, l.b, l.c, l.group_size, l.out_features, 1);
  if (!l.d.defined()) return y;
  if (l.act_group > 0) return y - at::matmul(scales * zeros, l.d);
  return y - (scales * zeros) * l.d.unsqueeze(0);
}

}  // namespace

StepProgram::StepProgram(int64_t heads, double scale, bool quantized_pool, at::Tensor tables, at::Tensor cos_table,
                         at::Tensor sin_table, int64_t bits, int64_t sinks, double min_scale)
    : heads_(heads), scale_(scale), min_scale_(min_scale), quantized_pool_(quantized_pool),
      tables_(std::move(tables)), cos_table_(std::move(cos_table)), sin_table_(std::move(sin_table)), bits_(bits),
      sinks_(sinks) {
  TORCH_CHECK(tables_.scalar_type() == at::kInt && tables_.dim() == 2, "tables must be [sequences, blocks] int32");
}

void StepProgram::add_block(const std::vector<c10::optional<at::Tensor>>& norms, const std::vector<double>& eps,
                            const std::vector<at::Tensor>& pool) {
  TORCH_CHECK(norms.size() == 4 && eps.size() == 4, "a block takes 4 norms (attn, mlp, q, k) and 4 epsilons");
  TORCH_CHECK(norms[0].has_value() && norms[1].has_value(), "a block needs its attention and MLP norms");
  TORCH_CHECK(pool.size() == (quantized_pool_ ? 11u : 2u), "a block's pool layer has ", quantized_pool_ ? 11 : 2,
              " tensors, got ", pool.size());
  StepBlock block;
  block.attn_norm = *norms[0];
  block.mlp_norm = *norms[1];
  block.q_norm = norms[2];
  block.k_norm = norms[3];
  for (int i = 0; i < 4; ++i) block.eps[i] = eps[i];
  block.pool = pool;
  blocks_.push_back(std::move(block));
}

void StepProgram::add_linear(int64_t which, int64_t kind, const std::vector<c10::optional<at::Tensor>>& tensors,
                             const std::vector<int64_t>& ints) {
  TORCH_CHECK(!blocks_.empty(), "add a block before its linears");
  TORCH_CHECK(which >= 0 && which < 4, "projection ", which, " is not one of 0 (qkv), 1 (o), 2 (gate_up), 3 (down)");
  TORCH_CHECK(kind >= 0 && kind < kStepKinds, "unknown step kind ", kind);
  TORCH_CHECK(tensors.size() == 5 && ints.size() == 7, "a linear takes 5 tensors (a, b, c, d, bias) and 7 ints");
  TORCH_CHECK(tensors[0].has_value(), "a linear needs its weight tensor (a)");
  StepLinear l;
  l.kind = kind;
  at::Tensor* slots[4] = {&l.a, &l.b, &l.c, &l.d};
  for (int i = 0; i < 4; ++i)
    if (tensors[i].has_value()) *slots[i] = *tensors[i];
  l.bias = tensors[4];
  l.group_size = ints[0], l.in_features = ints[1], l.out_features = ints[2];
  l.act_qmin = ints[3], l.act_qmax = ints[4], l.act_group = ints[5], l.padded_in = ints[6];
  blocks_.back().projections[which].push_back(std::move(l));
}

at::Tensor StepProgram::linear(const StepLinear& l, const at::Tensor& x) const {
  at::Tensor y;
  switch (l.kind) {
    case kFloat:
      return at::linear(x, l.a, l.bias);  // nn.Linear's own operator, bias included
    case kInt8Weight:
      y = minus_zero_term(int8_weight_matmul(x, l.a, l.b), x, l.c);
      break;
    case kInt8Pack:
      y = minus_zero_term(at::mul(at::_weight_int8pack_mm(x.to(at::kBFloat16), l.a, l.b), l.c.unsqueeze(0)), x, l.d);
      break;
    case kInt8Int8: {
      const auto [codes, scales] = quantize_rows(x, min_scale_, 127);
      y = int8_int8_matmul(codes, scales, l.a, l.b, l.c);
      break;
    }
    case kIntMm: {
      const auto [codes, scales] = quantize_rows(x, min_scale_, 127);
      y = dequantize_rows(at::_int_mm(codes, l.a), scales, l.b);
      break;
    }
    case kInt8Dequant: {
      const int64_t out = l.a.size(0), in = l.a.size(1);
      at::Tensor w = l.a.to(at::kFloat);
      if (l.c.defined()) w = w - expand_groups(l.c, l.group_size, out, in);
      y = at::matmul(x, (w * expand_groups(l.b, l.group_size, out, in)).t());
      break;
    }
    case kInt4Digits:
      y = int4_digits_matmul(x, l.a, l.b, optional(l.c), l.group_size);
      break;
    case kInt4Weight:
      y = int4_weight_matmul(x, l.a, l.b, optional(l.c), l.group_size, true);
      break;
    case kInt4Dequant:
      y = at::matmul(x, dequantize_int4(l.a, l.b, optional(l.c), l.in_features, l.group_size).t());
      break;
    case kInt4Pack: {
      const at::Tensor padded = l.padded_in > l.in_features ? at::constant_pad_nd(x, {0, l.padded_in - l.in_features})
                                                            : x;
      y = at::_weight_int4pack_mm_for_cpu(padded.to(at::kBFloat16).contiguous(), l.a, l.group_size, l.b);
      y = (y.size(1) == l.out_features ? y : y.slice(1, 0, l.out_features)).to(at::kFloat);
      break;
    }
    case kInt4Int8:
      y = int4_int8_linear(l, x, min_scale_);
      break;
    default:
      TORCH_CHECK(false, "unknown step kind ", l.kind);
  }
  return l.bias.has_value() ? y + l.bias->to(at::kFloat) : y;  // QuantLinear adds its bias in fp32
}

at::Tensor StepProgram::project(const StepBlock& block, int64_t which, const at::Tensor& x) const {
  const std::vector<StepLinear>& members = block.projections[which];
  TORCH_CHECK(!members.empty(), "projection ", which, " of a block has no linear");
  if (members.size() == 1) return linear(members[0], x);
  std::vector<at::Tensor> outputs;
  outputs.reserve(members.size());
  for (const StepLinear& member : members) outputs.push_back(linear(member, x));
  return at::cat(outputs, -1);
}

// The pool write of the rows' keys and values, then every row's attention over its sequence: [rows, heads * dim].
at::Tensor StepProgram::attend(const StepBlock& block, const at::Tensor& qkv, const StepRows& rows) const {
  const double q_eps = block.eps[2], k_eps = block.eps[3];
  if (!quantized_pool_) {
    const at::Tensor queries = paged_rope_store(qkv, rows.cos, rows.sin, block.pool[0], block.pool[1], rows.slots,
                                                heads_, block.q_norm, block.k_norm, q_eps, k_eps);
    return paged_attention(queries, block.pool[0], block.pool[1], tables_, rows.row_seq, rows.lengths, scale_);
  }
  const at::Tensor queries = quant_rope_store(qkv, rows.cos, rows.sin, block.pool, rows.slots, rows.row_seq,
                                              rows.positions, heads_, block.q_norm, block.k_norm, q_eps, k_eps, bits_,
                                              sinks_);
  return quant_attention(queries, block.pool, tables_, rows.row_seq, rows.lengths, cos_table_, sin_table_, bits_,
                         sinks_, scale_);
}

at::Tensor StepProgram::run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                            const at::Tensor& row_seq, const at::Tensor& positions, const at::Tensor& lengths,
                            int64_t first, int64_t last) const {
  TORCH_CHECK(0 <= first && first <= last && last <= blocks(), "blocks [", first, ", ", last, ") are not within the ",
              blocks(), " of this program");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "the step's rows must be a contiguous fp32 [rows, hidden]");
  const StepRows rows{cos, sin, slots, row_seq, positions, lengths};
  for (int64_t index = first; index < last; ++index) {
    const StepBlock& block = blocks_[index];
    const at::Tensor qkv = project(block, 0, rms_norm(x, block.attn_norm, block.eps[0]));
    x.add_(project(block, 1, attend(block, qkv.contiguous(), rows)));
    x.add_(project(block, 3, silu_mul(project(block, 2, rms_norm(x, block.mlp_norm, block.eps[1])))));
  }
  return x;
}
