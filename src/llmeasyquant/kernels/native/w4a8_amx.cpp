// W4A8 for a prompt's many rows on AMX's int8 tiles (matmul_kernels.cpp's int4_int8_matmul calls it where the CPU
// and the kernel allow; kernels/native.py builds it with the other files). A tile multiply-add (tdpbusd) makes
// 16 x 16 x 64 products of unsigned by signed bytes in one instruction, where the VNNI loop spends one instruction on
// 16 x 4 and an unpack a block: a 512-row GEMM of SmolLM2's shapes takes 0.55-0.63 of the VNNI loop's time on the
// Xeon of docs/RESULTS.md ("W4A8 prefill on AMX tiles").
//
// The operands, per group of weight columns (exact int32 sums per group, as the VNNI loop):
//   A: the activations as unsigned bytes a = qx + 128, [16 rows, step] a tile;
//   B: the stored nibbles u = code + 8 (signed bytes in [0, 15]), [step / 4, 16 channels x 4] a tile. The W4A8
//      tiles of kernels/cpu.py `tile_int4_codes` are this layout already: a 64-byte block's low nibbles are the
//      columns 8b..8b+3 of 16 channels, 4 bytes each, its high nibbles the columns 8b+4..8b+7.
//   C = sum a u = sum qx u + 128 sum u, and the wanted sum qx (u - offset) = C - 128 sum u - offset sum qx.
// The int32 sums are those of the VNNI loop, and the fp32 steps after them are the same in the same order: the
// same bits (tests/kernels/test_kernels.py).

#include "common.h"
#include "w4a8_tiles.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define LLMEASYQUANT_AMX 1
#endif

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(LLMEASYQUANT_AMX)
namespace {

constexpr int64_t kAmxRows = 32;       // rows a pass: two A tiles
constexpr int64_t kAmxChannels = 32;   // channels a pass: two B tiles, so four C tiles of 16 x 16 int32
constexpr int64_t kAmxMaxStep = 64;    // bytes of a row an A tile holds
constexpr int64_t kAmxChunkBytes = 1 << 20;  // activations a pass over the channels reads (kept in L2)
constexpr long kArchRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
constexpr long kTileData = 18;                   // XFEATURE_XTILEDATA

// The layout ldtilecfg reads (palette 1): bytes per row and rows of each of the 16 tile registers.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (rows r..r+15 or r+16..r+31 by channels c..c+15 or c+16..c+31); 4, 5: A; 6, 7: B.
TileConfig tile_config(int64_t step) {
  TileConfig config;
  for (int i = 0; i < 4; ++i) {
    config.colsb[i] = 64;
    config.rows[i] = 16;
  }
  for (int i = 4; i < 6; ++i) {
    config.colsb[i] = static_cast<uint16_t>(step);
    config.rows[i] = 16;
  }
  for (int i = 6; i < 8; ++i) {
    config.colsb[i] = 64;
    config.rows[i] = static_cast<uint8_t>(step / 4);
  }
  return config;
}

// The largest A tile width (a multiple of 8 up to 64) that divides a group: tiles never straddle two groups.
int64_t tile_step(int64_t span) {
  for (int64_t step = kAmxMaxStep; step > 8; step /= 2)
    if (span % step == 0) return step;
  return 8;
}

// One tile of 16 channels for B, [kpad / 4 rows of 64 bytes]: per block the low nibbles, then the high ones, each
// less its channel's offset (e = u - offset = code - zero, signed bytes: the operator checks that they fit), zero
// past the stored blocks. And per group and channel `bias` = 128 sum e, so that the exact sum is C - bias with no
// term per row, and the group's scales (`scales` [groups, 16]). A missing tile (an odd count's last strip) is zero.
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void unpack_tile(const Int4TiledWeights& w, int64_t tile, int64_t kpad, int8_t* b, int32_t* bias, float* scales) {
  std::memset(b, 0, kpad * 16);
  std::memset(bias, 0, w.groups * 16 * sizeof(int32_t));
  std::memset(scales, 0, w.groups * 16 * sizeof(float));
  if (tile >= w.tiles) return;
  const int64_t padded = w.tiles * 16;
  const __m512i low_mask = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi8(1);
  for (int64_t g = 0; g < w.groups; ++g) {
    // Each channel's offset, its low byte (bytes subtract modulo 256), in all 4 bytes of its 32-bit lane.
    const __m512i offset = _mm512_mullo_epi32(
        _mm512_and_si512(_mm512_loadu_si512(w.offsets + g * padded + tile * 16), _mm512_set1_epi32(0xFF)),
        _mm512_set1_epi32(0x01010101));
    __m512i sum = _mm512_setzero_si512();
    const int64_t last = std::min(w.blocks, (g + 1) * w.group_size / 8);
    for (int64_t block = g * w.group_size / 8; block < last; ++block) {
      const __m512i bytes = _mm512_loadu_si512(w.tiled + (tile * w.blocks + block) * 64);
      const __m512i low = _mm512_sub_epi8(_mm512_and_si512(bytes, low_mask), offset);
      const __m512i high = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_mask), offset);
      _mm512_storeu_si512(b + block * 128, low);
      _mm512_storeu_si512(b + block * 128 + 64, high);
      sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum, ones, low), ones, high);
    }
    _mm512_storeu_si512(bias + g * 16, _mm512_slli_epi32(sum, 7));
    _mm512_storeu_ps(scales + g * 16, _mm512_loadu_ps(w.scales + g * padded + tile * 16));
  }
}

