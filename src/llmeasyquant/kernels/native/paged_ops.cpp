// Paged KV-cache operators of the serving engine's continuous batching: store a step's keys and values into a pool
// of blocks and attend over the pool, for a float pool and for the SimQuant-coded pool (kernels/native.py builds this
// file with the others; bindings.cpp registers the operators; runtime/paged_reference.py is the PyTorch oracle with
// the same names, arguments and results).
//
// Paging. A layer's cache is a pool of N blocks of B positions. A running sequence has a slot s in 0..S-1 and a block
// table row tables[s] (int32 [M]): its position p lives in block tables[s, p / B] at offset p % B, flat slot
// tables[s, p / B] * B + p % B. A step runs `rows` query rows, possibly of different sequences: row r belongs to
// sequence row_seq[r], sits at position positions[r], is stored at flat slot slots[r] and attends over lengths[r] =
// positions[r] + 1 positions (all int64). Rows of one sequence come in increasing position order (a prefill chunk).
// A step first stores every row's key and value, then runs attention for every row: a row sees the pool as the whole
// step left it.
//
// Float pool (keys after rotary): key_pool, value_pool [N, kv_heads, B, dim], fp32 or fp16, read as fp32 and rounded
// to the pool's type on write.
//
// Quantized pool (the SimQuant coding of nn/kv/coding.py and nn/kv/key_blocks.py, uniform levels): `bits` in
// {2, 3, 4, 8} for keys and values; a packed vector holds P = ceil(dim / 8) * bits bytes (dim for 8 bits) laid out as
// primitives.pack_bits lays them out (a bit stream, least significant bits first). A list of 11 tensors, in order:
//    0 key_codes            [N, kv_heads, B, P] uint8   pre-rotary keys of complete blocks, per channel on the block's
//    1 key_lo               [N, kv_heads, dim] fp16     range (KeyBlocks online mode): lo = min, scale = (max - lo) /
//    2 key_scale            [N, kv_heads, dim] fp16     (2^bits - 1), at least 2^-24
//    3 value_codes          [N, kv_heads, B, P] uint8   values per token as coding.code_per_token codes them: on the
//    4 value_scale          [N, kv_heads, B] fp16       vector's range widened to hold 0, the zero point in one byte
//    5 value_zero           [N, kv_heads, B] uint8      (coding._zero_steps parts of a step), after setting the n_out
//    6 value_outlier_values [N, kv_heads, B, n_out] fp16  outliers coding._range_shrinking picks apart (n_out may
//    7 value_outlier_index  [N, kv_heads, B, n_out] uint8  be 0)
//    8 sink_keys            [S, kv_heads, sinks, dim] fp16  post-rotary keys of positions < sinks (sinks may be 0)
//    9 sink_values          [S, kv_heads, sinks, dim] fp16
//   10 residual_keys        [S, kv_heads, B, dim] fp16      pre-rotary keys of the sequence's incomplete block, at p % B
// Positions p < sinks live only in the sink buffers (their slots in block 0 stay unused, and block 0's key range
// covers only its positions >= sinks). A position p >= sinks has its value coded at once into its slot and its key
// (after the key norm, before rotary) written to residual_keys; when p is its block's last position, the block's keys
// (positions max(sinks, block start) .. block end - 1) are coded from residual_keys into the block's codes and range.
// Attention reads the sinks from their buffers, complete blocks from their codes and the sequence's last, incomplete
// block from residual_keys (a sequence's stored length is the largest lengths[r] of its rows in the call), and
// rotates keys by their position's row of cos_table / sin_table [max_positions, dim]. It reads the codes directly,
// with no dequantized copy of the cache: keys are decoded and rotated in registers as the scores read them, and the
// values of up to 64 positions are decoded into a per-thread buffer of a few KiB that the weighted sums read at once.
//
// Attention on both pools: a task is a tile of rows of one sequence (a decode row, or up to 32 query vectors of a
// prefill chunk), its kv head(s) and a piece of its positions; scores of a batch of up to 64 positions go through an
// online softmax; long sequences are split into pieces whose softmax states are merged (flash-decoding), so a few
// decode rows still keep every thread busy.

#include "common.h"
#include "operators.h"
#include "row_ops.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kLanes = Vec::size();
constexpr float kMinScale = 5.9604644775390625e-08f;  // 2^-24, primitives.MIN_SCALE
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The hot loops hold their vectors in the GCC/Clang vector extension's type, not in at::vec::Vectorized: GCC does not
// keep arrays of Vectorized in registers across a loop (it writes every element back to the stack each iteration,
// which made the weighted sums store-bound); it does keep these. Arithmetic is elementwise, a * b + c contracts to an
// FMA, and a scalar operand is broadcast.
#if !defined(CPU_CAPABILITY_AVX512) && !defined(CPU_CAPABILITY_AVX2)
// Without AVX the 32-byte type is passed in memory; every function using it is internal and inlined, so GCC's note
// that this ABI differs from an AVX build's concerns nothing here.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
using Lanes = float __attribute__((vector_size(kLanes * sizeof(float))));
static_assert(sizeof(Lanes) == sizeof(Vec), "Lanes and Vec must have the same width");

inline Lanes lanes_of(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return static_cast<__m512>(v);
#elif defined(CPU_CAPABILITY_AVX2)
  return static_cast<__m256>(v);
#else
  Lanes out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#endif
}
inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline Lanes load_lanes(const at::Half* p) {
  Vec v;
  at::vec::load_to_float(p, v);
  return lanes_of(v);
}
inline void store_lanes(const Lanes& v, float* p) { std::memcpy(p, &v, sizeof v); }

// ==== rows: fp16 loads, stores, norms of a qkv row (norm_row, rope_row, dot: row_ops.h) ====

void half_row_to_float(const at::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Vec v;
    at::vec::load_to_float(src + i, v);
    v.store(dst + i);
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Asks for the cache lines of [p, p + bytes): a unit's blocks lie anywhere in the pool, so the hardware prefetcher
// cannot see the next one coming; asked for ahead, they arrive while the current unit is computed.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

// Float pool blocks a task asks for ahead of the one it computes.
constexpr int64_t kPrefetchBlocks = 4;

template <typename T>
void store_row(const float* src, int64_t n, T* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// The query heads then the key heads of one qkv row [(heads + 2 kv_heads) * dim], each RMS-normalised when norm
// weights are given: qk [(heads + kv_heads) * dim], not yet rotated.
void normalised_row(const float* row, int64_t heads, int64_t kv_heads, int64_t dim, const float* q_norm,
                    const float* k_norm, float q_eps, float k_eps, float* qk) {
  std::copy_n(row, (heads + kv_heads) * dim, qk);
  if (q_norm == nullptr) return;
  for (int64_t h = 0; h < heads + kv_heads; ++h) {
    const bool query = h < heads;
    norm_row(qk + h * dim, query ? q_norm : k_norm, query ? q_eps : k_eps, dim, qk + h * dim);
  }
}

// ==== packed codes ====

// Code i of a packed vector: `bits` bits at bit i * bits of the byte stream, least significant first.
inline uint32_t code_at(const uint8_t* packed, int64_t i, int bits) {
  if (bits == 8) return packed[i];
  const int64_t bit = i * bits, byte = bit / 8, shift = bit % 8;
  uint32_t word = packed[byte];
  if (shift + bits > 8) word |= static_cast<uint32_t>(packed[byte + 1]) << 8;
  return (word >> shift) & ((1u << bits) - 1u);
}

#if defined(CPU_CAPABILITY_AVX512)
// AVX-512, BITS <= 4: lane j of the result holds code i + j in its low BITS bits (the bits above it are the next
// codes'), i a multiple of 16. Runs of 8 codes fill BITS bytes, so the 16 codes lie in 2 * BITS bytes: each lane takes
// the 32-bit word holding its code and shifts it by its own amount. Codes become floats through a 16-entry table
// (vpermps reads the low 4 bits of each lane): no mask, no conversion.
template <int BITS>
inline __m512i code_lanes(const uint8_t* packed, int64_t i) {
  static_assert(BITS <= 4, "8-bit codes are widened, not looked up");
  if constexpr (BITS == 2) {  // 16 codes in one 32-bit word
    uint32_t word;
    std::memcpy(&word, packed + i / 4, 4);
    return _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int32_t>(word)),
                             _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30));
  } else if constexpr (BITS == 4) {  // 16 codes in two 32-bit words: lanes 0-7 take the first, 8-15 the second
    const __m512i words = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + i / 2))));
    return _mm512_srlv_epi32(words, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28));
  } else {  // 3 bits: lanes 0-7 in bits 0-23, lanes 8-15 in bits 24-47
    uint64_t word = 0;
    std::memcpy(&word, packed + i / 8 * 3, 6);
    const __m512i both = _mm512_inserti64x4(_mm512_set1_epi32(static_cast<int32_t>(word)),
                                            _mm256_set1_epi32(static_cast<int32_t>(word >> 24)), 1);
    return _mm512_srlv_epi32(both, _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21));
  }
}

// table[j] = the code in the low BITS bits of j, as a float.
template <int BITS>
inline __m512 code_table() {
  constexpr int m = (1 << BITS) - 1;
  return _mm512_setr_ps(0 & m, 1 & m, 2 & m, 3 & m, 4 & m, 5 & m, 6 & m, 7 & m, 8 & m, 9 & m, 10 & m, 11 & m, 12 & m,
                        13 & m, 14 & m, 15 & m);
}
#endif

// kLanes codes from code i on (i a multiple of kLanes) as floats.
template <int BITS>
inline Lanes codes_vec(const uint8_t* packed, int64_t i) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (BITS == 8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + i))));
  } else {
    return _mm512_permutexvar_ps(code_lanes<BITS>(packed, i), code_table<BITS>());
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (BITS == 8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + i))));
  } else {  // 8 codes in BITS bytes: each lane shifts the word by its own amount and masks
    uint32_t word = 0;
    std::memcpy(&word, packed + i / 8 * BITS, BITS);
    const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS);
    const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int32_t>(word)), shifts),
                                           _mm256_set1_epi32((1 << BITS) - 1));
    return _mm256_cvtepi32_ps(codes);
  }
#else
  Lanes codes;
  for (int64_t j = 0; j < kLanes; ++j) codes[j] = static_cast<float>(code_at(packed, i + j, BITS));
  return codes;
#endif
}

// out[i] = code i * scale[i] + lo[i] for the dim codes of one packed vector (per-channel ranges: keys).
template <int BITS>
void decode_channels(const uint8_t* packed, const float* lo, const float* scale, int64_t dim, float* out) {
  int64_t i = 0;
  for (; i + kLanes <= dim; i += kLanes)
    store_lanes(codes_vec<BITS>(packed, i) * load_lanes(scale + i) + load_lanes(lo + i), out + i);
  for (; i < dim; ++i) out[i] = static_cast<float>(code_at(packed, i, BITS)) * scale[i] + lo[i];
}

