// ggml's own quantization and dequantization routines, exposed to Python without copies of the inputs.
#pragma once

#include <nanobind/nanobind.h>

namespace rapidmoe {

// Registers quantize, dequantize, type_info and row_size on the module.
void bind_quant(nanobind::module_ & m);

}  // namespace rapidmoe
