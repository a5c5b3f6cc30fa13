// The exact sums' cut-and-add (infra/exact_sum.py, for the Gram matrices of methods/gram.py): one pass over an fp32
// term instead of the seven PyTorch passes (two remainders, two differences, two promoted additions) that took
// as long as the GEMM that made the term at an 8B model's widths.
//
// Every step is exact, so these bits are the PyTorch path's whatever the order or the vector width: the remainder
// by a power of two, x - trunc(x / u) * u, drops bits and never rounds (x / u and the product only move the
// exponent; a quotient too small for a normal fp32 truncates to zero all the same), and each piece fits its fp64
// bin without rounding (infra/exact_sum.py says why).

#include "common.h"

#include <cmath>

namespace {

inline float remainder_by(float x, float unit) { return x - std::trunc(x / unit) * unit; }

}  // namespace

// term: fp32 [n] (contiguous), high_bin, low_bin: fp64 [n] (added to in place), high_unit, low_unit: the powers of
// two that bound the two bins (both normal fp32 numbers). Adds the bits of each term from high_unit down to
// low_unit into high_bin, from low_unit down by as much again into low_bin; lower bits are dropped.
void exact_cut_add(const at::Tensor& term_in, at::Tensor high_bin, at::Tensor low_bin, double high_unit,
                   double low_unit) {
  const at::Tensor term = input(term_in, at::kFloat, "term");
  check_cpu(high_bin, at::kDouble, "high_bin");
  check_cpu(low_bin, at::kDouble, "low_bin");
  TORCH_CHECK(high_bin.numel() == term.numel() && low_bin.numel() == term.numel(),
              "the bins must hold as many entries as the term");
  const float high = static_cast<float>(high_unit), low = static_cast<float>(low_unit);
  TORCH_CHECK(high == high_unit && low == low_unit && std::isnormal(high) && std::isnormal(low),
              "the bin units must be normal fp32 numbers");
  const float* x = term.data_ptr<float>();
  double* upper = high_bin.data_ptr<double>();
  double* lower = low_bin.data_ptr<double>();
  at::parallel_for(0, term.numel(), 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float rest = remainder_by(x[i], high);
      upper[i] += static_cast<double>(x[i] - rest);
      lower[i] += static_cast<double>(rest - remainder_by(rest, low));
    }
  });
}