// out[i] = code i * scale + lo for the dim codes of one packed vector (one range: a value vector).
template <int BITS>
void decode_token(const uint8_t* packed, float lo, float scale, int64_t dim, float* out) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (BITS <= 4) {  // the vector's decoded values in a table: one lookup a lane
    const __m512 table = Lanes(code_table<BITS>()) * scale + lo;
    for (; i + kLanes <= dim; i += kLanes)
      _mm512_storeu_ps(out + i, _mm512_permutexvar_ps(code_lanes<BITS>(packed, i), table));
  }
#endif
  for (; i + kLanes <= dim; i += kLanes) store_lanes(codes_vec<BITS>(packed, i) * scale + lo, out + i);
  for (; i < dim; ++i) out[i] = static_cast<float>(code_at(packed, i, BITS)) * scale + lo;
}

// codes [dim] in [0, 2^bits) -> packed [P] as primitives.pack_bits (codes past dim count as 0).
void pack_codes(const uint8_t* codes, int64_t dim, int bits, uint8_t* packed) {
  if (bits == 8) {
    std::copy_n(codes, dim, packed);
    return;
  }
  for (int64_t g = 0; g * 8 < dim; ++g) {
    uint64_t word = 0;
    for (int64_t i = 0; i < 8 && g * 8 + i < dim; ++i) word |= static_cast<uint64_t>(codes[g * 8 + i]) << (i * bits);
    for (int b = 0; b < bits; ++b) packed[g * bits + b] = static_cast<uint8_t>(word >> (8 * b));
  }
}

// primitives.range_quantize with uniform levels: round((x - lo) / scale) half to even (as torch.round), clamped.
inline uint8_t quantize_value(float x, float lo, float scale, float top) {
  const float t = std::nearbyint((x - lo) / scale);
  return static_cast<uint8_t>(std::min(std::max(t, 0.0f), top));
}

// coding._zero_steps: the parts of a step the per-token zero point is stored in.
inline int64_t zero_steps(int bits) { return 256 >> bits; }

// coding._token_lo: the fp32 bottom of a per-token grid.
inline float token_lo(uint8_t zero, at::Half scale, int bits) {
  return -static_cast<float>(zero) / static_cast<float>(zero_steps(bits)) * static_cast<float>(scale);
}

// ==== SimQuant coding (the store side) ====

// Per-thread buffers of the coders.
struct CoderScratch {
  std::vector<int64_t> order;
  std::vector<uint8_t> codes;
  std::vector<char> outlier;
  std::vector<float> rows;
};

// One value vector x [dim] coded as coding.code_per_token codes it: the n_out values whose removal leaves the
// narrowest range set apart (coding._range_shrinking: the a smallest and n_out - a largest for the first best a, in
// that order), the range of the rest widened to hold 0 with its fp16 step and its zero point in 1/_zero_steps of a
// step (coding._token_range), every value (outliers too) rounded onto that grid.
void code_value(const float* x, int64_t dim, int bits, int64_t n_out, CoderScratch& scratch, uint8_t* packed,
                at::Half* scale_out, uint8_t* zero_out, at::Half* outlier_values, uint8_t* outlier_index) {
  scratch.outlier.assign(dim, 0);
  if (n_out > 0) {
    std::vector<int64_t>& order = scratch.order;
    order.resize(dim);
    for (int64_t i = 0; i < dim; ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [x](int64_t a, int64_t b) { return x[a] < x[b] || (x[a] == x[b] && a < b); });
    int64_t low = 0;
    float best = 0.0f;
    for (int64_t a = 0; a <= n_out; ++a) {
      const float span = x[order[dim - 1 - (n_out - a)]] - x[order[a]];
      if (a == 0 || span < best) best = span, low = a;
    }
    for (int64_t j = 0; j < n_out; ++j) {
      const int64_t index = j < low ? order[j] : order[dim - 1 - (j - low)];
      outlier_values[j] = static_cast<at::Half>(x[index]);
      outlier_index[j] = static_cast<uint8_t>(index);
      scratch.outlier[index] = 1;
    }
  }
  float lo = std::numeric_limits<float>::infinity(), hi = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < dim; ++i) {
    if (scratch.outlier[i]) continue;
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  lo = std::min(lo, 0.0f);
  hi = std::max(hi, 0.0f);
  const float top = static_cast<float>((1 << bits) - 1);
  const at::Half scale16 = static_cast<at::Half>(std::max((hi - lo) / top, kMinScale));
  const float parts = static_cast<float>(zero_steps(bits));
  const float zero = std::nearbyint(-lo / static_cast<float>(scale16) * parts);
  const uint8_t zero8 = static_cast<uint8_t>(std::min(std::max(zero, 0.0f), top * parts));
  const float grid_lo = token_lo(zero8, scale16, bits), scale = static_cast<float>(scale16);
  scratch.codes.resize(dim);
  for (int64_t i = 0; i < dim; ++i) scratch.codes[i] = quantize_value(x[i], grid_lo, scale, top);
  pack_codes(scratch.codes.data(), dim, bits, packed);
  *scale_out = scale16;
  *zero_out = zero8;
}

// The keys of one block, rows first..block-1 of its residual [block, dim] fp16, coded per channel on their own range
// as KeyBlocks codes a block online: lo16 = min (fp16), scale16 = ((max - lo16) / (2^bits - 1)) at least 2^-24
// (fp16), codes round((x - lo16) / scale16) clamped. Rows before `first` (sink positions) are left as they are.
void code_key_block(const at::Half* residual, int64_t first, int64_t block, int64_t dim, int bits, int64_t width,
                    CoderScratch& scratch, uint8_t* codes, at::Half* lo_out, at::Half* scale_out) {
  const int64_t count = block - first;
  scratch.rows.resize(count * dim + 2 * dim);
  float* keys = scratch.rows.data();
  float* lo = keys + count * dim;
  float* scale = lo + dim;
  for (int64_t t = 0; t < count; ++t) half_row_to_float(residual + (first + t) * dim, dim, keys + t * dim);
  const float top = static_cast<float>((1 << bits) - 1);
  for (int64_t c = 0; c < dim; ++c) {
    float low = keys[c], high = keys[c];
    for (int64_t t = 1; t < count; ++t) {
      low = std::min(low, keys[t * dim + c]);
      high = std::max(high, keys[t * dim + c]);
    }
    const at::Half lo16 = static_cast<at::Half>(low);
    const at::Half scale16 = static_cast<at::Half>(std::max((high - static_cast<float>(lo16)) / top, kMinScale));
    lo_out[c] = lo16;
    scale_out[c] = scale16;
    lo[c] = static_cast<float>(lo16);
    scale[c] = static_cast<float>(scale16);
  }
  scratch.codes.resize(dim);
  for (int64_t t = 0; t < count; ++t) {
    for (int64_t c = 0; c < dim; ++c) scratch.codes[c] = quantize_value(keys[t * dim + c], lo[c], scale[c], top);
    pack_codes(scratch.codes.data(), dim, bits, codes + (first + t) * width);
  }
}

// ==== attention: scores and weighted sums over a unit's rows ====

// The lane sums of kLanes vectors as one vector, sums[i] = the sum of v[i]'s lanes: a transpose-and-add tree, some 3
// shuffles and adds a sum where kLanes separate reductions take some 8.
#if defined(CPU_CAPABILITY_AVX512)
inline Lanes lane_sums(const Lanes* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 x = v[2 * i], y = v[2 * i + 1];
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));  // per 128 bits: x, y, x, y
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),  // per 128 bits: the sums of 4 vectors
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif defined(CPU_CAPABILITY_AVX2)
inline Lanes lane_sums(const Lanes* v) {
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}
#else
inline Lanes lane_sums(const Lanes* v) {
  Lanes sums;
  for (int64_t i = 0; i < kLanes; ++i) {
    float sum = 0.0f;
    for (int64_t j = 0; j < kLanes; ++j) sum += v[i][j];
    sums[i] = sum;
  }
  return sums;
}
#endif

// Key rows as V vectors in registers, produced one row at a time by a functor keys(t, k): the rows are read (or
// decoded and rotated) once for every query vector of a task and never written back to memory.

// Rows of an fp32 or fp16 buffer [n, dim] (a float pool's block, rotated sink keys, a decoded buffer).
template <int V, typename T>
struct RowKeys {
  const T* rows;
  void operator()(int64_t t, Lanes* k) const {
    for (int v = 0; v < V; ++v) k[v] = load_lanes(rows + (t * V + v) * kLanes);
  }
};

// Rotary embedding of a row held as V vectors (V even: the halves are whole vectors), cos/sin rows of dim values.
template <int V>
inline void rope_vecs(Lanes* k, const float* cos, const float* sin) {
  constexpr int H = V / 2;
  for (int v = 0; v < H; ++v) {
    const Lanes a = k[v], b = k[v + H];
    k[v] = a * load_lanes(cos + v * kLanes) - b * load_lanes(sin + v * kLanes);
    k[v + H] = b * load_lanes(cos + (v + H) * kLanes) + a * load_lanes(sin + (v + H) * kLanes);
  }
}

// Rows of a complete block: codes [n, width] decoded on the block's per-channel range (lo, scale: fp32 [dim]) and
// rotated by their positions' cos/sin rows (from the unit's first position).
template <int V, int BITS>
struct CodedKeys {
  const uint8_t* codes;
  int64_t width;
  const float *lo, *scale, *cos, *sin;
  void operator()(int64_t t, Lanes* k) const {
    const uint8_t* row = codes + t * width;
    for (int v = 0; v < V; ++v)
      k[v] = codes_vec<BITS>(row, v * kLanes) * load_lanes(scale + v * kLanes) + load_lanes(lo + v * kLanes);
    rope_vecs<V>(k, cos + t * V * kLanes, sin + t * V * kLanes);
  }
};

// Rows of a residual (fp16, not rotated) rotated by their positions' cos/sin rows.
template <int V>
struct ResidualKeys {
  const at::Half* rows;
  const float *cos, *sin;
  void operator()(int64_t t, Lanes* k) const {
    for (int v = 0; v < V; ++v) k[v] = load_lanes(rows + (t * V + v) * kLanes);
    rope_vecs<V>(k, cos + t * V * kLanes, sin + t * V * kLanes);
  }
};

// Turns the partial products of the rows t0..t0+m-1 (m <= kLanes; parts [count, kLanes] vectors) into scores.
inline void finish_scores(Lanes* parts, int64_t count, int64_t m, float* scores, int64_t ld, int64_t t0) {
  for (int64_t i = 0; i < count; ++i) {
    Lanes* part = parts + i * kLanes;
    for (int64_t j = m; j < kLanes; ++j) part[j] = Lanes{};
    const Lanes sums = lane_sums(part);
    if (m == kLanes) {
      store_lanes(sums, scores + i * ld + t0);
    } else {
      for (int64_t j = 0; j < m; ++j) scores[i * ld + t0 + j] = sums[j];
    }
  }
}

