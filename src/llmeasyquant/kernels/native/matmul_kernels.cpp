// Weight-only matmuls on the CPU: W8A16 (int8 weights) and W4A16 (int4 weights, and their dequantization for
// GEMMs of many rows), with fp32 activations and sums where PyTorch's weight-only operators round them to bf16
// (kernels/native.py builds this file with decoder_ops.cpp and bindings.cpp on first use; bindings.cpp registers
// the operators by name), and the integer matmuls: W4A8 (int4 weights, int8 activations) and W8A8 for decode's
// few rows (PyTorch's integer GEMM stays the one for many rows).

#include "common.h"
#include "operators.h"
#include "w4a8_tiles.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// ==== int8 weights: far streams of channels, dot products ====

// Output channels a thread computes together, each from its own stretch of the thread's channels: its share is read
// as kInt8Streams sequential streams far apart (stream s takes channels first + s * span + i, i in order), each one
// run of memory the prefetchers follow. On this project's 2-core EPYC (one row, 3072 x 576 int8, on 2 MiB pages;
// scratch timing, the same bits) four neighbouring channels a pass, which read four runs of a row's 9 cache lines
// side by side and then jump, streamed 9-10 GB/s a thread; one channel after the other 23-28 GB/s, four far streams
// 24 GB/s and, with two threads, 42-45 GB/s against 17-19: independent sums in flight without short runs.
constexpr int64_t kInt8Streams = 4;
constexpr int64_t kCacheLine = 64;

// The threads split the first seven eighths of a layer's output channels evenly; the last eighth goes in chunks of
// 64 channels (four streams of 16) to whichever thread is free, so that a thread the host slows down does not keep
// the other waiting at the end (up to 150 us of 2.7 ms per call measured between two threads' shares of a 28672 x
// 4096 W4A16 layer). Scratch timing of the digits kernel, two runs: +4-5% at 4096 x 14336, +4-8% at 6144 x 4096, -1
// to +9% at 28672 x 4096; a quarter in chunks of 128, or a sixteenth in chunks of 32, no better. At least 32
// channels a thread.
constexpr int64_t kTailShare = 8, kTailChannels = 64, kThreadChannels = 32;

// Calls body(begin, end) over ranges of output channels that cover [0, out) once, split over the threads (or the
// team) as above.
template <typename Body>
void for_channel_ranges(int64_t out, const Body& body) {
  const int64_t threads = std::clamp<int64_t>(out / kThreadChannels, 1, split_threads());
  const int64_t even = out - out / kTailShare;
  const int64_t chunks = (out - even + kTailChannels - 1) / kTailChannels;
  for_workers(threads, [&](int64_t t, const auto& next_chunk) {
    body(even * t / threads, even * (t + 1) / threads);
    for (int64_t k = next_chunk(); k < chunks; k = next_chunk())
      body(even + k * kTailChannels, std::min(out, even + (k + 1) * kTailChannels));
  });
}

// Calls body(o, stride, streams) over the output channels [0, out), split over the threads (or the team): streams
// is std::integral_constant<int, kInt8Streams> for channels o + s * stride (s < kInt8Streams), or <int, 1> for o
// alone (a range's last few channels).
template <typename Body>
void for_channel_streams(int64_t out, const Body& body) {
  for_channel_ranges(out, [&](int64_t begin, int64_t end) {
    const int64_t span = (end - begin) / kInt8Streams;
    for (int64_t i = 0; i < span; ++i) body(begin + i, span, std::integral_constant<int, kInt8Streams>());
    for (int64_t o = begin + kInt8Streams * span; o < end; ++o) body(o, 0, std::integral_constant<int, 1>());
  });
}

// body(R, r) for the rows [0, rows) in groups of R <= 4 from row r (R a std::integral_constant): up to four rows
// share each load of weights.
template <typename Body>
void for_row_groups(int64_t rows, const Body& body) {
  for (int64_t r = 0; r < rows;) {
    switch (std::min<int64_t>(4, rows - r)) {
      case 4: body(std::integral_constant<int, 4>(), r), r += 4; break;
      case 3: body(std::integral_constant<int, 3>(), r), r += 3; break;
      case 2: body(std::integral_constant<int, 2>(), r), r += 2; break;
      default: body(std::integral_constant<int, 1>(), r), r += 1; break;
    }
  }
}

// sums[r * S + s] = sum_i float(w[s * stride + i]) * x[r * ldx + i] for S channels of int8 weights (rows of `width`
// codes, `stride` codes apart) and R rows of x: the codes widened to fp32 in registers (exact), fp32 products and
// sums. Each sum runs in the same order whatever S and R: a vector of partial sums over the row, reduced, then the
// columns left over one by one.
template <int S, int R>
void int8_dot(const int8_t* w, int64_t stride, const float* x, int64_t ldx, int64_t width, float* sums) {
  int64_t i = 0;
  for (int k = 0; k < S * R; ++k) sums[k] = 0.0f;
#if defined(CPU_CAPABILITY_AVX512)
  __m512 acc[R][S];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_ps();
  for (; i + 16 <= width; i += 16)
    for (int s = 0; s < S; ++s) {
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + s * stride + i));
      const __m512 weights = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
      for (int r = 0; r < R; ++r) acc[r][s] = _mm512_fmadd_ps(weights, _mm512_loadu_ps(x + r * ldx + i), acc[r][s]);
    }
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) sums[r * S + s] = _mm512_reduce_add_ps(acc[r][s]);
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 acc[R][S];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) acc[r][s] = _mm256_setzero_ps();
  for (; i + 8 <= width; i += 8)
    for (int s = 0; s < S; ++s) {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + s * stride + i));
      const __m256 weights = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
      for (int r = 0; r < R; ++r) acc[r][s] = _mm256_fmadd_ps(weights, _mm256_loadu_ps(x + r * ldx + i), acc[r][s]);
    }
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[r][s]);
      for (float lane : lanes) sums[r * S + s] += lane;
    }
#endif
  for (; i < width; ++i)
    for (int r = 0; r < R; ++r)
      for (int s = 0; s < S; ++s) sums[r * S + s] += static_cast<float>(w[s * stride + i]) * x[r * ldx + i];
}

// ==== results through the epilogue ====

// v as computed, hidden from the optimiser: GCC fuses a product feeding an addition into one FMA, across statements
// (-ffp-contract=fast, its default), which rounds once where the per-op path rounds the product, stores it and adds
// it in another operator.
inline float opaque(float v) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+x"(v));
#elif defined(__aarch64__)
  __asm__("" : "+w"(v));
#else
  volatile float held = v;
  v = held;
#endif
  return v;
}

// row[o] = y (+ bias[o]), or row[o] += that: the epilogue of operators.h, each addition rounded on its own.
inline void put(const Epilogue& epilogue, float* row, int64_t o, float y) {
  if (epilogue.bias != nullptr) y = opaque(opaque(y) + epilogue.bias[o]);
  row[o] = epilogue.accumulate ? row[o] + opaque(y) : y;
}

// ==== int4 groups and nibbles ====

// The weights of one group of int4 codes, dequantized as the reference does: (float(u - 8) - zero) * scale, one
// rounding, u the stored nibble (kernels' layout: even column in the low nibble); on a non-uniform grid (`levels`,
// 16 fp32 values, or null) levels[u] * scale, one rounding too. AVX-512 turns 16 nibbles into their weights with one
// permute of a 16-entry table made per group, so the table holds exactly those values.
struct Int4Group {
  float scale, zero;
  const float* levels = nullptr;
  float value(uint8_t nibble) const {
    if (levels != nullptr) return levels[nibble] * scale;
    return (static_cast<float>(static_cast<int>(nibble) - 8) - zero) * scale;
  }
#if defined(CPU_CAPABILITY_AVX512)
  __m512 table() const {
    if (levels != nullptr) return _mm512_mul_ps(_mm512_loadu_ps(levels), _mm512_set1_ps(scale));
    const __m512 codes = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
    return _mm512_mul_ps(_mm512_sub_ps(codes, _mm512_set1_ps(zero)), _mm512_set1_ps(scale));
  }
#endif
};

uint8_t nibble(const uint8_t* packed, int64_t column) {
  return column % 2 == 0 ? packed[column / 2] & 0x0F : packed[column / 2] >> 4;
}

#if defined(CPU_CAPABILITY_AVX512)
// The 16 weights of columns column..column+15 (column even) from the group's table.
__m512 int4_weights(const uint8_t* packed, int64_t column, __m512 table) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + column / 2));
  const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
  return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high)), table);
}

// The 32 weights of columns column..column+31 (column even) from 16 bytes: those of the even columns, then those of
// the odd ones. The permute reads the low 4 bits of each index, so the low nibble needs no mask.
void int4_weights32(const uint8_t* packed, int64_t column, __m512 table, __m512& even, __m512& odd) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + column / 2)));
  even = _mm512_permutexvar_ps(bytes, table);
  odd = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
#endif

// Calls body(first, last, group) for each group's column range of a row of `width` columns.
template <typename Body>
void for_groups(int64_t width, int64_t group_size, const Body& body) {
  for (int64_t g = 0, first = 0; first < width; ++g, first += group_size)
    body(first, std::min(width, first + group_size), g);
}

}  // namespace

// ==== W8A16: int8-weight matmul ====

// x: [rows, in] fp32, q: [out, in] int8, scales: [out] fp32 -> y: [rows, out] fp32
// x [rows, in] fp32 times int8 weights q [out, in] (per-output-channel codes) scaled by scales [out]:
// y[r, o] = scales[o] * sum_i q[o, i] * x[r, i], in fp32 throughout. For W8A16 decode: PyTorch's int8 operator
// takes bf16 activations and rounds its output to bf16; this one keeps fp32 and streams the weights as fast.
at::Tensor int8_weight_matmul(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& scales_in) {
  const at::Tensor x = input(x_in, at::kFloat, "x");
  const at::Tensor q = input(q_in, at::kChar, "q");
  const at::Tensor scales = input(scales_in, at::kFloat, "scales");
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "x [rows, in] and q [out, in] must share in");
  TORCH_CHECK(scales.numel() == q.size(0), "scales must have one value per output channel");
  const int64_t rows = x.size(0), width = x.size(1), out = q.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  int8_weight_matmul_into(x.data_ptr<float>(), rows, width, q.data_ptr<int8_t>(), scales.data_ptr<float>(), out,
                          y.data_ptr<float>(), out, Epilogue{});
  return y;
}

void int8_weight_matmul_into(const float* x, int64_t rows, int64_t width, const int8_t* q, const float* scales,
                             int64_t out, float* y, int64_t ldy, const Epilogue& epilogue) {
  for_channel_streams(out, [&](int64_t o, int64_t span, auto streams) {
    constexpr int S = decltype(streams)::value;
    for_row_groups(rows, [&](auto group, int64_t r) {
      constexpr int R = decltype(group)::value;
      float sums[R * S];
      int8_dot<S, R>(q + o * width, span * width, x + r * width, width, width, sums);
      for (int k = 0; k < R; ++k)
        for (int c = 0; c < S; ++c)
          put(epilogue, y + (r + k) * ldy, o + c * span, sums[k * S + c] * scales[o + c * span]);
    });
  });
}

// ==== W4A16 weights: packed int4 codes, scales, zeros ====

// The shapes every W4A16 operator takes: packed [out, ceil(in / 2)], scales [out, ceil(in / group_size)], zeros as
// the scales.
void check_int4_layout(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                       int64_t width, int64_t group_size) {
  const int64_t out = packed.size(0);
  TORCH_CHECK(packed.dim() == 2 && packed.size(1) == (width + 1) / 2, "packed must be [out, ceil(in / 2)] = [", out,
              ", ", (width + 1) / 2, "]");
  TORCH_CHECK(group_size > 0 && (group_size % 2 == 0 || group_size >= width),
              "group size must be even or cover the row, got ", group_size);
  const int64_t groups = (width + group_size - 1) / group_size;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == out && scales.size(1) == groups, "scales must be [out, groups] = [",
              out, ", ", groups, "]");
  TORCH_CHECK(!zeros.has_value() || zeros->sizes() == scales.sizes(), "zeros must match scales");
}

// Weights of W4A16 layers: packed [out, ceil(in / 2)] uint8 nibbles (u = code + 8, even column low), scales and
// zeros [out, groups] fp32 (zeros absent: symmetric), `group_size` columns a group (even, or one group a row).
struct Int4Weights {
  const uint8_t* packed;
  const float* scales;
  const float* zeros;
  int64_t out, width, groups, group_size, row_bytes;
  // A non-uniform grid's levels (set by with_levels): 16 fp32 values shared (stride 0) or a row's own (stride 16).
  const float* levels = nullptr;
  int64_t levels_stride = 0;

  Int4Weights(const at::Tensor& packed_t, const at::Tensor& scales_t, const c10::optional<at::Tensor>& zeros_t,
              int64_t in_features, int64_t group_size_in)
      : packed(packed_t.data_ptr<uint8_t>()), scales(scales_t.data_ptr<float>()),
        zeros(zeros_t.has_value() ? zeros_t->data_ptr<float>() : nullptr), out(packed_t.size(0)),
        width(in_features), groups(scales_t.size(1)), group_size(group_size_in), row_bytes(packed_t.size(1)) {
    check_int4_layout(packed_t, scales_t, zeros_t, width, group_size);
  }

  Int4Group group(int64_t row, int64_t g) const {
    return {scales[row * groups + g], zeros != nullptr ? zeros[row * groups + g] : 0.0f,
            levels != nullptr ? levels + row * levels_stride : nullptr};
  }

  // The weights as levels[u] * scale: levels [16] (one table) or [out, 16] (one a row), fp32; no zero points.
  Int4Weights& with_levels(const at::Tensor& levels_t) {
    check_cpu(levels_t, at::kFloat, "levels");
    TORCH_CHECK(zeros == nullptr, "a grid's weights have no zero points");
    TORCH_CHECK(levels_t.numel() == 16 || (levels_t.dim() == 2 && levels_t.size(0) == out && levels_t.size(1) == 16),
                "levels must be [16] or [out, 16] = [", out, ", 16]");
    levels = levels_t.data_ptr<float>();
    levels_stride = levels_t.numel() == 16 ? 0 : 16;
    return *this;
  }

  // The fp32 weights of output channel `row` into w [width].
  void dequantize_row(int64_t row, float* w) const {
    const uint8_t* p = packed + row * row_bytes;
    for_groups(width, group_size, [&](int64_t first, int64_t last, int64_t g) {
      const Int4Group q = group(row, g);
      int64_t i = first;
#if defined(CPU_CAPABILITY_AVX512)
      const __m512 table = q.table();
      for (; i + 16 <= last; i += 16) _mm512_storeu_ps(w + i, int4_weights(p, i, table));
#endif
      for (; i < last; ++i) w[i] = q.value(nibble(p, i));
    });
  }
};

