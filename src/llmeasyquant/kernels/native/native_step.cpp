// The engine's step over a model's blocks in one native call (runtime/native_step.py builds the program, runtime/
// batch.py runs it for every step's rows: decode rows of many sequences and prompt chunks together). Each block is
// the operators the Python forward of runtime/batch.py calls, in its order: RMS norm, the q/k/v projection, rotary
// embedding with the pool write (float or SimQuant codes), paged attention, the o projection and residual, RMS norm,
// gate/up, SiLU x up, down and residual; each projection as its chosen kernel runs it (step_kinds.h). The same
// operators in the same order give the Python forward's logits bit for bit; what goes is the interpreter between
// them (module calls, kernel dispatch, tensor views), some two hundred calls a step.

#include "native_step.h"

#include "common.h"
#include "operators.h"

#include <cstdlib>
#include <cstring>
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

// ==== the team's linears ====

// Rows a step may hold for the team: decode rows. Longer steps (prompt chunks) take the per-op path, whose operators
// switch to the GEMMs made for many rows.

// Whether a linear of this kind, with these tensors, has a step form (operators.h), checked as the per-op operator
// checks them; its bias, if any, fp32 contiguous (the per-op path adds `bias.to(fp32)`).
bool has_step_form(const StepLinear& l) {
  const auto dense = [](const at::Tensor& t, at::ScalarType dtype, int64_t numel) {
    return t.defined() && t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() &&
           (numel < 0 || t.numel() == numel);
  };
  const auto int8_codes = [&](const at::Tensor& t) {
    return dense(t, at::kChar, -1) && t.dim() == 2 && t.size(0) == l.out_features && t.size(1) == l.in_features;
  };
  if (l.bias.has_value() && (!l.bias->device().is_cpu() || l.bias->numel() != l.out_features)) return false;
  switch (l.kind) {
    case kInt8Weight:  // without zero points: their rank-1 term is a PyTorch sum
      return int8_codes(l.a) && dense(l.b, at::kFloat, l.out_features) && !l.c.defined();
    case kInt8Int8:
      return int8_codes(l.a) && dense(l.b, at::kFloat, l.out_features) && dense(l.c, at::kInt, l.out_features);
    case kInt4Digits:
      try {
        check_int4_digits(l.in_features, l.a, l.b, optional(l.c), l.group_size);
      } catch (const c10::Error&) {
        return false;
      }
      return l.a.size(0) == l.out_features;
    case kInt4Tiles:
      try {
        check_int4_tiles(l.in_features, l.a, l.b, optional(l.c), l.group_size, l.out_features);
      } catch (const c10::Error&) {
        return false;
      }
      return true;
    case kInt4Int8:  // symmetric activation codes (zero points take a PyTorch product), per token or per group
      if (l.d.defined() || l.act_qmax < 1 || l.act_qmax > 127 || (l.act_group > 0 && l.in_features % l.act_group))
        return false;
      try {
        check_int4_int8(l.in_features, l.a, l.b, l.c, l.group_size, l.out_features);
      } catch (const c10::Error&) {
        return false;
      }
      // one activation scale a row, or one a weight group (int4_int8_matmul's two forms)
      return l.act_group == 0 || l.act_group == l.group_size;
    default:
      return false;
  }
}

// The activation scales a row of a W4A8 linear takes: one, or one a group of act_group columns.
int64_t activation_groups(const StepLinear& l) { return l.act_group > 0 ? l.in_features / l.act_group : 1; }

// The team's switch when a program is built: LLMEASYQUANT_STEP_TEAM=0 turns it off.
bool team_wanted() {
  const char* value = std::getenv("LLMEASYQUANT_STEP_TEAM");
  return value == nullptr || std::strcmp(value, "0") != 0;
}

}  // namespace