// q_i . k as a vector of partial sums, two FMA chains (V vectors).
template <int V>
inline Lanes partial_dot(const Lanes* q, const Lanes* k) {
  Lanes a = q[0] * k[0], b = V > 1 ? q[V > 1 ? 1 : 0] * k[V > 1 ? 1 : 0] : Lanes{};
  for (int v = 2; v + 1 < V; v += 2) {
    a += q[v] * k[v];
    b += q[v + 1] * k[v + 1];
  }
  if constexpr (V > 1 && V % 2 == 1) a += q[V - 1] * k[V - 1];
  return a + b;
}

// scores[i * ld + t] = q_i . k_t for C query vectors q [C, dim] (in registers) and the n key rows `keys` produces
// (V = dim / kLanes at compile time). Each key row is produced once; its partial products with the queries go to
// `parts` ([C, kLanes] vectors), and each run of kLanes rows is turned into kLanes scores by one lane_sums.
template <int V, int C, typename Keys>
void scores_fixed(const float* q, const Keys& keys, int64_t n, float* scores, int64_t ld, Lanes* parts) {
  constexpr int64_t dim = V * kLanes;
  Lanes qv[C][V];
  for (int i = 0; i < C; ++i)
    for (int v = 0; v < V; ++v) qv[i][v] = load_lanes(q + i * dim + v * kLanes);
  for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, n - t0);
    for (int64_t j = 0; j < m; ++j) {
      Lanes k[V];
      keys(t0 + j, k);
      for (int i = 0; i < C; ++i) parts[i * kLanes + j] = partial_dot<V>(qv[i], k);
    }
    finish_scores(parts, C, m, scores, ld, t0);
  }
}

template <int V, int C, typename Keys>
void scores_upto(int64_t count, const float* q, const Keys& keys, int64_t n, float* scores, int64_t ld, Lanes* parts) {
  if constexpr (C > 1) {
    if (count < C) return scores_upto<V, C - 1>(count, q, keys, n, scores, ld, parts);
  }
  scores_fixed<V, C>(q, keys, n, scores, ld, parts);
}

// Query vectors a scoring pass keeps in registers: up to 16 vectors of them (at most 8 queries).
constexpr int max_queries(int vecs) { return std::max(1, std::min(8, 16 / vecs)); }

// scores[i * ld + t] = q_i . k_t for query vectors q [count, dim] and the n key rows `keys` produces. Up to
// max_queries(V) queries stay in registers; more (a prefill chunk's tile) are read from L1 for each key row, so that
// each row is still produced (decoded) once.
template <int V, typename Keys>
void scores_rows(const float* q, int64_t count, const Keys& keys, int64_t n, float* scores, int64_t ld,
                 Lanes* parts) {
  constexpr int kMax = max_queries(V);
  if (count <= kMax) return scores_upto<V, kMax>(count, q, keys, n, scores, ld, parts);
  constexpr int64_t dim = V * kLanes;
  for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, n - t0);
    for (int64_t j = 0; j < m; ++j) {
      Lanes k[V];
      keys(t0 + j, k);
      for (int64_t i = 0; i < count; ++i) {
        Lanes qi[V];
        for (int v = 0; v < V; ++v) qi[v] = load_lanes(q + i * dim + v * kLanes);
        parts[i * kLanes + j] = partial_dot<V>(qi, k);
      }
    }
    finish_scores(parts, count, m, scores, ld, t0);
  }
}

// Output sums that stay in registers over a unit's rows: 24 vectors with AVX-512's 32 registers, 12 with 16.
constexpr int kRegisterVecs = kLanes == 16 ? 24 : 12;
constexpr int max_sums(int vecs) { return std::max(1, std::min(8, kRegisterVecs / vecs)); }

// Rows of values a batch reads: fp32 or fp16 [n, dim] each (a float pool's blocks, or one decoded buffer).
template <typename T>
struct Rows {
  const T* rows;
  int64_t n;
};

// acc[j, :] += sum_t weights[j * ld + t] * row_t for C query vectors at once, the rows t those of the segments in
// turn: the sums stay in registers and each row is read once for all of them.
template <int V, int C, typename T>
void accumulate_fixed(const float* weights, int64_t ld, const Rows<T>* segments, int64_t count, float* acc) {
  constexpr int64_t dim = V * kLanes;
  Lanes sum[C][V];
  for (int j = 0; j < C; ++j)
    for (int v = 0; v < V; ++v) sum[j][v] = load_lanes(acc + j * dim + v * kLanes);
  for (int64_t s = 0; s < count; ++s) {
    const T* rows = segments[s].rows;
    for (int64_t t = 0; t < segments[s].n; ++t) {
      float w[C];
      for (int j = 0; j < C; ++j) w[j] = weights[j * ld + t];
      for (int v = 0; v < V; ++v) {
        const Lanes r = load_lanes(rows + t * dim + v * kLanes);
        for (int j = 0; j < C; ++j) sum[j][v] += w[j] * r;
      }
    }
    weights += segments[s].n;
  }
  for (int j = 0; j < C; ++j)
    for (int v = 0; v < V; ++v) store_lanes(sum[j][v], acc + j * dim + v * kLanes);
}

template <int V, int C, typename T>
void accumulate_upto(int64_t vectors, const float* weights, int64_t ld, const Rows<T>* segments, int64_t count,
                     float* acc) {
  if constexpr (C > 1) {
    if (vectors < C) return accumulate_upto<V, C - 1>(vectors, weights, ld, segments, count, acc);
  }
  accumulate_fixed<V, C>(weights, ld, segments, count, acc);
}

// acc[j, :] += the weighted sums of `vectors` query vectors; V = 0: any dim, plain loops.
template <int V, typename T>
void accumulate(const float* weights, int64_t ld, int64_t vectors, const Rows<T>* segments, int64_t count,
                int64_t dim, float* acc) {
  if constexpr (V == 0) {
    int64_t column = 0;
    for (int64_t s = 0; s < count; ++s) {
      for (int64_t j = 0; j < vectors; ++j)
        for (int64_t t = 0; t < segments[s].n; ++t) {
          const float w = weights[j * ld + column + t];
          const T* row = segments[s].rows + t * dim;
          for (int64_t i = 0; i < dim; ++i) acc[j * dim + i] += w * static_cast<float>(row[i]);
        }
      column += segments[s].n;
    }
  } else {
    constexpr int kMax = max_sums(V);
    for (int64_t j = 0; j < vectors; j += kMax)
      accumulate_upto<V, kMax>(std::min<int64_t>(kMax, vectors - j), weights + j * ld, ld, segments, count,
                               acc + j * dim);
  }
}

// body(V) with V = dim / kLanes where it is one the kernels are compiled for (1, 2, 4, 8), else 0 (plain loops).
template <typename Body>
void with_vecs(int64_t dim, const Body& body) {
  if (dim % kLanes == 0) {
    switch (dim / kLanes) {
      case 1: return body(std::integral_constant<int, 1>());
      case 2: return body(std::integral_constant<int, 2>());
      case 4: return body(std::integral_constant<int, 4>());
      case 8: return body(std::integral_constant<int, 8>());
      default: break;
    }
  }
  body(std::integral_constant<int, 0>());
}

// ==== attention: tiles, units, tasks ====

// Consecutive rows of one sequence whose lengths do not decrease (one row of a decode step, or rows of a prefill
// chunk): their query vectors read each unit of the cache together.
struct Tile {
  int64_t row, rows, seq, length;  // first row, row count, sequence, largest length
};

// The online softmax of one task's query vectors: row i of the tile, query head j of the kv head -> vector
// i * group + j, queries pre-multiplied by the scale. Units of positions are scored into a batch of up to `ld`
// consecutive positions; a flush folds the batch into the running max and sum and adds its weighted values, so the
// softmax's reductions and the sums' loads and stores are paid once a batch, not once a block.
template <typename T>
struct TileState {
  int64_t count = 0, group = 0, dim = 0, ld = 0;
  std::vector<float> q, top, total, acc, scores;
  std::vector<Lanes> parts;    // partial products of scores_rows
  std::vector<int64_t> limit;  // positions the vector's row sees
  int64_t batch_first = 0, batch_size = 0, active = 0;
  std::vector<Rows<T>> values;  // the batch's value rows

  void start(const Tile& tile, int64_t g, const float* queries, int64_t heads, int64_t group_, int64_t dim_,
             float scale, const int64_t* lengths, int64_t ld_) {
    group = group_, dim = dim_, ld = ld_, count = tile.rows * group;
    q.resize(count * dim);
    top.assign(count, kNegInf);
    total.assign(count, 0.0f);
    acc.assign(count * dim, 0.0f);
    scores.resize(count * ld);
    parts.resize(count * kLanes);
    limit.resize(count);
    batch_size = 0;
    values.clear();
    const Vec s(scale);
    for (int64_t i = 0; i < tile.rows; ++i)
      for (int64_t j = 0; j < group; ++j) {
        const int64_t vector = i * group + j;
        limit[vector] = lengths[tile.row + i];
        at::vec::map([s](Vec x) { return x * s; }, q.data() + vector * dim,
                     queries + ((tile.row + i) * heads + g * group + j) * dim, dim);
      }
  }

  // Whether n more positions overflow the batch (flush first).
  bool full(int64_t n) const { return batch_size > 0 && batch_size + n > ld; }

  // A unit of n positions first..first+n-1 (following the batch's last): keys as a producer of V vectors a row (V =
  // 0: fp32 rows [n, dim]), values fp32 or fp16 rows [n, dim], read at the flush.
  template <int V, typename Keys>
  void add(const Keys& keys, const T* rows, int64_t first, int64_t n) {
    if (batch_size == 0) {
      batch_first = first;
      active = 0;  // vectors of rows that do not reach the batch: rows come in increasing length
      while (active < count && limit[active] <= first) active += group;
    }
    if (active < count) {
      if constexpr (V == 0) {
        for (int64_t i = active; i < count; ++i)
          for (int64_t t = 0; t < n; ++t)
            scores[i * ld + batch_size + t] = dot(q.data() + i * dim, keys + t * dim, dim);
      } else {
        scores_rows<V>(q.data() + active * dim, count - active, keys, n, scores.data() + active * ld + batch_size, ld,
                       parts.data());
      }
    }
    values.push_back({rows, n});
    batch_size += n;
  }

