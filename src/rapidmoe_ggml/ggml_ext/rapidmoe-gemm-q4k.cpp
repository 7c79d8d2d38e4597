// Q4_K x Q8_K gemm over llama.cpp's repacked block_q4_Kx8 layout (8 columns interleaved in 8-byte chunks) and the
// 4-row interleaved activations (block_q8_Kx4), for prompt batches: attention, the output head and Q4_K experts.
//
// Built as our Q2_K gemm (rapidmoe-gemm-q2k.cpp): a weight block is unpacked once (nibbles to bytes, the 8
// sub-blocks' 6-bit scales to 16-bit lanes, the mins) into a buffer that stays in L1 and multiplied with every
// 4-row group of the call; each 4-column vector is multiplied as it is laid out with the activation's 8 bytes
// broadcast. Upstream's AVX2 kernel unpacks and shuffles every block again for each 4 rows (profiled on the bench
// model, pp512, Zen 5 with AVX2: 4.1-4.9 CPU ms per token, against ik_llama.cpp's 1.9).
// Every integer sum is exact (a 16-bit partial is at most 4 x 2 x 15 x 128) and the float operations per (row,
// column) are the gemv's, in its order: the output is bit-identical to the repacked gemv run on each row
// (tools/kernel_cost.py --check). Upstream's AVX2 gemm adds in another order: equal to float rounding.
#include "rapidmoe-gemm.h"

#include "rapidmoe-gemm-loop.h"
#include "rapidmoe-simd.h"
#include "repack.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
namespace {

// One weight block (8 columns x 256 values) unpacked for the 4-row products
struct UnpackedQ4K {
    __m256i w[8][4][2];   // sub-block s (32 values), values 8i..8i+7: columns 0-3, columns 4-7
    __m256i scale[8][2];  // sub-block s: each column's scale in 4 16-bit lanes, columns 0-3 and 4-7
    __m256i mins[4];      // sub-blocks 2p and 2p + 1: 16-bit lanes (column c, sub-block) for c
    __m256 d;             // the columns' super-block scales
    __m256 dmin;          // and min scales
};

void unpack(const block_q4_Kx8 & blk, UnpackedQ4K & u) {
    const __m256i m4b = _mm256_set1_epi8(0xF);
    // 16-bit lanes from the 8 scale bytes (byte c: column c), each column's scale 4 times: columns 0-3 or 4-7
    const __m256i scales_lo = scale_lanes_mask(0, 1, 0);
    const __m256i scales_hi = scale_lanes_mask(4, 1, 0);
    u.d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) blk.d));
    u.dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) blk.dmin));
    for (int p = 0; p < 4; p++) {
        // 256 bytes: 4 x (columns 0-3, columns 4-7) 8 bytes each; low nibbles: sub-block 2 p, high: 2 p + 1
        const uint8_t * q = blk.qs + p * 256;
        for (int i = 0; i < 4; i++) {
            const __m256i raw_lo = _mm256_loadu_si256((const __m256i *) (q + 64 * i));
            const __m256i raw_hi = _mm256_loadu_si256((const __m256i *) (q + 64 * i + 32));
            u.w[2 * p][i][0] = _mm256_and_si256(raw_lo, m4b);
            u.w[2 * p][i][1] = _mm256_and_si256(raw_hi, m4b);
            u.w[2 * p + 1][i][0] = _mm256_and_si256(_mm256_srli_epi16(raw_lo, 4), m4b);
            u.w[2 * p + 1][i][1] = _mm256_and_si256(_mm256_srli_epi16(raw_hi, 4), m4b);
        }
        const __m128i ms0 = unpack_scales_mins(blk.scales + 24 * p);
        const __m128i ms1 = unpack_scales_mins(blk.scales + 24 * p + 12);
        const __m256i sc0 = _mm256_broadcastsi128_si256(ms0);
        const __m256i sc1 = _mm256_broadcastsi128_si256(ms1);
        u.scale[2 * p][0] = _mm256_shuffle_epi8(sc0, scales_lo);
        u.scale[2 * p][1] = _mm256_shuffle_epi8(sc0, scales_hi);
        u.scale[2 * p + 1][0] = _mm256_shuffle_epi8(sc1, scales_lo);
        u.scale[2 * p + 1][1] = _mm256_shuffle_epi8(sc1, scales_hi);
        // the mins of both sub-blocks side by side
        u.mins[p] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_shuffle_epi32(ms0, 78), _mm_shuffle_epi32(ms1, 78)));
    }
}

// The integer sums of one block for 4 activation rows: sums[r] (columns 0-7) and mins[r] (the mins against the
// activation's 32-value sums), exact
inline void block_sums(const UnpackedQ4K & u, const block_q8_Kx4 & a, __m256i sums[4], __m256i mins[4]) {
    __m256i acc_lo[4];
    __m256i acc_hi[4];
    for (int r = 0; r < 4; r++) {
        acc_lo[r] = _mm256_setzero_si256();
        acc_hi[r] = _mm256_setzero_si256();
    }
    for (int sub = 0; sub < 8; sub++) {
        // sub-block sub of row r, values 8i..8i+7: at qs + 128 sub + 32 i + 8 r
        const int8_t * aq = a.qs + 128 * sub;
        for (int r = 0; r < 4; r++) {
            __m256i p_lo = _mm256_setzero_si256();
            __m256i p_hi = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                const __m256i ai = broadcast_8_bytes(aq + 32 * i + 8 * r);
                p_lo = _mm256_add_epi16(p_lo, _mm256_maddubs_epi16(u.w[sub][i][0], ai));
                p_hi = _mm256_add_epi16(p_hi, _mm256_maddubs_epi16(u.w[sub][i][1], ai));
            }
            acc_lo[r] = _mm256_add_epi32(acc_lo[r], _mm256_madd_epi16(p_lo, u.scale[sub][0]));
            acc_hi[r] = _mm256_add_epi32(acc_hi[r], _mm256_madd_epi16(p_hi, u.scale[sub][1]));
        }
    }
    // hadd(lo, hi) holds columns 0 1 4 5 | 2 3 6 7: back to 0..7
    const __m256i natural = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    for (int r = 0; r < 4; r++) {
        sums[r] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(acc_lo[r], acc_hi[r]), natural);
        // row r's 16-value sums 4q..4q+3 at bsums + 16 q + 4 r; pairs of them make the 8 sub-blocks' sums
        const __m128i g0 = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *) (a.bsums + 4 * r)),
                                              _mm_loadl_epi64((const __m128i *) (a.bsums + 16 + 4 * r)));
        const __m128i g1 = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *) (a.bsums + 32 + 4 * r)),
                                              _mm_loadl_epi64((const __m128i *) (a.bsums + 48 + 4 * r)));
        const __m256i q8s = _mm256_broadcastsi128_si256(_mm_hadd_epi16(g0, g1));
        const __m256i m0 = _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 0), u.mins[0]);
        const __m256i m1 = _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 85), u.mins[1]);
        const __m256i m2 = _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 170), u.mins[2]);
        const __m256i m3 = _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 255), u.mins[3]);
        mins[r] = _mm256_add_epi32(_mm256_add_epi32(m0, m1), _mm256_add_epi32(m2, m3));
    }
}

}  // namespace
#endif

void rapidmoe_gemm_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) {
#if defined(__AVX2__)
    rapidmoe_gemm_columns<block_q4_Kx8, UnpackedQ4K, unpack, block_sums>(n, s, bs, vx, vy, nr, nc);
#else
    (void) n; (void) s; (void) bs; (void) vx; (void) vy; (void) nr; (void) nc;
#endif
}
