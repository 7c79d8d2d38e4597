// RapidMoE's Q3_K x Q8_K dot product for x86 with AVX2 or AVX-512, called from llama.cpp's ggml_vec_dot_q3_K_q8_K
// (patches/0010-cpu-vec-dot-q3k.patch; ggml-cpu's x86 file is C). Compiled into ggml-cpu.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

// *s = the Q3_K row vx (n / 256 blocks) times the Q8_K row vy: the same integer sums per 32-bit lane and the same
// float operations as upstream's AVX2 kernel (the one x86 builds run, with or without AVX-512), so the same bits
void rapidmoe_vec_dot_q3_K_q8_K(int n, float * s, const void * vx, const void * vy);

// Whether ggml_vec_dot_q3_K_q8_K runs it: yes, unless RAPIDMOE_VEC_DOT_Q3_K=0 is in the environment (read once) or
// the file was compiled without AVX2 and F16C
int rapidmoe_vec_dot_q3_K_enabled(void);

#ifdef __cplusplus
}
#endif
