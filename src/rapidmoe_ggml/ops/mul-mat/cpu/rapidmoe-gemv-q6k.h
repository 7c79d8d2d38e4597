// RapidMoE's Q6_K x Q8_K gemv and gemm for the CPU's repacked 8-column layout (block_q6_Kx8, 8-byte interleave) on
// x86, called from llama.cpp's ggml_gemv_q6_K_8x8_q8_K / ggml_gemm_q6_K_8x8_q8_K (patches/0017-cpu-repack-q6-k.patch).
// Compiled into ggml-cpu.
// Upstream repacks Q6_K on ARM only: on x86 every Q6_K matmul goes through the plain vec_dot, one row at a time. The
// patch repacks Q6_K on x86 with AVX2 unless rapidmoe_q6_K_repack() says no.
#pragma once

#include <cstddef>

// s[0..nc) = the nc interleaved Q6_K rows of vx (block_q6_Kx8) times the one Q8_K row vy (nr = 1), n values a row.
// Per super-block: the exact integer dot product of each column with the activation, times (column d x activation
// d), accumulated in float: the plain vec_dot's integers, accumulated in another order (tolerance-equal).
void rapidmoe_gemv_q6_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);

// s[r * bs + c] for the nr activation rows (a multiple of 4, block_q8_Kx4 as ggml_quantize_mat_q8_K_4x8 writes them)
// times the nc interleaved columns of vx: each group of 4 rows de-interleaved, then the gemv's bits for each row
void rapidmoe_gemm_q6_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);

// Whether Q6_K weights are repacked on x86 with AVX2: yes, unless RAPIDMOE_Q6_K_REPACK=0 is in the environment (read
// at each weight load; then Q6_K stays plain, as upstream keeps it on x86)
bool rapidmoe_q6_K_repack();