Int4Weights int4_weights_of(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                            int64_t in_features, int64_t group_size) {
  check_cpu(packed, at::kByte, "packed");
  check_cpu(scales, at::kFloat, "scales");
  if (zeros.has_value()) check_cpu(*zeros, at::kFloat, "zeros");
  TORCH_CHECK(packed.dim() == 2 && scales.dim() == 2,
              "packed [out, ceil(in / 2)] and scales [out, groups] must be 2-D");
  return Int4Weights(packed, scales, zeros, in_features, group_size);
}

// ==== W4A16: dequantize_int4 ====

// packed: [out, ceil(in / 2)] uint8, scales: [out, groups] fp32, zeros: [out, groups] fp32 or absent,
// groups = ceil(in / group_size) -> w: [out, in] fp32
// The fp32 weight [out, in] of a W4A16 layer, equal bit for bit to the reference kernel's dequantization: for many
// rows the kernel multiplies by it with PyTorch's fp32 GEMM, as the reference does, in one pass instead of five.
at::Tensor dequantize_weights(const Int4Weights& weights, int64_t in_features, const at::Tensor& scales);

at::Tensor dequantize_int4(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                           int64_t in_features, int64_t group_size) {
  return dequantize_weights(int4_weights_of(packed, scales, zeros, in_features, group_size), in_features, scales);
}

at::Tensor dequantize_weights(const Int4Weights& weights, int64_t in_features, const at::Tensor& scales) {
  at::Tensor w = at::empty({weights.out, in_features}, scales.options());
  float* pw = w.data_ptr<float>();
  for_rows(weights.out, in_features, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) weights.dequantize_row(r, pw + r * in_features);
  });
  return w;
}

// The weights of a bf16 prompt GEMM are dequantized this many bf16 bytes at a time: a block of channels stays in
// the caches between its dequantization and its GEMM, and no call maps (and faults in) a fresh buffer the size of
// the whole layer (at Llama-1B shapes, 512 rows: 50 ms a layer against 84-90 whole).
constexpr int64_t kBf16ChunkBytes = int64_t{2} << 20;

// Channels [first, last) of a W4A16 layer as bf16 [last - first, in]: each row dequantized in fp32 as
// dequantize_int4 does, into a row buffer that stays in L1, then rounded to bf16 as PyTorch's conversion rounds
// (the same at::vec::convert): one pass over the chunk instead of an fp32 weight written, read and cast.
at::Tensor dequantize_bf16_rows(const Int4Weights& weights, int64_t first, int64_t last) {
  const int64_t width = weights.width;
  at::Tensor w = at::empty({last - first, width}, at::dtype(at::kBFloat16));
  auto* pw = reinterpret_cast<c10::BFloat16*>(w.data_ptr<at::BFloat16>());
  for_rows(last - first, width, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width);
    for (int64_t r = begin; r < end; ++r) {
      weights.dequantize_row(first + r, row.data());
      at::vec::convert(row.data(), pw + r * width, width);
    }
  });
  return w;
}

// y[:, first, first + block.size(1)) = block widened to fp32 (both row-major; y [rows, out]).
void widen_into_columns(const at::Tensor& block, at::Tensor& y, int64_t first) {
  const int64_t rows = block.size(0), cols = block.size(1), out = y.size(1);
  const auto* pb = reinterpret_cast<const c10::BFloat16*>(block.data_ptr<at::BFloat16>());
  float* py = y.data_ptr<float>();
  for_rows(rows, cols, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) at::vec::convert(pb + r * cols, py + r * out + first, cols);
  });
}

at::Tensor int4_bf16_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& zeros, int64_t in_features, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features, "x must be [rows, in_features]");
  const Int4Weights weights = int4_weights_of(packed, scales, zeros, in_features, group_size);
  const int64_t out = weights.out;
  const int64_t step = std::max<int64_t>(16, kBf16ChunkBytes / (2 * in_features) / 16 * 16);
  const at::Tensor xb = x.to(at::kBFloat16);
  at::Tensor y = at::empty({x.size(0), out}, x.options().dtype(at::kFloat));
  for (int64_t first = 0; first < out; first += step) {
    const int64_t last = std::min(first + step, out);
    // fp32 sums in oneDNN's bf16 GEMM, its outputs rounded to bf16 (PyTorch's int4 operator's rounding too)
    widen_into_columns(at::matmul(xb, dequantize_bf16_rows(weights, first, last).t()), y, first);
  }
  return y;
}

// ==== W4A16: int4-weight matmul ====

constexpr int64_t kPrefetchChannels = 4;

// Activation rows [rows, width] with each full block of 32 columns reordered as its 16 even columns, then its 16 odd
// ones: the order int4_weights32 gives the weights in. Only blocks that start on a multiple of 32 are read so,
// which every block inside a group is when groups are multiples of 32 wide or span the row.
std::vector<float> split_even_odd(const float* x, int64_t rows, int64_t width) {
  std::vector<float> split(x, x + rows * width);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c + 32 <= width; c += 32)
      for (int64_t k = 0; k < 16; ++k) {
        split[r * width + c + k] = x[r * width + c + 2 * k];
        split[r * width + c + 16 + k] = x[r * width + c + 2 * k + 1];
      }
  return split;
}

// sums[r] = x[r] . (weights of output channel o) for R rows of x [.., width] (split: the same rows reordered by
// split_even_odd, or null): each weight dequantized in registers as dequantize_int4 does, once for the R rows,
// multiplied with fp32 activations in fp32. Even and odd columns sum apart: two independent chains of FMAs.
template <int64_t R>
void int4_channel(const Int4Weights& weights, int64_t o, const float* x, const float* split, float* sums) {
  const uint8_t* p = weights.packed + o * weights.row_bytes;
  const int64_t width = weights.width;
  if (o + kPrefetchChannels < weights.out)  // a later channel's bytes, requested now: decode reads them from memory
    for (int64_t b = 0; b < weights.row_bytes; b += kCacheLine)
      __builtin_prefetch(p + kPrefetchChannels * weights.row_bytes + b, 0, 3);
  for (int64_t r = 0; r < R; ++r) sums[r] = 0.0f;
#if defined(CPU_CAPABILITY_AVX512)
  __m512 acc[R], acc_odd[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = acc_odd[r] = _mm512_setzero_ps();
#endif
  for_groups(width, weights.group_size, [&](int64_t first, int64_t last, int64_t g) {
    const Int4Group q = weights.group(o, g);
    int64_t i = first;
#if defined(CPU_CAPABILITY_AVX512)
    const __m512 table = q.table();
    if (split != nullptr) {
      for (; i + 32 <= last; i += 32) {
        __m512 even, odd;
        int4_weights32(p, i, table, even, odd);
        for (int64_t r = 0; r < R; ++r) {
          acc[r] = _mm512_fmadd_ps(even, _mm512_loadu_ps(split + r * width + i), acc[r]);
          acc_odd[r] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(split + r * width + i + 16), acc_odd[r]);
        }
      }
    }
    for (; i + 16 <= last; i += 16) {
      const __m512 w = int4_weights(p, i, table);
      for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * width + i), acc[r]);
    }
#endif
    for (; i < last; ++i) {
      const float w = q.value(nibble(p, i));
      for (int64_t r = 0; r < R; ++r) sums[r] += w * x[r * width + i];
    }
  });
#if defined(CPU_CAPABILITY_AVX512)
  for (int64_t r = 0; r < R; ++r) sums[r] += _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc_odd[r]));
#endif
}

// ==== W4A16 on bf16 dot products (AVX-512 BF16) ====

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
namespace {

// The table-lookup path above spends four shuffles and two FMAs on every 32 weights and turns some 10 GB/s of codes
// per core into sums, a third of what the memory delivers. Here each 64-byte load of codes (128 weights) becomes
// 128 bf16 words of u - 8 (exact: small integers) by two byte-table lookups and two unpacks per 64 nibbles, and one
// vdpbf16ps multiplies 32 words by 32 bf16 activations, adding pairs into fp32 lanes. The activations are split into
// two bf16 numbers, hi = bf16(x) and lo = bf16(x - hi), whose sum carries 16 significant bits of x: each weight
// takes two dot products and the result stays near the fp32 reference (x's relative error below 2^-16).
//   sum_i x_i (u_i - 8 - zero) scale = scale * (sum_i x_i (u_i - 8) - zero * sum_i x_i)
// The first sum is what the dot products give, a 16-lane vector per 128 columns scaled lane by lane by the scale of
// the lane's group (each 128-bit lane covers 32 columns, so groups of any multiple of 32 columns line up); the second
// is made once per row of x and group (`column_sums`) and taken off at the end. Four output channels share each
// load of activations, which would otherwise be read at eight times the bytes of the codes.
constexpr int64_t kBlockColumns = 128;
constexpr int64_t kTileChannels = 4;

// One row of activations in the order the unpacked words come in: per block of 128 columns, the words of
// unpacklo(low nibbles), unpackhi(low nibbles), unpacklo(high nibbles), unpackhi(high nibbles), 32 each; within
// each, 128-bit lane k holds bytes 16k.. (+8 for unpackhi), byte j carrying columns 2j (low) and 2j + 1 (high).
// Columns past the row are zero, so padding codes add nothing. Also, per block, which group each 32-bit lane's
// columns belong to: lanes 4k..4k+3 cover columns b + 32k.., in group (b + 32k) / group_size, given relative to the
// block's first group (`first_group`), with how many groups from there the block touches (`touched`, at most 4).
struct SplitActivations {
  std::vector<uint16_t> hi, lo;  // [rows, blocks * 128] bf16 bits
  std::vector<float> column_sums;  // [rows, groups]: sum over the group's columns of hi + lo
  std::vector<int32_t> lane_group;  // [blocks, 16]
  std::vector<int64_t> first_group, touched;  // [blocks]
  int64_t padded;

  SplitActivations(const float* x, int64_t rows, int64_t width, int64_t group_size, int64_t groups)
      : padded((width + kBlockColumns - 1) / kBlockColumns * kBlockColumns) {
    hi.assign(rows * padded, 0);
    lo.assign(rows * padded, 0);
    column_sums.assign(rows * groups, 0.0f);
    for (int64_t b = 0; b < padded; b += kBlockColumns) {
      const int64_t g0 = b / group_size;
      first_group.push_back(g0);
      touched.push_back(std::min<int64_t>(4, groups - g0));
      for (int64_t l = 0; l < 16; ++l)
        lane_group.push_back(static_cast<int32_t>(std::min(groups - 1, (b + 32 * (l / 4)) / group_size) - g0));
    }
    // Columns in their own order, each to its place (shifts and masks only: this runs on every call, and a
    // division per column cost more than a small layer's whole product); the group advances at its boundary.
    for (int64_t r = 0; r < rows; ++r) {
      float* sums = column_sums.data() + r * groups;
      for (int64_t column = 0, g = 0, group_end = group_size; column < width; ++column) {
        if (column == group_end) ++g, group_end += group_size;
        const int64_t j = column % kBlockColumns, byte = j >> 1, lane = byte >> 4, half = (byte >> 3) & 1;
        const int64_t place = r * padded + column - j + 32 * (2 * (j & 1) + half) + 8 * lane + (byte & 7);
        const float value = x[r * width + column];
        const c10::BFloat16 high(value), low(value - static_cast<float>(high));
        hi[place] = high.x;
        lo[place] = low.x;
        sums[g] += static_cast<float>(high) + static_cast<float>(low);
      }
    }
  }
};

// The bf16 words of u - 8 for the 128 nibbles of 64 bytes, in SplitActivations' order: the low and high bytes of
// each word looked up from two 16-entry tables, then interleaved.
inline void centred_words(__m512i bytes, __m512i words[4]) {
  // bf16(u - 8) for u = 0..15: -8, -7, ..., 7; byte tables of its low and high halves, repeated in each 128-bit lane.
  const __m512i low_table = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0x00, (char)0xE0, (char)0xC0, (char)0xA0, (char)0x80, 0x40, 0x00, (char)0x80, 0x00, (char)0x80,
                    0x00, 0x40, (char)0x80, (char)0xA0, (char)0xC0, (char)0xE0));
  const __m512i high_table = _mm512_broadcast_i32x4(
      _mm_setr_epi8((char)0xC1, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0,
                    (char)0xBF, 0x00, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40));
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const __m512i nibbles[2] = {_mm512_and_si512(bytes, mask), _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask)};
  for (int64_t n = 0; n < 2; ++n) {
    const __m512i low = _mm512_shuffle_epi8(low_table, nibbles[n]);
    const __m512i high = _mm512_shuffle_epi8(high_table, nibbles[n]);
    words[2 * n] = _mm512_unpacklo_epi8(low, high);
    words[2 * n + 1] = _mm512_unpackhi_epi8(low, high);
  }
}

// sums[r * C + c] = x[first_row + r] . (weights of output channel o + c) for R rows of x and C channels.
template <int64_t R, int64_t C>
void int4_channels_bf16(const Int4Weights& weights, int64_t o, const SplitActivations& x, int64_t first_row,
                        float* sums) {
  const uint8_t* p = weights.packed + o * weights.row_bytes;
  // The bytes of the tile kPrefetchChannels on, a cache line a channel at each block: decode reads every weight once,
  // from memory.
  const uint8_t* ahead = o + C + kPrefetchChannels <= weights.out ? p + kPrefetchChannels * weights.row_bytes : nullptr;
  __m512 total[R][C];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) total[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.padded; b += kBlockColumns) {
    const int64_t left = weights.row_bytes - b / 2, block = b / kBlockColumns, g0 = x.first_group[block];
    const __mmask64 byte_mask = left >= 64 ? ~0ULL : (1ULL << left) - 1;
    const __m512i lane_group = _mm512_loadu_si512(x.lane_group.data() + 16 * block);
    const __mmask16 group_mask = (__mmask16)((1u << x.touched[block]) - 1);
    __m512i words[C][4];
    __m512 lane_scale[C];
    if (ahead != nullptr)
      for (int64_t c = 0; c < C; ++c) __builtin_prefetch(ahead + c * weights.row_bytes + b / 2, 0, 3);
    for (int64_t c = 0; c < C; ++c) {
      centred_words(_mm512_maskz_loadu_epi8(byte_mask, p + c * weights.row_bytes + b / 2), words[c]);
      lane_scale[c] = _mm512_permutexvar_ps(
          lane_group, _mm512_maskz_loadu_ps(group_mask, weights.scales + (o + c) * weights.groups + g0));
    }
    for (int64_t r = 0; r < R; ++r) {
      const uint16_t* hi = x.hi.data() + (first_row + r) * x.padded + b;
      const uint16_t* lo = x.lo.data() + (first_row + r) * x.padded + b;
      __m512 acc[C], acc_lo[C];
      for (int64_t c = 0; c < C; ++c) acc[c] = acc_lo[c] = _mm512_setzero_ps();
      for (int64_t v = 0; v < 4; ++v) {
        const __m512i xh = _mm512_loadu_si512(hi + 32 * v), xl = _mm512_loadu_si512(lo + 32 * v);
        for (int64_t c = 0; c < C; ++c) {
          acc[c] = _mm512_dpbf16_ps(acc[c], (__m512bh)words[c][v], (__m512bh)xh);
          acc_lo[c] = _mm512_dpbf16_ps(acc_lo[c], (__m512bh)words[c][v], (__m512bh)xl);
        }
      }
      for (int64_t c = 0; c < C; ++c)
        total[r][c] = _mm512_fmadd_ps(_mm512_add_ps(acc[c], acc_lo[c]), lane_scale[c], total[r][c]);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float* column_sums = x.column_sums.data() + (first_row + r) * weights.groups;
    for (int64_t c = 0; c < C; ++c) {
      float offset = 0.0f;
      if (weights.zeros != nullptr)
        for (int64_t g = 0; g < weights.groups; ++g) {
          const int64_t k = (o + c) * weights.groups + g;
          offset += weights.scales[k] * weights.zeros[k] * column_sums[g];
        }
      sums[r * C + c] = _mm512_reduce_add_ps(total[r][c]) - offset;
    }
  }
}

