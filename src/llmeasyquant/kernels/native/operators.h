// Every operator the extension exports, with its contract: bindings.cpp registers them by name for Python, and
// native_step.cpp chains them in C++ (the engine's step). Each is defined in the file its section names.

#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <tuple>
#include <vector>

// ==== the step's forms ====

// StepProgram's team (native_step.cpp) calls the operators below in a form of their own: raw rows in, results into
// rows it holds (no tensor made per call), every thread of the team calling each with the same arguments (common.h).
// Each operator above is its step form with the input checks and its output allocated.

// What a step-form matmul does with each result y[r, o]: adds bias[o] (fp32; none where null), then stores the sum
// or, with `accumulate`, adds it to what the output holds (the residual stream: x += o(attention)). Each addition is
// rounded on its own, as the per-op path's separate operators round it.
struct Epilogue {
  const float* bias = nullptr;
  bool accumulate = false;
};

// ==== decoder operators (decoder_ops.cpp) ====

// x: [..., width] fp32, weight: [width] fp32 -> [..., width] fp32
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps);
void rms_norm_into(const float* x, const float* weight, double eps, int64_t rows, int64_t width, float* y);
// qkv: [rows, (heads + 2 * kv_heads) * dim] fp32, cos, sin: [rows, dim] fp32, keys, values: [kv_heads, max, dim] fp32
// (written in place), q_norm, k_norm: [dim] fp32 or absent -> q: [rows, heads, dim] fp32
at::Tensor rope_store(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in, at::Tensor keys,
                      at::Tensor values, int64_t pos, int64_t heads, const c10::optional<at::Tensor>& q_norm,
                      const c10::optional<at::Tensor>& k_norm, double q_eps, double k_eps);
// q: [heads, dim] or [1, heads, dim] fp32, keys, values: [kv_heads, max, dim] fp32 -> [1, heads * dim] fp32
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values, int64_t length,
                            double scale);
// q: [rows, heads, dim] fp32, keys, values: [kv_heads, max, dim] fp32 -> [rows, heads * dim] fp32
at::Tensor causal_attention(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                            double scale);
// wanted: bool -> bool (whether causal_attention now calls BLAS)
bool use_blas(bool wanted);
// gate_up: [rows, 2 * width] fp32, activation (step_kinds.h) -> act(gate) * up [rows, width] fp32
at::Tensor gate_mul(const at::Tensor& gate_up_in, int64_t activation);
void gate_mul_into(int64_t activation, const float* gate_up, int64_t rows, int64_t width, float* out);
// x: [rows, in] fp32, qmax: the largest code (127 or 7) -> (codes: [rows, in] int8, scales: [rows, 1] fp32)
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x_in, double min_scale, int64_t qmax);
// codes: [rows, in] int8, scales: [rows] fp32
void quantize_rows_into(const float* x, int64_t rows, int64_t width, double min_scale, int64_t qmax, int8_t* codes,
                        float* scales);
// x: [rows, in] fp32, [qmin, qmax]: the code range -> (codes: [rows, in] int8, scales: [rows, 1] fp32, zeros: [rows, 1] int32)
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_asym(const at::Tensor& x_in, double min_scale,
                                                                  int64_t qmin, int64_t qmax);
// acc: [rows, out] int32, row_scales: [rows, 1] fp32, column_scales: [out] fp32 -> [rows, out] fp32
at::Tensor dequantize_rows(const at::Tensor& acc_in, const at::Tensor& row_scales_in,
                           const at::Tensor& column_scales_in);

// x: [rows, width] fp32, signs: [width] fp32, odd: [m, m] fp32 -> [rows, width] fp32 (x diag(signs) (H ⊗ odd) / sqrt(H's order))
at::Tensor hadamard_transform(const at::Tensor& x_in, const at::Tensor& signs_in, const at::Tensor& odd_in);
// x: [rows, width] fp32, fractions: [F] fp32 -> [rows, width] fp32 (each row clamped to the fraction of its range that
// rounds it to `bits`-bit dynamic codes with the least squared error)
at::Tensor search_clip_rows(const at::Tensor& x_in, int64_t bits, bool symmetric, const at::Tensor& fractions_in,
                            double min_scale);

// ==== matmul kernels (matmul_kernels.cpp) ====

// x: [rows, in] fp32, q: [out, in] int8, scales: [out] fp32 -> [rows, out] fp32
at::Tensor int8_weight_matmul(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& scales_in);
// y: [rows, ldy] fp32, columns 0..out-1 written through the epilogue
void int8_weight_matmul_into(const float* x, int64_t rows, int64_t width, const int8_t* q, const float* scales,
                             int64_t out, float* y, int64_t ldy, const Epilogue& epilogue);
