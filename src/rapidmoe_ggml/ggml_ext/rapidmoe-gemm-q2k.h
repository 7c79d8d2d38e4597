// RapidMoE's Q2_K x Q8_K gemm for the CPU's repacked 8-column layout (block_q2_Kx8) and 4-row interleaved
// activations (block_q8_Kx4), called from llama.cpp's ggml_gemm_q2_K_8x8_q8_K on AVX2 CPUs
// (patches/0008-cpu-gemm-q2k.patch). Compiled into ggml-cpu.
#pragma once

#include <cstddef>

// s[r * bs + c] for r < nr (a multiple of 4), c < nc (a multiple of 8) = row r of vy (nr / 4 groups of n / 256
// block_q8_Kx4) times column c of vx (nc / 8 groups of n / 256 block_q2_Kx8), n values per row; the same integer
// sums and float operations as upstream's kernel, so the same bits
void rapidmoe_gemm_q2_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);

// Whether ggml_gemm_q2_K_8x8_q8_K runs this kernel: yes, unless RAPIDMOE_GEMM_Q2_K=0 is in the environment (read
// once; for comparing with upstream's kernel)
bool rapidmoe_gemm_q2_K_enabled();