StepProgram::StepProgram(int64_t heads, double scale, bool quantized_pool, at::Tensor tables, at::Tensor cos_table,
                         at::Tensor sin_table, int64_t bits, int64_t sinks, double min_scale, int64_t activation)
    : heads_(heads), scale_(scale), min_scale_(min_scale), activation_(activation), quantized_pool_(quantized_pool),
      tables_(std::move(tables)), cos_table_(std::move(cos_table)), sin_table_(std::move(sin_table)), bits_(bits),
      sinks_(sinks), team_(team_wanted()) {
  TORCH_CHECK(tables_.scalar_type() == at::kInt && tables_.dim() == 2, "tables must be [sequences, blocks] int32");
  TORCH_CHECK(activation >= 0 && activation < kGateActivations, "unknown gate activation ", activation);
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
  // The team checks a step's rows once, against the first block's layer: every other must have its layout.
  try {
    check_pool_layer(pool, quantized_pool_, bits_, sinks_, block.q_norm, block.k_norm);
    check_cpu(block.attn_norm, at::kFloat, "attn_norm");
    check_cpu(block.mlp_norm, at::kFloat, "mlp_norm");
    block.team_pool = block.attn_norm.numel() == block.mlp_norm.numel();
    for (size_t i = 0; i < pool.size() && !blocks_.empty(); ++i)
      block.team_pool = block.team_pool && pool[i].sizes() == blocks_[0].pool[i].sizes() &&
                        pool[i].scalar_type() == blocks_[0].pool[i].scalar_type();
  } catch (const c10::Error&) {
    block.team_pool = false;  // the per-op path meets the same error, and raises it, when the block runs
  }
  // key_lo [N, kv_heads, dim], or the keys [N, kv_heads, B, dim]
  const at::Tensor& keys = quantized_pool_ ? pool[1] : pool[0];
  block.kv_heads = keys.dim() >= 3 ? keys.size(1) : 0;
  block.dim = keys.dim() >= 3 ? keys.size(-1) : 0;
  blocks_.push_back(std::move(block));
}

StepLinear step_linear(int64_t kind, const std::vector<c10::optional<at::Tensor>>& tensors,
                       const std::vector<int64_t>& ints) {
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
  l.team = has_step_form(l);
  if (l.team && l.bias.has_value()) l.bias32 = l.bias->to(at::kFloat).contiguous();
  if (l.team && kind == kInt4Int8) l.uniform_offset = uniform_offset(l.c);
  return l;
}

bool has_team_form(int64_t kind, const std::vector<c10::optional<at::Tensor>>& tensors,
                   const std::vector<int64_t>& ints) {
  return step_linear(kind, tensors, ints).team;
}

