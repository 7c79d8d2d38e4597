// RapidMoE's quantize_row_q8_K for x86 with AVX2, called from llama.cpp's quantize_row_q8_K
// (patches/0009-cpu-quantize-q8k.patch; ggml-cpu's x86 file is C), and the 4-row interleave of Q8_K rows the repacked
// MUL_MAT_ID gemm reads (patches/0014-cpu-mmid-gemm-interleave.patch). Compiled into ggml-cpu.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// y (k / 256 block_q8_K) = x (k floats) quantized as quantize_row_q8_K_ref does, byte for byte: the same scale
// (from the first value of the largest magnitude), the same rounding (to nearest, ties to even), the same sums
void rapidmoe_quantize_row_q8_K(const float * x, void * y, int64_t k);

// y (k / 256 block_q8_Kx4) = the four rows of Q8_K blocks in `rows` (k values each), interleaved as the repacked
// gemm kernels read them (8 bytes of each row in turn, the 16-value sums four of each row in turn, the 4 scales):
// the bytes ggml_quantize_mat_q8_K_4x8 writes for the same float rows, without quantizing them again (patch 0014:
// MUL_MAT_ID's gemm groups, whose rows the op has already quantized one by one)
void rapidmoe_interleave_q8_K_4x8(const void * const rows[4], void * y, int64_t k);

#ifdef __cplusplus
}
#endif
