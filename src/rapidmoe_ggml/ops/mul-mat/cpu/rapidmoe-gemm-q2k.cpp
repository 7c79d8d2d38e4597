// Q2_K x Q8_K gemm over llama.cpp's repacked block_q2_Kx8 layout (8 columns interleaved in 8-byte chunks) and the
// 4-row interleaved activations (block_q8_Kx4), for prompt batches: the routed rows of an expert (patch 0005 groups
// them by 4) and dense matmuls.
//
// Why our own: upstream's AVX2 kernel spends about as much per activation row as its gemv does, because it unpacks
// and shuffles each weight block again for every 4 rows. Profiled on the bench model (pp512, 2 threads, Zen 5 with
// AVX2) it took 24.8 CPU ms per token, where ik_llama.cpp's repacked Q2_K gemm takes 7.7. This kernel
//  - unpacks a weight block once (8 columns x 256 2-bit values to bytes, the 16 sub-blocks' scales to 16-bit lanes,
//    the mins) into a buffer that stays in L1, then multiplies it with every 4-row group of the batch: the unpack
//    is paid once per block, not once per 4 rows;
//  - multiplies each 4-column vector as it is laid out with the activation's 8 bytes broadcast (a load, no shuffle),
//    as our gemv does (rapidmoe-gemv-q2k.cpp), so the inner loop is loads, multiplies and adds.
// On a CPU with AVX-512 VNNI (Zen 4/5, Ice Lake and later) a second path multiplies each unpacked 2-bit value by its
// sub-block's 4-bit scale once per block (at most 45: a byte) and takes a block's sum per row and column pair with
// vpdpbusd alone: 64 products an instruction with no per-sub-block step. Measured on the bench model (pp512, 2
// threads, Zen 5 VM, with the Q4_K gemm's path too): `cpu-fast` prompts 1.33x (r = 0) and 1.50x (r = 1) faster end
// to end than with the AVX2 paths (bench/results/prefill-gemm-avx512-zen5.md); RAPIDMOE_GEMM=avx2 runs the AVX2
// path instead.
// Every integer sum is exact (no 16-bit partial exceeds 2 x 2 x 3 x 128), and the float operations per (row,
// column) are the gemv's, in its order (per block: acc += sum x (column scale x row scale), mins likewise, then
// acc - mins): the output is bit-identical to the repacked gemv run on each row, ours and upstream's
// (tools/kernel_cost.py --check, tests/engine/test_cpu_kernels.py). Upstream's AVX2 gemm adds the same terms in
// another order: equal to float rounding.
#include "rapidmoe-gemm.h"