  template <int V>
  void flush() {
    if (batch_size == 0) return;
    if (active < count) {
      for (int64_t i = active; i < count; ++i) {
        float* row = scores.data() + i * ld;
        const int64_t valid = std::min(batch_size, limit[i] - batch_first);
        const float local = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, row,
                                                       valid);
        if (local > top[i]) {  // a new maximum: what was summed so far is rescaled to it
          if (top[i] != kNegInf) {
            const float alpha = std::exp(top[i] - local);
            total[i] *= alpha;
            float* out = acc.data() + i * dim;
            const Vec a(alpha);
            at::vec::map([a](Vec x) { return x * a; }, out, out, dim);
          }
          top[i] = local;
        }
        const float shift = top[i];
        at::vec::map([shift](Vec x) { return (x - Vec(shift)).exp(); }, row, row, valid);
        std::fill(row + valid, row + batch_size, 0.0f);
        total[i] += at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, row, valid);
      }
      accumulate<V>(scores.data() + active * ld, ld, count - active, values.data(),
                    static_cast<int64_t>(values.size()), dim, acc.data() + active * dim);
    }
    batch_size = 0;
    values.clear();
  }

  // softmax-weighted sums -> out rows [rows, heads * dim] at this kv head's query heads.
  void finish(const Tile& tile, int64_t g, int64_t heads, float* out) const {
    for (int64_t i = 0; i < tile.rows; ++i)
      for (int64_t j = 0; j < group; ++j) {
        const int64_t vector = i * group + j;
        const Vec inv(1.0f / total[vector]);
        at::vec::map([inv](Vec x) { return x * inv; }, out + ((tile.row + i) * heads + g * group + j) * dim,
                     acc.data() + vector * dim, dim);
      }
  }

  // The state as a partial result of one piece: [count] max, [count] sum, [count, dim] sums.
  void save(float* partial) const {
    std::copy(top.begin(), top.end(), partial);
    std::copy(total.begin(), total.end(), partial + count);
    std::copy(acc.begin(), acc.end(), partial + 2 * count);
  }
};

// Positions a batch holds: 64, or one whole unit where units are larger.
inline int64_t batch_positions(int64_t unit) { return std::max<int64_t>(64, unit); }

// Tasks of one attention call: per tile and kv head (or per tile for all its kv heads, where they share the reads of
// a unit: the quantized pool's rotary rows), its units split into pieces of consecutive units. A sequence of one
// decode row has few (tile, kv head) pairs, too few for the threads; splitting its positions into pieces whose
// softmax states are merged at the end (flash-decoding) keeps every thread busy.
struct Task {
  int64_t tile, g_begin, g_end, unit_begin, unit_end, piece, cost;
};

// The tasks of one call, and what they are the same for: the threads the pieces were sized for and the work that
// sizes the workers. A step's attention has the same plan in every layer (the same rows, lengths and pool shape):
// the step makes it once (plan_attention).
struct Plan {
  std::vector<Tile> tiles;
  std::vector<Task> tasks;
  std::vector<int64_t> pair_partial;  // (tile, g) -> offset of its pieces' partials, -1 when one piece
  std::vector<int64_t> tile_pieces;   // tile -> pieces of each of its kv heads
  int64_t partial_floats = 0, cost = 0, threads = 1, kv_heads = 1, group = 1, dim = 0;
};

std::vector<Tile> make_tiles(const int64_t* row_seq, const int64_t* lengths, int64_t rows, int64_t group) {
  // Up to 32 query vectors a tile: their scores and sums stay in L1 and L2.
  const int64_t max_rows = std::max<int64_t>(1, 32 / group);
  std::vector<Tile> tiles;
  for (int64_t r = 0; r < rows; ++r) {
    Tile* last = tiles.empty() ? nullptr : &tiles.back();
    if (last != nullptr && last->seq == row_seq[r] && last->rows < max_rows && lengths[r] >= last->length) {
      last->rows += 1;
      last->length = lengths[r];
    } else {
      tiles.push_back({r, 1, row_seq[r], lengths[r]});
    }
  }
  return tiles;
}

// units(tile) -> the number of units the tile reads; positions_per_unit for the smallest worthwhile piece;
// heads_per_task: 1 or kv_heads.
template <typename Units>
Plan make_plan(std::vector<Tile> tiles, int64_t kv_heads, int64_t group, int64_t dim, int64_t positions_per_unit,
               int64_t heads_per_task, const Units& units) {
  Plan plan;
  plan.tiles = std::move(tiles);
  plan.kv_heads = kv_heads, plan.group = group, plan.dim = dim;
  std::vector<int64_t> tile_units(plan.tiles.size());
  for (size_t t = 0; t < plan.tiles.size(); ++t) {
    tile_units[t] = units(plan.tiles[t]);
    plan.cost += tile_units[t] * plan.tiles[t].rows * kv_heads;
  }
  const int64_t threads = plan.threads = at::get_num_threads();
  // Pieces of at least 64 positions, and some 4 tasks a thread where the pairs alone are too few: a decode row of a
  // few hundred positions still splits its kv heads over the threads (at 129 positions of SmolLM2's 3 kv heads, 6
  // tasks for 2 threads where 3 kept one thread on two of them).
  const int64_t min_units = std::max<int64_t>(1, 64 / positions_per_unit);
  const int64_t target = threads > 1 ? std::max<int64_t>(1, plan.cost / (4 * threads)) : plan.cost + 1;
  plan.pair_partial.assign(plan.tiles.size() * kv_heads, -1);
  plan.tile_pieces.assign(plan.tiles.size(), 1);
  for (size_t t = 0; t < plan.tiles.size(); ++t) {
    const int64_t count = tile_units[t], work = count * plan.tiles[t].rows;
    const int64_t pieces = std::max<int64_t>(1, std::min((work + target - 1) / target, count / min_units));
    plan.tile_pieces[t] = pieces;
    for (int64_t g = 0; g < kv_heads && pieces > 1; ++g) {
      plan.pair_partial[t * kv_heads + g] = plan.partial_floats;
      plan.partial_floats += pieces * plan.tiles[t].rows * group * (dim + 2);
    }
    for (int64_t g = 0; g < kv_heads; g += heads_per_task)
      for (int64_t p = 0; p < pieces; ++p) {
        const int64_t begin = count * p / pieces, end = count * (p + 1) / pieces;
        plan.tasks.push_back({static_cast<int64_t>(t), g, g + heads_per_task, begin, end, p,
                              (end - begin) * plan.tiles[t].rows * heads_per_task});
      }
  }
  // Largest first, taken in turn by the threads: the last tasks to start are the short ones.
  std::stable_sort(plan.tasks.begin(), plan.tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return plan;
}

// Runs every task of the plan: run(task, tile, states) attends over its units (states: a TileState<T> per kv head,
// for value rows of type T; the task's kv heads are used); then the pieces of split pairs are merged. out: [rows,
// heads * dim]; partials: plan.partial_floats, shared by the threads.
template <typename T, typename Run>
void run_plan(const Plan& plan, int64_t heads, float* out, float* partials, const Run& run) {
  const int64_t kv_heads = plan.kv_heads, group = plan.group, dim = plan.dim;
  const int64_t tasks = static_cast<int64_t>(plan.tasks.size());
  // Small calls on one thread, as opening a parallel region costs more than they do; a team's threads are there
  // already, and which thread runs a task changes nothing in its result.
  const int64_t work = plan.cost * group * dim;
  const bool shared = work >= 32768 || llmeasyquant::team::current != nullptr;
  const int64_t workers = shared ? std::min<int64_t>(plan.threads, tasks) : 1;
  for_workers(workers, [&](int64_t, const auto& next) {
    thread_local std::vector<TileState<T>> states;  // kept: a step's layers reuse their buffers
    states.resize(kv_heads);
    for (int64_t i = next(); i < tasks; i = next()) {
      const Task& task = plan.tasks[i];
      const Tile& tile = plan.tiles[task.tile];
      run(task, tile, states);
      for (int64_t g = task.g_begin; g < task.g_end; ++g) {
        const int64_t partial = plan.pair_partial[task.tile * kv_heads + g];
        if (partial < 0) {
          states[g].finish(tile, g, heads, out);
        } else {
          states[g].save(partials + partial + task.piece * tile.rows * group * (dim + 2));
        }
      }
    }
  });
  if (plan.partial_floats == 0) return;
  // Merging, each split (tile, kv head) pair on its own: out = sum_p exp(top_p - top) acc_p / sum_p exp(top_p - top)
  // total_p. Pairs go to the threads in runs of some 16k merged values (a decode row's few pairs: one thread).
  const int64_t pairs = static_cast<int64_t>(plan.tiles.size()) * kv_heads;
  const int64_t pair_values = plan.partial_floats / std::max<int64_t>(1, pairs);
  parallel_range(0, pairs, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, pair_values)), [&](int64_t begin,
                                                                                                int64_t end) {
    thread_local std::vector<float> sum;
    sum.resize(dim);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t t = pair / kv_heads, g = pair % kv_heads, offset = plan.pair_partial[pair];
      if (offset < 0) continue;
      const Tile& tile = plan.tiles[t];
      const int64_t count = tile.rows * group, stride = count * (dim + 2), pieces = plan.tile_pieces[t];
      const float* base = partials + offset;
      for (int64_t i = 0; i < count; ++i) {
        float top = kNegInf;
        for (int64_t p = 0; p < pieces; ++p) top = std::max(top, base[p * stride + i]);
        float total = 0.0f;
        std::fill(sum.begin(), sum.end(), 0.0f);
        for (int64_t p = 0; p < pieces; ++p) {
          const float* piece = base + p * stride;
          const float weight = std::exp(piece[i] - top);  // 0 for a piece the vector saw nothing of
          if (weight == 0.0f) continue;
          total += weight * piece[count + i];
          const float* acc = piece + 2 * count + i * dim;
          for (int64_t c = 0; c < dim; ++c) sum[c] += weight * acc[c];
        }
        const int64_t row = tile.row + i / group, head = g * group + i % group;
        for (int64_t c = 0; c < dim; ++c) out[(row * heads + head) * dim + c] = sum[c] / total;
      }
    }
  });
}

// Checks shared by the attention operators (and the step): `rows` queries of `heads` heads, row_seq/lengths [rows],
// each row's block table entries within the pool.
void check_rows(int64_t rows, int64_t heads, const at::Tensor& row_seq, const at::Tensor& lengths,
                const at::Tensor& tables, int64_t kv_heads, int64_t block, int64_t pool_blocks) {
  TORCH_CHECK(heads % kv_heads == 0, heads, " query heads do not group over ", kv_heads, " kv heads");
  TORCH_CHECK(row_seq.numel() == rows && lengths.numel() == rows, "row_seq and lengths must hold one value a row (",
              rows, ")");
  TORCH_CHECK(tables.dim() == 2, "tables must be [sequences, max_blocks]");
  const int64_t sequences = tables.size(0), max_blocks = tables.size(1);
  const int64_t* seq = row_seq.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int32_t* table = tables.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(seq[r] >= 0 && seq[r] < sequences, "row ", r, " belongs to sequence ", seq[r], ", outside 0..",
                sequences - 1);
    TORCH_CHECK(length[r] >= 1 && length[r] <= max_blocks * block, "row ", r, " attends over ", length[r],
                " positions, outside 1..", max_blocks * block);
    for (int64_t b = 0; b * block < length[r]; ++b) {
      const int32_t entry = table[seq[r] * max_blocks + b];
      TORCH_CHECK(entry >= 0 && entry < pool_blocks, "block ", b, " of sequence ", seq[r], " is pool block ", entry,
                  ", outside 0..", pool_blocks - 1);
    }
  }
}

// ==== quantized pool: its tensors ====

struct QuantPool {
  int64_t blocks, kv_heads, block, width, dim, n_out, sequences, sink_capacity;
  uint8_t* key_codes;
  at::Half *key_lo, *key_scale;
  uint8_t* value_codes;
  at::Half* value_scale;
  uint8_t* value_zero;
  at::Half* outlier_values;
  uint8_t* outlier_index;
  at::Half *sink_keys, *sink_values, *residual_keys;
};

