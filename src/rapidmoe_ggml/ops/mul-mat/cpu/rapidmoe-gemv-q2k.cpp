// Q2_K x Q8_K gemv over llama.cpp's repacked block_q2_Kx8 layout (8 columns interleaved in 8-byte chunks), for
// decode steps: one activation row against the routed experts' (and the residuals') weights.
//
// Why our own: on the 2-core AVX-512 machine this project measures on, upstream's kernel ran at 70-75 ps per
// weight (one thread, weights from memory) while it needs 26 ps with the weights in L2: it waits on memory, and
// its inner loop shuffles lanes for every multiply. This kernel
//  - multiplies each 4-column vector as it is laid out with the activation's 8 bytes broadcast (a load, no
//    shuffle), so the 32-bit lanes hold (column, half) sums that one hadd per block folds; upstream blends two
//    shuffled column vectors and shuffles the activation for each multiply;
//  - prefetches the weights PREFETCH_BYTES ahead (the hardware prefetcher alone left the loads waiting).
// Called directly on one thread, weights from memory: 40 vs 74 ps per weight; L2-hot: 17 vs 26. Through ggml
// (tools/kernel_cost.py), routed experts from memory: 49-56 vs 92-98 on one thread, 23-26 vs 35 on two
// (docs/split-routing.md, CPU performance). Every integer sum is exact (no 16-bit partial exceeds 2 x 2 x 3 x 128) and the float operations
// per column are upstream's, in its order: the output is bit-identical (tests/engine/test_cpu_kernels.py compares it
// with the stock build's, tests/engine/test_split_routing.py the logits at r = 0).
// With AVX-512 VNNI a second path takes all 8 columns in one zmm: vpdpbusd gives each sub-block's sums of 4 products
// per (column, half) lane, vpackssdw packs two sub-blocks' sums (at most 8 x 3 x 128: 16 bits) and one vpdpwssd
// multiplies them by their scales and adds them: 8 instructions per 512 products where the AVX2 path needs about 25.
// The same exact integers, the same float operations: the same bits (RAPIDMOE_GEMM=avx2 runs the AVX2 path).
#include "rapidmoe-gemv-q2k.h"

#include "rapidmoe-gemm.h"
#include "rapidmoe-simd.h"
#include "repack.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <cstdlib>

namespace {

constexpr int PREFETCH_BYTES = 2048; // about three blocks ahead: the best of 1, 2, 4, 8, 16 KiB measured here

#if defined(__AVX2__)
// The 8 columns' mins of one half block (sub-blocks 8 h .. 8 h + 7, high nibbles of the 64 scale bytes at sc) against
// the activation's 16-value sums of those sub-blocks: column c in lane c (both paths)
inline __m256i half_block_mins(const uint8_t * sc, const int16_t * bsums) {
    const __m128i m4b = _mm_set1_epi8(0xF);
    const __m256i q8s = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) bsums));
    __m256i mins[4];
    for (int i = 0; i < 4; i++) {
        const __m128i ms = _mm_loadu_si128((const __m128i *) (sc + 16 * i));
        mins[i] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(ms, 4), m4b));
    }
    const __m256i m01 = _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 0), mins[0]);
    const __m256i m23 = _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 85), mins[1]);
    const __m256i m45 = _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 170), mins[2]);
    const __m256i m67 = _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 255), mins[3]);
    return _mm256_add_epi32(_mm256_add_epi32(m01, m23), _mm256_add_epi32(m45, m67));
}

