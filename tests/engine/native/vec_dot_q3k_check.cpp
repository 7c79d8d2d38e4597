// Compares RapidMoE's Q3_K dot product (ops/mul-mat/cpu/rapidmoe-vecdot-q3k.cpp, compiled into this program with the
// flags test_vec_dot_q3k.py chooses: AVX-512 or AVX2 only) with the one in the ggml-cpu library it links, called
// with RAPIDMOE_VEC_DOT_Q3_K=0 in the environment (upstream's kernel), bit for bit, on random blocks and rows of
// 1 to 16 blocks. Prints "rows N mismatches M" and exits 1 on a mismatch.
#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"
#include "ggml-cpu.h"
#include "rapidmoe-vecdot-q3k.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

extern "C" void ggml_vec_dot_q3_K_q8_K(int n, float * s, size_t bs, const void * vx, size_t bx, const void * vy,
                                       size_t by, int nrc);

int main() {
    ggml_cpu_init();  // ggml's fp16 table
    std::mt19937 rng(7);
    const int max_blocks = 16;
    const int rows = 3000;
    std::vector<block_q3_K> w((size_t) rows * max_blocks);
    for (auto & b : w) {
        auto * p = (uint8_t *) &b;
        for (size_t k = 0; k < sizeof b; k++) {
            p[k] = (uint8_t) rng();
        }
        const float scale = std::ldexp(1.0f + (float) (rng() % 1000) / 1000.0f, (int) (rng() % 16) - 14);
        b.d = ggml_fp32_to_fp16(rng() % 2 ? scale : -scale);
    }
    std::vector<block_q8_K> a(max_blocks);
    for (auto & b : a) {
        for (int k = 0; k < QK_K; k++) {
            b.qs[k] = (int8_t) ((int) (rng() % 256) - 128);  // the full range, -128 included
        }
        b.d = std::ldexp(1.0f + (float) (rng() % 1000) / 1000.0f, -7);
    }
    int mismatches = 0;
    for (int r = 0; r < rows; r++) {
        const int nb = 1 + r % max_blocks;
        const block_q3_K * x = &w[(size_t) r * max_blocks];
        float ours = 0.0f;
        float upstream = 0.0f;
        rapidmoe_vec_dot_q3_K_q8_K(nb * QK_K, &ours, x, a.data());
        ggml_vec_dot_q3_K_q8_K(nb * QK_K, &upstream, 0, x, 0, a.data(), 0, 1);
        if (std::memcmp(&ours, &upstream, sizeof(float)) != 0) {
            if (mismatches++ < 5) {
                std::printf("row %d (%d blocks): %.9g vs upstream %.9g\n", r, nb, ours, upstream);
            }
        }
    }
    std::printf("rows %d mismatches %d\n", rows, mismatches);
    return mismatches == 0 ? 0 : 1;
}