QuantPool quant_pool(const std::vector<at::Tensor>& pool, int64_t bits, int64_t sinks) {
  TORCH_CHECK(pool.size() == 11, "the quantized pool is a list of 11 tensors (see paged_ops.cpp), got ", pool.size());
  TORCH_CHECK(bits == 2 || bits == 3 || bits == 4 || bits == 8, "bits must be 2, 3, 4 or 8, got ", bits);
  const char* names[11] = {"key_codes", "key_lo", "key_scale", "value_codes", "value_scale", "value_zero",
                           "value_outlier_values", "value_outlier_index", "sink_keys", "sink_values",
                           "residual_keys"};
  const at::ScalarType types[11] = {at::kByte, at::kHalf, at::kHalf, at::kByte, at::kHalf, at::kByte,
                                    at::kHalf, at::kByte, at::kHalf, at::kHalf, at::kHalf};
  const int64_t ranks[11] = {4, 3, 3, 4, 3, 3, 4, 4, 4, 4, 4};
  for (int i = 0; i < 11; ++i) {
    check_cpu(pool[i], types[i], names[i]);
    TORCH_CHECK(pool[i].dim() == ranks[i], names[i], " must have ", ranks[i], " dimensions, got ", pool[i].dim());
  }
  QuantPool p;
  p.blocks = pool[0].size(0), p.kv_heads = pool[0].size(1), p.block = pool[0].size(2), p.width = pool[0].size(3);
  p.dim = pool[1].size(2), p.n_out = pool[6].size(3), p.sequences = pool[10].size(0);
  p.sink_capacity = pool[8].size(2);
  const int64_t width = bits == 8 ? p.dim : (p.dim + 7) / 8 * bits;
  TORCH_CHECK(p.width == width, "key_codes hold ", p.width, " bytes a vector; ", p.dim, " codes of ", bits,
              " bits take ", width);
  TORCH_CHECK(p.dim % 2 == 0 && p.dim <= 256, "head dim must be even and at most 256, got ", p.dim);
  TORCH_CHECK(p.n_out < p.dim, "n_out (", p.n_out, ") must be below the head dim (", p.dim, ")");
  TORCH_CHECK(sinks >= 0 && sinks <= p.sink_capacity, "sinks (", sinks, ") must lie in 0..", p.sink_capacity);
  const auto same = [&](int i, at::IntArrayRef sizes) {
    TORCH_CHECK(pool[i].sizes() == sizes, names[i], " must be ", sizes, ", got ", pool[i].sizes());
  };
  same(1, {p.blocks, p.kv_heads, p.dim});
  same(2, {p.blocks, p.kv_heads, p.dim});
  same(3, {p.blocks, p.kv_heads, p.block, p.width});
  same(4, {p.blocks, p.kv_heads, p.block});
  same(5, {p.blocks, p.kv_heads, p.block});
  same(6, {p.blocks, p.kv_heads, p.block, p.n_out});
  same(7, {p.blocks, p.kv_heads, p.block, p.n_out});
  same(8, {p.sequences, p.kv_heads, p.sink_capacity, p.dim});
  same(9, {p.sequences, p.kv_heads, p.sink_capacity, p.dim});
  same(10, {p.sequences, p.kv_heads, p.block, p.dim});
  p.key_codes = pool[0].data_ptr<uint8_t>();
  p.key_lo = pool[1].data_ptr<at::Half>();
  p.key_scale = pool[2].data_ptr<at::Half>();
  p.value_codes = pool[3].data_ptr<uint8_t>();
  p.value_scale = pool[4].data_ptr<at::Half>();
  p.value_zero = pool[5].data_ptr<uint8_t>();
  p.outlier_values = pool[6].data_ptr<at::Half>();
  p.outlier_index = pool[7].data_ptr<uint8_t>();
  p.sink_keys = pool[8].data_ptr<at::Half>();
  p.sink_values = pool[9].data_ptr<at::Half>();
  p.residual_keys = pool[10].data_ptr<at::Half>();
  return p;
}

// The units of a sequence read up to `length` on the quantized pool: the sinks (when any), then one per block from
// the one holding position `sinks`.
struct QuantUnits {
  int64_t sinks, block;
  int64_t count(int64_t length) const {
    return (sinks > 0 ? 1 : 0) + (length > sinks ? (length - 1) / block - sinks / block + 1 : 0);
  }
  int64_t block_of(int64_t u) const { return sinks / block + u - (sinks > 0 ? 1 : 0); }  // u: not the sink unit
  // (first position, positions) of unit u read up to `length`
  std::pair<int64_t, int64_t> span(int64_t u, int64_t length) const {
    if (sinks > 0 && u == 0) return {0, std::min(sinks, length)};
    const int64_t first = std::max(block_of(u) * block, sinks);
    return {first, std::min(block_of(u) * block + block, length) - first};
  }
};

// The values of n consecutive tokens from [N, kv_heads, B] index `token` on: per-token grids, outliers patched in.
template <int BITS>
void decode_values(const QuantPool& p, int64_t token, int64_t n, float* values) {
  const int64_t dim = p.dim;
  for (int64_t t = 0; t < n; ++t) {
    const at::Half s = p.value_scale[token + t];
    float* row = values + t * dim;
    decode_token<BITS>(p.value_codes + (token + t) * p.width, token_lo(p.value_zero[token + t], s, BITS),
                       static_cast<float>(s), dim, row);
    const at::Half* outlier_values = p.outlier_values + (token + t) * p.n_out;
    const uint8_t* outlier_index = p.outlier_index + (token + t) * p.n_out;
    for (int64_t j = 0; j < p.n_out; ++j) row[outlier_index[j]] = static_cast<float>(outlier_values[j]);
  }
}

// The keys of unit u of sequence `seq` for kv head g (positions up to `length`, the sequence stored up to `stored`),
// rotated, into keys [n, dim] fp32; scratch: 2 * dim floats. Returns (first position, n).
template <int BITS>
std::pair<int64_t, int64_t> decode_keys(const QuantPool& p, const QuantUnits& units, const int32_t* table, int64_t seq,
                                        int64_t g, int64_t u, int64_t length, int64_t stored, const float* cos_table,
                                        const float* sin_table, float* scratch, float* keys) {
  const int64_t dim = p.dim, block = p.block;
  const auto [first, n] = units.span(u, length);
  if (units.sinks > 0 && u == 0) {
    half_row_to_float(p.sink_keys + (seq * p.kv_heads + g) * p.sink_capacity * dim, n * dim, keys);
    return {first, n};
  }
  const int64_t b = units.block_of(u), offset = first - b * block;
  const int64_t head = table[b] * p.kv_heads + g;  // [N, kv_heads] index
  if (b * block + block <= stored) {  // complete: the block's codes
    float* lo = scratch;
    float* scale = scratch + dim;
    half_row_to_float(p.key_lo + head * dim, dim, lo);
    half_row_to_float(p.key_scale + head * dim, dim, scale);
    const uint8_t* codes = p.key_codes + (head * block + offset) * p.width;
    for (int64_t t = 0; t < n; ++t) decode_channels<BITS>(codes + t * p.width, lo, scale, dim, keys + t * dim);
  } else {  // the incomplete last block: its residual
    half_row_to_float(p.residual_keys + ((seq * p.kv_heads + g) * block + offset) * dim, n * dim, keys);
  }
  for (int64_t t = 0; t < n; ++t)
    rope_row(keys + t * dim, cos_table + (first + t) * dim, sin_table + (first + t) * dim, dim, keys + t * dim);
  return {first, n};
}

// The values of unit u of sequence `seq` for kv head g into values [n, dim] fp32.
template <int BITS>
void decode_unit_values(const QuantPool& p, const QuantUnits& units, const int32_t* table, int64_t seq, int64_t g,
                        int64_t u, int64_t length, float* values) {
  const auto [first, n] = units.span(u, length);
  if (units.sinks > 0 && u == 0) {
    half_row_to_float(p.sink_values + (seq * p.kv_heads + g) * p.sink_capacity * p.dim, n * p.dim, values);
    return;
  }
  const int64_t b = units.block_of(u);
  decode_values<BITS>(p, (table[b] * p.kv_heads + g) * p.block + first - b * p.block, n, values);
}

// Prefetches what unit u of sequence `seq` reads for kv head g from the pool (not the sinks).
void prefetch_unit(const QuantPool& p, const QuantUnits& units, const int32_t* table, int64_t seq, int64_t g,
                   int64_t u, int64_t length, int64_t stored) {
  if (units.sinks > 0 && u == 0) return;
  const auto [first, n] = units.span(u, length);
  const int64_t b = units.block_of(u), offset = first - b * p.block;
  const int64_t head = table[b] * p.kv_heads + g, token = head * p.block + offset;
  if (b * p.block + p.block <= stored) {
    prefetch(p.key_codes + token * p.width, n * p.width);
    prefetch(p.key_lo + head * p.dim, p.dim * 2);
    prefetch(p.key_scale + head * p.dim, p.dim * 2);
  } else {
    prefetch(p.residual_keys + ((seq * p.kv_heads + g) * p.block + offset) * p.dim, n * p.dim * 2);
  }
  prefetch(p.value_codes + token * p.width, n * p.width);
  prefetch(p.value_scale + token, n * 2);
  prefetch(p.value_zero + token, n);
  prefetch(p.outlier_values + token * p.n_out, n * p.n_out * 2);
  prefetch(p.outlier_index + token * p.n_out, n * p.n_out);
}

// Unit u of sequence `seq` for kv head g into the task's softmax state (positions up to `length`, the sequence stored
// up to `stored`). Values are decoded (outliers patched in) into the batch's buffer `values` [ld, dim], which the
// weighted sums read while it is still in L1; keys are decoded and rotated in registers as the scores read them (V
// even), or through `keys` [rows, dim] where V is odd or 0. scratch: 2 * dim floats.
template <int V, int BITS>
void add_unit(TileState<float>& state, const QuantPool& p, const QuantUnits& units, const int32_t* table, int64_t seq,
              int64_t g, int64_t u, int64_t length, int64_t stored, const float* cos_table, const float* sin_table,
              float* keys, float* values, float* scratch) {
  const int64_t dim = p.dim, block = p.block;
  const auto [first, n] = units.span(u, length);
  if (state.full(n)) state.template flush<V>();
  float* rows = values + state.batch_size * dim;
  decode_unit_values<BITS>(p, units, table, seq, g, u, length, rows);
  if constexpr (V == 0 || V % 2 == 1) {
    decode_keys<BITS>(p, units, table, seq, g, u, length, stored, cos_table, sin_table, scratch, keys);
    if constexpr (V == 0) {
      state.add<0>(static_cast<const float*>(keys), rows, first, n);
    } else {
      state.add<V>(RowKeys<V, float>{keys}, rows, first, n);
    }
  } else {
    if (units.sinks > 0 && u == 0) {
      state.add<V>(RowKeys<V, at::Half>{p.sink_keys + (seq * p.kv_heads + g) * p.sink_capacity * dim}, rows, first,
                   n);
      return;
    }
    const int64_t b = units.block_of(u), offset = first - b * block;
    const int64_t head = table[b] * p.kv_heads + g;  // [N, kv_heads] index
    const float* cos = cos_table + first * dim;
    const float* sin = sin_table + first * dim;
    if (b * block + block <= stored) {  // complete: the block's codes
      float* lo = scratch;
      float* scale = scratch + dim;
      half_row_to_float(p.key_lo + head * dim, dim, lo);
      half_row_to_float(p.key_scale + head * dim, dim, scale);
      state.add<V>(CodedKeys<V, BITS>{p.key_codes + (head * block + offset) * p.width, p.width, lo, scale, cos, sin},
                   rows, first, n);
    } else {  // the incomplete last block: its residual
      state.add<V>(ResidualKeys<V>{p.residual_keys + ((seq * p.kv_heads + g) * block + offset) * dim, cos, sin}, rows,
                   first, n);
    }
  }
}

