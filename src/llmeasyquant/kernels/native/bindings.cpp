// The Python module of the native operators (kernels/native.py builds it from this file and the others its SOURCES
// name). PYBIND11_MODULE defines the module's one init function, so the registration is a single
// block in a file of its own: neither half owns it, and every name Python calls is listed here (operators.h has
// their contracts).

#include <torch/extension.h>

#include "native_step.h"
#include "operators.h"

// ==== registration ====

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every operator runs without the GIL (none touches a Python object; arguments are converted before, the result
  // after): a step's native call takes milliseconds, and holding the GIL through it kept the server's event loop
  // and the readers of the streams waiting, then the engine waiting for them to hand it back.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("use_blas", &use_blas);
  m.def("dequantize_int4", &dequantize_int4, no_gil);
  m.def("int4_bf16_matmul", &int4_bf16_matmul, no_gil);
  m.def("int4_weight_matmul", &int4_weight_matmul, no_gil);
  m.def("bf16_dot_built", &bf16_dot_built);
  m.def("int4_digits_matmul", &int4_digits_matmul, no_gil);
  m.def("int4_tiles_pack", &int4_tiles_pack, no_gil);
  m.def("int4_tiles_matmul", &int4_tiles_matmul, no_gil);
  m.def("int8_weight_matmul", &int8_weight_matmul, no_gil);
  m.def("int4_int8_matmul", &int4_int8_matmul, py::arg("qx"), py::arg("x_scales"), py::arg("tiled"), py::arg("scales"),
        py::arg("offsets"), py::arg("group_size"), py::arg("out_features"), py::arg("amx") = 1, no_gil);
  m.def("int4_bf16_tiles_matmul", &int4_bf16_tiles_matmul, no_gil);
  m.def("amx_int8_usable", &amx_int8_usable);
  m.def("int8_int8_matmul", &int8_int8_matmul, no_gil);
  m.def("int8_float_matmul", &int8_float_matmul, no_gil);
  m.def("stream_xor", &stream_xor, no_gil);
  m.def("exact_cut_add", &exact_cut_add, no_gil);
  m.def("gptq_block", &gptq_block, no_gil);
  m.def("rms_norm", &rms_norm, no_gil);
  m.def("rope_store", &rope_store, no_gil);
  m.def("decode_attention", &decode_attention, no_gil);
  m.def("causal_attention", &causal_attention, no_gil);
  m.def("gate_mul", &gate_mul, no_gil);
  m.def("quantize_rows", &quantize_rows, no_gil);
  m.def("quantize_rows_asym", &quantize_rows_asym, no_gil);
  m.def("dequantize_rows", &dequantize_rows, no_gil);
  m.def("paged_rope_store", &paged_rope_store, no_gil);
  m.def("paged_attention", &paged_attention, no_gil);
  m.def("quant_rope_store", &quant_rope_store, no_gil);
  m.def("quant_attention", &quant_attention, no_gil);
  m.def("quant_gather", &quant_gather, no_gil);
  m.def("dequantize_int4_levels", &dequantize_int4_levels, no_gil);
  m.def("int4_levels_matmul", &int4_levels_matmul, no_gil);
  m.def("hadamard_transform", &hadamard_transform, no_gil);
  m.def("search_clip_rows", &search_clip_rows, no_gil);
  // The engine's step (native_step.h): built once per model and row count, run every step.
  py::class_<StepProgram>(m, "StepProgram")
      .def(py::init<int64_t, double, bool, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, double, int64_t>())
      .def("add_block", &StepProgram::add_block)
      .def("add_linear", &StepProgram::add_linear)
      .def("run", &StepProgram::run, no_gil)
      .def("blocks", &StepProgram::blocks)
      .def("team_covers", &StepProgram::team_covers)
      .def("set_team", &StepProgram::set_team);
  m.def("has_team_form", &has_team_form);
  // The kinds of step_kinds.h by name, for the kernels' step_call (their one definition is that header).
  py::dict kinds;
#define LLMEASYQUANT_STEP_KIND_ENTRY(name, text) kinds[text] = static_cast<int64_t>(name);
  LLMEASYQUANT_STEP_KINDS(LLMEASYQUANT_STEP_KIND_ENTRY)
#undef LLMEASYQUANT_STEP_KIND_ENTRY
  m.attr("STEP_KINDS") = kinds;
  py::dict activations;
#define LLMEASYQUANT_GATE_ACTIVATION_ENTRY(name, text) activations[text] = static_cast<int64_t>(name);
  LLMEASYQUANT_GATE_ACTIVATIONS(LLMEASYQUANT_GATE_ACTIVATION_ENTRY)
#undef LLMEASYQUANT_GATE_ACTIVATION_ENTRY
  m.attr("GATE_ACTIVATIONS") = activations;
}