void StepProgram::add_linear(int64_t which, int64_t kind, const std::vector<c10::optional<at::Tensor>>& tensors,
                             const std::vector<int64_t>& ints) {
  TORCH_CHECK(!blocks_.empty(), "add a block before its linears");
  TORCH_CHECK(which >= 0 && which < 4, "projection ", which, " is not one of 0 (qkv), 1 (o), 2 (gate_up), 3 (down)");
  blocks_.back().projections[which].push_back(step_linear(kind, tensors, ints));
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
    case kInt8Float: {
      const auto [codes, scales] = quantize_rows(x, min_scale_, 127);
      y = int8_float_matmul(codes, scales, l.a, l.b);
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
    case kInt4Tiles:
      y = int4_tiles_matmul(x, l.a, l.b, optional(l.c), l.group_size);
      break;
    case kInt4Weight:
      y = int4_weight_matmul(x, l.a, l.b, optional(l.c), l.group_size, true);
      break;
    case kInt4Dequant:
      y = at::matmul(x, dequantize_int4(l.a, l.b, optional(l.c), l.in_features, l.group_size).t());
      break;
    case kInt4Bf16:
      y = int4_bf16_matmul(x, l.a, l.b, optional(l.c), l.in_features, l.group_size);
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
    case kInt4Bf16Tiles:
      y = int4_bf16_tiles_matmul(x, l.a, l.b, optional(l.c), l.group_size, l.out_features);
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
  if (team_covers(x.size(0), first, last)) {
    run_team(x, rows, first, last);
    return x;
  }
  for (int64_t index = first; index < last; ++index) {
    const StepBlock& block = blocks_[index];
    const at::Tensor qkv = project(block, 0, rms_norm(x, block.attn_norm, block.eps[0]));
    x.add_(project(block, 1, attend(block, qkv.contiguous(), rows)));
    x.add_(project(block, 3, gate_mul(project(block, 2, rms_norm(x, block.mlp_norm, block.eps[1])), activation_)));
  }
  return x;
}

// ==== the team: a decode step's blocks in one parallel region ====
//
// Operator by operator, a decode step opens some five OpenMP parallel regions a block (each GEMV, attention), each
// ending with the threads waiting for the slowest, and allocates every intermediate; at one row the threads spent a
// third of the step in those waits. The team opens one region for all the blocks (as llama.cpp's graph compute
// does): its threads call the same operators in their step forms (operators.h) one after the other, each splitting
// its work over them (GEMVs by output channels, attention by its plan's tasks, row operations by rows) and ending
// with a barrier, into buffers made once a step. Same operators, same per-element operations, and the attention's
// plan is the operator's own for the same thread count: the per-op path's bits.

bool StepProgram::team_block_fits(const StepBlock& block) const {
  if (!block.team_pool || block.kv_heads <= 0 || heads_ % block.kv_heads != 0) return false;
  int64_t totals[4] = {0, 0, 0, 0};  // the outputs of qkv, o, gate_up, down
  for (int which = 0; which < 4; ++which) {
    if (block.projections[which].empty()) return false;
    for (const StepLinear& l : block.projections[which]) {
      if (!l.team) return false;
      totals[which] += l.out_features;
    }
  }
  const int64_t hidden = block.attn_norm.numel();
  const int64_t inputs[4] = {hidden, heads_ * block.dim, hidden, totals[2] / 2};
  for (int which = 0; which < 4; ++which)
    for (const StepLinear& l : block.projections[which])
      if (l.in_features != inputs[which]) return false;
  return totals[0] == (heads_ + 2 * block.kv_heads) * block.dim && totals[1] == hidden && totals[2] % 2 == 0 &&
         totals[3] == hidden;
}

bool StepProgram::team_covers(int64_t rows, int64_t first, int64_t last) const {
  if (!team_ || rows < 1 || rows > kTeamRows || first >= last) return false;
  for (int64_t index = first; index < last; ++index)
    if (!team_block_fits(blocks_[index])) return false;
  return true;
}

// What the team's threads share for a step: its rows, its attention's plan and the buffers between the operators.
struct StepProgram::TeamStep {
  int64_t rows = 0, hidden = 0;
  float* x = nullptr;
  const float *cos = nullptr, *sin = nullptr;
  const int64_t *slots = nullptr, *row_seq = nullptr, *positions = nullptr, *lengths = nullptr;
  const int32_t* tables = nullptr;
  int64_t max_blocks = 0;
  std::shared_ptr<const AttentionPlan> plan;
  std::vector<float> normed, qkv, queries, attention, gate_up, act, row_scales, partials;
  std::vector<int8_t> codes;  // a W8A8 linear's activation codes
};

void StepProgram::run_team(at::Tensor& x, const StepRows& rows, int64_t first, int64_t last) const {
  const StepBlock& layout = blocks_[first];
  TeamStep step;
  step.rows = x.size(0), step.hidden = x.size(1);
  // Every check before the region: its threads cannot stop halfway through.
  check_step_rows(layout.pool, quantized_pool_, bits_, sinks_, heads_, step.rows, rows.cos, rows.sin, rows.slots,
                  rows.row_seq, rows.positions, rows.lengths, tables_, cos_table_, sin_table_);
  int64_t qkv = 0, gate_up = 0;
  for (int64_t index = first; index < last; ++index) {
    TORCH_CHECK(blocks_[index].attn_norm.numel() == step.hidden && blocks_[index].dim == layout.dim,
                "block ", index, " does not take the step's rows of ", step.hidden, " values");
    int64_t block_qkv = 0, block_gate_up = 0;
    for (const StepLinear& l : blocks_[index].projections[0]) block_qkv += l.out_features;
    for (const StepLinear& l : blocks_[index].projections[2]) block_gate_up += l.out_features;
    qkv = std::max(qkv, block_qkv), gate_up = std::max(gate_up, block_gate_up);
  }
  const int64_t n = step.rows, attention = heads_ * layout.dim;
  const int64_t widest = std::max({step.hidden, attention, gate_up / 2});
  step.normed.resize(n * step.hidden);
  step.qkv.resize(n * qkv);
  step.queries.resize(n * attention);
  step.attention.resize(n * attention);
  step.gate_up.resize(n * gate_up);
  step.act.resize(n * gate_up / 2);
  step.row_scales.resize(n * widest);  // W4A8 with activation groups: one a group (at least 8 columns) a row
  step.codes.resize(n * widest);
  step.plan = plan_attention(layout.pool, quantized_pool_, bits_, sinks_, heads_, rows.row_seq, rows.lengths,
                             cos_table_, sin_table_);
  step.partials.resize(attention_partial_floats(*step.plan));
  step.x = x.data_ptr<float>();
  step.cos = rows.cos.data_ptr<float>(), step.sin = rows.sin.data_ptr<float>();
  step.slots = rows.slots.data_ptr<int64_t>(), step.row_seq = rows.row_seq.data_ptr<int64_t>();
  step.positions = rows.positions.data_ptr<int64_t>(), step.lengths = rows.lengths.data_ptr<int64_t>();
  step.tables = tables_.data_ptr<int32_t>(), step.max_blocks = tables_.size(1);
  llmeasyquant::team::Team team;
  const int threads = static_cast<int>(at::get_num_threads());
#pragma omp parallel num_threads(threads)
  {
#if defined(_OPENMP)
    Member member{&team, omp_get_thread_num(), omp_get_num_threads()};
#else
    Member member{&team, 0, 1};
#endif
    llmeasyquant::team::current = &member;
    for (int64_t index = first; index < last; ++index) team_block(blocks_[index], step);
    llmeasyquant::team::current = nullptr;
  }
}

// One block, by every thread of the team: the per-op path's operators in its order (run()'s loop).
void StepProgram::team_block(const StepBlock& block, TeamStep& step) const {
  const int64_t n = step.rows, hidden = step.hidden;
  rms_norm_into(step.x, block.attn_norm.data_ptr<float>(), block.eps[0], n, hidden, step.normed.data());
  team_project(block, 0, step.normed.data(), step.qkv.data(), 0, false, step);
  const float* q_norm = block.q_norm.has_value() ? block.q_norm->data_ptr<float>() : nullptr;
  const float* k_norm = block.k_norm.has_value() ? block.k_norm->data_ptr<float>() : nullptr;
  if (!quantized_pool_) {
    paged_rope_store_into(step.qkv.data(), n, step.cos, step.sin, block.pool[0], block.pool[1], step.slots, heads_,
                          q_norm, k_norm, block.eps[2], block.eps[3], step.queries.data());
    paged_attention_into(*step.plan, step.queries.data(), heads_, block.pool[0], block.pool[1], step.tables,
                         step.max_blocks, step.lengths, scale_, step.attention.data(), step.partials.data());
  } else {
    quant_rope_store_into(step.qkv.data(), n, step.cos, step.sin, block.pool, step.slots, step.row_seq,
                          step.positions, heads_, q_norm, k_norm, block.eps[2], block.eps[3], bits_, sinks_,
                          step.queries.data());
    quant_attention_into(*step.plan, step.queries.data(), heads_, block.pool, step.tables, step.max_blocks,
                         step.lengths, cos_table_.data_ptr<float>(), sin_table_.data_ptr<float>(), bits_, sinks_,
                         scale_, step.attention.data(), step.partials.data());
  }
  team_project(block, 1, step.attention.data(), step.x, hidden, true, step);  // x += o(attention)
  rms_norm_into(step.x, block.mlp_norm.data_ptr<float>(), block.eps[1], n, hidden, step.normed.data());
  team_project(block, 2, step.normed.data(), step.gate_up.data(), 0, false, step);
  int64_t gate_up = 0;
  for (const StepLinear& l : block.projections[2]) gate_up += l.out_features;
  gate_mul_into(activation_, step.gate_up.data(), n, gate_up / 2, step.act.data());
  team_project(block, 3, step.act.data(), step.x, hidden, true, step);  // x += down(act)
}

// Projection `which` of rows `in`: its members' outputs side by side in out (row stride ldo; 0: their total), added
// to what out holds where `accumulate`.
void StepProgram::team_project(const StepBlock& block, int64_t which, const float* in, float* out, int64_t ldo,
                               bool accumulate, TeamStep& step) const {
  const std::vector<StepLinear>& members = block.projections[which];
  if (ldo == 0)
    for (const StepLinear& l : members) ldo += l.out_features;
  int64_t column = 0;
  for (const StepLinear& l : members) {
    const Epilogue epilogue{l.bias32.defined() ? l.bias32.data_ptr<float>() : nullptr, accumulate};
    float* y = out + column;
    switch (l.kind) {
      case kInt8Weight:
        int8_weight_matmul_into(in, step.rows, l.in_features, l.a.data_ptr<int8_t>(), l.b.data_ptr<float>(),
                                l.out_features, y, ldo, epilogue);
        break;
      case kInt8Int8:
        quantize_rows_into(in, step.rows, l.in_features, min_scale_, 127, step.codes.data(), step.row_scales.data());
        int8_int8_matmul_into(step.codes.data(), step.row_scales.data(), step.rows, l.in_features,
                              l.a.data_ptr<int8_t>(), l.b.data_ptr<float>(), l.c.data_ptr<int32_t>(), l.out_features,
                              y, ldo, epilogue);
        break;
      case kInt4Digits:
        int4_digits_matmul_into(in, step.rows, l.in_features, l.a, l.b, optional(l.c), l.group_size, y, ldo,
                                epilogue);
        break;
      case kInt4Tiles:
        int4_tiles_matmul_into(in, step.rows, l.in_features, l.a, l.b, optional(l.c), l.group_size, l.out_features, y,
                               ldo, epilogue);
        break;
      case kInt4Int8: {  // int4_int8_linear's codes: each row (or each group of a row) quantized on its own
        const int64_t groups = activation_groups(l);
        quantize_rows_into(in, step.rows * groups, l.in_features / groups, min_scale_, l.act_qmax, step.codes.data(),
                           step.row_scales.data());
        int4_int8_matmul_into(step.codes.data(), step.row_scales.data(), groups, step.rows, l.in_features, l.a, l.b,
                              l.c, l.group_size, l.out_features, l.uniform_offset, y, ldo, epilogue);
        break;
      }
      default:  // team_covers let in only the kinds above
        break;
    }
    column += l.out_features;
  }
}