template <typename Body>
void dispatch_bits(int64_t bits, const Body& body) {
  switch (bits) {
    case 2: return body(std::integral_constant<int, 2>());
    case 3: return body(std::integral_constant<int, 3>());
    case 4: return body(std::integral_constant<int, 4>());
    default: return body(std::integral_constant<int, 8>());
  }
}

}  // namespace

// ==== checks the operators and the step share ====

namespace {

// key_pool, value_pool: [N, kv_heads, B, dim], both fp32 or both fp16.
void check_float_pool(const at::Tensor& key_pool, const at::Tensor& value_pool) {
  const at::ScalarType dtype = key_pool.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf, "the pools must be Float or Half, got ", c10::toString(dtype));
  check_cpu(key_pool, dtype, "key_pool");
  check_cpu(value_pool, dtype, "value_pool");
  TORCH_CHECK(key_pool.dim() == 4 && key_pool.sizes() == value_pool.sizes(),
              "key_pool and value_pool must be [blocks, kv_heads, block, dim]");
}

// q_norm, k_norm: both absent, or [dim] fp32 each.
void check_norms(const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, int64_t dim) {
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "give both query and key norms or neither");
  if (q_norm.has_value()) {
    check_cpu(*q_norm, at::kFloat, "q_norm");
    check_cpu(*k_norm, at::kFloat, "k_norm");
    TORCH_CHECK(q_norm->numel() == dim && k_norm->numel() == dim, "q/k norm weights must have ", dim, " values");
  }
}

const float* data_or_null(const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

// The float pool's store: a slot in the pool for each row.
void check_slots(const int64_t* slot, int64_t rows, int64_t capacity) {
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(slot[r] >= 0 && slot[r] < capacity, "slot ", slot[r], " of row ", r, " is outside the pool of ",
                capacity);
}

// The quantized pool's store: each row's sequence, position and slot, the slot at the position's offset in its block.
void check_quant_rows(const QuantPool& p, const int64_t* slot, const int64_t* seq, const int64_t* pos, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(seq[r] >= 0 && seq[r] < p.sequences, "row ", r, " belongs to sequence ", seq[r], ", outside 0..",
                p.sequences - 1);
    TORCH_CHECK(pos[r] >= 0, "row ", r, " has position ", pos[r]);
    TORCH_CHECK(slot[r] >= 0 && slot[r] < p.blocks * p.block, "slot ", slot[r], " of row ", r,
                " is outside the pool of ", p.blocks * p.block);
    TORCH_CHECK(slot[r] % p.block == pos[r] % p.block, "slot ", slot[r], " of row ", r, " is not at offset ",
                pos[r] % p.block, " of its block (position ", pos[r], ")");
  }
}

// Each sequence's stored length (the largest of its rows' lengths), and the rotary tables holding them.
std::vector<int64_t> stored_lengths(const QuantPool& p, const int64_t* seq, const int64_t* length, int64_t rows,
                                    const at::Tensor& cos_table, const at::Tensor& sin_table) {
  std::vector<int64_t> stored(p.sequences, 0);
  for (int64_t r = 0; r < rows; ++r) stored[seq[r]] = std::max(stored[seq[r]], length[r]);
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(cos_table.dim() == 2 && cos_table.size(1) == p.dim && cos_table.size(0) >= stored[seq[r]] &&
                    sin_table.sizes() == cos_table.sizes(),
                "cos_table and sin_table must be [max_positions >= ", stored[seq[r]], ", ", p.dim, "]");
  return stored;
}

// The plans of the two pools' attention: a float pool's task is one kv head and a piece of its blocks, a quantized
// pool's all kv heads of its tile (they share the reads of a unit's rotary rows).
Plan float_plan(const int64_t* seq, const int64_t* length, int64_t rows, int64_t heads, int64_t kv_heads,
                int64_t dim, int64_t block) {
  const int64_t group = heads / kv_heads;
  return make_plan(make_tiles(seq, length, rows, group), kv_heads, group, dim, block, 1,
                   [block](const Tile& tile) { return (tile.length + block - 1) / block; });
}

Plan quant_plan(const QuantPool& p, const int64_t* seq, const int64_t* length, int64_t rows, int64_t heads,
                int64_t sinks) {
  const int64_t group = heads / p.kv_heads;
  const QuantUnits units{sinks, p.block};
  return make_plan(make_tiles(seq, length, rows, group), p.kv_heads, group, p.dim, p.block, p.kv_heads,
                   [&units](const Tile& tile) { return units.count(tile.length); });
}

}  // namespace

// A step's attention plan (operators.h): the plan, and for the quantized pool each sequence's stored length.
struct AttentionPlan {
  Plan plan;
  std::vector<int64_t> stored;
};

// ==== float pool: rotary embedding + store ====

void paged_rope_store_into(const float* qkv, int64_t rows, const float* cos, const float* sin,
                           const at::Tensor& key_pool, const at::Tensor& value_pool, const int64_t* slots,
                           int64_t heads, const float* q_norm, const float* k_norm, double q_eps, double k_eps,
                           float* q) {
  const int64_t kv_heads = key_pool.size(1), block = key_pool.size(2), dim = key_pool.size(3);
  const int64_t width = (heads + 2 * kv_heads) * dim;
  const auto store = [&](auto* keys, auto* values) {
    for_rows(rows, width, [&](int64_t first, int64_t last) {
      thread_local std::vector<float> qk;
      qk.resize((heads + kv_heads) * dim);
      for (int64_t r = first; r < last; ++r) {
        const float* row = qkv + r * width;
        normalised_row(row, heads, kv_heads, dim, q_norm, k_norm, static_cast<float>(q_eps),
                       static_cast<float>(k_eps), qk.data());
        for (int64_t h = 0; h < heads + kv_heads; ++h)
          rope_row(qk.data() + h * dim, cos + r * dim, sin + r * dim, dim, qk.data() + h * dim);
        const int64_t b = slots[r] / block, offset = slots[r] % block;
        for (int64_t h = 0; h < kv_heads; ++h) {
          const int64_t base = ((b * kv_heads + h) * block + offset) * dim;
          store_row(qk.data() + (heads + h) * dim, dim, keys + base);
          store_row(row + (heads + kv_heads + h) * dim, dim, values + base);
        }
        std::copy_n(qk.data(), heads * dim, q + r * heads * dim);
      }
    });
  };
  if (key_pool.scalar_type() == at::kFloat) {
    store(key_pool.data_ptr<float>(), value_pool.data_ptr<float>());
  } else {
    store(key_pool.data_ptr<at::Half>(), value_pool.data_ptr<at::Half>());
  }
}

// qkv: [rows, (heads + 2 * kv_heads) * dim] fp32, cos, sin: [rows, dim] fp32, key_pool, value_pool: [N, kv_heads, B,
// dim] fp32 or fp16 (written in place), slots: [rows] int64, q_norm, k_norm: [dim] fp32 or both absent
// -> q: [rows, heads, dim] fp32
// rope_store of decoder_ops.cpp on a paged pool: optionally RMS-normalises each query and key head, rotates queries
// and keys, writes row r's key and value at flat slot slots[r] (block slot / B, offset slot % B) and returns the
// rotated queries.
at::Tensor paged_rope_store(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                            at::Tensor key_pool, at::Tensor value_pool, const at::Tensor& slots_in, int64_t heads,
                            const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                            double q_eps, double k_eps) {
  const at::Tensor qkv = input(qkv_in, at::kFloat, "qkv");
  const at::Tensor cos = input(cos_in, at::kFloat, "cos");
  const at::Tensor sin = input(sin_in, at::kFloat, "sin");
  const at::Tensor slots = input(slots_in, at::kLong, "slots");
  check_float_pool(key_pool, value_pool);
  const int64_t blocks = key_pool.size(0), kv_heads = key_pool.size(1), block = key_pool.size(2),
                dim = key_pool.size(3);
  const int64_t width = (heads + 2 * kv_heads) * dim;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == width, "qkv must be [rows, ", width, "], got ", qkv.sizes());
  const int64_t rows = qkv.size(0);
  TORCH_CHECK(cos.numel() == rows * dim && sin.numel() == rows * dim, "cos and sin must hold ", rows,
              " positions of ", dim, " values");
  TORCH_CHECK(slots.numel() == rows, "slots must hold one slot a row (", rows, ")");
  check_slots(slots.data_ptr<int64_t>(), rows, blocks * block);
  check_norms(q_norm, k_norm, dim);
  at::Tensor q = at::empty({rows, heads, dim}, qkv.options());
  paged_rope_store_into(qkv.data_ptr<float>(), rows, cos.data_ptr<float>(), sin.data_ptr<float>(), key_pool,
                        value_pool, slots.data_ptr<int64_t>(), heads, data_or_null(q_norm), data_or_null(k_norm),
                        q_eps, k_eps, q.data_ptr<float>());
  return q;
}

// ==== float pool: attention ====

