// Q4_K x Q8_K gemv over llama.cpp's repacked block_q4_Kx8 layout (8 columns interleaved in 8-byte chunks), for
// decode steps: one activation row against a Q4_K matrix (attention, the output head, Q4_K experts).
//
// Why our own: in a decode step of the cpu-fast preset (and of stock Q4_K_M) most bytes read are Q4_K (on the
// 8.1 GB bench model: attention and the output head, 155 MB a token against 50 MB of routed Q2_K experts), and
// upstream's kernel is built as its Q2_K one was (patch 0006): every multiply blends two shuffled column vectors and
// shuffles the activation, and nothing prefetches. This kernel, like ours for Q2_K,
//  - multiplies each 4-column vector as it is laid out with the activation's 8 bytes broadcast (one load, no
//    shuffle), so the 32-bit lanes hold (column, half) sums that one hadd per block folds;
//  - prefetches the weights PREFETCH_BYTES ahead.
// Every integer sum is exact (a 16-bit partial is at most 4 x 2 x 15 x 128) and the float operations per column
// are upstream's, in its order, so the output is bit-identical to upstream's (tools/kernel_cost.py --check compares
// it with the stock build's; tests/engine/test_cpu_kernels.py runs that).
// With AVX-512 VNNI a second path takes all 8 columns in one zmm: vpdpbusd gives each sub-block's sums per (column,
// half) lane (at most 16 x 15 x 128: 16 bits), vpackssdw packs a pair of sub-blocks' sums and one vpdpwssd
// multiplies them by their 6-bit scales and adds them: the same exact integers and float operations, so the same
// bits (RAPIDMOE_GEMM=avx2 runs the AVX2 path).
#include "rapidmoe-gemv-q4k.h"

#include "rapidmoe-gemm.h"
#include "rapidmoe-simd.h"
#include "repack.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace {

constexpr int PREFETCH_BYTES = 2048; // about two blocks (1152 bytes each) ahead, as for Q2_K

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// One row of 8 interleaved columns against one activation row, all 8 columns in a zmm (column c's 8 bytes are 64-bit
// lane c: its sums sit in 32-bit lanes 2c and 2c + 1). Per pair of sub-blocks (2p, 2p + 1): 8 vpdpbusd (low and
// high nibbles x the activation's 8 bytes broadcast), vpackssdw of the two sums (128-bit lane j: sub-block 2p's
// lanes of columns 2j, 2j + 1, then 2p + 1's), one vpdpwssd against the scales in that order.
void gemv_512(int nb, const block_q4_Kx8 * b_ptr, const block_q8_K * a_ptr, float * out) {
    const __m512i m4b = _mm512_set1_epi8(0xF);
    __m256 acc_row = _mm256_setzero_ps();
    __m256 acc_min_rows = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        for (int i = 0; i < (int) sizeof(block_q4_Kx8); i += 64) {
            _mm_prefetch((const char *) (b_ptr + b) + PREFETCH_BYTES + i, _MM_HINT_T0);
        }
        const __m256 row_scale = _mm256_set1_ps(a_ptr[b].d);
        const __m256 col_scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b_ptr[b].d));
        const __m256 col_dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b_ptr[b].dmin));
        // the activation's sums of each 32 values (sub-blocks 0..7), as 16-bit lanes, twice (the AVX2 path's)
        const __m256i q8sums = _mm256_loadu_si256((const __m256i *) a_ptr[b].bsums);
        __m256i q8s = _mm256_castsi128_si256(
            _mm_hadd_epi16(_mm256_castsi256_si128(q8sums), _mm256_extracti128_si256(q8sums, 1)));
        q8s = _mm256_permute2f128_si256(q8s, q8s, 0);
        __m512i acc = _mm512_setzero_si512();
        __m256i iacc_min_b = _mm256_setzero_si256();
        for (int sb = 0; sb < QK_K / 64; sb++) {
            // 256 bytes: 4 x 64 (values 8i..8i+7 of the 8 columns); low nibbles: sub-block 2 sb, high: 2 sb + 1
            const uint8_t * q = b_ptr[b].qs + sb * 256;
            const int8_t * aq = a_ptr[b].qs + sb * 64;
            const __m128i ms0 = unpack_scales_mins(b_ptr[b].scales + 24 * sb);
            const __m128i ms1 = unpack_scales_mins(b_ptr[b].scales + 24 * sb + 12);
            __m512i sum0 = _mm512_setzero_si512();
            __m512i sum1 = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) {
                const __m512i raw = _mm512_loadu_si512((const void *) (q + 64 * i));
                sum0 = _mm512_dpbusd_epi32(sum0, _mm512_and_si512(raw, m4b), broadcast_8_bytes_512(aq + 8 * i));
                sum1 = _mm512_dpbusd_epi32(sum1, _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4b),
                                           broadcast_8_bytes_512(aq + 32 + 8 * i));
            }
            // 16-bit lanes 8j .. 8j + 7: scales of columns 2j, 2j (sub-block 2 sb), 2j + 1, 2j + 1, then 2 sb + 1's
            const __m512i sc8 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi16(ms0, ms1));
            const __m512i scales = _mm512_or_si512(sc8, _mm512_slli_epi32(sc8, 16));
            acc = _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(sum0, sum1), scales);
            // the mins of both sub-blocks side by side, against the activation's two 32-value sums
            const __m256i mins_01 =
                _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_shuffle_epi32(ms0, 78), _mm_shuffle_epi32(ms1, 78)));
            iacc_min_b = _mm256_add_epi32(iacc_min_b, _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 0), mins_01));
            q8s = _mm256_bsrli_epi128(q8s, 4);
        }
        const __m256i iacc_b = column_pairs_packed(acc);
        acc_row = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc_b), _mm256_mul_ps(col_scale, row_scale), acc_row);
        acc_min_rows = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc_min_b), _mm256_mul_ps(col_dmin, row_scale), acc_min_rows);
    }
    _mm256_storeu_ps(out, _mm256_sub_ps(acc_row, acc_min_rows));
}
#endif

}  // namespace

