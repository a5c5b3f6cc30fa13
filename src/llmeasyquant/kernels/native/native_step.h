// The engine's step as native code (native_step.cpp): a model's blocks, each with its norms, its four projections
// as the kernels chosen for them run them (step_kinds.h), and its layer of the paged KV pool, built once from
// Python (runtime/native_step.py) and run for every step's rows in one call. bindings.cpp exposes the class.

#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "step_kinds.h"

// One linear layer as its kernel runs it at the step's row count: the kind and its tensors (step_kinds.h).
struct StepLinear {
  int64_t kind = kFloat;
  at::Tensor a, b, c, d;  // undefined where the kind does not take them
  c10::optional<at::Tensor> bias;
  int64_t group_size = 0, in_features = 0, out_features = 0;
  int64_t act_qmin = 0, act_qmax = 0, act_group = 0, padded_in = 0;
  int32_t uniform_offset = 0;  // W4A8: the offset all of c's entries equal (operators.h), else 0
  // Whether the team runs it (its kind has a step form, its tensors passed that form's checks), and its bias as the
  // fp32 the per-op path adds (undefined without).
  bool team = false;
  at::Tensor bias32;
};

// A block of a pre-norm rotary decoder: x += o(attention(qkv(norm(x)))); x += down(act(gate) * up(norm(x))).
// A projection is one linear, or several whose outputs lie side by side (q, k, v not fused into one GEMM).
struct StepBlock {
  at::Tensor attn_norm, mlp_norm;
  c10::optional<at::Tensor> q_norm, k_norm;
  double eps[4] = {0, 0, 0, 0};  // attn, mlp, q, k
  std::vector<StepLinear> projections[4];  // qkv, o, gate_up, down
  std::vector<at::Tensor> pool;  // this layer's KV pool: keys and values (float), or the 11 coded tensors
  // Whether the pool layer and norms passed the team's checks, with the first block's layout (the team checks a
  // step's rows against that one); the layer's kv heads and head dim.
  bool team_pool = false;
  int64_t kv_heads = 0, dim = 0;
};

// The step's rows (runtime/kv_pool.py's Rows): sequence slot, position, flat cache slot and length of each row, and
// its rotary rows cos, sin [rows, dim].
struct StepRows {
  at::Tensor cos, sin, slots, row_seq, positions, lengths;
};

// The most rows a step runs in the team (one OpenMP parallel region for all its blocks); more run op by op.
constexpr int64_t kTeamRows = 16;

// A linear from add_linear's arguments: its kind (step_kinds.h), tensors a, b, c, d, bias and ints group_size, in,
// out, act_qmin, act_qmax, act_group, padded_in; whether the team can run it is worked out here.
StepLinear step_linear(int64_t kind, const std::vector<c10::optional<at::Tensor>>& tensors,
                       const std::vector<int64_t>& ints);
// Whether a linear with these arguments runs in the team (the kernel choice prefers such kernels for a step's
// few rows: one kernel without a team form takes its whole step out of the team).
bool has_team_form(int64_t kind, const std::vector<c10::optional<at::Tensor>>& tensors,
                   const std::vector<int64_t>& ints);

class StepProgram {
 public:
  // heads: query heads; scale: attention's; tables: the pool's block tables [S, M] int32 (updated in place by
  // Python); cos_table, sin_table [max_positions, dim] fp32 and bits, sinks: the coded pool's (quantized_pool);
  // min_scale: the activation scales' floor; activation: the gated MLP's (step_kinds.h's GateActivation).
  StepProgram(int64_t heads, double scale, bool quantized_pool, at::Tensor tables, at::Tensor cos_table,
              at::Tensor sin_table, int64_t bits, int64_t sinks, double min_scale, int64_t activation);
  // Appends a block: norms attn, mlp, q, k (q, k absent without), their epsilons, its layer's pool tensors.
  void add_block(const std::vector<c10::optional<at::Tensor>>& norms, const std::vector<double>& eps,
                 const std::vector<at::Tensor>& pool);
  // Appends a linear to projection `which` (0 qkv, 1 o, 2 gate_up, 3 down) of the last block: its kind, tensors
  // a, b, c, d, bias, and ints group_size, in, out, act_qmin, act_qmax, act_group, padded_in.
  void add_linear(int64_t which, int64_t kind, const std::vector<c10::optional<at::Tensor>>& tensors,
                  const std::vector<int64_t>& ints);
  // x [rows, hidden] fp32 through blocks [first, last), in place; the rows' keys and values go into the pool.
  at::Tensor run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                 const at::Tensor& row_seq, const at::Tensor& positions, const at::Tensor& lengths, int64_t first,
                 int64_t last) const;
  int64_t blocks() const { return static_cast<int64_t>(blocks_.size()); }
  // Whether run() takes the team for `rows` rows over blocks [first, last): one OpenMP parallel region for all of
  // them (native_step.cpp), for decode's few rows where every linear has a step form.
  bool team_covers(int64_t rows, int64_t first, int64_t last) const;
  // The team on (the default; LLMEASYQUANT_STEP_TEAM=0 when the program is built: off) or off, every step then
  // running operator by operator. The same bits either way; the switch is for tests and timings.
  void set_team(bool on) { team_ = on; }

 private:
  struct TeamStep;
  bool team_block_fits(const StepBlock& block) const;
  void run_team(at::Tensor& x, const StepRows& rows, int64_t first, int64_t last) const;
  void team_block(const StepBlock& block, TeamStep& step) const;
  void team_project(const StepBlock& block, int64_t which, const float* in, float* out, int64_t ldo, bool accumulate,
                    TeamStep& step) const;
  at::Tensor project(const StepBlock& block, int64_t which, const at::Tensor& x) const;
  at::Tensor linear(const StepLinear& l, const at::Tensor& x) const;
  at::Tensor attend(const StepBlock& block, const at::Tensor& qkv, const StepRows& rows) const;

  int64_t heads_;
  double scale_, min_scale_;
  int64_t activation_;
  bool quantized_pool_;
  at::Tensor tables_, cos_table_, sin_table_;
  int64_t bits_, sinks_;
  std::vector<StepBlock> blocks_;
  bool team_ = true;
};