// y for rows [first, first + stored) and channel strips [begin, end) of 32 (two tiles); `a` [count, kpad] holds
// qx + 128 for those rows, count a multiple of 32 (the rows past `stored` are computed and not written).
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni")))
void w4a8_amx_strips(const Int4TiledWeights& w, const uint8_t* a, int64_t kpad, int64_t first, int64_t count,
                     int64_t stored, const float* x_scales, float* y, int64_t begin, int64_t end) {
  const int64_t step = tile_step(w.group_size);
  const TileConfig config = tile_config(step);
  _tile_loadconfig(&config);
  std::vector<int8_t> b(2 * kpad * 16);
  std::vector<int32_t> bias(2 * w.groups * 16);
  std::vector<float> scales(2 * w.groups * 16);
  alignas(64) int32_t c[4][16][16];
  alignas(64) float total[kAmxRows][kAmxChannels];
  for (int64_t strip = begin; strip < end; ++strip) {
    const int64_t t = strip * 2;
    for (int64_t half = 0; half < 2; ++half)
      unpack_tile(w, t + half, kpad, b.data() + half * kpad * 16, bias.data() + half * w.groups * 16,
                  scales.data() + half * w.groups * 16);
    for (int64_t r0 = 0; r0 < count; r0 += kAmxRows) {
      std::memset(total, 0, sizeof(total));
      for (int64_t g = 0; g < w.groups; ++g) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = g * w.group_size; k < (g + 1) * w.group_size; k += step) {
          _tile_loadd(4, a + (r0 + 0) * kpad + k, kpad);
          _tile_loadd(5, a + (r0 + 16) * kpad + k, kpad);
          _tile_loadd(6, b.data() + k * 16, 64);
          _tile_loadd(7, b.data() + kpad * 16 + k * 16, 64);
          _tile_dpbusd(0, 4, 6);
          _tile_dpbusd(1, 4, 7);
          _tile_dpbusd(2, 5, 6);
          _tile_dpbusd(3, 5, 7);
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        for (int half = 0; half < 2; ++half) {
          const __m512i group_bias = _mm512_loadu_si512(bias.data() + (half * w.groups + g) * 16);
          const __m512 scale = _mm512_loadu_ps(scales.data() + (half * w.groups + g) * 16);
#pragma GCC unroll 32
          for (int r = 0; r < kAmxRows; ++r) {
            const __m512i exact = _mm512_sub_epi32(_mm512_load_si512(c[(r / 16) * 2 + half][r % 16]), group_bias);
            float* acc = total[r] + half * 16;
            if (w.groups > 1) {
              _mm512_store_ps(acc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, _mm512_load_ps(acc)));
            } else {
              _mm512_store_si512(acc, exact);  // the int32 sum, turned to float below as the VNNI loop does
            }
          }
        }
      }
      for (int64_t half = 0; half < 2 && t + half < w.tiles; ++half) {
        const int64_t o = (t + half) * 16;
        const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, w.out - o)) - 1);
        const __m512 scale = _mm512_loadu_ps(scales.data() + half * w.groups * 16);
        for (int64_t r = 0; r < std::min<int64_t>(kAmxRows, stored - r0); ++r) {
          const int64_t row = first + r0 + r;
          const __m512 xs = _mm512_set1_ps(x_scales[row]);
          const float* acc = total[r] + half * 16;
          const __m512 result =
              w.groups > 1 ? _mm512_mul_ps(_mm512_load_ps(acc), xs)
                           : _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(acc)), xs), scale);
          _mm512_mask_storeu_ps(y + row * w.out + o, mask, result);
        }
      }
    }
  }
  _tile_release();
}

}  // namespace
#endif

