// Q3_K x Q8_K gemv and gemm over our repacked 8-row layout (rapidmoe_block_q3_Kx8: rapidmoe-q3k-x8.h).
//
// Why: the refine codec's WQ experts are Q3_K (and llama-quantize's Q3_K_M mixture is mostly Q3_K), and the plain
// Q3_K dot product, ours included (patch 0010), is compute-bound on this project's 2-core AVX-512 machine: 12-15 GB/s
// of weights where the repacked Q2_K and Q4_K gemvs stream 25-35 (bench/results/speed-refine-q3k-zen5-avx512.md).
// One row at a time, each 32 weights cost a dozen instructions: unpacking the 2 low bits, the high bit and the
// sub-block scale, and folding the lanes. With 8 rows in one zmm the same instructions serve 8 rows:
//  - the 2 low bits of 64 bytes (the same 8 positions of the 8 rows) by one shift and mask, as in our Q2_K gemv;
//  - the high bit as a mask register (vptestmb against the hmask bytes, interleaved like qs) that adds 4 to the
//    lanes that have it (one masked vpaddb): each value q = low + 4 high in 0..7, unsigned, as vpdpbusd wants;
//  - vpdpbusd with the activation's 8 bytes broadcast, vpackssdw of two sub-blocks' sums (at most 8 x 7 x 128: 16
//    bits), one vpdpwssd against their scales (6-bit, minus 32: 16-bit lanes by one pshufb of bytes the repack
//    stored in this order);
//  - the -4 of every value once a block: 4 x the sum over sub-blocks of (scale x the activation's 16-value sum);
//  - the 128 scales of a block decoded by a few 256-bit operations (the repack split them into 4-bit and 2-bit
//    fields that line up); each block's cache lines prefetched as its work starts (all its misses issued at once).
// Every integer is exact, so each row's block sum is the plain vec_dot's; per block one fma (the sum times row d x
// activation d) in block order, so the output is the plain path's to float rounding (tools/kernel_cost.py --check),
// and the scalar version here (the path without AVX-512 VNNI, and what RAPIDMOE_GEMM=avx2 runs) gives the same bits.
// The gemm de-interleaves each group of 4 activation rows and runs the gemv's code on the 4 (weights unpacked once):
// the gemv's bits.
#include "rapidmoe-gemv-q3k.h"

#include "rapidmoe-gemm-loop.h"
#include "rapidmoe-gemm.h"
#include "rapidmoe-q3k-x8.h"
#include "rapidmoe-simd.h"
#include "ggml-impl.h"
#include "repack.h"
#include "simd-mappings.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RAPIDMOE_Q3_K_512 1
#else
#define RAPIDMOE_Q3_K_512 0
#endif

