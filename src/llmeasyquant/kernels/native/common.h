// What both halves of the native operators need (kernels/native.py compiles decoder_ops.cpp, matmul_kernels.cpp and
// bindings.cpp into one extension): the headers, ATen's vector type, the input checks and the thread-splitting
// helper. The helpers sit in an anonymous namespace, so each file that includes this one gets its own copy with
// internal linkage, as when all the operators were one file.

#pragma once

// ==== headers ====

// ATen, not torch/extension.h: the operators need tensors and no Python, and pybind11 with the C++ frontend would
// near triple each file's compile time. bindings.cpp, which registers them, includes torch/extension.h.
#include <ATen/ATen.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace {

// ==== vector type ====

using Vec = at::vec::Vectorized<float>;

// ==== input checks ====

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

// ==== thread splitting ====

// Runs body(first, last) over row ranges, split over the threads where the rows hold enough values to pay for it
// (a prompt's rows); a decode step's single row runs inline.
template <typename Body>
void for_rows(int64_t rows, int64_t width, const Body& body) {
  constexpr int64_t kValuesPerTask = 16384;
  at::parallel_for(0, rows, std::max<int64_t>(1, kValuesPerTask / std::max<int64_t>(1, width)), body);
}

}  // namespace
