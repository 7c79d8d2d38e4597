// What RapidMoE's repacked gemms share. rapidmoe_q8_Kx4_rows: a group of 4 interleaved activation rows as plain
// Q8_K rows (the Q6_K and Q3_K gemms run their gemv code on those). rapidmoe_gemm_columns:
// the column loop of the Q2_K and Q4_K gemms (rapidmoe-gemm-q2k.cpp, -q4k.cpp): for each 8-column group and
// weight block, unpack the block once (Unpack), take every 4-row group's exact integer sums (Sums), and add them to
// per-row float accumulators in the gemv's order (per block: acc += sums x (column scale x row scale), mins
// likewise; at the end acc - mins), so the output is the repacked gemv's bit for bit.
#pragma once

#include "repack.h"

#include <cstring>

// row r (< 4) of nb interleaved activation blocks (block_q8_Kx4, as ggml_quantize_mat_q8_K_4x8 writes them: qs[32 k
// + 8 r + i] is row r's value 8 k + i) as plain Q8_K blocks rows[r * nb .. r * nb + nb - 1], its 16-value sums
// recomputed (exact, whatever order the interleaved bsums are in): for gemms that run a gemv on each row
inline void rapidmoe_q8_Kx4_rows(const block_q8_Kx4 * a, int nb, block_q8_K * rows) {
    for (int l = 0; l < nb; l++) {
        for (int r = 0; r < 4; r++) {
            block_q8_K & out = rows[(size_t) r * nb + l];
            out.d = a[l].d[r];
            for (int k = 0; k < QK_K / 8; k++) {
                std::memcpy(out.qs + 8 * k, a[l].qs + 32 * k + 8 * r, 8);
            }
            for (int g = 0; g < QK_K / 16; g++) {
                int sum = 0;
                for (int i = 0; i < 16; i++) {
                    sum += out.qs[16 * g + i];
                }
                out.bsums[g] = (int16_t) sum;
            }
        }
    }
}

#if defined(__AVX2__)
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <vector>

// Unpacked needs d and dmin (__m256: the 8 columns' super-block scales)
template <typename Block, typename Unpacked, void (*Unpack)(const Block &, Unpacked &),
          void (*Sums)(const Unpacked &, const block_q8_Kx4 &, __m256i *, __m256i *)>
void rapidmoe_gemm_columns(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) {
    const int nb = n / QK_K;
    const int n_groups = nr / 4;
    const auto * b_start = (const Block *) vx;
    const auto * a_start = (const block_q8_Kx4 *) vy;
    // the float accumulators of every row of the batch for the 8 columns at hand: sums, mins
    static thread_local std::vector<__m256> acc;
    acc.resize(2 * (size_t) nr);
    alignas(32) Unpacked u;
    for (int x = 0; x < nc / 8; x++) {
        const Block * b_ptr = b_start + (int64_t) x * nb;
        for (int b = 0; b < nb; b++) {
            Unpack(b_ptr[b], u);
            for (int y = 0; y < n_groups; y++) {
                const block_q8_Kx4 & a = a_start[(int64_t) y * nb + b];
                __m256i sums[4];
                __m256i mins[4];
                Sums(u, a, sums, mins);
                for (int r = 0; r < 4; r++) {
                    const __m256 row_scale = _mm256_set1_ps(a.d[r]);
                    __m256 & acc_row = acc[2 * (4 * y + r)];
                    __m256 & acc_min = acc[2 * (4 * y + r) + 1];
                    if (b == 0) {
                        acc_row = _mm256_setzero_ps();
                        acc_min = _mm256_setzero_ps();
                    }
                    acc_row = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(u.d, row_scale), acc_row);
                    acc_min = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins[r]), _mm256_mul_ps(u.dmin, row_scale), acc_min);
                }
            }
        }
        for (int row = 0; row < 4 * n_groups; row++) {
            _mm256_storeu_ps(s + (int64_t) row * bs + x * 8, _mm256_sub_ps(acc[2 * row], acc[2 * row + 1]));
        }
    }
}
#endif