// Rows four at a time, each tile of four channels in two halves then (four rows by four channels would want 32
// accumulators, all the registers there are, and spill); the last few channels one by one.
template <int64_t R>
void int4_rows_bf16(const Int4Weights& weights, const SplitActivations& x, int64_t first_row, int64_t begin,
                    int64_t end, float* y) {
  constexpr int64_t C = R == 1 ? kTileChannels : kTileChannels / 2;
  float sums[R * C];
  int64_t o = begin;
  for (; o + C <= end; o += C) {
    int4_channels_bf16<R, C>(weights, o, x, first_row, sums);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) y[(first_row + r) * weights.out + o + c] = sums[r * C + c];
  }
  for (; o < end; ++o) {
    int4_channels_bf16<R, 1>(weights, o, x, first_row, sums);
    for (int64_t r = 0; r < R; ++r) y[(first_row + r) * weights.out + o] = sums[r];
  }
}

at::Tensor int4_matmul_bf16(const at::Tensor& x, const Int4Weights& weights) {
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor y = at::empty({rows, weights.out}, x.options());
  const SplitActivations split(x.data_ptr<float>(), rows, width, std::min(weights.group_size, width), weights.groups);
  float* py = y.data_ptr<float>();
  at::parallel_for(0, (weights.out + kTileChannels - 1) / kTileChannels, 4, [&](int64_t begin, int64_t end) {
    const int64_t first = begin * kTileChannels, last = std::min(weights.out, end * kTileChannels);
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) int4_rows_bf16<4>(weights, split, r, first, last, py);
    for (; r < rows; ++r) int4_rows_bf16<1>(weights, split, r, first, last, py);
  });
  return y;
}

}  // namespace
#endif

// Whether int4_weight_matmul can take the bf16 dot-product path on this build (AVX-512 BF16 compiled in).
bool bf16_dot_built() {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x: [rows, in] fp32, packed: [out, ceil(in / 2)] uint8, scales: [out, groups] fp32, zeros: [out, groups] fp32 or
// absent -> y: [rows, out] fp32
// y [rows, out] = x [rows, in] times the W4A16 weights, for a few rows (decode; dequantize_int4 and a GEMM serve
// a prompt): rows four at a time, so each dequantized weight serves four activation rows. With `bf16_dot` and a
// build that has it, groups that are multiples of 32 columns (or one a row) take the bf16 dot-product path.
at::Tensor int4_matmul_weights(const at::Tensor& x, const Int4Weights& weights);

at::Tensor int4_weight_matmul(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, int64_t group_size, bool bf16_dot) {
  const at::Tensor x = input(x_in, at::kFloat, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  const Int4Weights weights = int4_weights_of(packed, scales, zeros, x.size(1), group_size);
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if (bf16_dot && (group_size % 32 == 0 || group_size >= x.size(1))) return int4_matmul_bf16(x, weights);
#else
  (void)bf16_dot;
#endif
  return int4_matmul_weights(x, weights);
}

at::Tensor int4_matmul_weights(const at::Tensor& x, const Int4Weights& weights) {
  const int64_t rows = x.size(0), width = x.size(1), group_size = weights.group_size;
  at::Tensor y = at::empty({rows, weights.out}, x.options());
  const float* px = x.data_ptr<float>();
  float* py = y.data_ptr<float>();
  std::vector<float> split;
  if (group_size % 32 == 0 || group_size >= width) split = split_even_odd(px, rows, width);
  const float* ps = split.empty() ? nullptr : split.data();
  at::parallel_for(0, weights.out, 16, [&](int64_t begin, int64_t end) {
    float sums[4];
    for (int64_t o = begin; o < end; ++o) {
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) {
        int4_channel<4>(weights, o, px + r * width, ps == nullptr ? nullptr : ps + r * width, sums);
        for (int64_t k = 0; k < 4; ++k) py[(r + k) * weights.out + o] = sums[k];
      }
      for (; r < rows; ++r) {
        int4_channel<1>(weights, o, px + r * width, ps == nullptr ? nullptr : ps + r * width, sums);
        py[r * weights.out + o] = sums[0];
      }
    }
  });
  return y;
}

// ==== W4A8: int4 weights x int8 activations, int32 sums ====

namespace {

// Blocks of 64 bytes ahead that each tile's stream prefetches.
constexpr int64_t kW4A8PrefetchBlocks = 16;

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(CPU_CAPABILITY_AVX2)
// acc + the sums of 4 products u * q in each 32-bit lane (u unsigned < 16, q signed): vpmaddubsw's 16-bit pair
// sums (at most 2 * 15 * 128: never saturated), then vpmaddwd with ones.
inline __m256i dot4_avx2(__m256i acc, __m256i u, __m256i q) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1)));
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// acc + the sums of 4 products u * q in each 32-bit lane (u unsigned < 16, q signed): VNNI's one instruction where
// the CPU has it, else the AVX512-BW pair (the 16-bit pair sums, at most 2 * 15 * 128, never saturate).
inline __m512i dot4(__m512i acc, __m512i u, __m512i q) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, q);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, q), _mm512_set1_epi16(1)));
#endif
}

// y[r, 16 T channels of tiles t..t+T-1] for R activation rows: per group, exact int32 sums of u * qx less the
// offset times the group's activation sum, then scaled by the weight scales in fp32 and summed over groups; times the
// row's scale. One group (per-channel weights): float(sum) * x_scale * w_scale, the reference kernel's order, bit
// for bit. With activation groups (xg = groups scales a row, one per weight group) each group's sum is scaled by
// its weight scale times its activation scale instead, and nothing after. Each broadcast of 4 activation bytes
// serves T tiles, each unpacked block of weights R rows.
template <int R, int T>
void w4a8_tiles(const Int4TiledWeights& w, int64_t t, const int8_t* qx, int64_t stride, const int32_t* sums,
                const float* x_scales, int64_t xg, float* y, int64_t ldy, const Epilogue& epilogue) {
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  __m512 total[T][R];
  __m512i acc[T][R];
  for (int k = 0; k < T; ++k)
    for (int r = 0; r < R; ++r) total[k][r] = _mm512_setzero_ps();
  const int64_t padded = w.tiles * 16;
  const bool uniform = w.uniform_offset != 0;
  for (int64_t g = 0; g < w.groups; ++g) {
    for (int r = 0; r < R; ++r) {
      const __m512i start = uniform ? _mm512_set1_epi32(-w.uniform_offset * sums[r * w.groups + g])
                                    : _mm512_setzero_si512();
      for (int k = 0; k < T; ++k) acc[k][r] = start;
    }
    const int64_t first = g * w.group_size / 8, last = std::min(w.blocks, (g + 1) * w.group_size / 8);
    for (int64_t b = first; b < last; ++b) {
      __m512i low[T], high[T];
      for (int k = 0; k < T; ++k) {
        // A kilobyte ahead in each tile's stream (past a tile's end: the next tile's first blocks, or nothing; a
        // prefetch never faults). Streaming the 8B shapes from memory, one row: +8% alone, +34% with 8 tiles a pass.
        __builtin_prefetch(w.tiled + ((t + k) * w.blocks + b + kW4A8PrefetchBlocks) * 64, 0, 3);
        const __m512i bytes = _mm512_loadu_si512(w.tiled + ((t + k) * w.blocks + b) * 64);
        low[k] = _mm512_and_si512(bytes, low_mask);
        high[k] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_mask);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* row = qx + r * stride + b * 8;
        const __m512i first4 = _mm512_set1_epi32(four_bytes(row)), second4 = _mm512_set1_epi32(four_bytes(row + 4));
        for (int k = 0; k < T; ++k) acc[k][r] = dot4(dot4(acc[k][r], low[k], first4), high[k], second4);
      }
    }
    for (int k = 0; k < T; ++k) {
      const __m512 scale = _mm512_loadu_ps(w.scales + g * padded + (t + k) * 16);
      if (!uniform) {
        const __m512i offset = _mm512_loadu_si512(w.offsets + g * padded + (t + k) * 16);
        for (int r = 0; r < R; ++r)
          acc[k][r] = _mm512_sub_epi32(acc[k][r],
                                       _mm512_mullo_epi32(offset, _mm512_set1_epi32(sums[r * w.groups + g])));
      }
      for (int r = 0; r < R; ++r) {
        if (w.groups > 1) {
          const __m512 both = xg > 1 ? _mm512_mul_ps(scale, _mm512_set1_ps(x_scales[r * xg + g])) : scale;
          total[k][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[k][r]), both, total[k][r]);
        }
      }
    }
  }
  for (int k = 0; k < T; ++k) {
    const int64_t valid = std::min<int64_t>(16, w.out - (t + k) * 16);
    const __m512 scale = _mm512_loadu_ps(w.scales + (t + k) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_set1_ps(xg > 1 ? 1.0f : x_scales[r]);
      const __m512 result = w.groups > 1 ? (xg > 1 ? total[k][r] : _mm512_mul_ps(total[k][r], xs))
                                         : _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[k][r]), xs), scale);
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, result);
      for (int64_t j = 0; j < valid; ++j) put(epilogue, y + r * ldy, (t + k) * 16 + j, lanes[j]);
    }
  }
}
#elif defined(CPU_CAPABILITY_AVX2)
// AVX2: tile t's 16 channels as two halves of 8 (32 bytes a block each), every row in turn: the same exact int32 sums
// per group and the same per-channel fp32 operations in the same order as the AVX-512 path and the scalar one (no
// sum crosses lanes), so the same bits.
void w4a8_tile_avx2(const Int4TiledWeights& w, int64_t t, int64_t rows, const int8_t* qx, int64_t stride,
                    const int32_t* sums, const float* x_scales, int64_t xg, float* y, int64_t ldy,
                    const Epilogue& epilogue) {
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const int64_t padded = w.tiles * 16, valid = std::min<int64_t>(16, w.out - t * 16);
  for (int64_t r = 0; r < rows; ++r) {
    __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256i acc[2];
    for (int64_t g = 0; g < w.groups; ++g) {
      acc[0] = acc[1] = _mm256_setzero_si256();
      const int64_t first = g * w.group_size / 8, last = std::min(w.blocks, (g + 1) * w.group_size / 8);
      for (int64_t b = first; b < last; ++b) {
        __builtin_prefetch(w.tiled + (t * w.blocks + b + kW4A8PrefetchBlocks) * 64, 0, 3);
        const int8_t* row = qx + r * stride + b * 8;
        const __m256i first4 = _mm256_set1_epi32(four_bytes(row)), second4 = _mm256_set1_epi32(four_bytes(row + 4));
        for (int64_t h = 0; h < 2; ++h) {
          const __m256i bytes =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.tiled + (t * w.blocks + b) * 64 + 32 * h));
          const __m256i low = _mm256_and_si256(bytes, low_mask);
          const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_mask);
          acc[h] = dot4_avx2(dot4_avx2(acc[h], low, first4), high, second4);
        }
      }
      for (int64_t h = 0; h < 2; ++h) {
        const __m256i offset =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.offsets + g * padded + t * 16 + 8 * h));
        acc[h] = _mm256_sub_epi32(acc[h], _mm256_mullo_epi32(offset, _mm256_set1_epi32(sums[r * w.groups + g])));
        if (w.groups > 1) {
          const __m256 scale = _mm256_loadu_ps(w.scales + g * padded + t * 16 + 8 * h);
          const __m256 both = xg > 1 ? _mm256_mul_ps(scale, _mm256_set1_ps(x_scales[r * xg + g])) : scale;
          total[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[h]), both, total[h]);
        }
      }
    }
    alignas(32) float lanes[16];
    for (int64_t h = 0; h < 2; ++h) {
      const __m256 xs = _mm256_set1_ps(xg > 1 ? 1.0f : x_scales[r]);
      const __m256 scale = _mm256_loadu_ps(w.scales + t * 16 + 8 * h);
      const __m256 result = w.groups > 1 ? (xg > 1 ? total[h] : _mm256_mul_ps(total[h], xs))
                                         : _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[h]), xs), scale);
      _mm256_store_ps(lanes + 8 * h, result);
    }
    for (int64_t j = 0; j < valid; ++j) put(epilogue, y + r * ldy, t * 16 + j, lanes[j]);
  }
}
#endif

// The same arithmetic one value at a time, for CPUs without AVX2.
void w4a8_tile_scalar(const Int4TiledWeights& w, int64_t t, int64_t rows, const int8_t* qx, int64_t stride,
                      const int32_t* sums, const float* x_scales, int64_t xg, float* y, int64_t ldy,
                      const Epilogue& epilogue) {
  const int64_t padded = w.tiles * 16;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < 16 && t * 16 + j < w.out; ++j) {
      const int64_t o = t * 16 + j;
      float total = 0.0f;
      int32_t acc = 0;
      for (int64_t g = 0; g < w.groups; ++g) {
        acc = 0;
        const int64_t first = g * w.group_size / 8, last = std::min(w.blocks, (g + 1) * w.group_size / 8);
        for (int64_t b = first; b < last; ++b) {
          const uint8_t* lane = w.tiled + ((t * w.blocks + b) * 16 + j) * 4;
          for (int64_t c = 0; c < 4; ++c) {
            acc += static_cast<int32_t>(lane[c] & 0x0F) * qx[r * stride + b * 8 + c];
            acc += static_cast<int32_t>(lane[c] >> 4) * qx[r * stride + b * 8 + 4 + c];
          }
        }
        acc -= w.offsets[g * padded + o] * sums[r * w.groups + g];
        const float both = xg > 1 ? w.scales[g * padded + o] * x_scales[r * xg + g] : w.scales[g * padded + o];
        if (w.groups > 1) total = std::fma(static_cast<float>(acc), both, total);
      }
      put(epilogue, y + r * ldy, o, w.groups > 1 ? (xg > 1 ? total : total * x_scales[r])
                                                 : static_cast<float>(acc) * x_scales[r] * w.scales[o]);
    }
}

