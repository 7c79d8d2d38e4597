// RapidMoE's Q4_K x Q8_K gemv for the CPU's repacked 8-column layout (block_q4_Kx8), called from llama.cpp's
// ggml_gemv_q4_K_8x8_q8_K on AVX2 CPUs (patches/0007-cpu-gemv-q4k.patch). Compiled into ggml-cpu.
#pragma once

#include <cstddef>

// s[0..nc) = the nc interleaved Q4_K rows of vx times the one Q8_K row vy (nr = 1), n values per row; the same
// integer sums and float operations as upstream's kernel, so the same bits
void rapidmoe_gemv_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
