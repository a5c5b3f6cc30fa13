// The W4A8 weights as matmul_kernels.cpp's VNNI loop and w4a8_amx.cpp's AMX tiles both read them, and the AMX entry
// point the VNNI loop's operator calls for a prompt's rows. Outside any anonymous namespace: the two files share
// the type.

#pragma once

#include <cstdint>

// The weights of a W4A8 layer, tiled for the integer dot product (kernels/cpu.py `tile_int4_codes` makes them):
// `tiled` [tiles, blocks, 16, 4] uint8 holds, for each tile of 16 output channels and each block of 8 input
// columns, 4 bytes a channel: byte c has column 8b + c in its low nibble and column 8b + 4 + c in its high one, the
// nibble being u = code + 8 in [0, 15]. One 64-byte load gives 16 channels x 8 columns, so the 32-bit lanes of a
// vector are output channels and each takes 4 activation bytes broadcast to all lanes: no horizontal sums, and the
// activations are read in their natural order.
// `scales` [groups, padded out] fp32 and `offsets` [groups, padded out] int32 (8 + zero, so that
// sum_i (code_i - zero) qx_i = sum_i u_i qx_i - offset * sum_i qx_i, exact in int32 per group). `group_size` is
// the columns a group spans (the padded row when one group covers it).
// `uniform_offset`, where not 0, says every offset equals it (symmetric weights: 8), so a group's sums can start at
// -offset * the activations' sum instead of taking a per-channel product after (the same integers).
struct Int4TiledWeights {
  const uint8_t* tiled;
  const float* scales;
  const int32_t* offsets;
  int64_t tiles, blocks, groups, group_size, out;
  int32_t uniform_offset = 0;
};

// Whether this CPU and OS run AMX's int8 tiles (asks Linux for the tile state once).
bool amx_int8_usable();

// y [rows, out] for qx [rows, stride] int8 (stride = blocks * 8, zero past the row) and x_scales [rows]: the VNNI
// loop's result, bit for bit, on AMX. False (nothing written) where AMX is not usable here or the offsets do not fit
// its signed bytes.
bool int4_int8_matmul_amx(const Int4TiledWeights& w, const int8_t* qx, int64_t rows, int64_t stride,
                          const float* x_scales, float* y);