void rapidmoe_gemv_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) {
    (void) bs;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (!rapidmoe_gemm_avx2_only()) {
        const int nb = n / QK_K;
        for (int y = 0; y < nr; y++) {
            for (int x = 0; x < nc / 8; x++) {
                gemv_512(nb, (const block_q4_Kx8 *) vx + (int64_t) x * nb, (const block_q8_K *) vy + (int64_t) y * nb,
                         s + (y * nr + x * 8));
            }
        }
        return;
    }
#endif
#if defined(__AVX2__)
    const int nb = n / QK_K;
    const __m256i m4b = _mm256_set1_epi8(0xF);
    // 16-bit lanes from the 8 scale bytes (byte c: column c), each column's scale 4 times: columns 0-3 or 4-7
    const __m256i scales_lo = scale_lanes_mask(0, 1, 0);
    const __m256i scales_hi = scale_lanes_mask(4, 1, 0);
    // hadd(lo, hi) holds columns 0 1 4 5 | 2 3 6 7: back to 0..7
    const __m256i natural = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);

    const auto * b_start = (const block_q4_Kx8 *) vx;
    const auto * a_start = (const block_q8_K *) vy;
    for (int y = 0; y < nr; y++) {
        const block_q8_K * a_ptr = a_start + (int64_t) y * nb;
        for (int x = 0; x < nc / 8; x++) {
            const block_q4_Kx8 * b_ptr = b_start + (int64_t) x * nb;
            __m256 acc_row = _mm256_setzero_ps();
            __m256 acc_min_rows = _mm256_setzero_ps();
            for (int b = 0; b < nb; b++) {
                for (int i = 0; i < (int) sizeof(block_q4_Kx8); i += 64) {
                    _mm_prefetch((const char *) (b_ptr + b) + PREFETCH_BYTES + i, _MM_HINT_T0);
                }
                const __m256 row_scale = _mm256_set1_ps(a_ptr[b].d);
                const __m256 col_scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b_ptr[b].d));
                const __m256 col_dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b_ptr[b].dmin));
                // the activation's sums of each 32 values (sub-blocks 0..7), as 16-bit lanes, twice
                const __m256i q8sums = _mm256_loadu_si256((const __m256i *) a_ptr[b].bsums);
                __m256i q8s = _mm256_castsi128_si256(
                    _mm_hadd_epi16(_mm256_castsi256_si128(q8sums), _mm256_extracti128_si256(q8sums, 1)));
                q8s = _mm256_permute2f128_si256(q8s, q8s, 0);
                __m256i acc_lo = _mm256_setzero_si256(); // lanes: (column 0-3, first/second 4 of each 8 bytes)
                __m256i acc_hi = _mm256_setzero_si256(); // the same for columns 4-7
                __m256i iacc_min_b = _mm256_setzero_si256();
                for (int sb = 0; sb < QK_K / 64; sb++) {
                    // 256 bytes: 4 x (columns 0-3, columns 4-7) 8 bytes each; low nibbles: sub-block 2 sb, high: 2 sb + 1
                    const uint8_t * q = b_ptr[b].qs + sb * 256;
                    const int8_t * aq = a_ptr[b].qs + sb * 64;
                    const __m128i ms0 = unpack_scales_mins(b_ptr[b].scales + 24 * sb);
                    const __m128i ms1 = unpack_scales_mins(b_ptr[b].scales + 24 * sb + 12);
                    __m256i p_lo0 = _mm256_setzero_si256();
                    __m256i p_hi0 = _mm256_setzero_si256();
                    __m256i p_lo1 = _mm256_setzero_si256();
                    __m256i p_hi1 = _mm256_setzero_si256();
                    for (int i = 0; i < 4; i++) {
                        const __m256i raw_lo = _mm256_loadu_si256((const __m256i *) (q + 64 * i));
                        const __m256i raw_hi = _mm256_loadu_si256((const __m256i *) (q + 64 * i + 32));
                        const __m256i a0 = broadcast_8_bytes(aq + 8 * i);
                        const __m256i a1 = broadcast_8_bytes(aq + 32 + 8 * i);
                        p_lo0 = _mm256_add_epi16(p_lo0, _mm256_maddubs_epi16(_mm256_and_si256(raw_lo, m4b), a0));
                        p_hi0 = _mm256_add_epi16(p_hi0, _mm256_maddubs_epi16(_mm256_and_si256(raw_hi, m4b), a0));
                        p_lo1 = _mm256_add_epi16(
                            p_lo1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw_lo, 4), m4b), a1));
                        p_hi1 = _mm256_add_epi16(
                            p_hi1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw_hi, 4), m4b), a1));
                    }
                    const __m256i sc0 = _mm256_broadcastsi128_si256(ms0);
                    const __m256i sc1 = _mm256_broadcastsi128_si256(ms1);
                    acc_lo = _mm256_add_epi32(acc_lo, _mm256_madd_epi16(p_lo0, _mm256_shuffle_epi8(sc0, scales_lo)));
                    acc_hi = _mm256_add_epi32(acc_hi, _mm256_madd_epi16(p_hi0, _mm256_shuffle_epi8(sc0, scales_hi)));
                    acc_lo = _mm256_add_epi32(acc_lo, _mm256_madd_epi16(p_lo1, _mm256_shuffle_epi8(sc1, scales_lo)));
                    acc_hi = _mm256_add_epi32(acc_hi, _mm256_madd_epi16(p_hi1, _mm256_shuffle_epi8(sc1, scales_hi)));
                    // the mins of both sub-blocks side by side, against the activation's two 32-value sums
                    const __m256i mins_01 = _mm256_cvtepu8_epi16(
                        _mm_unpacklo_epi8(_mm_shuffle_epi32(ms0, 78), _mm_shuffle_epi32(ms1, 78)));
                    iacc_min_b = _mm256_add_epi32(iacc_min_b, _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 0), mins_01));
                    q8s = _mm256_bsrli_epi128(q8s, 4);
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
