// Q4_K x Q8_K gemm over llama.cpp's repacked block_q4_Kx8 layout (8 columns interleaved in 8-byte chunks) and the
// 4-row interleaved activations (block_q8_Kx4), for prompt batches: attention, the output head and Q4_K experts.
//
// Built as our Q2_K gemm (rapidmoe-gemm-q2k.cpp): a weight block is unpacked once (nibbles to bytes, the 8
// sub-blocks' 6-bit scales to 16-bit lanes, the mins) into a buffer that stays in L1 and multiplied with every
// 4-row group of the call; each 4-column vector is multiplied as it is laid out with the activation's 8 bytes
// broadcast. Upstream's AVX2 kernel unpacks and shuffles every block again for each 4 rows (profiled on the bench
// model, pp512, Zen 5 with AVX2: 4.1-4.9 CPU ms per token, against ik_llama.cpp's 1.9).
// With AVX-512 VNNI a second path takes each sub-block's 32-value sums with vpdpbusd and scales them with vpmulld
// (rapidmoe-gemm-q2k.cpp says what it measured; RAPIDMOE_GEMM=avx2 runs the AVX2 path).
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

// Row r's mins term for the 8 columns: the sub-blocks' mins (16-bit lanes (column c, sub-block), sub-blocks 2p and
// 2p + 1 in mins[p]) against the row's 32-value sums (pairs of its 16-value sums, 4q..4q+3 at bsums + 16 q + 4 r)
inline __m256i block_mins(const __m256i u_mins[4], const block_q8_Kx4 & a, int r) {
    const __m128i g0 = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *) (a.bsums + 4 * r)),
                                          _mm_loadl_epi64((const __m128i *) (a.bsums + 16 + 4 * r)));
    const __m128i g1 = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *) (a.bsums + 32 + 4 * r)),
                                          _mm_loadl_epi64((const __m128i *) (a.bsums + 48 + 4 * r)));
    const __m256i q8s = _mm256_broadcastsi128_si256(_mm_hadd_epi16(g0, g1));
    const __m256i m0 = _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 0), u_mins[0]);
    const __m256i m1 = _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 85), u_mins[1]);
    const __m256i m2 = _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 170), u_mins[2]);
    const __m256i m3 = _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 255), u_mins[3]);
    return _mm256_add_epi32(_mm256_add_epi32(m0, m1), _mm256_add_epi32(m2, m3));
}

}  // namespace
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
namespace {

// AVX-512 VNNI: the nibbles as bytes, each zmm 8 values of all 8 columns (column c's 8 bytes in 32-bit lanes 2c and
// 2c + 1, the repacked block's own order) for vpdpbusd against an activation's 8 bytes broadcast to every 64-bit
// lane; a sub-block's 32-value sums (at most 15 x 128 x 32: 32 bits) are multiplied by its 6-bit scales with
// vpmulld. The AVX2 kernel's 16-bit partials need 4 instructions where this needs 1.5 per 64 products.
struct UnpackedQ4K512 {
    __m512i w[8][4];   // sub-block s (32 values), values 8i..8i+7 of the 8 columns
    __m512i scale[8];  // sub-block s: column c's scale in 32-bit lanes 2c and 2c + 1
    __m256i mins[4];   // as the AVX2 kernel's: sub-blocks 2p and 2p + 1, 16-bit lanes (column c, sub-block)
    __m256 d;          // the columns' super-block scales
    __m256 dmin;       // and min scales
};

void unpack_512(const block_q4_Kx8 & blk, UnpackedQ4K512 & u) {
    const __m512i m4b = _mm512_set1_epi8(0xF);
    u.d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) blk.d));
    u.dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) blk.dmin));
    for (int p = 0; p < 4; p++) {
        // 256 bytes: 4 x 64 (values 8i..8i+7 of the 8 columns); low nibbles: sub-block 2 p, high: 2 p + 1
        const uint8_t * q = blk.qs + p * 256;
        for (int i = 0; i < 4; i++) {
            const __m512i raw = _mm512_loadu_si512((const void *) (q + 64 * i));
            u.w[2 * p][i] = _mm512_and_si512(raw, m4b);
            u.w[2 * p + 1][i] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4b);
        }
        const __m128i ms0 = unpack_scales_mins(blk.scales + 24 * p);
        const __m128i ms1 = unpack_scales_mins(blk.scales + 24 * p + 12);
        // 8 scale bytes to 64-bit lanes, each column's scale in both halves
        const __m512i s0 = _mm512_cvtepu8_epi64(ms0);
        const __m512i s1 = _mm512_cvtepu8_epi64(ms1);
        u.scale[2 * p] = _mm512_or_si512(s0, _mm512_slli_epi64(s0, 32));
        u.scale[2 * p + 1] = _mm512_or_si512(s1, _mm512_slli_epi64(s1, 32));
        u.mins[p] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_shuffle_epi32(ms0, 78), _mm_shuffle_epi32(ms1, 78)));
    }
}

// block_sums' integers (exact, the same products) with vpdpbusd and vpmulld; the mins as the AVX2 kernel
inline void block_sums_512(const UnpackedQ4K512 & u, const block_q8_Kx4 & a, __m256i sums[4], __m256i mins[4]) {
    __m512i acc[4];
    for (int r = 0; r < 4; r++) {
        acc[r] = _mm512_setzero_si512();
    }
    for (int sub = 0; sub < 8; sub++) {
        // sub-block sub of row r, values 8i..8i+7: at qs + 128 sub + 32 i + 8 r
        const int8_t * aq = a.qs + 128 * sub;
        for (int r = 0; r < 4; r++) {
            // values 0-15 and 16-31 in two chains, added before the scale
            const __m512i zero = _mm512_setzero_si512();
            __m512i p01 = _mm512_dpbusd_epi32(zero, u.w[sub][0], broadcast_8_bytes_512(aq + 8 * r));
            __m512i p23 = _mm512_dpbusd_epi32(zero, u.w[sub][2], broadcast_8_bytes_512(aq + 64 + 8 * r));
            p01 = _mm512_dpbusd_epi32(p01, u.w[sub][1], broadcast_8_bytes_512(aq + 32 + 8 * r));
            p23 = _mm512_dpbusd_epi32(p23, u.w[sub][3], broadcast_8_bytes_512(aq + 96 + 8 * r));
            acc[r] = _mm512_add_epi32(acc[r], _mm512_mullo_epi32(_mm512_add_epi32(p01, p23), u.scale[sub]));
        }
    }
    for (int r = 0; r < 4; r++) {
        sums[r] = column_pairs(acc[r]);
        mins[r] = block_mins(u.mins, a, r);
    }
}

}  // namespace
#endif

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
        mins[r] = block_mins(u.mins, a, r);
    }
}

}  // namespace
#endif

void rapidmoe_gemm_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (!rapidmoe_gemm_avx2_only()) {
        rapidmoe_gemm_columns<block_q4_Kx8, UnpackedQ4K512, unpack_512, block_sums_512>(n, s, bs, vx, vy, nr, nc);
        return;
    }
#endif
#if defined(__AVX2__)
    rapidmoe_gemm_columns<block_q4_Kx8, UnpackedQ4K, unpack, block_sums>(n, s, bs, vx, vy, nr, nc);
#else
    (void) n; (void) s; (void) bs; (void) vx; (void) vy; (void) nr; (void) nc;
#endif
}