void paged_attention_into(const AttentionPlan& step_plan, const float* q, int64_t heads, const at::Tensor& key_pool,
                          const at::Tensor& value_pool, const int32_t* table, int64_t max_blocks,
                          const int64_t* length, double scale, float* out, float* partials) {
  const Plan& plan = step_plan.plan;
  const int64_t kv_heads = plan.kv_heads, group = plan.group, dim = plan.dim, block = key_pool.size(2);
  const float s = static_cast<float>(scale);
  const auto attend = [&](auto type) {
    using T = typename decltype(type)::type;
    const T* keys = key_pool.data_ptr<T>();
    const T* values = value_pool.data_ptr<T>();
    with_vecs(dim, [&](auto vecs) {
      constexpr int V = decltype(vecs)::value;
      run_plan<T>(plan, heads, out, partials, [&](const Task& task, const Tile& tile,
                                                  std::vector<TileState<T>>& states) {
        TileState<T>& state = states[task.g_begin];
        state.start(tile, task.g_begin, q, heads, group, dim, s, length, batch_positions(block));
        thread_local std::vector<float> buffer;  // fp16 keys as fp32 rows for the plain loops (V = 0)
        const auto base_of = [&](int64_t b) {
          return ((table[tile.seq * max_blocks + b] * kv_heads + task.g_begin) * block) * dim;
        };
        // The blocks kPrefetchBlocks on are asked for as a block is computed, and the first ones at the start: a
        // decode step's pool comes from memory (the weights streamed through the caches since the last layer read it).
        const auto prefetch_block = [&](int64_t b) {
          const int64_t bytes = std::min(block, tile.length - b * block) * dim * sizeof(T);
          prefetch(keys + base_of(b), bytes);
          prefetch(values + base_of(b), bytes);
        };
        for (int64_t b = task.unit_begin; b < std::min(task.unit_end, task.unit_begin + kPrefetchBlocks); ++b)
          prefetch_block(b);
        for (int64_t b = task.unit_begin; b < task.unit_end; ++b) {
          const int64_t first = b * block, n = std::min(block, tile.length - first);
          const int64_t base = base_of(b);
          if (b + kPrefetchBlocks < task.unit_end) prefetch_block(b + kPrefetchBlocks);
          if (state.full(n)) state.template flush<V>();
          if constexpr (V > 0) {
            state.template add<V>(RowKeys<V, T>{keys + base}, values + base, first, n);
          } else if constexpr (std::is_same_v<T, float>) {
            state.template add<0>(keys + base, values + base, first, n);
          } else {
            buffer.resize(block * dim);
            half_row_to_float(keys + base, n * dim, buffer.data());
            state.template add<0>(static_cast<const float*>(buffer.data()), values + base, first, n);
          }
        }
        state.template flush<V>();
      });
    });
  };
  if (key_pool.scalar_type() == at::kFloat) {
    attend(std::type_identity<float>());
  } else {
    attend(std::type_identity<at::Half>());
  }
}

// q: [rows, heads, dim] fp32, key_pool, value_pool: [N, kv_heads, B, dim] fp32 or fp16, tables: [S, M] int32,
// row_seq, lengths: [rows] int64 -> out: [rows, heads * dim] fp32
// Attention of each row over positions 0..lengths[r]-1 of its sequence row_seq[r] (grouped-query: query head h reads
// kv head h / (heads / kv_heads)): softmax(scale * q k^T) v, heads side by side. A task is a tile of rows of one
// sequence, one kv head and a piece of its blocks; each block's keys and values are read once for the tile's query
// vectors (fp16 rows converted to fp32 in registers as they are read).
at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& key_pool, const at::Tensor& value_pool,
                           const at::Tensor& tables_in, const at::Tensor& row_seq_in, const at::Tensor& lengths_in,
                           double scale) {
  const at::Tensor q = input(q_in, at::kFloat, "q");
  const at::Tensor tables = input(tables_in, at::kInt, "tables");
  const at::Tensor row_seq = input(row_seq_in, at::kLong, "row_seq");
  const at::Tensor lengths = input(lengths_in, at::kLong, "lengths");
  check_float_pool(key_pool, value_pool);
  const int64_t kv_heads = key_pool.size(1), block = key_pool.size(2), dim = key_pool.size(3);
  TORCH_CHECK(q.dim() == 3, "q must be [rows, heads, dim]");
  check_rows(q.size(0), q.size(1), row_seq, lengths, tables, kv_heads, block, key_pool.size(0));
  TORCH_CHECK(q.size(2) == dim, "queries have ", q.size(2), " values per head, the pool ", dim);
  const int64_t rows = q.size(0), heads = q.size(1);
  const AttentionPlan plan{float_plan(row_seq.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), rows, heads,
                                      kv_heads, dim, block), {}};
  at::Tensor out = at::empty({rows, heads * dim}, q.options());
  std::vector<float> partials(plan.plan.partial_floats);
  paged_attention_into(plan, q.data_ptr<float>(), heads, key_pool, value_pool, tables.data_ptr<int32_t>(),
                       tables.size(1), lengths.data_ptr<int64_t>(), scale, out.data_ptr<float>(), partials.data());
  return out;
}

// ==== quantized pool: rotary embedding + coding store ====

void quant_rope_store_into(const float* qkv, int64_t rows, const float* cos, const float* sin,
                           const std::vector<at::Tensor>& pool, const int64_t* slot, const int64_t* seq,
                           const int64_t* pos, int64_t heads, const float* q_norm, const float* k_norm, double q_eps,
                           double k_eps, int64_t bits, int64_t sinks, float* q) {
  const QuantPool p = quant_pool(pool, bits, sinks);
  const int64_t kv_heads = p.kv_heads, block = p.block, dim = p.dim;
  const int64_t width = (heads + 2 * kv_heads) * dim;
  const float qe = static_cast<float>(q_eps), ke = static_cast<float>(k_eps);
  // Queries: independent rows.
  for_rows(rows, heads * dim, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      float* out = q + r * heads * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float* x = qkv + r * width + h * dim;
        if (q_norm != nullptr) {
          norm_row(x, q_norm, qe, dim, out + h * dim);
        } else {
          std::copy_n(x, dim, out + h * dim);
        }
        rope_row(out + h * dim, cos + r * dim, sin + r * dim, dim, out + h * dim);
      }
    }
  });
  // Keys and values: per kv head, the rows in order.
  const int64_t grain = rows * dim >= 4096 ? 1 : kv_heads;
  parallel_range(0, kv_heads, grain, [&](int64_t begin, int64_t end) {
    thread_local CoderScratch scratch;
    thread_local std::vector<float> key;
    key.resize(dim);
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = qkv + r * width;
        const float* value = row + (heads + kv_heads + g) * dim;
        if (k_norm != nullptr) {
          norm_row(row + (heads + g) * dim, k_norm, ke, dim, key.data());
        } else {
          std::copy_n(row + (heads + g) * dim, dim, key.data());
        }
        const int64_t s = seq[r], position = pos[r];
        if (position < sinks) {
          const int64_t base = ((s * kv_heads + g) * p.sink_capacity + position) * dim;
          rope_row(key.data(), cos + r * dim, sin + r * dim, dim, key.data());
          store_row(key.data(), dim, p.sink_keys + base);
          store_row(value, dim, p.sink_values + base);
          continue;
        }
        const int64_t b = slot[r] / block, offset = slot[r] % block;
        const int64_t head = b * kv_heads + g, token = head * block + offset;
        code_value(value, dim, static_cast<int>(bits), p.n_out, scratch, p.value_codes + token * p.width,
                   p.value_scale + token, p.value_zero + token, p.outlier_values + token * p.n_out,
                   p.outlier_index + token * p.n_out);
        const at::Half* residual = p.residual_keys + (s * kv_heads + g) * block * dim;
        store_row(key.data(), dim, p.residual_keys + ((s * kv_heads + g) * block + offset) * dim);
        if (offset == block - 1) {  // the block is complete: code its keys from the residual
          const int64_t first = std::max<int64_t>(sinks - (position - offset), 0);
          code_key_block(residual, first, block, dim, static_cast<int>(bits), p.width, scratch,
                         p.key_codes + head * block * p.width, p.key_lo + head * dim, p.key_scale + head * dim);
        }
      }
    }
  });
}

// qkv: [rows, (heads + 2 * kv_heads) * dim] fp32, cos, sin: [rows, dim] fp32, pool: the 11 tensors (file header;
// written in place), slots, row_seq, positions: [rows] int64, q_norm, k_norm: [dim] fp32 or both absent
// -> q: [rows, heads, dim] fp32 (rotated queries)
// Stores each row's key and value in the quantized pool (file header): positions < sinks into the sink buffers (key
// rotated), later ones with the value coded into its slot and the key (normalised, not rotated) into the sequence's
// residual, whose block is coded when the row completes it. Rows are stored in order (a block completed by one row of
// a chunk is coded before a later row starts the next); the kv heads run on the threads.
at::Tensor quant_rope_store(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                            const std::vector<at::Tensor>& pool, const at::Tensor& slots_in,
                            const at::Tensor& row_seq_in, const at::Tensor& positions_in, int64_t heads,
                            const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                            double q_eps, double k_eps, int64_t bits, int64_t sinks) {
  const at::Tensor qkv = input(qkv_in, at::kFloat, "qkv");
  const at::Tensor cos = input(cos_in, at::kFloat, "cos");
  const at::Tensor sin = input(sin_in, at::kFloat, "sin");
  const at::Tensor slots = input(slots_in, at::kLong, "slots");
  const at::Tensor row_seq = input(row_seq_in, at::kLong, "row_seq");
  const at::Tensor positions = input(positions_in, at::kLong, "positions");
  const QuantPool p = quant_pool(pool, bits, sinks);
  const int64_t dim = p.dim, width = (heads + 2 * p.kv_heads) * dim;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == width, "qkv must be [rows, ", width, "], got ", qkv.sizes());
  const int64_t rows = qkv.size(0);
  TORCH_CHECK(cos.numel() == rows * dim && sin.numel() == rows * dim, "cos and sin must hold ", rows,
              " positions of ", dim, " values");
  TORCH_CHECK(slots.numel() == rows && row_seq.numel() == rows && positions.numel() == rows,
              "slots, row_seq and positions must hold one value a row (", rows, ")");
  check_quant_rows(p, slots.data_ptr<int64_t>(), row_seq.data_ptr<int64_t>(), positions.data_ptr<int64_t>(), rows);
  check_norms(q_norm, k_norm, dim);
  at::Tensor q = at::empty({rows, heads, dim}, qkv.options());
  quant_rope_store_into(qkv.data_ptr<float>(), rows, cos.data_ptr<float>(), sin.data_ptr<float>(), pool,
                        slots.data_ptr<int64_t>(), row_seq.data_ptr<int64_t>(), positions.data_ptr<int64_t>(), heads,
                        data_or_null(q_norm), data_or_null(k_norm), q_eps, k_eps, bits, sinks, q.data_ptr<float>());
  return q;
}

// ==== quantized pool: attention ====