// Activation rows that share each unpacked block of weights: 8 for one tile, 4 for a pair of tiles (4 x 2 integer
// and 4 x 2 float accumulators, plus the weights, fit AVX-512's 32 registers). Decode's one to three rows take 8
// tiles a pass instead: eight streams of weights in flight and eight independent sums. On the 2-core Xeon of
// docs/RESULTS.md ("Speed at real sizes"), streaming the 8B layers from memory at one row, 2 threads: 19 GB/s with
// pairs, 26 GB/s (a torch sum's rate) with 8 tiles and the prefetch.
constexpr int64_t kW4A8Rows = 8, kW4A8PairRows = 4, kW4A8DecodeTiles = 8;
// Calls of at least this many rows and tiles of 16 channels take AMX's tiles where the CPU has them (w4a8_amx.cpp;
// 32 rows a pass, padded). Measured on the Xeon of docs/RESULTS.md, 2 threads: at 576 x 1536 AMX is ahead from 24
// rows (0.056 against 0.082 ms at 32), at 1536 x 576 even at 32 and 1.4x at 64; at 576 x 192 (12 tiles) behind up
// to 128 rows and even at 512 (each strip's fixed cost: unpacking, tile configuration).
constexpr int64_t kW4A8AmxRows = 32, kW4A8AmxTiles = 32;

#if defined(CPU_CAPABILITY_AVX512)
// Every row of y [rows, out] for tiles t..t+T-1: R rows per call, then the rest one at a time.
template <int R, int T>
void w4a8_rows(const Int4TiledWeights& w, int64_t t, int64_t rows, const int8_t* qx, int64_t stride,
               const int32_t* sums, const float* x_scales, int64_t xg, float* y, int64_t ldy,
               const Epilogue& epilogue) {
  int64_t r = 0;
  for (; r + R <= rows; r += R)
    w4a8_tiles<R, T>(w, t, qx + r * stride, stride, sums + r * w.groups, x_scales + r * xg, xg, y + r * ldy, ldy,
                     epilogue);
  for (; r < rows; ++r)
    w4a8_tiles<1, T>(w, t, qx + r * stride, stride, sums + r * w.groups, x_scales + r * xg, xg, y + r * ldy, ldy,
                     epilogue);
}
#endif

}  // namespace

// qx: [rows, in] int8, x_scales: [rows, 1] fp32 (or [rows, groups]: one activation scale per row and weight group),
// tiled: [tiles, blocks, 16, 4] uint8, scales: [groups, tiles * 16] fp32, offsets: [groups, tiles * 16] int32 ->
// y: [rows, out] fp32
// y = (qx times the int4 weights) scaled, as kernels/reference.py's integer product computes it: exact int32 sums
// per group. group_size is a multiple of 8 (or covers the row); columns past `in` up to the block are zero in qx.
// amx: 1 takes AMX's tiles (w4a8_amx.cpp, the same bits) for calls large enough to gain, 0 never, 2 whenever the CPU
// has them (tests).
namespace {

// The tiled weights of a W4A8 layer for rows of `width` columns, as int4_int8_matmul takes them (checked). Offsets
// may be left undefined only where `offsets_optional` (the W4A16 bf16 operator's symmetric weights: null then).
Int4TiledWeights int4_tiled_weights(int64_t width, const at::Tensor& tiled, const at::Tensor& scales,
                                    const at::Tensor& offsets, int64_t group_size, int64_t out_features,
                                    bool offsets_optional = false) {
  check_cpu(tiled, at::kByte, "tiled");
  check_cpu(scales, at::kFloat, "scales");
  if (offsets.defined() || !offsets_optional) check_cpu(offsets, at::kInt, "offsets");
  TORCH_CHECK(tiled.dim() == 4 && tiled.size(2) == 16 && tiled.size(3) == 4, "tiled must be [tiles, blocks, 16, 4]");
  const int64_t tiles = tiled.size(0), blocks = tiled.size(1);
  TORCH_CHECK(blocks == (width + 7) / 8, "tiled has ", blocks, " blocks of 8 columns, x has ", width, " columns");
  TORCH_CHECK(group_size > 0 && (group_size % 8 == 0 || group_size >= width),
              "group size must be a multiple of 8 or cover the row, got ", group_size);
  TORCH_CHECK(out_features > 0 && out_features <= tiles * 16, "out_features must fit the tiles");
  const int64_t span = group_size >= width ? blocks * 8 : group_size, groups = (blocks * 8 + span - 1) / span;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == groups && scales.size(1) == tiles * 16 &&
                  (!offsets.defined() || offsets.sizes() == scales.sizes()),
              "scales and offsets must be [groups, tiles * 16] = [", groups, ", ", tiles * 16, "]");
  return {tiled.data_ptr<uint8_t>(), scales.data_ptr<float>(),
          offsets.defined() ? offsets.data_ptr<int32_t>() : nullptr, tiles, blocks, groups, span, out_features};
}

// y = qx times the W4A8 weights for qx [rows, stride] (stride = blocks * 8, zero past the row) and x_scales [rows,
// xg], on the VNNI loop (or its scalar form), through the epilogue.
void w4a8_matmul(const Int4TiledWeights& w, const int8_t* qx, const float* x_scales, int64_t xg, int64_t rows,
                 int64_t stride, float* y, int64_t ldy, const Epilogue& epilogue) {
  // Each row's activation sum per group (the offsets' term); a team's threads each make their own (a decode step's
  // few rows), in a buffer they keep.
  thread_local std::vector<int32_t> kept;
  std::vector<int32_t> local;
  std::vector<int32_t>& sums = llmeasyquant::team::current != nullptr ? kept : local;
  sums.assign(rows * w.groups, 0);
  on_own([&] {
    for_rows(rows, stride, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r)
        for (int64_t g = 0; g < w.groups; ++g) {
          int32_t sum = 0;
          const int8_t* part = qx + r * stride + g * w.group_size;
#pragma omp simd reduction(+ : sum)
          for (int64_t i = 0; i < std::min(w.group_size, stride - g * w.group_size); ++i) sum += part[i];
          sums[r * w.groups + g] = sum;
        }
    });
  });
  parallel_range(0, w.tiles, 2, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end;) {
#if defined(CPU_CAPABILITY_AVX512)
      if (rows < kW4A8PairRows && t + kW4A8DecodeTiles <= end) {
        w4a8_rows<1, kW4A8DecodeTiles>(w, t, rows, qx, stride, sums.data(), x_scales, xg, y, ldy, epilogue);
        t += kW4A8DecodeTiles;
      } else if (t + 1 < end) {  // two tiles per broadcast of activations (fewer broadcasts per sum: measured faster)
        w4a8_rows<kW4A8PairRows, 2>(w, t, rows, qx, stride, sums.data(), x_scales, xg, y, ldy, epilogue);
        t += 2;
      } else {
        w4a8_rows<kW4A8Rows, 1>(w, t, rows, qx, stride, sums.data(), x_scales, xg, y, ldy, epilogue);
        ++t;
      }
#elif defined(CPU_CAPABILITY_AVX2)
      w4a8_tile_avx2(w, t, rows, qx, stride, sums.data(), x_scales, xg, y, ldy, epilogue);
      ++t;
#else
      w4a8_tile_scalar(w, t, rows, qx, stride, sums.data(), x_scales, xg, y, ldy, epilogue);
      ++t;
#endif
    }
  });
}

}  // namespace

// qx: [rows, in] int8, x_scales: [rows, 1] fp32 (or [rows, groups]: one activation scale per row and weight group),
// tiled: [tiles, blocks, 16, 4] uint8, scales: [groups, tiles * 16] fp32, offsets: [groups, tiles * 16] int32 ->
// y: [rows, out] fp32
// y = (qx times the int4 weights) scaled, as kernels/reference.py's integer product computes it: exact int32 sums
// per group. group_size is a multiple of 8 (or covers the row); columns past `in` up to the block are zero in qx.
// amx: 1 takes AMX's tiles (w4a8_amx.cpp, the same bits) for calls large enough to gain, 0 never, 2 whenever the CPU
// has them (tests).
at::Tensor int4_int8_matmul(const at::Tensor& qx_in, const at::Tensor& x_scales_in, const at::Tensor& tiled,
                            const at::Tensor& scales, const at::Tensor& offsets, int64_t group_size,
                            int64_t out_features, int64_t amx) {
  const at::Tensor qx_dense = input(qx_in, at::kChar, "qx");
  const at::Tensor x_scales = input(x_scales_in, at::kFloat, "x_scales");
  TORCH_CHECK(qx_dense.dim() == 2 && (qx_dense.size(0) == 0 ? x_scales.numel() == 0
                                                             : x_scales.numel() % qx_dense.size(0) == 0),
              "qx [rows, in] needs x_scales [rows, 1] or [rows, groups]");
  TORCH_CHECK(amx >= 0 && amx <= 2, "amx must be 0 (never), 1 (large calls) or 2 (always), got ", amx);
  const int64_t rows = qx_dense.size(0), width = qx_dense.size(1);
  const Int4TiledWeights w = int4_tiled_weights(width, tiled, scales, offsets, group_size, out_features);
  const int64_t xg = rows > 0 ? x_scales.numel() / rows : 1;  // activation scales a row: 1, or one a weight group
  TORCH_CHECK(xg == 1 || (xg == w.groups && w.groups > 1), "x_scales must be [rows, 1] or [rows, groups] = [", rows,
              ", ", w.groups, "], got ", xg, " a row");
  // Rows padded to whole blocks with zero codes.
  at::Tensor qx = qx_dense;
  if (width % 8 != 0) qx = at::constant_pad_nd(qx_dense, {0, w.blocks * 8 - width}, 0);
  const int64_t stride = w.blocks * 8;
  const int8_t* pq = qx.data_ptr<int8_t>();
  at::Tensor y = at::empty({rows, out_features}, x_scales.options());
  float* py = y.data_ptr<float>();
  const float* pxs = x_scales.data_ptr<float>();
  const bool large = rows >= kW4A8AmxRows && w.tiles >= kW4A8AmxTiles;
  // The AMX strips scale each row once (one activation scale a row); activation groups take the VNNI loop.
  if (xg == 1 && (amx == 2 || (amx == 1 && large)) && int4_int8_matmul_amx(w, pq, rows, stride, pxs, py)) return y;
  w4a8_matmul(w, pq, pxs, xg, rows, stride, py, out_features, Epilogue{});
  return y;
}

void check_int4_int8(int64_t width, const at::Tensor& tiled, const at::Tensor& scales, const at::Tensor& offsets,
                     int64_t group_size, int64_t out_features) {
  TORCH_CHECK(width % 8 == 0, "the step form of W4A8 takes rows of whole blocks of 8 columns, got ", width);
  int4_tiled_weights(width, tiled, scales, offsets, group_size, out_features);
}

void int4_int8_matmul_into(const int8_t* qx, const float* x_scales, int64_t xg, int64_t rows, int64_t width,
                           const at::Tensor& tiled, const at::Tensor& scales, const at::Tensor& offsets,
                           int64_t group_size, int64_t out_features, int32_t uniform_offset, float* y, int64_t ldy,
                           const Epilogue& epilogue) {
  Int4TiledWeights w = int4_tiled_weights(width, tiled, scales, offsets, group_size, out_features);
  w.uniform_offset = uniform_offset;
  w4a8_matmul(w, qx, x_scales, xg, rows, width, y, ldy, epilogue);
}

int32_t uniform_offset(const at::Tensor& offsets) {
  if (offsets.numel() == 0) return 0;
  const int32_t first = offsets.flatten()[0].item<int32_t>();
  return first != 0 && offsets.eq(first).all().item<bool>() ? first : 0;
}

// ==== W4A16 on bf16 dot products from the W4A8 tiles: many rows sharing each decoded weight ====

namespace {

// The W4A8 tiles (Int4TiledWeights) hold, per 16 output channels and 8 input columns, one 32-bit lane a channel
// whose byte c carries columns c (low nibble) and c + 4 (high). Each byte becomes one lane of two bf16 words, u - 8
// of each nibble (small integers: exact), by one word permute of a 32-entry table; one vdpbf16ps then multiplies the
// 16 channels' pair by a row's two activations (broadcast), adding both products into the channel's fp32 lane. A
// decoded lane serves up to kBf16TileRows rows, so at a batch's 16 rows the decoding costs a fraction of the dot
// products: the weights read once a call for all rows, 32 multiply-adds an instruction. The activations are rounded
// to bf16 once (8 significant bits, as PyTorch's int4 operator and oneDNN's bf16 GEMM round them); the weights stay
// exact, each group's sum is scaled in fp32, and the zero points' term is taken off as zero * scale * (the group's
// sum of the rounded activations).
constexpr int64_t kBf16TileRows = 12;

// x [rows, width] as bf16 pairs in the tiles' order: for row r and block b of 8 columns, pair 4b + c holds columns
// 8b + c (low word) and 8b + c + 4 (high), rounded to nearest even; columns past the row are zero. With zero
// points, each row's sum per group of those rounded values.
struct Bf16Pairs {
  std::vector<uint32_t> pairs;  // [rows, blocks * 4]
  std::vector<float> group_sums;  // [rows, groups], only with zero points
  int64_t stride;
};

inline float bf16_value(uint32_t bits) {
  return static_cast<float>(c10::BFloat16(static_cast<uint16_t>(bits), c10::BFloat16::from_bits()));
}

void bf16_pairs_fill(const float* x, int64_t rows, int64_t width, const Int4TiledWeights& w, bool sums,
                     Bf16Pairs& out) {
  out.stride = w.blocks * 4;
  out.pairs.assign(rows * out.stride, 0);
  out.group_sums.assign(sums ? rows * w.groups : 0, 0.0f);
  for_rows(rows, width, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* row = x + r * width;
      uint32_t* pair = out.pairs.data() + r * out.stride;
      int64_t b = 0;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
      // two blocks a vector: 16 columns rounded (nearest even, as c10::BFloat16), their words put in pair order
      const __m256i order = _mm256_setr_epi16(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
      for (; 8 * b + 16 <= width; b += 2) {
        const __m256i words = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + 8 * b));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pair + 4 * b), _mm256_permutexvar_epi16(order, words));
      }