#include "rapidmoe-gemm-loop.h"
#include "rapidmoe-simd.h"
#include "repack.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
namespace {

// AVX-512 VNNI: one weight block unpacked as bytes already multiplied by their sub-block's scale (q x scale <= 3 x
// 15 = 45 fits an unsigned byte), laid out for vpdpbusd: each zmm holds 8 values of all 8 columns, column c's 8 bytes
// in 32-bit lanes 2c and 2c + 1 (the repacked block's own order); an activation's 8 bytes broadcast to every 64-bit
// lane meet them. A block's sum is then one chain of vpdpbusd, without a per-sub-block scaling step.
struct UnpackedQ2K512 {
    __m512i w[16][2]; // sub-block j: values 0-7 and 8-15 of the 8 columns, times the sub-block's scale
    __m512i mins[4];  // sub-blocks 4g..4g+3: 16-bit lanes 4c + t = column c's min of sub-block 4g + t
    __m256 d;         // the columns' super-block scales
    __m256 dmin;      // and min scales
};

void unpack_512(const block_q2_Kx8 & blk, UnpackedQ2K512 & u) {
    const __m512i m3b = _mm512_set1_epi8(3);
    const __m512i m4b = _mm512_set1_epi8(0xF);
    const __m256i m4b_256 = _mm256_set1_epi8(0xF);
    // byte b of a zmm belongs to column b / 8; its scale is byte 2 (b / 8) + p of the 16 scale bytes (p: the
    // sub-block's parity), low nibble. pshufb indexes within a 128-bit lane, and each lane holds all 16 (broadcast).
    static const struct ScaleIndex {
        __m512i p[2];
        ScaleIndex() {
            for (int parity = 0; parity < 2; parity++) {
                alignas(64) int8_t idx[64];
                for (int b = 0; b < 64; b++) {
                    idx[b] = (int8_t) (2 * (b / 8) + parity);
                }
                p[parity] = _mm512_load_si512(idx);
            }
        }
    } scale_index;
    u.d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) blk.d));
    u.dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) blk.dmin));
    for (int h = 0; h < 2; h++) {
        const uint8_t * q = blk.qs + h * 256;
        const uint8_t * sc = blk.scales + h * 64;
        for (int k = 0; k < 8; k++) {
            // sub-block 8h + k: values 0-7 of the 8 columns in the 64 bytes at raw[2 (k & 1)], 8-15 in the next 64,
            // at bits 2 (k / 2) of each byte
            const int src = (k & 1) * 2;
            const __m128i shift = _mm_cvtsi32_si128(2 * (k / 2));
            const __m512i scale = _mm512_shuffle_epi8(
                _mm512_and_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *) (sc + 16 * (k / 2)))), m4b),
                scale_index.p[k & 1]);
            const __m512i scale2 = _mm512_add_epi8(scale, scale);
            for (int g = 0; g < 2; g++) {
                const __m512i v = _mm512_and_si512(
                    _mm512_srl_epi16(_mm512_loadu_si512((const void *) (q + 64 * (src + g))), shift), m3b);
                // v x scale for v in 0..3: bit 0 adds the scale, bit 1 twice it
                const __mmask64 bit0 = _mm512_test_epi8_mask(v, _mm512_set1_epi8(1));
                const __mmask64 bit1 = _mm512_test_epi8_mask(v, _mm512_set1_epi8(2));
                u.w[8 * h + k][g] =
                    _mm512_add_epi8(_mm512_maskz_mov_epi8(bit0, scale), _mm512_maskz_mov_epi8(bit1, scale2));
            }
        }
        // mins: high nibbles; bytes 2c + p of the 16 at sc + 16 i are column c's mins of sub-blocks 8h + 2i + p
        for (int gg = 0; gg < 2; gg++) {
            const __m256i m = _mm256_and_si256(
                _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *) (sc + 32 * gg)), 4), m4b_256);
            const __m128i a = _mm256_castsi256_si128(m);      // sub-blocks 8h + 4gg + {0, 1}
            const __m128i b = _mm256_extracti128_si256(m, 1); // sub-blocks 8h + 4gg + {2, 3}
            // words (c: p0 p1) of a and b interleaved: bytes 4c + t for t = 0..3
            const __m256i ordered = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi16(a, b)),
                                                            _mm_unpackhi_epi16(a, b), 1);
            u.mins[2 * h + gg] = _mm512_cvtepu8_epi16(ordered);
        }
    }
}

