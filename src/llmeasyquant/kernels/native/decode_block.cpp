// One decode step of one block in one call (runtime/decoder.py's lean loop takes it for a token when the block's
// four linears all run W4A16's digits kernel). The loop's Python between the operators (module calls, kernel
// dispatch, a dozen tensor views), each step meeting caches that the previous layer's weights had just streamed
// through, cost 6.6 ms of a 142.5 ms token at 8B (docs/RESULTS.md, "One native call a block"); here the same
// operators run back to back in the order decoder.py calls them, so the result is the Python loop's, bit for bit.

#include "common.h"
#include "operators.h"

#include <vector>

namespace {

// The tensors of one block, in the order decode_block's `tensors` lists them.
enum Slot : int64_t { kAttnNorm, kMlpNorm, kQNorm, kKNorm, kFirstLinear };
constexpr int64_t kLinears = 4;      // qkv, o, gate_up, down
constexpr int64_t kLinearSlots = 4;  // packed codes, scales, zeros, bias

// A linear as QuantLinear runs it on one row: the digits kernel, then the bias in fp32.
at::Tensor linear(const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& tensors, int64_t which,
                  int64_t group_size) {
  const int64_t first = kFirstLinear + which * kLinearSlots;
  at::Tensor y = int4_digits_matmul(x, *tensors[first], *tensors[first + 1], tensors[first + 2], group_size);
  const c10::optional<at::Tensor>& bias = tensors[first + 3];
  return bias.has_value() ? y + bias->to(at::kFloat) : y;
}

}  // namespace

// x: [1, hidden] fp32, updated in place; tensors: attn_norm, mlp_norm, q_norm, k_norm (absent without), then per
// linear (qkv, o, gate_up, down) its packed codes, scales, zeros and bias (the two last absent without);
// group_sizes: [4]; eps: attn, mlp, q, k; cos, sin: [1, dim] fp32 (this position's); keys, values:
// [kv_heads, max, dim] fp32 (the block's cache, written at `pos`) -> x
at::Tensor decode_block(at::Tensor x, const std::vector<c10::optional<at::Tensor>>& tensors,
                        const std::vector<int64_t>& group_sizes, const std::vector<double>& eps, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor keys, at::Tensor values, int64_t pos, int64_t heads,
                        double scale) {
  TORCH_CHECK(tensors.size() == kFirstLinear + kLinears * kLinearSlots, "decode_block takes ",
              kFirstLinear + kLinears * kLinearSlots, " tensors, got ", tensors.size());
  TORCH_CHECK(group_sizes.size() == kLinears && eps.size() == 4, "decode_block takes 4 group sizes and 4 epsilons");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "decode_block steps one contiguous fp32 row [1, hidden]");
  TORCH_CHECK(tensors[kAttnNorm].has_value() && tensors[kMlpNorm].has_value(), "the block's norms are missing");
  for (int64_t which = 0; which < kLinears; ++which)
    TORCH_CHECK(tensors[kFirstLinear + which * kLinearSlots].has_value() &&
                    tensors[kFirstLinear + which * kLinearSlots + 1].has_value(),
                "linear ", which, " has no codes or scales");
  const at::Tensor qkv = linear(rms_norm(x, *tensors[kAttnNorm], eps[0]), tensors, 0, group_sizes[0]);
  const at::Tensor queries =
      rope_store(qkv, cos, sin, keys, values, pos, heads, tensors[kQNorm], tensors[kKNorm], eps[2], eps[3]);
  x.add_(linear(decode_attention(queries, keys, values, pos + 1, scale), tensors, 1, group_sizes[1]));
  const at::Tensor gate_up = linear(rms_norm(x, *tensors[kMlpNorm], eps[1]), tensors, 2, group_sizes[2]);
  x.add_(linear(silu_mul(gate_up), tensors, 3, group_sizes[3]));
  return x;
}
