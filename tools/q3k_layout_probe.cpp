// Design probe for a repacked Q3_K layout (issue 27; not part of the build): 16 rows interleaved per 256-weight
// block, each weight's 3 bits (2 low bits + the high bit, i.e. value + 4) stored contiguously, so that one vpermb +
// one vpmultishiftqb + one and give 16 rows x 4 weights as bytes for one vpdpbusd against 4 activation bytes
// broadcast (AVX-512 VBMI + VNNI); the -4 offset comes from the activation's 16-value sums (block_q8_K.bsums), the
// sub-block scales (decoded to int8, [sub-block][row]: 16 bytes a row instead of 12) by one vpmulld per sub-block.
// It checks the layout against upstream's ggml_vec_dot_q3_K_q8_K (run it with RAPIDMOE_VEC_DOT_Q3_K=0) and times it
// against our plain-row kernel (patch 0010), one thread, rows in L2 and from memory:
//
//   L=$(python -c "from rapidmoe._runtime import LIB_DIR; print(LIB_DIR)"); G=vendor/llama.cpp/ggml
//   g++ -O3 -march=native -std=c++17 -I$G/include -I$G/src -I$G/src/ggml-cpu -Isrc/rapidmoe_ggml/ops/mul-mat/cpu
//       tools/q3k_layout_probe.cpp src/rapidmoe_ggml/ops/mul-mat/cpu/rapidmoe-vecdot-q3k.cpp -o /tmp/q3k_probe
//       -L$L -lggml-cpu -lggml-base -Wl,-rpath,$L      (one command)
//   RAPIDMOE_VEC_DOT_Q3_K=0 /tmp/q3k_probe
//
// Measured on the AMD EPYC Zen 5 VM (AVX-512), 2026-12-03 (docs/split-routing.md, CPU performance): rows in L2
// 17.5-19 ps per weight against 37-41 for the plain kernel; from memory 22-30 against 40-44 with one block
// prefetched ahead (2 or 4 blocks ahead measured slower).
#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"
#include "ggml-cpu.h"
#include "rapidmoe-vecdot-q3k.h"
#include <immintrin.h>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
extern "C" void ggml_vec_dot_q3_K_q8_K(int n, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by, int nrc);

#ifndef PF_BLOCKS
#define PF_BLOCKS 1
#endif
struct block_q3_Kx16 {
    ggml_half d[16];
    int8_t scales[16][16];      // [sub-block][row], decoded (value - 32 already)
    uint8_t q[16][4][24];       // [sub-block][group of 4][8 lanes x 3 bytes: rows 2L (12 bits), 2L+1 (12 bits)]
    uint8_t pad[8];
};

static void repack(const block_q3_K * rows[16], block_q3_Kx16 & out) {
    memset(&out, 0, sizeof out);
    for (int r = 0; r < 16; r++) {
        const block_q3_K & b = *rows[r];
        out.d[r] = b.d;
        const uint8_t * p = b.scales;
        for (int j = 0; j < 16; j++) {
            int lo = j < 8 ? (p[j] & 0xF) : (p[j - 8] >> 4);
            int hi = (p[8 + (j % 4)] >> (2 * (j / 4))) & 3;
            out.scales[j][r] = (int8_t) ((lo | (hi << 4)) - 32);
        }
        for (int w = 0; w < 256; w++) {
            int j = w / 128, k = (w % 128) / 32, bb = w % 32;
            int ql = (b.qs[32 * j + bb] >> (2 * k)) & 3;
            int h = (b.hmask[bb] >> (4 * j + k)) & 1;
            int u = ql | (h << 2);  // value + 4
            int sb = w / 16, g = (w % 16) / 4, e = w % 4;
            int L = r / 2, bit = (r % 2) * 12 + 3 * e;
            uint8_t * lane = out.q[sb][g] + 3 * L;
            uint32_t v = lane[0] | (lane[1] << 8) | (lane[2] << 16);
            v |= (uint32_t) u << bit;
            lane[0] = v & 0xFF; lane[1] = (v >> 8) & 0xFF; lane[2] = (v >> 16) & 0xFF;
        }
    }
}

