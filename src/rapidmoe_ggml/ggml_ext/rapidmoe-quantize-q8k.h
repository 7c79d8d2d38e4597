// RapidMoE's quantize_row_q8_K for x86 with AVX2, called from llama.cpp's quantize_row_q8_K
// (patches/0009-cpu-quantize-q8k.patch; ggml-cpu's x86 file is C). Compiled into ggml-cpu.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// y (k / 256 block_q8_K) = x (k floats) quantized as quantize_row_q8_K_ref does, byte for byte: the same scale
// (from the first value of the largest magnitude), the same rounding (to nearest, ties to even), the same sums
void rapidmoe_quantize_row_q8_K(const float * x, void * y, int64_t k);

#ifdef __cplusplus
}
#endif
