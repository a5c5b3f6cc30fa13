// The row helpers every operator shares (decoder_ops.cpp's lean-loop operators, paged_ops.cpp's pool operators and
// through them the engine's step): RMS norm of a row, the dot product, the rotary embedding of a head. One set, so
// that a norm or a rotation is the same bits whichever operator applies it. In the anonymous namespace, as
// common.h's helpers: each file gets its own copy.

#pragma once

#include "common.h"

#include <cmath>

namespace {

// y = weight * (x * (1 / sqrt(mean(x^2) + eps))) over one row of `width` values; y may be x. The squares are summed
// in double, where each is exact, so the result hardly depends on the order of the sum: runtime/paged_reference.py
// (PyTorch's reduction in double) gets the same normalised keys bit for bit (the quantized pool codes them: their
// codes must match), and the sum may run in vector lanes.
void norm_row(const float* x, const float* weight, float eps, int64_t width, float* y) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < width; ++i) sum += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  const float mean = static_cast<float>(sum / static_cast<double>(width));
  const float inv = 1.0f / std::sqrt(mean + eps);
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

// Rotary embedding of one head vector: y = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1). y may be x.
void rope_row(const float* x, const float* cos, const float* sin, int64_t dim, float* y) {
  const int64_t half = dim / 2;
  int64_t i = 0;
  if (half % Vec::size() == 0) {
    for (; i < half; i += Vec::size()) {
      const Vec a = Vec::loadu(x + i), b = Vec::loadu(x + i + half);
      (a * Vec::loadu(cos + i) - b * Vec::loadu(sin + i)).store(y + i);
      (b * Vec::loadu(cos + i + half) + a * Vec::loadu(sin + i + half)).store(y + i + half);
    }
  }
  for (; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    y[i] = a * cos[i] - b * sin[i];
    y[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

}  // namespace
