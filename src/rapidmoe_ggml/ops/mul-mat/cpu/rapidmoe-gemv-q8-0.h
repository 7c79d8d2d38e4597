// RapidMoE's Q8_0 x Q8_0 gemv and gemm for the CPU's repacked 4-column layout (block_q8_0x4, 8-byte interleave) on
// x86, called from llama.cpp's ggml_gemv_q8_0_4x8_q8_0 / ggml_gemm_q8_0_4x8_q8_0
// (patches/0016-cpu-repack-q8-0.patch). Compiled into ggml-cpu.
// Upstream repacks Q8_0 on ARM and RISC-V only: on x86 every Q8_0 matmul goes through the plain vec_dot, one row at
// a time. The patch repacks Q8_0 on x86 with AVX2 unless rapidmoe_q8_0_repack() says no.
#pragma once

#include <cstddef>

// s[0..nc) = the nc interleaved Q8_0 rows of vx (block_q8_0x4) times the one Q8_0 row vy (nr = 1), n values a row.
// Per block: the exact integer dot product of each column with the activation, times (column scale x activation
// scale), accumulated in float: the plain vec_dot's arithmetic, accumulated in another order (tolerance-equal).
void rapidmoe_gemv_q8_0_4x8_q8_0(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);

// s[r * bs + c] for the nr activation rows (a multiple of 4, block_q8_0x4: 4 rows interleaved by 8 bytes, as
// ggml_quantize_mat_q8_0_4x8 writes them) times the nc interleaved columns of vx; each output the gemv's bits for
// the same row quantized alone (the same integer sums and float operations in the same order)
void rapidmoe_gemm_q8_0_4x8_q8_0(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);

// Whether Q8_0 weights are repacked on x86 with AVX2: yes, unless RAPIDMOE_Q8_0_REPACK=0 is in the environment (read
// at each weight load; then Q8_0 stays plain, as upstream keeps it on x86)
bool rapidmoe_q8_0_repack();
