// GPTQ's column loop within one lazy block (methods/gptq.py `gptq_solve`, static uniform group parameters): each
// column rounded, its error divided by the factor's diagonal and pushed onto the block's later columns. Rows are
// independent, so each thread takes whole rows and runs the block's columns in order on each; PyTorch's loop made
// some ten operator calls a column over all rows, 39k columns per 8B block.
//
// The same bits as that loop: the same operations in the same order, each rounded once. Contraction into fused
// multiply-adds is off for the row's arithmetic (the loop's product and difference are two roundings); round-half-even
// is std::nearbyint under the default rounding mode, as torch.round.

#include "common.h"

#include <cmath>
#include <initializer_list>

namespace {

struct BlockColumns {
  const float* factor;  // [B, B], the upper triangle read
  const float* scales;  // [rows, B]
  const float* zeros;   // [rows, B] or null
  float qmin, qmax;
  int64_t block;
};

// One row of the block, its columns in order. A function of its own, never inlined, that carries the attribute:
// GCC applies optimize() to the function it is written on, not to lambdas inside it, so the row loop that
// parallel_for ran inline on one thread had two roundings where the same loop in the OpenMP region (two threads)
// had a fused multiply-add, and one process and torchrun's one-thread ranks gave different codes (issue 59).
__attribute__((noinline, optimize("fp-contract=off"))) void gptq_row(const BlockColumns& c, int64_t r, float* row,
                                                                     float* codes, float* errors) {
  const int64_t at = r * c.block;
  for (int64_t i = 0; i < c.block; ++i) {
    const float value = row[i], scale = c.scales[at + i];
    float q = std::nearbyint(value / scale);
    if (c.zeros != nullptr) q = q + c.zeros[at + i];
    q = std::min(std::max(q, c.qmin), c.qmax);
    const float dequantized = c.zeros != nullptr ? (q - c.zeros[at + i]) * scale : q * scale;
    const float err = (value - dequantized) / c.factor[i * c.block + i];
    const float* pushed = c.factor + i * c.block;
    for (int64_t j = i + 1; j < c.block; ++j) {
      const float product = err * pushed[j];
      row[j] = row[j] - product;
    }
    codes[at + i] = q;
    errors[at + i] = err;
  }
}

}  // namespace

// w: [rows, B] fp32 (updated in place), factor: [B, B] fp32 (the block's rows of H⁻¹'s upper factor, only its upper
// triangle read), scales, zeros: [rows, B] fp32 (each column's group parameters; zeros absent when symmetric),
// codes, errors: [rows, B] fp32 (written). Codes are the clamped levels, as floats.
void gptq_block(at::Tensor w, const at::Tensor& factor_in, const at::Tensor& scales_in,
                const c10::optional<at::Tensor>& zeros_in, at::Tensor codes, at::Tensor errors, double qmin_in,
                double qmax_in) {
  check_cpu(w, at::kFloat, "w");
  check_cpu(codes, at::kFloat, "codes");
  check_cpu(errors, at::kFloat, "errors");
  const at::Tensor factor = input(factor_in, at::kFloat, "factor");
  const at::Tensor scales = input(scales_in, at::kFloat, "scales");
  const int64_t rows = w.size(0), block = w.size(1);
  TORCH_CHECK(w.dim() == 2 && factor.size(0) == block && factor.size(1) == block, "factor must be [B, B]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&scales, &codes, &errors})
    TORCH_CHECK(t->sizes() == w.sizes(), "scales, codes and errors must have w's shape");
  at::Tensor zeros;
  if (zeros_in.has_value()) {
    zeros = input(*zeros_in, at::kFloat, "zeros");
    TORCH_CHECK(zeros.sizes() == w.sizes(), "zeros must have w's shape");
  }
  const BlockColumns columns{factor.data_ptr<float>(), scales.data_ptr<float>(),
                             zeros.defined() ? zeros.data_ptr<float>() : nullptr, static_cast<float>(qmin_in),
                             static_cast<float>(qmax_in), block};
  float* wp = w.data_ptr<float>();
  float* cp = codes.data_ptr<float>();
  float* ep = errors.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 2048 / std::max<int64_t>(1, block)), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) gptq_row(columns, r, wp + r * block, cp, ep);
  });
}