// packed: [out, ceil(in / 2)] uint8, scales, zeros: [out, groups] fp32 (zeros absent: symmetric) -> [out, in] fp32
at::Tensor dequantize_int4(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                           int64_t in_features, int64_t group_size);
// x: [rows, in] fp32, packed, scales, zeros, in, group as dequantize_int4 -> [rows, out] fp32: that weight and x
// rounded to bf16, multiplied by PyTorch's bf16 GEMM a block of channels at a time, outputs rounded to bf16
at::Tensor int4_bf16_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& zeros, int64_t in_features, int64_t group_size);
// x: [rows, in] fp32, packed, scales, zeros as dequantize_int4 -> [rows, out] fp32
// (bf16_dot: take the bf16 dot-product path where this build has it)
at::Tensor int4_weight_matmul(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, int64_t group_size, bool bf16_dot);
bool bf16_dot_built();
// x: [rows, in] fp32, packed, scales, zeros as dequantize_int4 -> [rows, out] fp32 (x as 16-bit fixed point)
at::Tensor int4_digits_matmul(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, int64_t group_size);
// The checks of int4_digits_matmul's weights for rows of `width` values.
void check_int4_digits(int64_t width, const at::Tensor& packed, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& zeros, int64_t group_size);
// x: [rows, in] fp32 (weights that pass check_int4_digits), y as int8_weight_matmul_into's
void int4_digits_matmul_into(const float* x, int64_t rows, int64_t width, const at::Tensor& packed,
                             const at::Tensor& scales, const c10::optional<at::Tensor>& zeros, int64_t group_size,
                             float* y, int64_t ldy, const Epilogue& epilogue);
// packed, scales as int4_digits_matmul's -> [ceil(out / 8), ceil(in / 128), bytes] uint8: the codes and scales as
// weight tiles of 8 channels x 128 columns (matmul_kernels.cpp says why and how)
at::Tensor int4_tiles_pack(const at::Tensor& packed, const at::Tensor& scales, int64_t in_features, int64_t group_size);
// The checks of int4_tiles_matmul's weights for rows of `width` values and out_features channels.
void check_int4_tiles(int64_t width, const at::Tensor& tiles, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& zeros, int64_t group_size, int64_t out_features);
// x: [rows, in] fp32, tiles from int4_tiles_pack, scales and zeros as int4_digits_matmul's -> [rows, out] fp32
// (int4_digits_matmul's sums bit for bit)
at::Tensor int4_tiles_matmul(const at::Tensor& x_in, const at::Tensor& tiles, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& zeros, int64_t group_size);
// x: [rows, in] fp32 (weights that pass check_int4_tiles), y as int8_weight_matmul_into's
void int4_tiles_matmul_into(const float* x, int64_t rows, int64_t width, const at::Tensor& tiles,
                            const at::Tensor& scales, const c10::optional<at::Tensor>& zeros, int64_t group_size,
                            int64_t out_features, float* y, int64_t ldy, const Epilogue& epilogue);
// packed, scales as dequantize_int4, levels: [16] or [out, 16] fp32 (a non-uniform grid) -> [out, in] fp32
at::Tensor dequantize_int4_levels(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& levels_in,
                                  int64_t in_features, int64_t group_size);
// x: [rows, in] fp32, packed, scales, levels as dequantize_int4_levels -> [rows, out] fp32
at::Tensor int4_levels_matmul(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales,
                              const at::Tensor& levels_in, int64_t group_size);

// qx: [rows, in] int8, x_scales: [rows, 1] fp32, tiled: [tiles, blocks, 16, 4] uint8, scales: [groups, tiles * 16]
// fp32, offsets: [groups, tiles * 16] int32 -> [rows, out] fp32; amx: 1 (the default) takes AMX's tiles for calls
// large enough to gain, 0 never, 2 whenever this CPU has them (tests)
at::Tensor int4_int8_matmul(const at::Tensor& qx_in, const at::Tensor& x_scales_in, const at::Tensor& tiled,
                            const at::Tensor& scales, const at::Tensor& offsets, int64_t group_size,
                            int64_t out_features, int64_t amx);
// The checks of int4_int8_matmul's weights for rows of `width` columns, a multiple of 8 (the step form's).
void check_int4_int8(int64_t width, const at::Tensor& tiled, const at::Tensor& scales, const at::Tensor& offsets,
                     int64_t group_size, int64_t out_features);
