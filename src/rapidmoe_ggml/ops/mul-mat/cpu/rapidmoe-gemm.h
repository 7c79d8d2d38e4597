// RapidMoE's gemm kernels for the CPU's repacked 8-column layouts (block_q2_Kx8, block_q4_Kx8) against 4-row
// interleaved activations (block_q8_Kx4), called from llama.cpp's ggml_gemm_q2_K_8x8_q8_K and
// ggml_gemm_q4_K_8x8_q8_K on AVX2 CPUs, with AVX-512 VNNI paths where the build has them
// (patches/0008-cpu-gemm.patch). Compiled into ggml-cpu.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>

// s[r * bs + c] for r < nr (a multiple of 4), c < nc (a multiple of 8) = row r of vy (nr / 4 groups of n / 256
// block_q8_Kx4) times column c of vx (nc / 8 groups of n / 256 blocks of the type), n values per row; the same
// integer sums and float operations per row and column as the repacked gemv, so its bits
void rapidmoe_gemm_q2_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void rapidmoe_gemm_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);

// Whether llama.cpp's gemm functions run these kernels: yes, unless RAPIDMOE_GEMM=0 is in the environment (read at
// each call, a few hundred a prompt batch, so a process can switch; upstream's gemms add in another order than its
// gemvs, so the tests that compare prompt logits with stock llama.cpp bit for bit set it)
inline bool rapidmoe_gemm_enabled() {
    const char * env = std::getenv("RAPIDMOE_GEMM");
    return env == nullptr || std::strcmp(env, "0") != 0;
}

// RAPIDMOE_GEMM=avx2 runs our AVX2 kernels on a CPU whose build has AVX-512 VNNI ones (the gemms and gemvs of Q2_K
// and Q4_K, the Q8_0 and Q6_K kernels; repacked Q3_K, which has no AVX2 kernel, its portable C): to time one against
// the other in one process, and to test the AVX2 code
inline bool rapidmoe_gemm_avx2_only() {
    const char * env = std::getenv("RAPIDMOE_GEMM");
    return env != nullptr && std::strcmp(env, "avx2") == 0;
}