#endif
      for (; b < w.blocks; ++b)
        for (int64_t c = 0; c < 4; ++c) {
          const int64_t low = 8 * b + c, high = low + 4;
          const c10::BFloat16 lo(low < width ? row[low] : 0.0f), hi(high < width ? row[high] : 0.0f);
          pair[4 * b + c] = static_cast<uint32_t>(lo.x) | (static_cast<uint32_t>(hi.x) << 16);
        }
      if (!sums) continue;
      float* g = out.group_sums.data() + r * w.groups;
      for (int64_t p = 0; p < w.blocks * 4; ++p) {
        const int64_t low = 8 * (p / 4) + p % 4;  // the pair's columns: low and low + 4, in one group
        g[low / w.group_size] += bf16_value(pair[p] & 0xFFFF) + bf16_value(pair[p] >> 16);
      }
    }
  });
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// y[r0 + r, 16 channels of each of tiles t..t+T-1] for R rows: R x T independent sums, each decoded vector of a tile
// serving R rows.
template <int R, int T>
void bf16_tile_rows(const Int4TiledWeights& w, int64_t t, const Bf16Pairs& x, int64_t r0, bool zeros, float* y,
                    int64_t ldy, const Epilogue& epilogue) {
  // bf16(u - 8) for u = 0..15 in words 0..15 and again in 16..31: a lane's index words carry one stray bit (bit 4).
  alignas(64) static const uint16_t kCentred[32] = {
      0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080,
      0x40A0, 0x40C0, 0x40E0, 0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80,
      0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};
  const __m512i table = _mm512_load_si512(kCentred);
  const int64_t padded = w.tiles * 16, per_group = w.group_size / 8;
  __m512 total[T][R];
  for (int k = 0; k < T; ++k)
    for (int r = 0; r < R; ++r) total[k][r] = _mm512_setzero_ps();
  for (int64_t g = 0, b = 0; g < w.groups; ++g) {
    __m512 acc[T][R];
    for (int k = 0; k < T; ++k)
      for (int r = 0; r < R; ++r) acc[k][r] = _mm512_setzero_ps();
    for (const int64_t end = std::min(w.blocks, b + per_group); b < end; ++b) {
      __m512i bytes[T];
      for (int k = 0; k < T; ++k) bytes[k] = _mm512_loadu_si512(w.tiled + ((t + k) * w.blocks + b) * 64);
      for (int c = 0; c < 4; ++c) {
        __m512bh weights[T];
        for (int k = 0; k < T; ++k) {
          const __m512i e = _mm512_srli_epi32(bytes[k], 8 * c);
          // word 0: byte c (its low nibble indexes the table), word 1: byte c shifted down 4 (its high nibble)
          const __m512i index = _mm512_mask_blend_epi16(0xAAAAAAAAu, e, _mm512_slli_epi32(e, 12));
          weights[k] = (__m512bh)_mm512_permutexvar_epi16(index, table);
        }
        const uint32_t* column = x.pairs.data() + r0 * x.stride + 4 * b + c;
        for (int r = 0; r < R; ++r) {
          const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(column[r * x.stride]));
          for (int k = 0; k < T; ++k) acc[k][r] = _mm512_dpbf16_ps(acc[k][r], pair, weights[k]);
        }
      }
    }
    for (int k = 0; k < T; ++k) {
      const __m512 scale = _mm512_loadu_ps(w.scales + g * padded + (t + k) * 16);
      if (zeros) {  // offsets are 8 + zero: take off zero * (the group's activation sum)
        const __m512 zero = _mm512_cvtepi32_ps(
            _mm512_sub_epi32(_mm512_loadu_si512(w.offsets + g * padded + (t + k) * 16), _mm512_set1_epi32(8)));
        for (int r = 0; r < R; ++r)
          acc[k][r] = _mm512_fnmadd_ps(zero, _mm512_set1_ps(x.group_sums[(r0 + r) * w.groups + g]), acc[k][r]);
      }
      for (int r = 0; r < R; ++r) total[k][r] = _mm512_fmadd_ps(acc[k][r], scale, total[k][r]);
    }
  }
  for (int k = 0; k < T; ++k) {
    const int64_t valid = std::min<int64_t>(16, w.out - (t + k) * 16);
    for (int r = 0; r < R; ++r) {
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, total[k][r]);
      for (int64_t c = 0; c < valid; ++c) put(epilogue, y + (r0 + r) * ldy, (t + k) * 16 + c, lanes[c]);
    }
  }
}

// bf16_tile_rows for `left` rows, 1 <= left <= R.
template <int R, int T>
void bf16_tile_rest(const Int4TiledWeights& w, int64_t t, const Bf16Pairs& x, int64_t r0, int64_t left, bool zeros,
                    float* y, int64_t ldy, const Epilogue& epilogue) {
  if constexpr (R > 0) {
    if (left == R) return bf16_tile_rows<R, T>(w, t, x, r0, zeros, y, ldy, epilogue);
    bf16_tile_rest<R - 1, T>(w, t, x, r0, left, zeros, y, ldy, epilogue);
  }
}

// Up to this many rows two tiles go together, so that a block of few rows still has a dozen independent sums (at 4
// rows alone, each waited on its dot products' latency).
constexpr int64_t kBf16PairRows = 6;
#endif

// The same sums one value at a time (CPUs without AVX-512 BF16): each group's products of the rounded activations
// and u - 8 in fp32, in column order, then scaled; the bits may differ from the vector path's in the sums' order.
void bf16_tile_scalar(const Int4TiledWeights& w, int64_t t, const Bf16Pairs& x, int64_t r, bool zeros, float* y,
                      int64_t ldy, const Epilogue& epilogue) {
  const int64_t padded = w.tiles * 16, per_group = w.group_size / 8;
  const uint8_t* tile = w.tiled + t * w.blocks * 64;
  const uint32_t* pairs = x.pairs.data() + r * x.stride;
  for (int64_t c = 0; c < std::min<int64_t>(16, w.out - t * 16); ++c) {
    float total = 0.0f;
    for (int64_t g = 0, b = 0; g < w.groups; ++g) {
      float acc = 0.0f;
      for (const int64_t end = std::min(w.blocks, b + per_group); b < end; ++b)
        for (int64_t k = 0; k < 4; ++k) {
          const uint8_t byte = tile[b * 64 + 4 * c + k];
          const uint32_t pair = pairs[4 * b + k];
          acc += static_cast<float>((byte & 0x0F) - 8) * bf16_value(pair & 0xFFFF) +
                 static_cast<float>((byte >> 4) - 8) * bf16_value(pair >> 16);
        }
      if (zeros) acc -= static_cast<float>(w.offsets[g * padded + t * 16 + c] - 8) * x.group_sums[r * w.groups + g];
      total += acc * w.scales[g * padded + t * 16 + c];
    }
    put(epilogue, y + r * ldy, t * 16 + c, total);
  }
}

void bf16_tiles_matmul(const Int4TiledWeights& w, const float* x, int64_t rows, int64_t width, bool zeros, float* y,
                       int64_t ldy, const Epilogue& epilogue) {
  thread_local Bf16Pairs kept;
  Bf16Pairs local;
  Bf16Pairs& pairs = llmeasyquant::team::current != nullptr ? kept : local;
  on_own([&] { bf16_pairs_fill(x, rows, width, w, zeros, pairs); });
  parallel_range(0, w.tiles, 2, [&](int64_t begin, int64_t end) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    for (int64_t t = begin; t < end;) {
      const bool two = rows <= kBf16PairRows && t + 1 < end;
      // equal blocks (16 rows: two of 8, not 12 and 4): a block of few rows waits on its few sums' latency
      for (int64_t r0 = 0; r0 < rows;) {
        const int64_t left = rows - r0, blocks = (left + kBf16TileRows - 1) / kBf16TileRows;
        const int64_t take = (left + blocks - 1) / blocks;
        if (two)
          bf16_tile_rest<kBf16PairRows, 2>(w, t, pairs, r0, take, zeros, y, ldy, epilogue);
        else
          bf16_tile_rest<kBf16TileRows, 1>(w, t, pairs, r0, take, zeros, y, ldy, epilogue);
        r0 += take;
      }
      t += two ? 2 : 1;
    }
#else
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r = 0; r < rows; ++r) bf16_tile_scalar(w, t, pairs, r, zeros, y, ldy, epilogue);
#endif
  });
}

}  // namespace

// x: [rows, in] fp32, tiled/scales/offsets: a W4A8 layer's tiles (int4_int8_matmul's), offsets only where the weights
// have zero points -> y: [rows, out] fp32, the activations rounded to bf16 and the weights exact (bf16_tiles_matmul).
at::Tensor int4_bf16_tiles_matmul(const at::Tensor& x_in, const at::Tensor& tiled, const at::Tensor& scales,
                                  const c10::optional<at::Tensor>& offsets, int64_t group_size, int64_t out_features) {
  const at::Tensor x = input(x_in, at::kFloat, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  const Int4TiledWeights w = int4_tiled_weights(x.size(1), tiled, scales, offsets.value_or(at::Tensor()), group_size,
                                                out_features, /*offsets_optional=*/true);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  bf16_tiles_matmul(w, x.data_ptr<float>(), x.size(0), x.size(1), w.offsets != nullptr, y.data_ptr<float>(),
                    out_features, Epilogue{});
  return y;
}

// ==== W4A16 on integer dot products: the activations as 16-bit fixed point in two int8 digits ====

namespace {

// The bf16 path above decodes every weight with shuffles and unpacks and stays compute-bound (some 7 GB/s of codes a
// core on the Xeon of docs/RESULTS.md, half of what the memory delivers). Here the codes stay integers u (the stored
// nibbles, u = code + 8) and the activations become integers: each 32 columns of a row as q s with
// s = max|x| / 32639 over the 32 and |q| <= 32639, an exact 16-bit integer written as 256 h + l, h and l int8
// (h = (q + 128) >> 8). Then, exact in int32 for each 8 columns,
//   sum_i u_i q_i - 8 sum_i q_i = 256 sum_i u_i h_i + sum_i u_i l_i - 8 sum_i q_i
// where VNNI's vpdpbusd (unsigned bytes times signed bytes) makes 64 products a step, so a weight costs two of its
// lanes' products and no decode but a mask and a shift. Times s (the 8 columns' activation scale) and the weight
// group's scale in fp32; zero points come off at the end (zero * scale * the group's sum of q s). The activations
// then differ from x by at most s / 2 = max|x| / 65278 over each 32 columns: 16 bits against the 8 significant bits
// of bf16 that PyTorch's int4 operator rounds them to.
constexpr int64_t kDigitBlock = 128;  // columns a 64-byte load of one channel's codes holds
constexpr int64_t kDigitChunk = 32;   // columns that share one activation scale
constexpr float kDigitMax = 32639.0f;  // 127 * 256 + 127: both digits stay in int8

// Per row and block of 128 columns, in the order of the codes (byte j of a block holds columns 2j and 2j + 1): the
// digits [h of the even columns, h of the odd, l of the even, l of the odd], 64 bytes each, column 2j + k at byte j;
// per 32-bit lane (8 columns: bytes 4m..4m+3) -8 * sum q and the scale s. Columns past the row are zero. Per block,
// which weight group each lane's columns belong to, relative to the block's first group (`first_group`), and how
// many groups from there the block touches (`touched`, at most 16: groups are multiples of 8 columns).
struct DigitActivations {
  int64_t blocks = 0, groups = 0;
  std::vector<int8_t> digits;        // [rows, blocks, 4, 64]
  std::vector<int32_t> minus_eight;  // [rows, blocks, 16]
  std::vector<float> lane_scales;    // [rows, blocks, 16]
  std::vector<float> group_sums;     // [rows, groups]: sum of q s over the group's columns (zero points only)
  std::vector<int32_t> lane_group;   // [blocks, 16]
  std::vector<int64_t> first_group, touched;  // [blocks]
  std::vector<uint8_t> one_group;  // [blocks]: whether every lane is in the first group (groups of 128 or more)
  bool one_group_each = true;      // whether that holds for every block

  // The activations of x [rows, width]; an object filled again keeps its buffers (the step's threads keep one each).
  void fill(const float* x, int64_t rows, int64_t width, int64_t group_size, int64_t groups_in, bool zeros) {
    blocks = (width + kDigitBlock - 1) / kDigitBlock;
    groups = groups_in;
    digits.assign(rows * blocks * 256, 0);
    minus_eight.assign(rows * blocks * 16, 0);
    lane_scales.assign(rows * blocks * 16, 0.0f);
    group_sums.assign(zeros ? rows * groups : 0, 0.0f);
    lane_group.clear();
    first_group.clear();
    touched.clear();
    one_group.clear();
    one_group_each = true;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t g0 = std::min(groups - 1, b * kDigitBlock / group_size);
      first_group.push_back(g0);
      touched.push_back(std::min<int64_t>(16, groups - g0));
      for (int64_t m = 0; m < 16; ++m)
        lane_group.push_back(static_cast<int32_t>(std::min(groups - 1, (b * kDigitBlock + 8 * m) / group_size) - g0));
      one_group.push_back(lane_group.back() == 0);
      one_group_each = one_group_each && one_group.back() != 0;
    }
    for_rows(rows, width, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        for (int64_t c = 0; c < blocks * kDigitBlock; c += kDigitChunk) chunk(x + r * width, width, r, c, group_size);
#if defined(CPU_CAPABILITY_AVX512)
        for (int64_t b = 0; b < blocks; ++b) lane_sums(r * blocks + b);
#endif
      }
    });
  }

#if defined(CPU_CAPABILITY_AVX512)
  // -8 times each lane's sum of q = 256 h + l over its 8 columns, from the block's digits (dot products with ones).
  void lane_sums(int64_t base) {
    const int8_t* d = digits.data() + base * 256;
    const __m512i ones = _mm512_set1_epi8(1), zero = _mm512_setzero_si512();
    const __m512i high = dot4(dot4(zero, ones, _mm512_loadu_si512(d)), ones, _mm512_loadu_si512(d + 64));
    const __m512i low = dot4(dot4(zero, ones, _mm512_loadu_si512(d + 128)), ones, _mm512_loadu_si512(d + 192));
    const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(high, 8), low);
    _mm512_storeu_si512(minus_eight.data() + base * 16, _mm512_mullo_epi32(sum, _mm512_set1_epi32(-8)));
  }
#endif

  // The 32 columns from `column` of row r (those past `width` zero).
  void chunk(const float* x, int64_t width, int64_t r, int64_t column, int64_t group_size) {
    const int64_t count = std::clamp<int64_t>(width - column, 0, kDigitChunk);
    alignas(64) int32_t q[kDigitChunk] = {};
    const float scale = count > 0 ? chunk_codes(x + column, count, q) : 0.0f;
    const int64_t j0 = (column % kDigitBlock) / 2, base = r * blocks + column / kDigitBlock;
    int8_t* d = digits.data() + base * 256 + j0;
#if defined(CPU_CAPABILITY_AVX512)
    // Codes 0..31 to even and odd columns, 16 each, then to their digits as bytes (lane_sums then sums them).
    const __m512i first = _mm512_load_si512(q), second = _mm512_load_si512(q + 16);
    const __m512i even_index = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd_index = _mm512_add_epi32(even_index, _mm512_set1_epi32(1));
    const __m512i parts[2] = {_mm512_permutex2var_epi32(first, even_index, second),
                              _mm512_permutex2var_epi32(first, odd_index, second)};
    for (int64_t part = 0; part < 2; ++part) {
      const __m512i high = _mm512_srai_epi32(_mm512_add_epi32(parts[part], _mm512_set1_epi32(128)), 8);
      const __m512i low = _mm512_sub_epi32(parts[part], _mm512_slli_epi32(high, 8));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + part * 64), _mm512_cvtepi32_epi8(high));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 128 + part * 64), _mm512_cvtepi32_epi8(low));
    }
#else
    for (int64_t k = 0; k < kDigitChunk; ++k) {
      const int32_t h = (q[k] + 128) >> 8, l = q[k] - 256 * h;
      d[(k % 2) * 64 + k / 2] = static_cast<int8_t>(h);
      d[128 + (k % 2) * 64 + k / 2] = static_cast<int8_t>(l);
    }
    for (int64_t m = 0; m < kDigitChunk / 8; ++m) {
      int32_t sum = 0;
      for (int64_t k = 0; k < 8; ++k) sum += q[8 * m + k];
      minus_eight[base * 16 + j0 / 4 + m] = -8 * sum;
    }
