// RapidMoE's Q2_K x Q8_K gemv for the CPU's repacked 8-column layout (block_q2_Kx8), called from llama.cpp's
// ggml_gemv_q2_K_8x8_q8_K on AVX2 CPUs (patches/0006-cpu-gemv-q2k.patch). Compiled into ggml-cpu.
// Upstream repacks Q2_K on x86 only where the CPU has AVX-512; with this kernel the layout pays off on AVX2 too, so
// the patch also repacks Q2_K there unless rapidmoe_q2_K_repack_avx2() says no.
#pragma once

#include <cstddef>

// s[0..nc) = the nc interleaved Q2_K rows of vx times the one Q8_K row vy (nr = 1), n values per row; the same
// integer sums and float operations as upstream's kernel, so the same bits
void rapidmoe_gemv_q2_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);

// Whether Q2_K weights are repacked on a CPU with AVX2 and without AVX-512 (where upstream keeps them plain): yes,
// unless RAPIDMOE_Q2_K_REPACK=0 is in the environment (read at each weight load; the tests that compare with stock
// llama.cpp bit for bit on such a CPU set it, since the repacked gemv sums in another order than the plain vec_dot)
bool rapidmoe_q2_K_repack_avx2();
