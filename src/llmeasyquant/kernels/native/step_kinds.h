// The ways a linear runs inside the native step (native_step.cpp), one definition for C++ and Python: bindings.cpp
// exports the names and numbers as the module's STEP_KINDS, and each kernel of kernels/cpu.py and
// kernels/reference.py names the kind it runs at a row count (its `step_call`). A new kernel is one entry here, one
// case in native_step.cpp's run_linear and one `step_call`.
//
// Each kind lists what its call's tensors a, b, c, d hold (absent: an undefined tensor) and the operators it runs,
// those its kernel's `run` runs for the same rows, in the same order (so the same bits).

#pragma once

#define LLMEASYQUANT_STEP_KINDS(X)                                                                                   \
  /* an nn.Linear: at::linear(x, a = weight, bias) */                                                                \
  X(kFloat, "float")                                                                                                 \
  /* int8_weight_matmul(x, a = codes, b = scales), minus x.sum(1) * c (zero times scale) where c is given */         \
  X(kInt8Weight, "int8_weight")                                                                                      \
  /* _weight_int8pack_mm(bf16 x, a = codes, b = unit scales) * c (scales), minus x.sum(1) * d where d is given */    \
  X(kInt8Pack, "int8_pack")                                                                                          \
  /* quantize_rows(x), int8_int8_matmul(.., a = codes, b = scales, c = code sums) */                                 \
  X(kInt8Int8, "int8_int8")                                                                                          \
  /* quantize_rows(x), _int_mm(.., a = codes as [in, out]), dequantize_rows(.., b = scales) */                       \
  X(kIntMm, "int_mm")                                                                                                \
  /* quantize_rows(x), int8_float_matmul(.., a = codes, b = scales): the int32 sums taken in fp32 */                 \
  X(kInt8Float, "int8_float")                                                                                        \
  /* the codes a dequantized as (a - c) * b (zero points c where given, scales b per group), then x @ w^T */         \
  X(kInt8Dequant, "int8_dequant")                                                                                    \
  /* int4_digits_matmul(x, a = packed, b = scales, c = zeros, group) */                                              \
  X(kInt4Digits, "int4_digits")                                                                                      \
  /* int4_tiles_matmul(x, a = tiles, b = scales, c = zeros, group) */                                                \
  X(kInt4Tiles, "int4_tiles")                                                                                        \
  /* int4_weight_matmul(x, a = packed, b = scales, c = zeros, group, bf16 dot products) */                           \
  X(kInt4Weight, "int4_weight")                                                                                      \
  /* dequantize_int4(a = packed, b = scales, c = zeros, in, group), then x @ w^T */                                  \
  X(kInt4Dequant, "int4_dequant")                                                                                    \
  /* int4_bf16_matmul(x, a = packed, b = scales, c = zeros, in, group) */                                            \
  X(kInt4Bf16, "int4_bf16")                                                                                          \
  /* x padded to padded_in, _weight_int4pack_mm_for_cpu(bf16 x, a = packed, group, b = scales and zeros) */          \
  X(kInt4Pack, "int4_pack")                                                                                          \
  /* per-token (or per-group) activation codes, int4_int8_matmul(.., a = tiles, b = scales, c = offsets), minus the */ \
  /* zero points' term with d (weight sums) when the activations are asymmetric */                                    \
  X(kInt4Int8, "int4_int8")                                                                                          \
  /* int4_bf16_tiles_matmul(x, a = tiles, b = scales, c = offsets where the weights have zero points, group) */        \
  X(kInt4Bf16Tiles, "int4_bf16_tiles")

enum StepKind : int64_t {
#define LLMEASYQUANT_STEP_KIND_ENUM(name, text) name,
  LLMEASYQUANT_STEP_KINDS(LLMEASYQUANT_STEP_KIND_ENUM)
#undef LLMEASYQUANT_STEP_KIND_ENUM
      kStepKinds
};

// The gated MLP's activations, act(gate) * up, one definition for C++ and Python: bindings.cpp exports them as the
// module's GATE_ACTIVATIONS, and runtime/model_parts.py maps a config's `hidden_act` onto them.
#define LLMEASYQUANT_GATE_ACTIVATIONS(X)                                                                             \
  /* gate * sigmoid(gate) (llama, mistral, qwen2, qwen3, phi3) */                                                     \
  X(kSilu, "silu")                                                                                                   \
  /* GELU's tanh approximation, 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) (gemma) */                          \
  X(kGeluTanh, "gelu_tanh")

enum GateActivation : int64_t {
#define LLMEASYQUANT_GATE_ACTIVATION_ENUM(name, text) name,
  LLMEASYQUANT_GATE_ACTIVATIONS(LLMEASYQUANT_GATE_ACTIVATION_ENUM)
#undef LLMEASYQUANT_GATE_ACTIVATION_ENUM
      kGateActivations
};