// block_sums' integers (exact: the same products, summed in 32 bits) with vpdpbusd and vpdpwssd
inline void block_sums_512(const UnpackedQ2K512 & u, const block_q8_Kx4 & a, __m256i sums[4], __m256i mins[4]) {
    __m512i acc0[4];
    __m512i acc1[4];
    for (int r = 0; r < 4; r++) {
        acc0[r] = _mm512_setzero_si512();
        acc1[r] = _mm512_setzero_si512();
    }
    for (int j = 0; j < 16; j++) {
        const int8_t * aq = a.qs + 64 * j;  // row r: values 0-7 at aq + 8 r, values 8-15 at aq + 32 + 8 r
        for (int r = 0; r < 4; r++) {
            acc0[r] = _mm512_dpbusd_epi32(acc0[r], u.w[j][0], broadcast_8_bytes_512(aq + 8 * r));
            acc1[r] = _mm512_dpbusd_epi32(acc1[r], u.w[j][1], broadcast_8_bytes_512(aq + 32 + 8 * r));
        }
    }
    for (int r = 0; r < 4; r++) {
        sums[r] = column_pairs(_mm512_add_epi32(acc0[r], acc1[r]));
        // row r's 16-value sums of sub-blocks 8h + 4gg .. + 3: 4 at bsums + 32 h + 16 gg + 4 r
        __m512i m = _mm512_setzero_si512();
        for (int g = 0; g < 4; g++) {
            m = _mm512_dpwssd_epi32(m, u.mins[g], broadcast_8_bytes_512(a.bsums + 32 * (g / 2) + 16 * (g % 2) + 4 * r));
        }
        mins[r] = column_pairs(m);
    }
}

}  // namespace
#endif

#if defined(__AVX2__)
namespace {

// One weight block (8 columns x 256 values) unpacked for the 4-row products
struct UnpackedQ2K {
    __m256i w[16][4];     // sub-block j: columns 0-3 values 0-7, columns 0-3 values 8-15, the same for columns 4-7
    __m256i scale[16][2]; // sub-block j: each column's scale in 4 16-bit lanes, columns 0-3 and 4-7
    __m256i mins[2][4];   // half h, sub-block pair i: 16-bit lanes (column c, sub-block 8h + 2i + p) for c, p
    __m256 d;             // the columns' super-block scales
    __m256 dmin;          // and min scales
};

void unpack(const block_q2_Kx8 & blk, UnpackedQ2K & u) {
    const __m256i m3b = _mm256_set1_epi8(3);
    const __m256i m4b = _mm256_set1_epi8(0xF);
    const __m128i m4b_sse = _mm_set1_epi8(0xF);
    // A sub-block's scale of column c is the low nibble of byte 2c + p of its 16 scale bytes (p: the sub-block's
    // parity). These masks make 16-bit lanes, each column's scale 4 times: columns 0-3 (lo) or 4-7 (hi).
    const __m256i scales_lo[2] = { scale_lanes_mask(0, 2, 0), scale_lanes_mask(0, 2, 1) };
    const __m256i scales_hi[2] = { scale_lanes_mask(4, 2, 0), scale_lanes_mask(4, 2, 1) };
    u.d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) blk.d));
    u.dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) blk.dmin));
    for (int h = 0; h < 2; h++) {
        // 256 bytes: 4 x (columns 0-3, columns 4-7), each byte 4 sub-blocks' 2-bit values; sub-block k of the
        // half: values 0-7 in raw[2 (k & 1)], 8-15 in raw[2 (k & 1) + 1], at bits 2 (k / 2)
        const uint8_t * q = blk.qs + h * 256;
        const uint8_t * sc = blk.scales + h * 64;
        for (int k = 0; k < 8; k++) {
            const int src = (k & 1) * 2;
            const int shift = 2 * (k / 2);
            const __m128i shift_count = _mm_cvtsi32_si128(shift);
            __m256i * w = u.w[8 * h + k];
            w[0] = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *) (q + 64 * src)), shift_count), m3b);
            w[1] = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *) (q + 64 * (src + 1))), shift_count), m3b);
            w[2] = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *) (q + 64 * src + 32)), shift_count), m3b);
            w[3] = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *) (q + 64 * (src + 1) + 32)), shift_count), m3b);
            const __m256i sc16 =
                _mm256_and_si256(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) (sc + 16 * (k / 2)))), m4b);
            u.scale[8 * h + k][0] = _mm256_shuffle_epi8(sc16, scales_lo[k & 1]);
            u.scale[8 * h + k][1] = _mm256_shuffle_epi8(sc16, scales_hi[k & 1]);
        }
        for (int i = 0; i < 4; i++) {
            const __m128i ms = _mm_loadu_si128((const __m128i *) (sc + 16 * i));
            u.mins[h][i] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(ms, 4), m4b_sse));
        }
    }
}