// qx: [rows, width] int8, x_scales: [rows, xg] fp32 (xg: 1, or the weights' groups), the weights as check_int4_int8
// takes them, uniform_offset as uniform_offset(offsets) gives it; y as int8_weight_matmul_into's (never on AMX: the
// step's few rows take the VNNI loop)
void int4_int8_matmul_into(const int8_t* qx, const float* x_scales, int64_t xg, int64_t rows, int64_t width,
                           const at::Tensor& tiled, const at::Tensor& scales, const at::Tensor& offsets,
                           int64_t group_size, int64_t out_features, int32_t uniform_offset, float* y, int64_t ldy,
                           const Epilogue& epilogue);
// The offset every entry of a W4A8 layer's offsets equals (8 for symmetric weights), or 0 where they differ: read
// once when a step is built, so that the kernel can start each group's sums at -offset * the activations' sum.
int32_t uniform_offset(const at::Tensor& offsets);
// x: [rows, in] fp32, tiled, scales as int4_int8_matmul's, offsets (8 + zero) only where the weights have zero
// points -> [rows, out] fp32: W4A16 on bf16 dot products, the activations rounded to bf16, the weights exact
at::Tensor int4_bf16_tiles_matmul(const at::Tensor& x_in, const at::Tensor& tiled, const at::Tensor& scales,
                                  const c10::optional<at::Tensor>& offsets, int64_t group_size, int64_t out_features);
// Whether this CPU and OS run AMX's int8 tiles (w4a8_amx.cpp)
bool amx_int8_usable();
// qx: [rows, in] int8, x_scales: [rows, 1] fp32, q: [out, in] int8, w_scales: [out] fp32, w_sums: [out] int32
// -> y: [rows, out] fp32
at::Tensor int8_int8_matmul(const at::Tensor& qx_in, const at::Tensor& x_scales_in, const at::Tensor& q_in,
                            const at::Tensor& w_scales_in, const at::Tensor& w_sums_in);
// x_scales: [rows] fp32, y as int8_weight_matmul_into's
void int8_int8_matmul_into(const int8_t* qx, const float* x_scales, int64_t rows, int64_t width, const int8_t* q,
                           const float* w_scales, const int32_t* w_sums, int64_t out, float* y, int64_t ldy,
                           const Epilogue& epilogue);

// qx, x_scales, q, w_scales as int8_int8_matmul's -> y: [rows, out] fp32, int8_int8_matmul's result with the sums
// taken in fp32 (PyTorch's fp32 GEMM on the codes widened a few MB at a time: rounded only past 2^24)
at::Tensor int8_float_matmul(const at::Tensor& qx_in, const at::Tensor& x_scales_in, const at::Tensor& q_in,
                             const at::Tensor& w_scales_in);

// ==== the read-bandwidth probe (memory_probe.cpp) ====

// buffer: uint8 [n] -> the XOR of its 64-bit words over whole cache lines
int64_t stream_xor(const at::Tensor& buffer);

// ==== the exact sums' cut-and-add (exact_sum_ops.cpp) ====

// term: fp32 [n], high_bin, low_bin: fp64 [n] (added to in place), high_unit, low_unit: powers of two
void exact_cut_add(const at::Tensor& term_in, at::Tensor high_bin, at::Tensor low_bin, double high_unit,
                   double low_unit);

// ==== GPTQ's column loop (gptq_ops.cpp) ====

// w: [rows, B] fp32 (in place), factor: [B, B] fp32, scales, zeros: [rows, B] fp32, codes, errors: [rows, B] fp32
void gptq_block(at::Tensor w, const at::Tensor& factor_in, const at::Tensor& scales_in,
                const c10::optional<at::Tensor>& zeros_in, at::Tensor codes, at::Tensor errors, double qmin_in,
                double qmax_in);

// ==== paged KV pool (paged_ops.cpp) ====

// qkv: [rows, (heads + 2 * kv_heads) * dim] fp32, cos, sin: [rows, dim] fp32, key_pool, value_pool: [N, kv_heads, B,
// dim] fp32 or fp16 (written in place), slots: [rows] int64, q_norm, k_norm: [dim] fp32 or absent
// -> q: [rows, heads, dim] fp32
at::Tensor paged_rope_store(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                            at::Tensor key_pool, at::Tensor value_pool, const at::Tensor& slots_in, int64_t heads,
                            const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                            double q_eps, double k_eps);
// q: [rows, heads, dim] fp32, key_pool, value_pool: [N, kv_heads, B, dim] fp32 or fp16, tables: [S, M] int32,
// row_seq, lengths: [rows] int64 -> [rows, heads * dim] fp32
at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& key_pool, const at::Tensor& value_pool,
                           const at::Tensor& tables_in, const at::Tensor& row_seq_in, const at::Tensor& lengths_in,
                           double scale);