namespace {

// 0: the block about to be used. On Zen 5 (2 threads) every matrix shape streamed faster so, on average over 2-3
// runs each (24-32 GB/s against 18-31 at 2 KiB ahead, the Q2_K gemv's distance, in a noisy VM; tools/kernel_cost.py,
// bench/results/prefetch-q3k-q6k-zen5-avx512.md)
constexpr int PREFETCH_BYTES = 0;

// The scalar version: R activation rows against one run of nb x8 blocks, the SIMD path's integers and float ops
template <int R>
void gemv_scalar(int nb, const rapidmoe_block_q3_Kx8 * x, const block_q8_K * const a[R], float * const out[R]) {
    float acc[R][8] = {};
    for (int b = 0; b < nb; b++) {
        uint8_t sc[128];
        rapidmoe_q3_K_x8_scales(x[b], sc);
        for (int c = 0; c < 8; c++) {
            const float dc = GGML_CPU_FP16_TO_FP32(x[b].d[c]);
            for (int r = 0; r < R; r++) {
                const block_q8_K & y = a[r][b];
                int32_t isum = 0;
                for (int k = 0; k < 16; k++) {  // sub-block k: half h, 2-bit field t, l = 16 p .. 16 p + 15
                    const int h = k / 8, t = (k % 8) / 2, p = k % 2;
                    int32_t s = 0;
                    for (int l = 16 * p; l < 16 * p + 16; l++) {
                        const int q = 32 * h + l;  // the byte of row c's qs
                        const int low = (x[b].qs[8 * (8 * (q / 8) + c) + q % 8] >> (2 * t)) & 3;
                        const int high = (x[b].hmask[8 * (8 * (l / 8) + c) + l % 8] >> (4 * h + t)) & 1;
                        s += (low + 4 * high) * y.qs[128 * h + 32 * t + l];
                    }
                    const int scale = sc[16 * (k / 2) + 2 * c + p] - 32;
                    isum += scale * s - 4 * scale * y.bsums[k];
                }
                acc[r][c] = std::fma((float) isum, dc * y.d, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        std::memcpy(out[r], acc[r], sizeof(acc[r]));
    }
}

#if RAPIDMOE_Q3_K_512
// R activation rows against one run of nb x8 blocks: all 8 weight rows in a zmm (row c's 8 bytes are 64-bit lane c,
// its sums in 32-bit lanes 2c and 2c + 1). Per 2-bit field t of a half h: sub-blocks k = 8 h + 2 t + p (p = 0: qs
// and hmask chunks 0, 1; p = 1: chunks 2, 3), two vpdpbusd each, vpackssdw of the pair, one vpdpwssd with the
// scales in that order (128-bit lane j: rows 2j, 2j + 1 of sub-block p = 0, then of p = 1: Q2_K's order).
//
// Activations: a[r] plain Q8_K rows, or (X4) a4[r / 4] groups of 4 interleaved rows (block_q8_Kx4, as the gemm gets
// them), read in place: the same integers (a row's 8-value runs 32 bytes apart, its exact 16-value sums in the
// group's order). De-interleaving every group first, for each call on a few columns, took a third of the gemm.
template <int R, bool X4 = false>
void gemv_512(int nb, const rapidmoe_block_q3_Kx8 * x, const block_q8_K * const a[R], float * const out[R],
              const block_q8_Kx4 * const a4[R / 4 + 1] = nullptr) {
    const __m512i m3b = _mm512_set1_epi8(3);
    const __m512i four = _mm512_set1_epi8(4);
    const __m512i c32 = _mm512_set1_epi16(32);
    const __m512i scale_index = packed_pair_scale_index();
    __m256 acc_f[R];
    for (int r = 0; r < R; r++) {
        acc_f[r] = _mm256_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        for (int i = 0; i < (int) sizeof(rapidmoe_block_q3_Kx8); i += 64) {
            _mm_prefetch((const char *) (x + b) + PREFETCH_BYTES + i, _MM_HINT_T0);
        }
        alignas(32) uint8_t sc[128];
        rapidmoe_q3_K_x8_scales_simd(x[b], sc);
        __m512i hraw[4];
        for (int i = 0; i < 4; i++) {
            hraw[i] = _mm512_loadu_si512((const void *) (x[b].hmask + 64 * i));
        }
        __m512i acc[R];
        for (int r = 0; r < R; r++) {
            acc[r] = _mm512_setzero_si512();
        }
        for (int h = 0; h < 2; h++) {
            __m512i raw[4];
            for (int i = 0; i < 4; i++) {
                raw[i] = _mm512_loadu_si512((const void *) (x[b].qs + 256 * h + 64 * i));
            }
            for (int t = 0; t < 4; t++) {
                const __m128i shift = _mm_cvtsi32_si128(2 * t);
                const __m512i bit = _mm512_set1_epi8((char) (1 << (4 * h + t)));
                __m512i w[4];  // chunk i's values q = low + 4 high
                for (int i = 0; i < 4; i++) {
                    const __m512i low = _mm512_and_si512(_mm512_srl_epi16(raw[i], shift), m3b);
                    w[i] = _mm512_mask_add_epi8(low, _mm512_test_epi8_mask(hraw[i], bit), low, four);
                }
                const __m128i group = _mm_load_si128((const __m128i *) (sc + 16 * (4 * h + t)));
                const __m512i scales =
                    _mm512_sub_epi16(_mm512_shuffle_epi8(_mm512_broadcast_i32x4(group), scale_index), c32);
                for (int r = 0; r < R; r++) {
                    if constexpr (X4) {
                        acc[r] = rapidmoe_q3_K_x8_field_dot<4>(
                            acc[r], w, a4[r / 4][b].qs + 8 * (r % 4) + 4 * (128 * h + 32 * t), scales);
                    } else {
                        acc[r] = rapidmoe_q3_K_x8_field_dot(acc[r], w, a[r][b].qs + 128 * h + 32 * t, scales);
                    }
                }
            }
        }
        // the -4 of every value: per row c, sum over sub-blocks 2g + p of (scale - 32) x bsum, 4 times
        __m512i sc32[4];
        rapidmoe_q3_K_x8_scales32(sc, sc32);
        const __m256 col_scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) x[b].d));
        for (int r = 0; r < R; r++) {
            __m256i offs;
            float d;
            if constexpr (X4) {
                offs = rapidmoe_q3_K_x8_scaled_bsums_x4(sc32, a4[r / 4][b].bsums, r % 4);
                d = a4[r / 4][b].d[r % 4];
            } else {
                offs = rapidmoe_q3_K_x8_scaled_bsums(sc32, a[r][b].bsums);
                d = a[r][b].d;
            }
            const __m256i isum = _mm256_sub_epi32(column_pairs_packed(acc[r]), _mm256_slli_epi32(offs, 2));
            acc_f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(col_scale, _mm256_set1_ps(d)),
                                       acc_f[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out[r], acc_f[r]);
    }
}
#endif

// the kernel for R rows: the VNNI one unless the build lacks it or RAPIDMOE_GEMM=avx2 asks for the portable code
template <int R>
void gemv_rows(int nb, const rapidmoe_block_q3_Kx8 * x, const block_q8_K * const a[R], float * const out[R]) {
#if RAPIDMOE_Q3_K_512
    if (!rapidmoe_gemm_avx2_only()) {
        gemv_512<R>(nb, x, a, out);
        return;
    }
#endif
    gemv_scalar<R>(nb, x, a, out);
}

}  // namespace

bool rapidmoe_q3_K_repack() {
    const char * env = std::getenv("RAPIDMOE_Q3_K_REPACK");
    return RAPIDMOE_Q3_K_512 && (env == nullptr || env[0] != '0');
}

bool rapidmoe_q3_K_x8_reader(const ggml_tensor * op) {
    if (op->op != GGML_OP_CUSTOM) {
        return false;
    }
    ggml_custom_op_params params;
    std::memcpy(&params, op->op_params, sizeof(params));
    return params.userdata == RAPIDMOE_Q3K_X8_READER;
}

void rapidmoe_repack_q3_K_x8(void * dst, const void * data, int64_t nrow, int64_t n) {
    const int64_t nb = n / QK_K;
    const auto * src = (const uint8_t *) data;
    auto * out = (rapidmoe_block_q3_Kx8 *) dst;
    for (int64_t r0 = 0; r0 < nrow; r0 += 8) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t * rows[8];
            for (int c = 0; c < 8; c++) {
                rows[c] = src + ((r0 + c) * nb + b) * RAPIDMOE_Q3K_BLOCK;
            }
            rapidmoe_q3_K_x8_pack(rows, *out++);
        }
    }
}