// The integer sums of one block for 4 activation rows: sums[r] (columns 0-7) and mins[r] (the mins against the
// activation's 16-value sums), exact
inline void block_sums(const UnpackedQ2K & u, const block_q8_Kx4 & a, __m256i sums[4], __m256i mins[4]) {
    __m256i acc_lo[4];
    __m256i acc_hi[4];
    for (int r = 0; r < 4; r++) {
        acc_lo[r] = _mm256_setzero_si256();
        acc_hi[r] = _mm256_setzero_si256();
    }
    for (int j = 0; j < 16; j++) {
        // sub-block j of row r: values 0-7 at qs + 64 j + 8 r, values 8-15 32 bytes on
        const int8_t * aq = a.qs + 64 * j;
        const __m256i w0 = u.w[j][0];
        const __m256i w1 = u.w[j][1];
        const __m256i w2 = u.w[j][2];
        const __m256i w3 = u.w[j][3];
        for (int r = 0; r < 4; r++) {
            const __m256i a0 = broadcast_8_bytes(aq + 8 * r);
            const __m256i a1 = broadcast_8_bytes(aq + 32 + 8 * r);
            const __m256i p_lo = _mm256_add_epi16(_mm256_maddubs_epi16(w0, a0), _mm256_maddubs_epi16(w1, a1));
            const __m256i p_hi = _mm256_add_epi16(_mm256_maddubs_epi16(w2, a0), _mm256_maddubs_epi16(w3, a1));
            acc_lo[r] = _mm256_add_epi32(acc_lo[r], _mm256_madd_epi16(p_lo, u.scale[j][0]));
            acc_hi[r] = _mm256_add_epi32(acc_hi[r], _mm256_madd_epi16(p_hi, u.scale[j][1]));
        }
    }
    // hadd(lo, hi) holds columns 0 1 4 5 | 2 3 6 7: back to 0..7
    const __m256i natural = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    for (int r = 0; r < 4; r++) {
        sums[r] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(acc_lo[r], acc_hi[r]), natural);
        // row r's 16-value sums of sub-blocks 8h..8h+7: 4 at bsums + 32 h + 4 r, 4 at bsums + 32 h + 16 + 4 r
        __m256i m = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m128i lo = _mm_loadl_epi64((const __m128i *) (a.bsums + 32 * h + 4 * r));
            const __m128i hi = _mm_loadl_epi64((const __m128i *) (a.bsums + 32 * h + 16 + 4 * r));
            const __m256i q8s = _mm256_broadcastsi128_si256(_mm_unpacklo_epi64(lo, hi));
            const __m256i m01 = _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 0), u.mins[h][0]);
            const __m256i m23 = _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 85), u.mins[h][1]);
            const __m256i m45 = _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 170), u.mins[h][2]);
            const __m256i m67 = _mm256_madd_epi16(_mm256_shuffle_epi32(q8s, 255), u.mins[h][3]);
            m = _mm256_add_epi32(m, _mm256_add_epi32(_mm256_add_epi32(m01, m23), _mm256_add_epi32(m45, m67)));
        }
        mins[r] = m;
    }
}

}  // namespace
#endif

void rapidmoe_gemm_q2_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (!rapidmoe_gemm_avx2_only()) {
        rapidmoe_gemm_columns<block_q2_Kx8, UnpackedQ2K512, unpack_512, block_sums_512>(n, s, bs, vx, vy, nr, nc);
        return;
    }
#endif
#if defined(__AVX2__)
    rapidmoe_gemm_columns<block_q2_Kx8, UnpackedQ2K, unpack, block_sums>(n, s, bs, vx, vy, nr, nc);
#else
    (void) n; (void) s; (void) bs; (void) vx; (void) vy; (void) nr; (void) nc;
#endif
}