// qkv, cos, sin as paged_rope_store, pool: the quantized pool's 11 tensors (written in place), slots, row_seq,
// positions: [rows] int64 -> q: [rows, heads, dim] fp32
at::Tensor quant_rope_store(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                            const std::vector<at::Tensor>& pool, const at::Tensor& slots_in,
                            const at::Tensor& row_seq_in, const at::Tensor& positions_in, int64_t heads,
                            const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                            double q_eps, double k_eps, int64_t bits, int64_t sinks);
// q: [rows, heads, dim] fp32, pool: the 11 tensors, tables: [S, M] int32, row_seq, lengths: [rows] int64,
// cos_table, sin_table: [max_positions, dim] fp32 -> [rows, heads * dim] fp32
at::Tensor quant_attention(const at::Tensor& q_in, const std::vector<at::Tensor>& pool, const at::Tensor& tables_in,
                           const at::Tensor& row_seq_in, const at::Tensor& lengths_in, const at::Tensor& cos_in,
                           const at::Tensor& sin_in, int64_t bits, int64_t sinks, double scale);
// pool: the 11 tensors, table: [M] int32, cos_table, sin_table: [max_positions, dim] fp32
// -> (keys, values): [kv_heads, length, dim] fp32
std::tuple<at::Tensor, at::Tensor> quant_gather(const std::vector<at::Tensor>& pool, const at::Tensor& table_in,
                                                int64_t seq, int64_t length, const at::Tensor& cos_in,
                                                const at::Tensor& sin_in, int64_t bits, int64_t sinks);

// ==== paged KV pool: the step's forms (paged_ops.cpp) ====

// The stores write q [rows, heads, dim] fp32; the attention operators read it and write out [rows, heads * dim] fp32,
// with `partials` (attention_partial_floats of the plan) as their scratch, shared by the team.
void paged_rope_store_into(const float* qkv, int64_t rows, const float* cos, const float* sin,
                           const at::Tensor& key_pool, const at::Tensor& value_pool, const int64_t* slots,
                           int64_t heads, const float* q_norm, const float* k_norm, double q_eps, double k_eps,
                           float* q);
void quant_rope_store_into(const float* qkv, int64_t rows, const float* cos, const float* sin,
                           const std::vector<at::Tensor>& pool, const int64_t* slots, const int64_t* row_seq,
                           const int64_t* positions, int64_t heads, const float* q_norm, const float* k_norm,
                           double q_eps, double k_eps, int64_t bits, int64_t sinks, float* q);
// The tasks of a step's attention (tiles of rows, pieces of their positions): the rows' sequences and lengths and
// the pool's shape make them, the same in every layer, so a step plans once for all its layers.
struct AttentionPlan;
std::shared_ptr<const AttentionPlan> plan_attention(const std::vector<at::Tensor>& pool, bool quantized, int64_t bits,
                                                    int64_t sinks, int64_t heads, const at::Tensor& row_seq,
                                                    const at::Tensor& lengths, const at::Tensor& cos_table,
                                                    const at::Tensor& sin_table);
int64_t attention_partial_floats(const AttentionPlan& plan);
void paged_attention_into(const AttentionPlan& plan, const float* q, int64_t heads, const at::Tensor& key_pool,
                          const at::Tensor& value_pool, const int32_t* tables, int64_t max_blocks,
                          const int64_t* lengths, double scale, float* out, float* partials);
void quant_attention_into(const AttentionPlan& plan, const float* q, int64_t heads,
                          const std::vector<at::Tensor>& pool, const int32_t* tables, int64_t max_blocks,
                          const int64_t* lengths, const float* cos_table, const float* sin_table, int64_t bits,
                          int64_t sinks, double scale, float* out, float* partials);
// Checks a layer of the pool (its keys and values, or the 11 coded tensors) and its q/k norms, then a step's rows
// against such a layer, as the store and attention operators check them: the team checks everything before it
// starts (its threads cannot stop halfway).
void check_pool_layer(const std::vector<at::Tensor>& pool, bool quantized, int64_t bits, int64_t sinks,
                      const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm);
void check_step_rows(const std::vector<at::Tensor>& pool, bool quantized, int64_t bits, int64_t sinks, int64_t heads,
                     int64_t rows, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                     const at::Tensor& row_seq, const at::Tensor& positions, const at::Tensor& lengths,
                     const at::Tensor& tables, const at::Tensor& cos_table, const at::Tensor& sin_table);