// s[0..16) = the 16 rows times y; nb blocks per row
static void gemv_x16(int nb, float * s, const block_q3_Kx16 * x, const block_q8_K * y) {
    const __m512i spread = _mm512_set_epi8(
        0,0,0,0,0,23,22,21, 0,0,0,0,0,20,19,18, 0,0,0,0,0,17,16,15, 0,0,0,0,0,14,13,12,
        0,0,0,0,0,11,10,9,  0,0,0,0,0,8,7,6,    0,0,0,0,0,5,4,3,    0,0,0,0,0,2,1,0);
    // output byte j of a 64-bit lane: bits 3j (j < 4) or 12 + 3 (j - 4)
    const __m512i offs = _mm512_set1_epi64((long long) 0x15120F0C09060300ULL);
    const __m512i m7 = _mm512_set1_epi8(7);
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        for (int l = 0; l < (int) sizeof(block_q3_Kx16); l += 64) _mm_prefetch((const char *) (x + b + PF_BLOCKS) + l, _MM_HINT_T0);
        const block_q3_Kx16 & X = x[b];
        const block_q8_K & Y = y[b];
        __m512i sumi = _mm512_setzero_si512();
        for (int sb = 0; sb < 16; sb++) {
            __m512i a = _mm512_set1_epi32(-4 * Y.bsums[sb]);
            for (int g = 0; g < 4; g++) {
                const __m512i raw = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) X.q[sb][g]));
                const __m512i lanes = _mm512_permutexvar_epi8(spread, raw);
                const __m512i u = _mm512_and_si512(_mm512_multishift_epi64_epi8(offs, lanes), m7);
                int32_t act; memcpy(&act, Y.qs + 16 * sb + 4 * g, 4);
                a = _mm512_dpbusd_epi32(a, u, _mm512_set1_epi32(act));
            }
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) X.scales[sb]));
            sumi = _mm512_add_epi32(sumi, _mm512_mullo_epi32(a, sc));
        }
        const __m512 d = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) X.d)), _mm512_set1_ps(Y.d));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), d, acc);
    }
    _mm512_storeu_ps(s, acc);
}

int main() {
    ggml_cpu_init();
    std::mt19937 rng(1);
    const int n = 2048, nb = n / 256, rows = 4096 * 8;
    std::vector<block_q3_K> w((size_t) rows * nb);
    for (auto & b : w) { auto * p = (uint8_t *) &b; for (size_t k = 0; k < sizeof b; k++) p[k] = rng(); b.d = ggml_fp32_to_fp16(std::ldexp(1.0f, -10) * (1 + (rng() % 100))); }
    std::vector<block_q8_K> a(nb);
    for (auto & b : a) { int s16[16] = {0}; for (int k = 0; k < 256; k++) { b.qs[k] = (int8_t) (rng() % 256 - 128); s16[k/16] += b.qs[k]; } for (int k=0;k<16;k++) b.bsums[k]=s16[k]; b.d = 0.01f; }
    std::vector<block_q3_Kx16> xr((size_t) rows / 16 * nb);
    for (int g = 0; g < rows / 16; g++) for (int b = 0; b < nb; b++) {
        const block_q3_K * rp[16]; for (int r = 0; r < 16; r++) rp[r] = &w[(size_t) (16 * g + r) * nb + b];
        repack(rp, xr[(size_t) g * nb + b]);
    }
    double maxrel = 0; 
    for (int g = 0; g < 200; g++) { float s[16]; gemv_x16(nb, s, &xr[(size_t) g * nb], a.data());
        for (int r = 0; r < 16; r++) { float ref; ggml_vec_dot_q3_K_q8_K(n, &ref, 0, &w[(size_t) (16*g+r)*nb], 0, a.data(), 0, 1);
            double rel = std::fabs(s[r] - ref) / std::max(1e-3f, std::fabs(ref)); if (rel > maxrel) maxrel = rel; } }
    printf("max rel diff vs upstream: %.3g\n", maxrel);
    std::vector<float> out(rows);
    for (int rep = 0; rep < 3; rep++) {
        auto t0 = std::chrono::steady_clock::now();
        for (int g = 0; g < rows / 16; g++) gemv_x16(nb, &out[16 * g], &xr[(size_t) g * nb], a.data());
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        printf("x16 mem: %.1f ps/weight\n", dt * 1e12 / ((double) rows * n));
        t0 = std::chrono::steady_clock::now();
        for (int it = 0; it < 100; it++) for (int g = 0; g < 16; g++) gemv_x16(nb, &out[16 * g], &xr[(size_t) g * nb], a.data());
        dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        printf("x16 L2: %.1f ps/weight\n", dt * 1e12 / (100.0 * 256 * n));
        t0 = std::chrono::steady_clock::now();
        for (int r = 0; r < rows; r++) rapidmoe_vec_dot_q3_K_q8_K(n, &out[r], &w[(size_t) r * nb], a.data());
        dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        printf("plain (ours) mem: %.1f ps/weight\n", dt * 1e12 / ((double) rows * n));
    }
}