void quant_attention_into(const AttentionPlan& step_plan, const float* q, int64_t heads,
                          const std::vector<at::Tensor>& pool, const int32_t* table, int64_t max_blocks,
                          const int64_t* length, const float* cos_table, const float* sin_table, int64_t bits,
                          int64_t sinks, double scale, float* out, float* partials) {
  const Plan& plan = step_plan.plan;
  const std::vector<int64_t>& stored = step_plan.stored;
  const QuantPool p = quant_pool(pool, bits, sinks);
  const int64_t group = plan.group, dim = p.dim;
  const float s = static_cast<float>(scale);
  const QuantUnits units{sinks, p.block};
  const int64_t unit_rows = std::max(p.block, sinks);
  dispatch_bits(bits, [&](auto bits_constant) {
    constexpr int kBits = decltype(bits_constant)::value;
    with_vecs(dim, [&](auto vecs) {
      constexpr int V = decltype(vecs)::value;
      run_plan<float>(plan, heads, out, partials, [&](const Task& task, const Tile& tile,
                                                      std::vector<TileState<float>>& states) {
        const int64_t ld = batch_positions(unit_rows);
        for (int64_t g = task.g_begin; g < task.g_end; ++g)
          states[g].start(tile, g, q, heads, group, dim, s, length, ld);
        thread_local std::vector<float> buffer;  // values of a batch, keys of a unit (V odd or 0), block ranges
        buffer.resize((ld + unit_rows + 2) * dim);
        float* values = buffer.data();
        float* keys = values + ld * dim;
        float* scratch = keys + unit_rows * dim;
        const int32_t* row = table + tile.seq * max_blocks;
        // The units of the batch from u on: as many as fit in ld positions (at least one).
        const auto batch_end = [&](int64_t u) {
          int64_t end = u, positions = 0;
          while (end < task.unit_end && (end == u || positions + units.span(end, tile.length).second <= ld))
            positions += units.span(end++, tile.length).second;
          return end;
        };
        // A batch of units at a time for every kv head in turn: the batch's rotary rows are read from memory once.
        // The next batch's blocks are asked for while this one is computed (a batch ahead: some microseconds, more
        // than a memory access takes).
        for (int64_t u = task.unit_begin, end = batch_end(u); u < task.unit_end; u = end, end = batch_end(u)) {
          if (u == task.unit_begin)
            for (int64_t g = task.g_begin; g < task.g_end; ++g)
              for (int64_t v = u; v < end; ++v)
                prefetch_unit(p, units, row, tile.seq, g, v, tile.length, stored[tile.seq]);
          if (end < task.unit_end) {
            const int64_t after = batch_end(end);
            for (int64_t g = task.g_begin; g < task.g_end; ++g)
              for (int64_t v = end; v < after; ++v)
                prefetch_unit(p, units, row, tile.seq, g, v, tile.length, stored[tile.seq]);
          }
          for (int64_t g = task.g_begin; g < task.g_end; ++g) {
            for (int64_t v = u; v < end; ++v) {
              add_unit<V, kBits>(states[g], p, units, row, tile.seq, g, v, tile.length, stored[tile.seq], cos_table,
                                 sin_table, keys, values, scratch);
            }
            states[g].template flush<V>();
          }
        }
      });
    });
  });
}

// q: [rows, heads, dim] fp32, pool: the 11 tensors (file header), tables: [S, M] int32, row_seq, lengths: [rows]
// int64, cos_table, sin_table: [max_positions, dim] fp32 -> out: [rows, heads * dim] fp32
// paged_attention over the quantized pool, reading the codes directly (file header): a task covers all kv heads of
// its tile, batch by batch, so that a batch's rotary rows come from memory once for all of them.
at::Tensor quant_attention(const at::Tensor& q_in, const std::vector<at::Tensor>& pool, const at::Tensor& tables_in,
                           const at::Tensor& row_seq_in, const at::Tensor& lengths_in, const at::Tensor& cos_in,
                           const at::Tensor& sin_in, int64_t bits, int64_t sinks, double scale) {
  const at::Tensor q = input(q_in, at::kFloat, "q");
  const at::Tensor tables = input(tables_in, at::kInt, "tables");
  const at::Tensor row_seq = input(row_seq_in, at::kLong, "row_seq");
  const at::Tensor lengths = input(lengths_in, at::kLong, "lengths");
  const at::Tensor cos_table = input(cos_in, at::kFloat, "cos_table");
  const at::Tensor sin_table = input(sin_in, at::kFloat, "sin_table");
  const QuantPool p = quant_pool(pool, bits, sinks);
  TORCH_CHECK(q.dim() == 3, "q must be [rows, heads, dim]");
  check_rows(q.size(0), q.size(1), row_seq, lengths, tables, p.kv_heads, p.block, p.blocks);
  TORCH_CHECK(q.size(2) == p.dim, "queries have ", q.size(2), " values per head, the pool ", p.dim);
  TORCH_CHECK(tables.size(0) == p.sequences, "tables have ", tables.size(0), " sequences, the pool's buffers ",
              p.sequences);
  const int64_t rows = q.size(0), heads = q.size(1);
  const int64_t* seq = row_seq.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const AttentionPlan plan{quant_plan(p, seq, length, rows, heads, sinks),
                           stored_lengths(p, seq, length, rows, cos_table, sin_table)};
  at::Tensor out = at::empty({rows, heads * p.dim}, q.options());
  std::vector<float> partials(plan.plan.partial_floats);
  quant_attention_into(plan, q.data_ptr<float>(), heads, pool, tables.data_ptr<int32_t>(), tables.size(1), length,
                       cos_table.data_ptr<float>(), sin_table.data_ptr<float>(), bits, sinks, scale,
                       out.data_ptr<float>(), partials.data());
  return out;
}

// ==== the step's attention: its checks and its plan ====

void check_pool_layer(const std::vector<at::Tensor>& pool, bool quantized, int64_t bits, int64_t sinks,
                      const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm) {
  if (quantized) {
    check_norms(q_norm, k_norm, quant_pool(pool, bits, sinks).dim);
    return;
  }
  TORCH_CHECK(pool.size() == 2, "a float pool's layer is its keys and values");
  check_float_pool(pool[0], pool[1]);
  check_norms(q_norm, k_norm, pool[0].size(3));
}

void check_step_rows(const std::vector<at::Tensor>& pool, bool quantized, int64_t bits, int64_t sinks, int64_t heads,
                     int64_t rows, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                     const at::Tensor& row_seq, const at::Tensor& positions, const at::Tensor& lengths,
                     const at::Tensor& tables, const at::Tensor& cos_table, const at::Tensor& sin_table) {
  check_cpu(cos, at::kFloat, "cos");
  check_cpu(sin, at::kFloat, "sin");
  for (const auto& [t, name] : {std::pair{&slots, "slots"}, {&row_seq, "row_seq"}, {&positions, "positions"},
                                {&lengths, "lengths"}}) {
    check_cpu(*t, at::kLong, name);
    TORCH_CHECK(t->numel() == rows, name, " must hold one value a row (", rows, ")");
  }
  check_cpu(tables, at::kInt, "tables");
  const int64_t* seq = row_seq.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  int64_t kv_heads, block, blocks, dim;
  if (quantized) {
    const QuantPool p = quant_pool(pool, bits, sinks);
    kv_heads = p.kv_heads, block = p.block, blocks = p.blocks, dim = p.dim;
    check_quant_rows(p, slots.data_ptr<int64_t>(), seq, positions.data_ptr<int64_t>(), rows);
    TORCH_CHECK(tables.size(0) == p.sequences, "tables have ", tables.size(0), " sequences, the pool's buffers ",
                p.sequences);
    check_cpu(cos_table, at::kFloat, "cos_table");
    check_cpu(sin_table, at::kFloat, "sin_table");
    stored_lengths(p, seq, length, rows, cos_table, sin_table);
  } else {
    kv_heads = pool[0].size(1), block = pool[0].size(2), blocks = pool[0].size(0), dim = pool[0].size(3);
    check_slots(slots.data_ptr<int64_t>(), rows, blocks * block);
  }
  TORCH_CHECK(cos.numel() == rows * dim && sin.numel() == rows * dim, "cos and sin must hold ", rows,
              " positions of ", dim, " values");
  check_rows(rows, heads, row_seq, lengths, tables, kv_heads, block, blocks);
}

std::shared_ptr<const AttentionPlan> plan_attention(const std::vector<at::Tensor>& pool, bool quantized, int64_t bits,
                                                    int64_t sinks, int64_t heads, const at::Tensor& row_seq,
                                                    const at::Tensor& lengths, const at::Tensor& cos_table,
                                                    const at::Tensor& sin_table) {
  const int64_t rows = row_seq.numel();
  const int64_t* seq = row_seq.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  if (!quantized)
    return std::make_shared<const AttentionPlan>(AttentionPlan{
        float_plan(seq, length, rows, heads, pool[0].size(1), pool[0].size(3), pool[0].size(2)), {}});
  const QuantPool p = quant_pool(pool, bits, sinks);
  return std::make_shared<const AttentionPlan>(AttentionPlan{
      quant_plan(p, seq, length, rows, heads, sinks), stored_lengths(p, seq, length, rows, cos_table, sin_table)});
}

int64_t attention_partial_floats(const AttentionPlan& plan) { return plan.plan.partial_floats; }

// pool: the 11 tensors (file header), table: [M] int32, cos_table, sin_table: [max_positions, dim] fp32
// -> (keys, values): [kv_heads, length, dim] fp32 each
// The keys (rotated) and values of positions 0..length-1 of sequence `seq` (stored up to `length`), decoded as
// quant_attention reads them: for tests and checks.
std::tuple<at::Tensor, at::Tensor> quant_gather(const std::vector<at::Tensor>& pool, const at::Tensor& table_in,
                                                int64_t seq, int64_t length, const at::Tensor& cos_in,
                                                const at::Tensor& sin_in, int64_t bits, int64_t sinks) {
  const at::Tensor table = input(table_in, at::kInt, "table");
  const at::Tensor cos_table = input(cos_in, at::kFloat, "cos_table");
  const at::Tensor sin_table = input(sin_in, at::kFloat, "sin_table");
  const QuantPool p = quant_pool(pool, bits, sinks);
  const int64_t kv_heads = p.kv_heads, block = p.block, dim = p.dim;
  TORCH_CHECK(table.dim() == 1, "table must be one sequence's row [max_blocks]");
  TORCH_CHECK(seq >= 0 && seq < p.sequences, "sequence ", seq, " is outside 0..", p.sequences - 1);
  TORCH_CHECK(length >= 0 && length <= table.numel() * block, "length ", length, " is outside 0..",
              table.numel() * block);
  TORCH_CHECK(cos_table.dim() == 2 && cos_table.size(1) == dim && cos_table.size(0) >= length &&
                  sin_table.sizes() == cos_table.sizes(),
              "cos_table and sin_table must be [max_positions >= ", length, ", ", dim, "]");
  const int32_t* entries = table.data_ptr<int32_t>();
  for (int64_t b = 0; b * block < length; ++b)
    TORCH_CHECK(entries[b] >= 0 && entries[b] < p.blocks, "block ", b, " is pool block ", entries[b],
                ", outside 0..", p.blocks - 1);
  at::Tensor keys = at::empty({kv_heads, length, dim}, cos_table.options());
  at::Tensor values = at::empty({kv_heads, length, dim}, cos_table.options());
  float* pk = keys.data_ptr<float>();
  float* pv = values.data_ptr<float>();
  const QuantUnits units{sinks, block};
  dispatch_bits(bits, [&](auto bits_constant) {
    constexpr int kBits = decltype(bits_constant)::value;
    at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(2 * dim);
      for (int64_t g = begin; g < end; ++g)
        for (int64_t u = 0; u < units.count(length); ++u) {
          const int64_t first = units.span(u, length).first;
          decode_keys<kBits>(p, units, entries, seq, g, u, length, length, cos_table.data_ptr<float>(),
                             sin_table.data_ptr<float>(), scratch.data(), pk + (g * length + first) * dim);
          decode_unit_values<kBits>(p, units, entries, seq, g, u, length, pv + (g * length + first) * dim);
        }
    });
  });
  return {keys, values};
}