#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// One row of 8 interleaved columns against one activation row, all 8 columns in a zmm (column c's 8 bytes are 64-bit
// lane c, so its sums sit in 32-bit lanes 2c and 2c + 1). Per pair of sub-blocks (2t, 2t + 1) of a half block: four
// vpdpbusd (2-bit values x the activation's 8 bytes broadcast), vpackssdw of the two sub-blocks' sums (128-bit lane
// j: sub-block 2t's lanes of columns 2j, 2j + 1, then 2t + 1's), one vpdpwssd against the scales in that order.
void gemv_512(int nb, const block_q2_Kx8 * b_ptr, const block_q8_K * a_ptr, float * out) {
    const __m512i m3b = _mm512_set1_epi8(3);
    const __m512i m4b = _mm512_set1_epi8(0xF);
    const __m512i scale_index = packed_pair_scale_index();
    __m256 acc_row = _mm256_setzero_ps();
    __m256 acc_min_rows = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        for (int i = 0; i < (int) sizeof(block_q2_Kx8); i += 64) {
            _mm_prefetch((const char *) (b_ptr + b) + PREFETCH_BYTES + i, _MM_HINT_T0);
        }
        const __m256 row_scale = _mm256_set1_ps(a_ptr[b].d);
        const __m256 col_scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b_ptr[b].d));
        const __m256 col_dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b_ptr[b].dmin));
        __m512i acc = _mm512_setzero_si512();
        __m256i iacc_min_b = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const uint8_t * q = b_ptr[b].qs + h * 256;
            const int8_t * aq = a_ptr[b].qs + h * 128;
            const uint8_t * sc = b_ptr[b].scales + h * 64;
            __m512i raw[4];
            for (int i = 0; i < 4; i++) {
                raw[i] = _mm512_loadu_si512((const void *) (q + 64 * i));
            }
            for (int t = 0; t < 4; t++) {
                // sub-block k = 2t + p: values 0-7 of the 8 columns in raw[2p], 8-15 in raw[2p + 1], at bits 2t
                const __m128i shift = _mm_cvtsi32_si128(2 * t);
                __m512i sums[2];
                for (int p = 0; p < 2; p++) {
                    const int k = 2 * t + p;
                    const __m512i w0 = _mm512_and_si512(_mm512_srl_epi16(raw[2 * p], shift), m3b);
                    const __m512i w1 = _mm512_and_si512(_mm512_srl_epi16(raw[2 * p + 1], shift), m3b);
                    sums[p] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, broadcast_8_bytes_512(aq + 16 * k));
                    sums[p] = _mm512_dpbusd_epi32(sums[p], w1, broadcast_8_bytes_512(aq + 16 * k + 8));
                }
                const __m512i scales = _mm512_shuffle_epi8(
                    _mm512_and_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *) (sc + 16 * t))), m4b),
                    scale_index);
                acc = _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(sums[0], sums[1]), scales);
            }
            iacc_min_b = _mm256_add_epi32(iacc_min_b, half_block_mins(sc, a_ptr[b].bsums + h * 8));
        }
        const __m256i iacc_b = column_pairs_packed(acc);
        acc_row = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc_b), _mm256_mul_ps(col_scale, row_scale), acc_row);
        acc_min_rows = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc_min_b), _mm256_mul_ps(col_dmin, row_scale), acc_min_rows);
    }
    _mm256_storeu_ps(out, _mm256_sub_ps(acc_row, acc_min_rows));
}
#endif

}  // namespace

bool rapidmoe_q2_K_repack_avx2() {
    const char * env = std::getenv("RAPIDMOE_Q2_K_REPACK");
    return env == nullptr || env[0] != '0';
}

