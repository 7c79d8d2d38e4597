// Compares RapidMoE's repacked Q2_K and Q4_K gemms (ops/mul-mat/cpu/rapidmoe-gemm-q2k.cpp, -q4k.cpp, compiled into this
// program with the flags test_gemm_paths.py chooses: their AVX-512 VNNI paths or their AVX2 ones) with the repacked
// gemvs in the ggml-cpu library it links (ggml_gemv_q2_K_8x8_q8_K, ggml_gemv_q4_K_8x8_q8_K, run on each activation
// row), bit for bit: random 8-column weight blocks (every byte random, super-block scales of both signs) against
// random activation rows quantized by the library, both as 4-row interleaved blocks (the gemm's input) and as single
// rows (the gemv's). Prints "TYPE outputs N mismatches M" per type and exits 1 on a mismatch.
#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"
#include "ggml-cpu.h"
#include "repack.h"
#include "rapidmoe-gemm.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

extern "C" void quantize_row_q8_K(const float * x, void * y, int64_t k);

using GemmFn = void (*)(int, float *, size_t, const void *, const void *, int, int);

template <typename Block>
static long check(const char * name, GemmFn gemm_fn, GemmFn gemv_fn, std::mt19937 & rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int shapes[][3] = {  // values per row, rows, columns
        {256, 4, 8}, {512, 8, 16}, {1024, 64, 24}, {2048, 12, 8}, {768, 36, 32}, {256, 128, 8},
    };
    long outputs = 0;
    long mismatches = 0;
    for (const auto & shape : shapes) {
        const int n = shape[0];
        const int nr = shape[1];
        const int nc = shape[2];
        const int nb = n / QK_K;
        std::vector<Block> w((size_t) (nc / 8) * nb);
        for (auto & b : w) {
            auto * p = (uint8_t *) &b;
            for (size_t k = 0; k < sizeof b; k++) {
                p[k] = (uint8_t) rng();
            }
            for (int c = 0; c < 8; c++) {
                const float d = std::ldexp(1.0f + (float) (rng() % 1000) / 1000.0f, (int) (rng() % 12) - 14);
                b.d[c] = ggml_fp32_to_fp16(rng() % 2 ? d : -d);
                b.dmin[c] = ggml_fp32_to_fp16(std::ldexp(1.0f + (float) (rng() % 1000) / 1000.0f, -12));
            }
        }
        std::vector<float> x((size_t) nr * n);
        for (auto & v : x) {
            v = normal(rng) * (rng() % 8 == 0 ? 8.0f : 1.0f);
        }
        std::vector<block_q8_Kx4> a4((size_t) (nr / 4) * nb);
        for (int g = 0; g < nr / 4; g++) {
            ggml_quantize_mat_q8_K_4x8(x.data() + (size_t) 4 * g * n, a4.data() + (size_t) g * nb, n);
        }
        std::vector<float> gemm((size_t) nr * nc);
        gemm_fn(n, gemm.data(), nc, w.data(), a4.data(), nr, nc);
        std::vector<block_q8_K> a1(nb);
        std::vector<float> gemv(nc);
        for (int r = 0; r < nr; r++) {
            quantize_row_q8_K(x.data() + (size_t) r * n, a1.data(), n);
            gemv_fn(n, gemv.data(), nc, w.data(), a1.data(), 1, nc);
            for (int c = 0; c < nc; c++) {
                outputs++;
                if (std::memcmp(&gemm[(size_t) r * nc + c], &gemv[c], sizeof(float)) != 0 && mismatches++ < 5) {
                    std::printf("%s n %d row %d column %d: gemm %.9g, gemv %.9g\n", name, n, r, c,
                                gemm[(size_t) r * nc + c], gemv[c]);
                }
            }
        }
    }
    std::printf("%s outputs %ld mismatches %ld\n", name, outputs, mismatches);
    return mismatches;
}

int main() {
    ggml_cpu_init();  // ggml's fp16 table
    std::mt19937 rng(11);
    long mismatches = check<block_q2_Kx8>("q2_K", rapidmoe_gemm_q2_K_8x8_q8_K, ggml_gemv_q2_K_8x8_q8_K, rng);
    mismatches += check<block_q4_Kx8>("q4_K", rapidmoe_gemm_q4_K_8x8_q8_K, ggml_gemv_q4_K_8x8_q8_K, rng);
    return mismatches == 0 ? 0 : 1;
}