bool amx_int8_usable() {
#if defined(LLMEASYQUANT_AMX)
  static const bool usable = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = edx & (1u << 24), int8 = edx & (1u << 25), vnni = ecx & (1u << 11);
    // Linux hands a process the tiles' 8 KB of register state only when asked (once, for all its threads).
    return tile && int8 && vnni && syscall(SYS_arch_prctl, kArchRequestPermission, kTileData) == 0;
  }();
  return usable;
#else
  return false;
#endif
}

bool int4_int8_matmul_amx(const Int4TiledWeights& w, const int8_t* qx, int64_t rows, int64_t stride,
                          const float* x_scales, float* y) {
#if defined(LLMEASYQUANT_AMX)
  if (!amx_int8_usable()) return false;
  // The weights become signed bytes e = u - offset with u in [0, 15]: offsets past [-112, 128] (zero points far
  // outside the 4-bit range) stay on the VNNI loop.
  const int32_t* offsets_end = w.offsets + w.groups * w.tiles * 16;
  if (std::any_of(w.offsets, offsets_end, [](int32_t offset) { return offset < -112 || offset > 128; })) return false;
  const int64_t kpad = w.groups * w.group_size;
  const int64_t chunk = std::max<int64_t>(kAmxRows, kAmxChunkBytes / kpad / kAmxRows * kAmxRows);
  const int64_t strips = (w.tiles + 1) / 2;
  std::vector<uint8_t> a(std::min(chunk, (rows + kAmxRows - 1) / kAmxRows * kAmxRows) * kpad);
  for (int64_t first = 0; first < rows; first += chunk) {
    const int64_t stored = std::min(chunk, rows - first);
    const int64_t count = (stored + kAmxRows - 1) / kAmxRows * kAmxRows;
    // qx + 128 as unsigned bytes (the XOR flips the sign bit). Columns past the row and rows past the end read 128:
    // their products are in each group's bias (past the stored blocks the weights are zero) or never stored.
    std::memset(a.data(), 0x80, count * kpad);
    for_rows(stored, kpad, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int8_t* source = qx + (first + r) * stride;
        uint8_t* target = a.data() + r * kpad;
        for (int64_t i = 0; i < stride; ++i) target[i] = static_cast<uint8_t>(source[i]) ^ 0x80;
      }
    });
    at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
      w4a8_amx_strips(w, a.data(), kpad, first, count, stored, x_scales, y, begin, end);
    });
  }
  return true;
#else
  (void)w, (void)qx, (void)rows, (void)stride, (void)x_scales, (void)y;
  return false;
#endif
}
