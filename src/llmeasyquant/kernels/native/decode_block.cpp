// One decode step of one block in one call (runtime/decoder.py's lean loop takes it for a token when each of the
// block's four linears runs one of the kernels below for one row). The loop's Python between the operators (module
// calls, kernel dispatch, a dozen tensor views), each step meeting caches that the previous layer's weights had just
// streamed through, cost 4.6-6.6 ms of a 142-145 ms token at 8B (docs/RESULTS.md, "One native call a block"); here
// the same operators run back to back in the order decoder.py calls them, so the result is the Python loop's, bit
// for bit.

#include "common.h"
#include "operators.h"

#include <vector>

namespace {

// The tensors of one block, in the order decode_block's `tensors` lists them.
enum Slot : int64_t { kAttnNorm, kMlpNorm, kQNorm, kKNorm, kFirstLinear };
constexpr int64_t kLinears = 4;      // qkv, o, gate_up, down
constexpr int64_t kLinearSlots = 4;  // codes, scales, a third tensor (zeros or code sums), bias
// How a linear runs (decode_block's `kinds`): the operator its kernel in kernels/cpu.py calls for one row.
enum Kind : int64_t {
  kDigits,      // cpu_native_w4a16_i16: int4_digits_matmul(x, packed, scales, zeros, group size)
  kInt8Weight,  // cpu_native_w8a16, symmetric: int8_weight_matmul(x, codes, scales)
  kInt8Int8,    // cpu_native_w8a8: quantize_rows(x, min_scale, 127), then int8_int8_matmul(.., codes, scales, sums)
};

// A linear as QuantLinear runs it on one row: its kernel's operators, then the bias in fp32.
at::Tensor linear(const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& tensors, int64_t which,
                  int64_t kind, int64_t group_size, double min_scale) {
  const int64_t first = kFirstLinear + which * kLinearSlots;
  const at::Tensor& codes = *tensors[first];
  const at::Tensor& scales = *tensors[first + 1];
  at::Tensor y;
  if (kind == kDigits) {
    y = int4_digits_matmul(x, codes, scales, tensors[first + 2], group_size);
  } else if (kind == kInt8Weight) {
    y = int8_weight_matmul(x, codes, scales);
  } else {
    const auto [qx, x_scales] = quantize_rows(x, min_scale, 127);
    y = int8_int8_matmul(qx, x_scales, codes, scales, *tensors[first + 2]);
  }
  const c10::optional<at::Tensor>& bias = tensors[first + 3];
  return bias.has_value() ? y + bias->to(at::kFloat) : y;
}

}  // namespace

// x: [1, hidden] fp32, updated in place; tensors: attn_norm, mlp_norm, q_norm, k_norm (absent without), then per
// linear (qkv, o, gate_up, down) its codes, scales, zeros (kDigits, absent without) or code sums (kInt8Int8), and
// bias (absent without); kinds, group_sizes: [4]; eps: attn, mlp, q, k; min_scale: the activation scale's floor
// (kInt8Int8); cos, sin: [1, dim] fp32 (this position's); keys, values: [kv_heads, max, dim] fp32 (the block's
// cache, written at `pos`) -> x
at::Tensor decode_block(at::Tensor x, const std::vector<c10::optional<at::Tensor>>& tensors,
                        const std::vector<int64_t>& kinds, const std::vector<int64_t>& group_sizes,
                        const std::vector<double>& eps, double min_scale, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor keys, at::Tensor values, int64_t pos, int64_t heads, double scale) {
  TORCH_CHECK(tensors.size() == kFirstLinear + kLinears * kLinearSlots, "decode_block takes ",
              kFirstLinear + kLinears * kLinearSlots, " tensors, got ", tensors.size());
  TORCH_CHECK(kinds.size() == kLinears && group_sizes.size() == kLinears && eps.size() == 4,
              "decode_block takes 4 kinds, 4 group sizes and 4 epsilons");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "decode_block steps one contiguous fp32 row [1, hidden]");
  TORCH_CHECK(tensors[kAttnNorm].has_value() && tensors[kMlpNorm].has_value(), "the block's norms are missing");
  for (int64_t which = 0; which < kLinears; ++which) {
    const int64_t first = kFirstLinear + which * kLinearSlots;
    TORCH_CHECK(kinds[which] >= kDigits && kinds[which] <= kInt8Int8, "linear ", which, " has an unknown kind ",
                kinds[which]);
    TORCH_CHECK(tensors[first].has_value() && tensors[first + 1].has_value() &&
                    (kinds[which] != kInt8Int8 || tensors[first + 2].has_value()),
                "linear ", which, " lacks its codes, scales or code sums");
  }
  const auto project = [&](const at::Tensor& input, int64_t which) {
    return linear(input, tensors, which, kinds[which], group_sizes[which], min_scale);
  };
  const at::Tensor qkv = project(rms_norm(x, *tensors[kAttnNorm], eps[0]), 0);
  const at::Tensor queries =
      rope_store(qkv, cos, sin, keys, values, pos, heads, tensors[kQNorm], tensors[kKNorm], eps[2], eps[3]);
  x.add_(project(decode_attention(queries, keys, values, pos + 1, scale), 1));
  x.add_(project(silu_mul(project(rms_norm(x, *tensors[kMlpNorm], eps[1]), 2)), 3));
  return x;
}