#endif
    std::fill_n(lane_scales.data() + base * 16 + j0 / 4, kDigitChunk / 8, scale);
    // each group's share of the chunk summed exactly in int32 (|q| <= kDigitMax, 32 of them), then scaled once
    for (int64_t k = 0; k < count && !group_sums.empty();) {
      const int64_t g = std::min(groups - 1, (column + k) / group_size);
      const int64_t stop = std::min(count, (g + 1) * group_size - column);
      int32_t part = 0;
      for (; k < stop; ++k) part += q[k];
      group_sums[r * groups + g] += static_cast<float>(part) * scale;
    }
  }

  // q[0..count) = round(x / s) with s = max|x| / kDigitMax; returns s. A non-finite value makes s NaN, so that the
  // row's sums are NaN as the reference's would be, rather than numbers made of undefined codes; an all-zero chunk
  // (or one so small that s underflows) keeps codes 0.
  static float chunk_codes(const float* x, int64_t count, int32_t* q) {
#if defined(CPU_CAPABILITY_AVX512)
    const __mmask16 first_mask = count >= 16 ? 0xFFFF : (1u << count) - 1;
    const __mmask16 second_mask = count >= 32 ? 0xFFFF : count > 16 ? (1u << (count - 16)) - 1 : 0;
    const __m512 first = _mm512_maskz_loadu_ps(first_mask, x), second = _mm512_maskz_loadu_ps(second_mask, x + 16);
    // 0x99: NaN (quiet or signalling) or an infinity
    if (_mm512_fpclass_ps_mask(first, 0x99) | _mm512_fpclass_ps_mask(second, 0x99))
      return std::numeric_limits<float>::quiet_NaN();
    const float scale = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(first), _mm512_abs_ps(second))) / kDigitMax;
    if (scale == 0.0f) return 0.0f;
    // Division and round-to-nearest-even conversion, as std::nearbyint(x / scale) below; |x / scale| <= kDigitMax
    // up to one rounding, so the clamp only guards.
    const __m512 divisor = _mm512_set1_ps(scale);
    const __m512i most = _mm512_set1_epi32(static_cast<int32_t>(kDigitMax));
    const __m512i least = _mm512_set1_epi32(-static_cast<int32_t>(kDigitMax));
    const __m512 halves[2] = {first, second};
    for (int64_t half = 0; half < 2; ++half) {
      const __m512i codes = _mm512_cvtps_epi32(_mm512_div_ps(halves[half], divisor));
      _mm512_store_si512(q + 16 * half, _mm512_max_epi32(least, _mm512_min_epi32(most, codes)));
    }
    return scale;
#else
    float largest = 0.0f;
    bool finite = true;
    for (int64_t k = 0; k < count; ++k) {
      const float magnitude = std::fabs(x[k]);
      finite = finite && magnitude <= std::numeric_limits<float>::max();  // false for inf and NaN
      largest = std::max(largest, magnitude);
    }
    if (!finite) return std::numeric_limits<float>::quiet_NaN();
    const float scale = largest / kDigitMax;
    if (scale == 0.0f) return 0.0f;
    for (int64_t k = 0; k < count; ++k)
      q[k] = static_cast<int32_t>(std::clamp(std::nearbyint(x[k] / scale), -kDigitMax, kDigitMax));
    return scale;
#endif
  }
};

// Output channels that share each load of digits, each from its own stretch of the thread's rows: a thread's rows
// are read as kDigitStreams sequential streams far apart (stream s takes channels first + s * span + i, i in
// order), each stream one run of memory from its first row to its last, prefetched kDigitLinesAhead lines on (into
// L1). Neighbouring channels (8 rows a row_bytes apart, with the next tile prefetched) had been the pattern before:
// streaming 1.2 GB of 8B-shaped layers from memory, one row, 2 threads (scratch timing, the same bits) 21.4 / 18.7 /
// 20.7 GB/s at 4096 x 14336 / 6144 x 4096 / 28672 x 4096 against 24.2 / 21.8 / 24.4 for four far streams; the
// same loads without arithmetic 27.5 / 24.7 / 28.4. Two streams read slower (20.0 / 19.8 / 22.8); 3 to 8 and 8 to
// 32 lines ahead alike.
constexpr int64_t kDigitStreams = 4;
constexpr int64_t kDigitLinesAhead = 16;
// A channel's scales are a short run of their own (64 bytes a channel at 4096 columns, fp16), read once a block: a
// stream of rows that the codes' prefetch does not cover. Each stream's scales kDigitScaleRowsAhead channels on are
// prefetched as a channel starts, and where one scale covers each block (OneGroup) the channel's scales are widened
// into a local fp32 row first, so that each block's is one broadcast load from L1. Scratch timing as above (2 MiB
// pages; the same bits): 26.1 / 24.7 / 27.1 -> 28.5 / 25.5 / 28.2 GB/s at 4096 x 14336 / 6144 x 4096 / 28672 x
// 4096; the same without any weight scale 30.9 / 27.5 / 29.8.
constexpr int64_t kDigitScaleRowsAhead = 2;
constexpr int64_t kDigitLocalGroups = 256;  // OneGroup takes rows of at most this many groups (32768 columns at g128)

// A W4A16 layer as the digits kernel reads it: the stored codes, and the scales and zero points in the dtype they
// are kept in, fp32 or fp16. fp16 ones are read as they are, not as an fp32 copy: half the scale bytes a token and
// no second copy in memory, with the same sums (an fp16 value widens to fp32 exactly).
template <typename Scale>
struct DigitWeights {
  const uint8_t* packed;
  const Scale* scales;
  const Scale* zeros;
  int64_t out, width, groups, row_bytes;
};

inline float widen(float value) { return value; }
inline float widen(at::Half value) { return static_cast<float>(value); }

#if defined(CPU_CAPABILITY_AVX512)
// The first n of 16 scales from p (mask: n ones), widened to fp32; the others 0.
inline __m512 load_widened(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load_widened(const at::Half* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

// sums[c] = xq[row] . (weights of output channel o + c * stride) for C channels, xq the activations as the digits
// carry them. OneGroup: every block's columns lie in one weight group (x.one_group_each: groups a multiple of 128
// columns) and a row has at most kDigitLocalGroups groups, so a block's scale is one broadcast from the local row.
// As one loop for both cases, the compiler computed the per-lane scales for every block too: 5-12% slower at 4096
// columns (scratch timing, the same bits), the same at 14336.
template <int64_t C, bool OneGroup, typename Scale>
void int4_digit_channels(const DigitWeights<Scale>& w, int64_t o, int64_t stride, const DigitActivations& x,
                         int64_t row, float* sums) {
  const uint8_t* p = w.packed + o * w.row_bytes;
  const int64_t row_bytes = w.row_bytes, groups = w.groups, stream_bytes = stride * row_bytes;
  const Scale* scales = w.scales + o * groups;
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  __m512 total[C];
  for (int64_t c = 0; c < C; ++c) total[c] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {  // past the last row this reaches the next stream's, or past the end: no fault
    const char* ahead = reinterpret_cast<const char*>(scales + (c * stride + kDigitScaleRowsAhead) * groups);
    for (int64_t k = 0; k < groups * static_cast<int64_t>(sizeof(Scale)); k += 64) __builtin_prefetch(ahead + k, 0, 3);
  }
  alignas(64) float local[OneGroup ? C : 1][OneGroup ? kDigitLocalGroups : 16];
  if constexpr (OneGroup) {
    for (int64_t c = 0; c < C; ++c)
      for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 mask = groups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (groups - g)) - 1);
        _mm512_store_ps(&local[c][g], load_widened(scales + c * stride * groups + g, mask));
      }
  }
  for (int64_t b = 0; b < x.blocks; ++b) {
    const int64_t left = row_bytes - b * 64, base = row * x.blocks + b;
    const __mmask64 byte_mask = left >= 64 ? ~0ULL : (1ULL << left) - 1;
    const int8_t* d = x.digits.data() + base * 256;
    const __m512i high_even = _mm512_loadu_si512(d), high_odd = _mm512_loadu_si512(d + 64);
    const __m512i low_even = _mm512_loadu_si512(d + 128), low_odd = _mm512_loadu_si512(d + 192);
    const __m512i minus_eight = _mm512_loadu_si512(x.minus_eight.data() + base * 16);
    const __m512 activation_scale = _mm512_loadu_ps(x.lane_scales.data() + base * 16);
    const Scale* block_scales = scales + x.first_group[b];
    for (int64_t c = 0; c < C; ++c) {
      const uint8_t* codes = p + c * stream_bytes + b * 64;
      // a stream runs on into its next row, so this reaches past a row's end (and never faults past the codes')
      __builtin_prefetch(codes + kDigitLinesAhead * 64, 0, 3);
      const __m512i bytes = _mm512_maskz_loadu_epi8(byte_mask, codes);
      const __m512i even = _mm512_and_si512(bytes, low_mask);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_mask);
      const __m512i high = dot4(dot4(_mm512_setzero_si512(), even, high_even), odd, high_odd);
      const __m512i low = dot4(dot4(minus_eight, even, low_even), odd, low_odd);
      const __m512i exact = _mm512_add_epi32(_mm512_slli_epi32(high, 8), low);
      const Scale* channel_scales = block_scales + c * stride * groups;
      __m512 weight_scale;
      if constexpr (OneGroup) {
        weight_scale = _mm512_set1_ps(local[c][x.first_group[b]]);
      } else if (x.one_group[b] != 0) {
        weight_scale = _mm512_set1_ps(widen(channel_scales[0]));
      } else {  // a block spanning groups (at most 16: groups are multiples of 8): each lane's own
        const __mmask16 group_mask = static_cast<__mmask16>((1u << x.touched[b]) - 1);
        weight_scale = _mm512_permutexvar_ps(_mm512_loadu_si512(x.lane_group.data() + 16 * b),
                                             load_widened(channel_scales, group_mask));
      }
      total[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(weight_scale, activation_scale), total[c]);
    }
  }
  for (int64_t c = 0; c < C; ++c) sums[c] = _mm512_reduce_add_ps(total[c]);
}
#endif

// The same sums one value at a time, for CPUs without AVX-512: the same exact integers per 8 columns.
template <typename Scale>
void int4_digit_channel_scalar(const DigitWeights<Scale>& w, int64_t o, const DigitActivations& x, int64_t row,
                               float* sum) {
  const uint8_t* p = w.packed + o * w.row_bytes;
  float total = 0.0f;
  for (int64_t b = 0; b < x.blocks; ++b) {
    const int64_t base = row * x.blocks + b;
    const int8_t* d = x.digits.data() + base * 256;
    for (int64_t m = 0; m < 16; ++m) {
      int32_t high = 0, low = x.minus_eight[base * 16 + m];
      for (int64_t j = 4 * m; j < 4 * m + 4; ++j) {
        const uint8_t byte = b * 64 + j < w.row_bytes ? p[b * 64 + j] : 0;
        const int32_t even = byte & 0x0F, odd = byte >> 4;
        high += even * d[j] + odd * d[64 + j];
        low += even * d[128 + j] + odd * d[192 + j];
      }
      const float weight_scale = widen(w.scales[o * w.groups + x.first_group[b] + x.lane_group[16 * b + m]]);
      // fused explicitly, so that fp32 and fp16 scales give the same bits (as `+=` they did not in the scalar build)
      total = std::fma(static_cast<float>(256 * high + low), weight_scale * x.lane_scales[base * 16 + m], total);
    }
  }
  *sum = total;
}

// sum over groups g of scale * zero * group_sums[g] for channel o: what the zero points take off its sum. Vectorised:
// as a scalar loop it took 68 of 373 us for a 6144 x 4096 layer with zero points (32 groups a channel).
template <typename Scale>
float zero_offset(const DigitWeights<Scale>& w, int64_t o, const float* group_sums) {
  const Scale* scales = w.scales + o * w.groups;
  const Scale* zeros = w.zeros + o * w.groups;
  int64_t g = 0;
  float offset = 0.0f;
#if defined(CPU_CAPABILITY_AVX512)
  __m512 total = _mm512_setzero_ps();
  for (; g < w.groups; g += 16) {
    const __mmask16 mask = w.groups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (w.groups - g)) - 1);
    const __m512 scaled = _mm512_mul_ps(load_widened(scales + g, mask), load_widened(zeros + g, mask));
    total = _mm512_fmadd_ps(scaled, _mm512_maskz_loadu_ps(mask, group_sums + g), total);
  }
  offset = _mm512_reduce_add_ps(total);
#endif
  for (; g < w.groups; ++g) offset = std::fma(widen(scales[g]) * widen(zeros[g]), group_sums[g], offset);
  return offset;
}

}  // namespace

namespace {

template <typename Scale>
void digits_matmul(const float* x, int64_t rows, int64_t width, const at::Tensor& packed, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& zeros, int64_t group_size, float* y, int64_t ldy,
                   const Epilogue& epilogue) {
  const DigitWeights<Scale> w{packed.data_ptr<uint8_t>(), scales.data_ptr<Scale>(),
                              zeros.has_value() ? zeros->data_ptr<Scale>() : nullptr, packed.size(0), width,
                              scales.size(1), packed.size(1)};
  // Each thread of a team makes its own copy of the activations (a decode step's few rows: less than waiting for
  // one thread to make them) in a buffer it keeps; a call of its own makes them once, its rows over the threads.
  thread_local DigitActivations kept;
  DigitActivations local;
  DigitActivations& digits = llmeasyquant::team::current != nullptr ? kept : local;
  on_own([&] { digits.fill(x, rows, w.width, std::min(group_size, w.width), w.groups, w.zeros != nullptr); });
  // y[r, o] from the channel's integer sums, less scale * zero * sum of the group's activations over its groups
  const auto finish = [&](int64_t r, int64_t o, float sum) {
    put(epilogue, y + r * ldy, o,
        w.zeros == nullptr ? sum : sum - zero_offset(w, o, digits.group_sums.data() + r * w.groups));
  };
  // channels [begin, end) of every row: kDigitStreams far streams, then the channels left over one at a time
  const auto channels = [&](int64_t begin, int64_t end) {
    float sums[kDigitStreams];
    for (int64_t r = 0; r < rows; ++r) {
#if defined(CPU_CAPABILITY_AVX512)
      const int64_t span = (end - begin) / kDigitStreams;
      for (int64_t i = 0; i < span; ++i) {
        if (digits.one_group_each && w.groups <= kDigitLocalGroups)
          int4_digit_channels<kDigitStreams, true>(w, begin + i, span, digits, r, sums);
        else
          int4_digit_channels<kDigitStreams, false>(w, begin + i, span, digits, r, sums);
        for (int64_t s = 0; s < kDigitStreams; ++s) finish(r, begin + i + s * span, sums[s]);
      }
      for (int64_t o = begin + kDigitStreams * span; o < end; ++o) {
        int4_digit_channels<1, false>(w, o, 1, digits, r, sums);
        finish(r, o, sums[0]);
      }
#else
      for (int64_t o = begin; o < end; ++o) {
        int4_digit_channel_scalar(w, o, digits, r, sums);
        finish(r, o, sums[0]);
      }
#endif
    }
  };
  for_channel_ranges(w.out, channels);
}

}  // namespace