void rapidmoe_gemv_q3_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) {
    const int nb = n / QK_K;
    for (int y = 0; y < nr; y++) {
        const block_q8_K * rows[1] = { (const block_q8_K *) vy + (int64_t) y * nb };
        for (int x = 0; x < nc / 8; x++) {
            float * out[1] = { s + (int64_t) y * bs + 8 * x };
            gemv_rows<1>(nb, (const rapidmoe_block_q3_Kx8 *) vx + (int64_t) x * nb, rows, out);
        }
    }
}

namespace {

// Activation rows y0 .. y0 + R - 1 (R / 4 groups of block_q8_Kx4) against every run of weight rows: each weight
// block unpacked once for the R rows
template <int R>
void gemm_rows(int nb, float * s, size_t bs, const void * vx, const void * vy, int y0, int nc,
               std::vector<block_q8_K> & rows) {
    const block_q8_Kx4 * a4[R / 4 + 1];
    for (int g = 0; g < R / 4; g++) {
        a4[g] = (const block_q8_Kx4 *) vy + (int64_t) (y0 / 4 + g) * nb;
    }
    const bool in_place = RAPIDMOE_Q3_K_512 && !rapidmoe_gemm_avx2_only();  // the VNNI kernel reads the groups
    const block_q8_K * ra[R] = {};
    if (!in_place) {  // the portable code reads plain rows
        rows.resize((size_t) R * nb);
        for (int g = 0; g < R / 4; g++) {
            rapidmoe_q8_Kx4_rows(a4[g], nb, rows.data() + 4 * g * nb);
        }
        for (int r = 0; r < R; r++) {
            ra[r] = rows.data() + (size_t) r * nb;
        }
    }
    for (int x = 0; x < nc / 8; x++) {
        const auto * wx = (const rapidmoe_block_q3_Kx8 *) vx + (int64_t) x * nb;
        float * out[R];
        for (int r = 0; r < R; r++) {
            out[r] = s + (int64_t) (y0 + r) * bs + 8 * x;
        }
#if RAPIDMOE_Q3_K_512
        if (in_place) {
            gemv_512<R, true>(nb, wx, nullptr, out, a4);
            continue;
        }
#endif
        gemv_rows<R>(nb, wx, ra, out);
    }
}

}  // namespace

// 8 rows at a time where there are (the weights' unpacking, scales and 2-bit fields, shared by twice the rows), the
// last 4 alone: each row's bits do not depend on the rows beside it
void rapidmoe_gemm_q3_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) {
    const int nb = n / QK_K;
    thread_local std::vector<block_q8_K> rows;
    int y = 0;
    for (; y + 8 <= nr; y += 8) {
        gemm_rows<8>(nb, s, bs, vx, vy, y, nc, rows);
    }
    for (; y + 4 <= nr; y += 4) {
        gemm_rows<4>(nb, s, bs, vx, vy, y, nc, rows);
    }
}