void rapidmoe_gemv_q2_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) {
    (void) bs;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (!rapidmoe_gemm_avx2_only()) {
        const int nb = n / QK_K;
        for (int y = 0; y < nr; y++) {
            for (int x = 0; x < nc / 8; x++) {
                gemv_512(nb, (const block_q2_Kx8 *) vx + (int64_t) x * nb, (const block_q8_K *) vy + (int64_t) y * nb,
                         s + (y * nr + x * 8));
            }
        }
        return;
    }
#endif
#if defined(__AVX2__)
    const int nb = n / QK_K;
    const __m256i m3b = _mm256_set1_epi8(3);
    const __m256i m4b = _mm256_set1_epi8(0xF);
    // A sub-block's scale of column c is the low nibble of byte 2c + p of its 16 scale bytes (p: the sub-block's
    // parity). These masks make 16-bit lanes, each column's scale 4 times: columns 0-3 (lo) or 4-7 (hi).
    const __m256i scales_lo[2] = { scale_lanes_mask(0, 2, 0), scale_lanes_mask(0, 2, 1) };
    const __m256i scales_hi[2] = { scale_lanes_mask(4, 2, 0), scale_lanes_mask(4, 2, 1) };
    // hadd(lo, hi) holds columns 0 1 4 5 | 2 3 6 7: back to 0..7
    const __m256i natural = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);

    const auto * b_start = (const block_q2_Kx8 *) vx;
    const auto * a_start = (const block_q8_K *) vy;
    for (int y = 0; y < nr; y++) {
        const block_q8_K * a_ptr = a_start + (int64_t) y * nb;
        for (int x = 0; x < nc / 8; x++) {
            const block_q2_Kx8 * b_ptr = b_start + (int64_t) x * nb;
            __m256 acc_row = _mm256_setzero_ps();
            __m256 acc_min_rows = _mm256_setzero_ps();
            for (int b = 0; b < nb; b++) {
                for (int i = 0; i < (int) sizeof(block_q2_Kx8); i += 64) {
                    _mm_prefetch((const char *) (b_ptr + b) + PREFETCH_BYTES + i, _MM_HINT_T0);
                }
                const __m256 row_scale = _mm256_set1_ps(a_ptr[b].d);
                const __m256 col_scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b_ptr[b].d));
                const __m256 col_dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b_ptr[b].dmin));
                __m256i acc_lo = _mm256_setzero_si256(); // lanes: (column 0-3, first/second 4 of each 8 bytes)
                __m256i acc_hi = _mm256_setzero_si256(); // the same for columns 4-7
                __m256i iacc_min_b = _mm256_setzero_si256();
                for (int sb = 0; sb < QK_K / 128; sb++) {
                    // 256 bytes: 4 x (columns 0-3, columns 4-7), each byte 4 sub-blocks' 2-bit values
                    const uint8_t * q = b_ptr[b].qs + sb * 256;
                    __m256i raw_lo[4];
                    __m256i raw_hi[4];
                    for (int i = 0; i < 4; i++) {
                        raw_lo[i] = _mm256_loadu_si256((const __m256i *) (q + 64 * i));
                        raw_hi[i] = _mm256_loadu_si256((const __m256i *) (q + 64 * i + 32));
                    }
                    const int8_t * aq = a_ptr[b].qs + sb * 128;
                    const uint8_t * sc = b_ptr[b].scales + sb * 64;
                    // sub-block k (16 values a column): values 0-7 in raw[2 (k & 1)], 8-15 in raw[2 (k & 1) + 1], at
                    // bits 2 (k / 2); the activation's 16 bytes at aq + 16 k; its scales in the 16 bytes at sc + 16 (k / 2)
#define RAPIDMOE_SUB_BLOCK(k, shift)                                                                                   \
    {                                                                                                                  \
        const int src = ((k) & 1) * 2;                                                                                 \
        const __m256i a0 = broadcast_8_bytes(aq + 16 * (k));                                    \
        const __m256i a1 = broadcast_8_bytes(aq + 16 * (k) + 8);                                \
        const __m256i w_lo0 = _mm256_and_si256(_mm256_srli_epi16(raw_lo[src], shift), m3b);                            \
        const __m256i w_lo1 = _mm256_and_si256(_mm256_srli_epi16(raw_lo[src + 1], shift), m3b);                        \
        const __m256i w_hi0 = _mm256_and_si256(_mm256_srli_epi16(raw_hi[src], shift), m3b);                            \
        const __m256i w_hi1 = _mm256_and_si256(_mm256_srli_epi16(raw_hi[src + 1], shift), m3b);                        \
        const __m256i p_lo = _mm256_add_epi16(_mm256_maddubs_epi16(w_lo0, a0), _mm256_maddubs_epi16(w_lo1, a1));       \
        const __m256i p_hi = _mm256_add_epi16(_mm256_maddubs_epi16(w_hi0, a0), _mm256_maddubs_epi16(w_hi1, a1));       \
        const __m256i sc16 =                                                                                           \
            _mm256_and_si256(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) (sc + 16 * ((k) / 2)))), m4b); \
        acc_lo = _mm256_add_epi32(acc_lo, _mm256_madd_epi16(p_lo, _mm256_shuffle_epi8(sc16, scales_lo[(k) & 1])));   \
        acc_hi = _mm256_add_epi32(acc_hi, _mm256_madd_epi16(p_hi, _mm256_shuffle_epi8(sc16, scales_hi[(k) & 1])));   \
    }
                    RAPIDMOE_SUB_BLOCK(0, 0)
                    RAPIDMOE_SUB_BLOCK(1, 0)
                    RAPIDMOE_SUB_BLOCK(2, 2)
                    RAPIDMOE_SUB_BLOCK(3, 2)
                    RAPIDMOE_SUB_BLOCK(4, 4)
                    RAPIDMOE_SUB_BLOCK(5, 4)
                    RAPIDMOE_SUB_BLOCK(6, 6)
                    RAPIDMOE_SUB_BLOCK(7, 6)
#undef RAPIDMOE_SUB_BLOCK
                    // the mins (high nibbles) against the activation's 16-value sums, in column order
                    iacc_min_b = _mm256_add_epi32(iacc_min_b, half_block_mins(sc, a_ptr[b].bsums + sb * 8));
                }
                const __m256i iacc_b = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(acc_lo, acc_hi), natural);
                acc_row = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc_b), _mm256_mul_ps(col_scale, row_scale), acc_row);
                acc_min_rows =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc_min_b), _mm256_mul_ps(col_dmin, row_scale), acc_min_rows);
            }
            _mm256_storeu_ps(s + (y * nr + x * 8), _mm256_sub_ps(acc_row, acc_min_rows));
        }
    }
#else
    (void) n; (void) s; (void) vx; (void) vy; (void) nr; (void) nc;
#endif
}