void check_int4_digits(int64_t width, const at::Tensor& packed, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& zeros, int64_t group_size) {
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf,
              "scales must be float32 or float16, got ", scales.scalar_type());
  check_cpu(packed, at::kByte, "packed");
  check_cpu(scales, scales.scalar_type(), "scales");
  if (zeros.has_value()) check_cpu(*zeros, scales.scalar_type(), "zeros (of the scales' dtype)");
  check_int4_layout(packed, scales, zeros, width, group_size);
  TORCH_CHECK(group_size % 8 == 0 || group_size >= width, "group size must be a multiple of 8 or cover the row, got ",
              group_size);
}

// x: [rows, in] fp32, packed as dequantize_int4, scales [out, groups] fp32 or fp16, zeros absent or as the scales
// -> y: [rows, out] fp32. y = x times the W4A16 weights, x taken as 16-bit fixed point per 32 columns
// (DigitActivations), for decode's few rows. group_size: a multiple of 8, or one group a row.
at::Tensor int4_digits_matmul(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, int64_t group_size) {
  const at::Tensor x = input(x_in, at::kFloat, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  check_int4_digits(x.size(1), packed, scales, zeros, group_size);
  at::Tensor y = at::empty({x.size(0), packed.size(0)}, x.options());
  int4_digits_matmul_into(x.data_ptr<float>(), x.size(0), x.size(1), packed, scales, zeros, group_size,
                          y.data_ptr<float>(), packed.size(0), Epilogue{});
  return y;
}

void int4_digits_matmul_into(const float* x, int64_t rows, int64_t width, const at::Tensor& packed,
                             const at::Tensor& scales, const c10::optional<at::Tensor>& zeros, int64_t group_size,
                             float* y, int64_t ldy, const Epilogue& epilogue) {
  if (scales.scalar_type() == at::kHalf) {
    digits_matmul<at::Half>(x, rows, width, packed, scales, zeros, group_size, y, ldy, epilogue);
  } else {
    digits_matmul<float>(x, rows, width, packed, scales, zeros, group_size, y, ldy, epilogue);
  }
}

// ==== W4A16 on integer dot products from weight tiles: one sequential stream a thread ====

namespace {

// The digits kernel above reads a thread's channels as four far streams of codes and four of scales. Repacked at
// load into tiles of 8 channels x 128 columns, each tile the 8 channels' 64 bytes of codes (channel c at byte 64c,
// in the stored byte order) followed by their scales for those 128 columns, a thread's channels are one run of
// memory that the prefetchers follow, with the scales inline. The sums are the digits kernel's, bit for bit: the
// same exact int32 per 8 columns, the same products of weight and activation scales, the same order. One row, two
// threads, 2 MiB pages, Llama-3.2-1B's layers at g32 on the AMD EPYC, 7-11 interleaved rounds (the read probe at
// 34 GB/s): a first scratch version 29-31 GB/s against the digits kernel's 25-27, this one 26-27 (the difference
// not found); in the engine's 1B decode step 24.8-27.3 ms a token against 26.9-29.6 (docs/RESULTS.md, "W4A16
// weight tiles"). The tiles must sit on 2 MiB pages as the weights do: on 4 KiB pages the step took 32.7 ms.
constexpr int64_t kTileWidth = 8;
constexpr int64_t kTileCodes = kTileWidth * 64;
constexpr int64_t kTilesAhead = 4;  // tiles prefetched ahead of the one being read

// Scales a channel keeps per 128-column block: one per 32 or 64 columns for groups of 32 or 64, else one (groups
// that are multiples of 128 columns, or one group a row): slot k of S covers lanes [16k / S, 16(k + 1) / S).
int64_t tile_scale_slots(int64_t group_size, int64_t width) {
  if (group_size >= width || group_size % kDigitBlock == 0) return 1;
  TORCH_CHECK(group_size == 32 || group_size == 64,
              "weight tiles take groups of 32 or 64 columns, multiples of 128, or one a row; got ", group_size);
  return kDigitBlock / group_size;
}

int64_t tile_bytes(int64_t slots, int64_t scale_bytes) { return kTileCodes + kTileWidth * slots * scale_bytes; }

template <typename Scale>
void pack_tiles(const uint8_t* packed, const Scale* scales, int64_t out, int64_t width, int64_t row_bytes,
                int64_t groups, int64_t group_size, int64_t slots, uint8_t* tiles) {
  const int64_t blocks = (width + kDigitBlock - 1) / kDigitBlock, bytes = tile_bytes(slots, sizeof(Scale));
  at::parallel_for(0, (out + kTileWidth - 1) / kTileWidth, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* tile = tiles + (t * blocks + b) * bytes;
        Scale* tile_scales = reinterpret_cast<Scale*>(tile + kTileCodes);
        for (int64_t c = 0; c < kTileWidth; ++c) {
          const int64_t o = t * kTileWidth + c, start = b * 64;
          const int64_t count = o < out ? std::clamp<int64_t>(row_bytes - start, 0, 64) : 0;
          if (count > 0) std::memcpy(tile + c * 64, packed + o * row_bytes + start, count);
          for (int64_t k = 0; k < slots; ++k) {
            const int64_t group = std::min(groups - 1, (b * kDigitBlock + k * kDigitBlock / slots) / group_size);
            tile_scales[c * slots + k] = o < out ? scales[o * groups + group] : Scale(0.0f);
          }
        }
      }
  });
}

#if defined(CPU_CAPABILITY_AVX512)
// The 8 channels' scales of a tile (8 * slots of them) widened to fp32: values [0, 16) in first, [16, 32) in second.
inline void tile_scales(const float* p, int64_t count, __m512& first, __m512& second) {
  first = _mm512_loadu_ps(p);
  second = count > 16 ? _mm512_loadu_ps(p + 16) : first;
}
inline void tile_scales(const at::Half* p, int64_t count, __m512& first, __m512& second) {
  const auto* q = reinterpret_cast<const __m256i*>(p);
  first = count >= 16 ? _mm512_cvtph_ps(_mm256_loadu_si256(q))
                      : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << count) - 1), q));
  second = count > 16 ? _mm512_cvtph_ps(_mm256_loadu_si256(q + 1)) : first;
}

// sums[c] for the 8 channels of `tiles` (their row of blocks) and row `row` of x, as int4_digit_channels sums them.
template <int64_t Slots, typename Scale>
void tile_channels(const uint8_t* tiles, const DigitActivations& x, int64_t row, float* sums) {
  constexpr int64_t bytes = kTileCodes + kTileWidth * Slots * static_cast<int64_t>(sizeof(Scale));
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  // lane m of channel c reads slot c * Slots + m * Slots / 16 of the 8 * Slots scales
  __m512i index[kTileWidth];
  for (int64_t c = 0; c < kTileWidth; ++c) {
    alignas(64) int32_t lanes[16];
    for (int64_t m = 0; m < 16; ++m) lanes[m] = static_cast<int32_t>((c * Slots + m * Slots / 16) % 16);
    index[c] = _mm512_load_si512(lanes);
  }
  __m512 total[kTileWidth];
  for (int64_t c = 0; c < kTileWidth; ++c) total[c] = _mm512_setzero_ps();
  const uint8_t* tile = tiles;
  for (int64_t b = 0; b < x.blocks; ++b, tile += bytes) {
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(tile + kTilesAhead * bytes + line, 0, 3);
    const int64_t base = row * x.blocks + b;
    const int8_t* d = x.digits.data() + base * 256;
    const __m512i high_even = _mm512_loadu_si512(d), high_odd = _mm512_loadu_si512(d + 64);
    const __m512i low_even = _mm512_loadu_si512(d + 128), low_odd = _mm512_loadu_si512(d + 192);
    const __m512i minus_eight = _mm512_loadu_si512(x.minus_eight.data() + base * 16);
    const __m512 activation_scale = _mm512_loadu_ps(x.lane_scales.data() + base * 16);
    __m512 scales[2];
    tile_scales(reinterpret_cast<const Scale*>(tile + kTileCodes), kTileWidth * Slots, scales[0], scales[1]);
    for (int64_t c = 0; c < kTileWidth; ++c) {
      const __m512i bytes_of = _mm512_loadu_si512(tile + c * 64);
      const __m512i even = _mm512_and_si512(bytes_of, low_mask);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(bytes_of, 4), low_mask);
      const __m512i high = dot4(dot4(_mm512_setzero_si512(), even, high_even), odd, high_odd);
      const __m512i low = dot4(dot4(minus_eight, even, low_even), odd, low_odd);
      const __m512i exact = _mm512_add_epi32(_mm512_slli_epi32(high, 8), low);
      const __m512 weight_scale = _mm512_permutexvar_ps(index[c], scales[c * Slots / 16]);
      total[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(weight_scale, activation_scale), total[c]);
    }
  }
  for (int64_t c = 0; c < kTileWidth; ++c) sums[c] = _mm512_reduce_add_ps(total[c]);
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// tile_channels for AVX2: the same exact int32 per 8 columns, each 64 bytes of a channel's codes as two halves of
// 8 lanes; a lane's weight scale is one of the tile's (at most two distinct ones a half). The fp32 sums run in
// another order than the AVX-512 path's (two 8-lane accumulators, then their lanes), so the bits differ between the
// two builds; each is deterministic.
template <int64_t Slots, typename Scale>
void tile_channels_avx2(const uint8_t* tiles, const DigitActivations& x, int64_t row, float* sums) {
  constexpr int64_t bytes = kTileCodes + kTileWidth * Slots * static_cast<int64_t>(sizeof(Scale));
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  __m256 total[kTileWidth];
  for (int64_t c = 0; c < kTileWidth; ++c) total[c] = _mm256_setzero_ps();
  const uint8_t* tile = tiles;
  for (int64_t b = 0; b < x.blocks; ++b, tile += bytes) {
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(tile + kTilesAhead * bytes + line, 0, 3);
    const int64_t base = row * x.blocks + b;
    const int8_t* d = x.digits.data() + base * 256;
    const Scale* stored = reinterpret_cast<const Scale*>(tile + kTileCodes);
    float scales[kTileWidth * Slots];
    for (int64_t k = 0; k < kTileWidth * Slots; ++k) scales[k] = widen(stored[k]);
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t at = 32 * half;
      const auto digits_at = [&](int64_t section) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + section * 64 + at));
      };
      const __m256i high_even = digits_at(0), high_odd = digits_at(1), low_even = digits_at(2), low_odd = digits_at(3);
      const __m256i minus_eight =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.minus_eight.data() + base * 16 + 8 * half));
      const __m256 activation_scale = _mm256_loadu_ps(x.lane_scales.data() + base * 16 + 8 * half);
      for (int64_t c = 0; c < kTileWidth; ++c) {
        const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + c * 64 + at));
        const __m256i even = _mm256_and_si256(codes, low_mask);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low_mask);
        const __m256i high = dot4_avx2(dot4_avx2(_mm256_setzero_si256(), even, high_even), odd, high_odd);
        const __m256i low = dot4_avx2(dot4_avx2(minus_eight, even, low_even), odd, low_odd);
        const __m256i exact = _mm256_add_epi32(_mm256_slli_epi32(high, 8), low);
        // lanes 8 half + j, j < 4 and j >= 4, read slots (8 half + j) * Slots / 16
        const float first = scales[c * Slots + (8 * half) * Slots / 16];
        const float second = scales[c * Slots + (8 * half + 4) * Slots / 16];
        const __m256 weight_scale = _mm256_set_m128(_mm_set1_ps(second), _mm_set1_ps(first));
        total[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(weight_scale, activation_scale), total[c]);
      }
    }
  }
  for (int64_t c = 0; c < kTileWidth; ++c) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, total[c]);
    float sum = 0.0f;
    for (const float lane : lanes) sum += lane;
    sums[c] = sum;
  }
}
#endif

// The same sums one value at a time, for CPUs without AVX2: int4_digit_channel_scalar's order, from the tiles.
template <typename Scale>
void tile_channels_scalar(const uint8_t* tiles, int64_t slots, const DigitActivations& x, int64_t row,
                          float* sums) {
  const int64_t bytes = tile_bytes(slots, sizeof(Scale));
  for (int64_t c = 0; c < kTileWidth; ++c) {
    float total = 0.0f;
    for (int64_t b = 0; b < x.blocks; ++b) {
      const uint8_t* tile = tiles + b * bytes;
      const Scale* scales = reinterpret_cast<const Scale*>(tile + kTileCodes) + c * slots;
      const int64_t base = row * x.blocks + b;
      const int8_t* d = x.digits.data() + base * 256;
      for (int64_t m = 0; m < 16; ++m) {
        int32_t high = 0, low = x.minus_eight[base * 16 + m];
        for (int64_t j = 4 * m; j < 4 * m + 4; ++j) {
          const uint8_t byte = tile[c * 64 + j];
          const int32_t even = byte & 0x0F, odd = byte >> 4;
          high += even * d[j] + odd * d[64 + j];
          low += even * d[128 + j] + odd * d[192 + j];
        }
        const float weight_scale = widen(scales[m * slots / 16]);
        total = std::fma(static_cast<float>(256 * high + low), weight_scale * x.lane_scales[base * 16 + m], total);
      }
    }
    sums[c] = total;
  }
}

template <typename Scale>
void tiles_matmul(const float* x, int64_t rows, int64_t width, const at::Tensor& tiles, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& zeros, int64_t group_size, int64_t out, float* y, int64_t ldy,
                  const Epilogue& epilogue) {
  const int64_t slots = tile_scale_slots(group_size, width), blocks = tiles.size(1), bytes = tiles.size(2);
  // the zero points' term as the digits kernel takes it off (its weights' scales and zeros, row by row)
  const DigitWeights<Scale> w{nullptr, scales.data_ptr<Scale>(), zeros.has_value() ? zeros->data_ptr<Scale>() : nullptr,
                              out, width, scales.size(1), 0};
  thread_local DigitActivations kept;
  DigitActivations local;
  DigitActivations& digits = llmeasyquant::team::current != nullptr ? kept : local;
  on_own([&] { digits.fill(x, rows, width, std::min(group_size, width), w.groups, w.zeros != nullptr); });
  const uint8_t* base = tiles.data_ptr<uint8_t>();
  for_channel_ranges((out + kTileWidth - 1) / kTileWidth, [&](int64_t begin, int64_t end) {
    float sums[kTileWidth];
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* row_of_tiles = base + t * blocks * bytes;
      for (int64_t r = 0; r < rows; ++r) {
#if defined(CPU_CAPABILITY_AVX512)
        if (slots == 4)
          tile_channels<4, Scale>(row_of_tiles, digits, r, sums);
        else if (slots == 2)
          tile_channels<2, Scale>(row_of_tiles, digits, r, sums);
        else
          tile_channels<1, Scale>(row_of_tiles, digits, r, sums);
#elif defined(CPU_CAPABILITY_AVX2)
        if (slots == 4)
          tile_channels_avx2<4, Scale>(row_of_tiles, digits, r, sums);
        else if (slots == 2)
          tile_channels_avx2<2, Scale>(row_of_tiles, digits, r, sums);
        else
          tile_channels_avx2<1, Scale>(row_of_tiles, digits, r, sums);
#else
        tile_channels_scalar<Scale>(row_of_tiles, slots, digits, r, sums);
#endif
        for (int64_t c = 0; c < kTileWidth && t * kTileWidth + c < out; ++c) {
          const int64_t o = t * kTileWidth + c;
          put(epilogue, y + r * ldy, o,
              w.zeros == nullptr ? sums[c] : sums[c] - zero_offset(w, o, digits.group_sums.data() + r * w.groups));
        }
      }
    }
  });
}

}  // namespace

at::Tensor int4_tiles_pack(const at::Tensor& packed, const at::Tensor& scales, int64_t in_features,
                           int64_t group_size) {
  check_int4_digits(in_features, packed, scales, c10::nullopt, group_size);
  const int64_t slots = tile_scale_slots(group_size, in_features), out = packed.size(0);
  const int64_t blocks = (in_features + kDigitBlock - 1) / kDigitBlock;
  const int64_t bytes = tile_bytes(slots, scales.element_size());
  at::Tensor tiles = at::zeros({(out + kTileWidth - 1) / kTileWidth, blocks, bytes}, packed.options());
  if (scales.scalar_type() == at::kHalf)
    pack_tiles(packed.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), out, in_features, packed.size(1),
               scales.size(1), group_size, slots, tiles.data_ptr<uint8_t>());
  else
    pack_tiles(packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), out, in_features, packed.size(1),
               scales.size(1), group_size, slots, tiles.data_ptr<uint8_t>());
  return tiles;
}

void check_int4_tiles(int64_t width, const at::Tensor& tiles, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& zeros, int64_t group_size, int64_t out_features) {
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf,
              "scales must be float32 or float16, got ", scales.scalar_type());
  check_cpu(tiles, at::kByte, "tiles");
  check_cpu(scales, scales.scalar_type(), "scales");
  if (zeros.has_value()) check_cpu(*zeros, scales.scalar_type(), "zeros (of the scales' dtype)");
  const int64_t groups = group_size >= width ? 1 : (width + group_size - 1) / group_size;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == out_features && scales.size(1) == groups, "scales must be [",
              out_features, ", ", groups, "]");
  if (zeros.has_value()) TORCH_CHECK(zeros->sizes() == scales.sizes(), "zeros must have the scales' shape");
  const int64_t slots = tile_scale_slots(group_size, width);
  TORCH_CHECK(tiles.dim() == 3 && tiles.size(0) == (out_features + kTileWidth - 1) / kTileWidth &&
                  tiles.size(1) == (width + kDigitBlock - 1) / kDigitBlock &&
                  tiles.size(2) == tile_bytes(slots, scales.element_size()),
              "tiles must be int4_tiles_pack's for ", out_features, " channels of ", width, " columns at group size ",
              group_size, " with ", scales.scalar_type(), " scales");
}

void int4_tiles_matmul_into(const float* x, int64_t rows, int64_t width, const at::Tensor& tiles,
                            const at::Tensor& scales, const c10::optional<at::Tensor>& zeros, int64_t group_size,
                            int64_t out_features, float* y, int64_t ldy, const Epilogue& epilogue) {
  if (scales.scalar_type() == at::kHalf)
    tiles_matmul<at::Half>(x, rows, width, tiles, scales, zeros, group_size, out_features, y, ldy, epilogue);
  else
    tiles_matmul<float>(x, rows, width, tiles, scales, zeros, group_size, out_features, y, ldy, epilogue);
}

// x: [rows, in] fp32, tiles from int4_tiles_pack, scales and zeros as int4_digits_matmul's -> [rows, out] fp32, the
// digits kernel's sums bit for bit.
at::Tensor int4_tiles_matmul(const at::Tensor& x_in, const at::Tensor& tiles, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& zeros, int64_t group_size) {
  const at::Tensor x = input(x_in, at::kFloat, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  const int64_t out = scales.size(0);
  check_int4_tiles(x.size(1), tiles, scales, zeros, group_size, out);
  at::Tensor y = at::empty({x.size(0), out}, x.options());
  int4_tiles_matmul_into(x.data_ptr<float>(), x.size(0), x.size(1), tiles, scales, zeros, group_size, out,
                         y.data_ptr<float>(), out, Epilogue{});
  return y;
}

// ==== W8A8 for a few rows: int8 weights x int8 activations, reading the stored codes ====

namespace {

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__)
// VNNI multiplies unsigned by signed bytes, so the activations go in as u = qx + 128 (one XOR with 0x80) and
// 128 * sum(q) is taken off each channel's sum afterwards: sum(u q) - 128 sum(q) = sum(qx q), exact in int32 (one
// lane's four products are at most 4 * 255 * 128, and a row of `in` columns sums to at most 32640 * in: exact for
// in < 65,793, as the int32 accumulation of torch._int_mm). Masked loads zero the weights past the last column,
// so the tail adds nothing whatever the activations there. sums[r * S + s] for S channels (stride codes apart) and
// R rows of qx (ldx apart), as int8_dot.
template <int S, int R>
void w8a8_dot(const int8_t* w, int64_t stride, const int8_t* qx, int64_t ldx, int64_t width, int32_t* sums) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[R][S];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_si512();
  for (int64_t i = 0; i < width; i += 64) {
    const __mmask64 mask = width - i >= 64 ? ~__mmask64{0} : (__mmask64{1} << (width - i)) - 1;
    __m512i u[R];
    for (int r = 0; r < R; ++r) u[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, qx + r * ldx + i), flip);
    for (int s = 0; s < S; ++s) {
      const __m512i weights = _mm512_maskz_loadu_epi8(mask, w + s * stride + i);
      for (int r = 0; r < R; ++r) acc[r][s] = _mm512_dpbusd_epi32(acc[r][s], u[r], weights);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) sums[r * S + s] = _mm512_reduce_add_epi32(acc[r][s]);
}
#elif defined(CPU_CAPABILITY_AVX2)
// AVX2: u = qx + 128 and the codes widened to 16 bits, 16 columns a step, and vpmaddwd's pairs of products summed
// into int32 lanes (each pair at most 2 * 255 * 128: exact; vpmaddubsw's 16-bit pair sums would saturate on u).
// The same int32 sums as the VNNI path: sum(u q), before the 128 * sum(q) correction; columns past a multiple of 16
// one at a time.
template <int S, int R>
void w8a8_dot(const int8_t* w, int64_t stride, const int8_t* qx, int64_t ldx, int64_t width, int32_t* sums) {
  const __m256i offset = _mm256_set1_epi16(128);
  __m256i acc[R][S];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) acc[r][s] = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 16 <= width; i += 16) {
    __m256i u[R];
    for (int r = 0; r < R; ++r)
      u[r] = _mm256_add_epi16(
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qx + r * ldx + i))), offset);
    for (int s = 0; s < S; ++s) {
      const __m256i weights =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + s * stride + i)));
      for (int r = 0; r < R; ++r) acc[r][s] = _mm256_add_epi32(acc[r][s], _mm256_madd_epi16(u[r], weights));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) {
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[r][s]);
      int32_t sum = 0;
      for (const int32_t lane : lanes) sum += lane;
      for (int64_t k = i; k < width; ++k) sum += (static_cast<int32_t>(qx[r * ldx + k]) + 128) * w[s * stride + k];
      sums[r * S + s] = sum;
    }
}
#else
// The same sums one value at a time (CPUs without AVX2; the registry's timing then prefers torch._int_mm), in the
// form the vector path leaves them: sum(u q) with u = qx + 128, before the 128 * sum(q) correction.
template <int S, int R>
void w8a8_dot(const int8_t* w, int64_t stride, const int8_t* qx, int64_t ldx, int64_t width, int32_t* sums) {
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) {
      int32_t sum = 0;
      for (int64_t i = 0; i < width; ++i) sum += (static_cast<int32_t>(qx[r * ldx + i]) + 128) * w[s * stride + i];
      sums[r * S + s] = sum;
    }
}
#endif

}  // namespace

// qx: [rows, in] int8, x_scales: [rows, 1] fp32, q: [out, in] int8, w_scales: [out] fp32, w_sums: [out] int32
// (each channel's sum of codes) -> y: [rows, out] fp32
// y[r, o] = float(sum_i qx[r, i] q[o, i]) * x_scales[r] * w_scales[o]: the exact int32 product of torch._int_mm
// scaled in dequantize_rows' order, so the same bits as the W8A8 kernel built on them. For decode's few rows: it
// streams the stored [out, in] codes once (4 channels per pass, up to 4 rows sharing each load), where oneDNN's
// GEMM is built for many rows.
at::Tensor int8_int8_matmul(const at::Tensor& qx_in, const at::Tensor& x_scales_in, const at::Tensor& q_in,
                            const at::Tensor& w_scales_in, const at::Tensor& w_sums_in) {
  const at::Tensor qx = input(qx_in, at::kChar, "qx");
  const at::Tensor x_scales = input(x_scales_in, at::kFloat, "x_scales");
  const at::Tensor q = input(q_in, at::kChar, "q");
  const at::Tensor w_scales = input(w_scales_in, at::kFloat, "w_scales");
  const at::Tensor w_sums = input(w_sums_in, at::kInt, "w_sums");
  TORCH_CHECK(qx.dim() == 2 && q.dim() == 2 && qx.size(1) == q.size(1), "qx [rows, in] and q [out, in] must share in");
  TORCH_CHECK(x_scales.numel() == qx.size(0), "x_scales must have one value per row");
  TORCH_CHECK(w_scales.numel() == q.size(0) && w_sums.numel() == q.size(0),
              "w_scales and w_sums must have one value per output channel");
  const int64_t rows = qx.size(0), width = qx.size(1), out = q.size(0);
  at::Tensor y = at::empty({rows, out}, x_scales.options());
  int8_int8_matmul_into(qx.data_ptr<int8_t>(), x_scales.data_ptr<float>(), rows, width, q.data_ptr<int8_t>(),
                        w_scales.data_ptr<float>(), w_sums.data_ptr<int32_t>(), out, y.data_ptr<float>(), out,
                        Epilogue{});
  return y;
}

void int8_int8_matmul_into(const int8_t* qx, const float* x_scales, int64_t rows, int64_t width, const int8_t* q,
                           const float* w_scales, const int32_t* w_sums, int64_t out, float* y, int64_t ldy,
                           const Epilogue& epilogue) {
  for_channel_streams(out, [&](int64_t o, int64_t span, auto streams) {
    constexpr int S = decltype(streams)::value;
    for_row_groups(rows, [&](auto group, int64_t r) {
      constexpr int R = decltype(group)::value;
      int32_t sums[R * S];
      w8a8_dot<S, R>(q + o * width, span * width, qx + r * width, width, width, sums);
      for (int k = 0; k < R; ++k)
        for (int c = 0; c < S; ++c) {
          const int64_t channel = o + c * span;
          const int32_t exact = sums[k * S + c] - 128 * w_sums[channel];
          put(epilogue, y + (r + k) * ldy, channel,
              static_cast<float>(exact) * x_scales[r + k] * w_scales[channel]);
        }
    });
  });
}

// ==== W8A8 on the fp32 GEMM: for CPUs whose integer GEMM is slow ====

// y[r, o] = float(sum_i qx[r, i] q[o, i]) * x_scales[r] * w_scales[o] with the sum taken by PyTorch's fp32 GEMM on the
// codes widened to fp32, kFloatCodeChunk values of them at a time (no fp32 copy of the weights is kept). Products of
// int8 codes are exact in fp32 and so is every partial sum up to 2^24 (1040 products of extreme codes); beyond, each
// addition rounds (relative 2^-24), far below the rounding of the activation codes themselves. The scaling is
// dequantize_rows' (the same two products in the same order). Where AVX-512 VNNI is missing, oneDNN's int8 GEMM
// behind torch._int_mm ran 128 rows of 576 x 3072 at about 4 GFLOP/s (issue 54's AVX2 EPYC): this is the fast
// candidate there.
constexpr int64_t kFloatCodeChunk = 1 << 20;

at::Tensor int8_float_matmul(const at::Tensor& qx_in, const at::Tensor& x_scales_in, const at::Tensor& q_in,
                             const at::Tensor& w_scales_in) {
  const at::Tensor qx = input(qx_in, at::kChar, "qx");
  const at::Tensor x_scales = input(x_scales_in, at::kFloat, "x_scales");
  const at::Tensor q = input(q_in, at::kChar, "q");
  const at::Tensor w_scales = input(w_scales_in, at::kFloat, "w_scales");
  TORCH_CHECK(qx.dim() == 2 && q.dim() == 2 && qx.size(1) == q.size(1), "qx [rows, in] and q [out, in] must share in");
  TORCH_CHECK(x_scales.numel() == qx.size(0), "x_scales must have one value per row");
  TORCH_CHECK(w_scales.numel() == q.size(0), "w_scales must have one value per output channel");
  const int64_t rows = qx.size(0), width = qx.size(1), out = q.size(0);
  const at::Tensor x = qx.to(at::kFloat);
  at::Tensor y = at::empty({rows, out}, x_scales.options());
  const int64_t channels = std::max<int64_t>(1, kFloatCodeChunk / std::max<int64_t>(1, width));
  for (int64_t first = 0; first < out; first += channels) {
    const int64_t last = std::min(out, first + channels);
    y.slice(1, first, last).copy_(at::mm(x, q.slice(0, first, last).to(at::kFloat).t()));
  }
  return y.mul_(x_scales.reshape({rows, 1})).mul_(w_scales.reshape({1, out}));
}

// ==== W4A16 on a non-uniform grid: the weights levels[u] * scale ====

// packed, scales as dequantize_int4 (no zeros), levels: [16] or [out, 16] fp32 -> w: [out, in] fp32, equal bit for
// bit to the reference's levels[code + 8] * scale.
at::Tensor dequantize_int4_levels(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& levels_in,
                                  int64_t in_features, int64_t group_size) {
  const at::Tensor levels = input(levels_in, at::kFloat, "levels");
  Int4Weights weights = int4_weights_of(packed, scales, c10::nullopt, in_features, group_size);
  return dequantize_weights(weights.with_levels(levels), in_features, scales);
}

// x: [rows, in] fp32, packed, scales, levels as dequantize_int4_levels -> y: [rows, out] fp32; int4_weight_matmul
// with each group's table made from the levels instead of the codes.
at::Tensor int4_levels_matmul(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales,
                              const at::Tensor& levels_in, int64_t group_size) {
  const at::Tensor x = input(x_in, at::kFloat, "x");
  const at::Tensor levels = input(levels_in, at::kFloat, "levels");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  Int4Weights weights = int4_weights_of(packed, scales, c10::nullopt, x.size(1), group_size);
  return int4_matmul_weights(x, weights.with_levels(levels));
}
