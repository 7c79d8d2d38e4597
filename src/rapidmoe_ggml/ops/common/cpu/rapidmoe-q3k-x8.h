// RapidMoE's repacked Q3_K layout: 8 weight rows' Q3_K blocks of the same 256 columns in one 880-byte block, the
// bytes of the 8 plain blocks rearranged (a repacked tensor keeps its size and row strides, and the bits per weight
// it is reported at). Upstream repacks no Q3_K; this layout is ours (patch 0021, rapidmoe-gemv-q3k.cpp), made for an
// AVX-512 VNNI gemv that treats all 8 rows in one zmm:
//  - qs and hmask interleaved 8 bytes at a time (block_q2_Kx8's qs layout: bytes 8 (8 g + c) .. + 7 hold row c's
//    bytes 8 g .. 8 g + 7), so one 64-byte load holds the same 8 positions of every row;
//  - the 16 x 8 six-bit sub-block scales (unsigned, 0..63: the value is the scale minus 32, as in block_q3_K) in
//    the order the gemv multiplies them, scale i = 16 g + 2 c + p for sub-block 2 g + p of row c, split into low 4
//    bits (scales_lo: byte i holds scale i at bits 0-3 and scale 64 + i at bits 4-7) and high 2 bits (scales_hi:
//    byte i holds those of scales i, 32 + i, 64 + i, 96 + i at bits 0, 2, 4, 6), so a few 256-bit operations decode
//    all 128 of a block.
// Header-only: ggml-cpu repacks with it (patch 0021), the refine codec's op (ops/refine/cpu/rapidmoe-refine.cpp) reads
// a repacked row back through rapidmoe_q3_K_x8_unpack (bit for bit the plain bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// The userdata of a ggml custom op that reads this layout where its src[0] is a repacked Q3_K tensor (the refine
// codec's op): the CPU_REPACK buffer accepts such an op (patch 0021), no other custom op
#define RAPIDMOE_Q3K_X8_READER ((void *) (uintptr_t) 0x52513338)

struct rapidmoe_block_q3_Kx8 {
    uint16_t d[8];          // row c's super-block scale d (fp16 bits)
    uint8_t scales_lo[64];  // the scales' low 4 bits (see above)
    uint8_t scales_hi[32];  // their high 2 bits
    uint8_t hmask[256];     // the rows' hmask, 8-byte interleaved
    uint8_t qs[512];        // the rows' qs (2 low bits of each value), 8-byte interleaved
};

// a plain block_q3_K: hmask[32], qs[64], scales[12] (ggml's 6-bit packing), d (fp16)
constexpr size_t RAPIDMOE_Q3K_HMASK = 0, RAPIDMOE_Q3K_QS = 32, RAPIDMOE_Q3K_SCALES = 96, RAPIDMOE_Q3K_D = 108;
constexpr size_t RAPIDMOE_Q3K_BLOCK = 110;
static_assert(sizeof(rapidmoe_block_q3_Kx8) == 8 * RAPIDMOE_Q3K_BLOCK, "block_q3_Kx8: the bytes of 8 Q3_K blocks");

// sub-block j's unsigned 6-bit scale (0..63) in ggml's 12-byte packing
inline int rapidmoe_q3_K_scale(const uint8_t * s, int j) {
    const int low = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
    const int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    return low | (high << 4);
}

// the 128 scales of an x8 block (unsigned, 0..63) in layout order, i = 16 g + 2 c + p
inline void rapidmoe_q3_K_x8_scales(const rapidmoe_block_q3_Kx8 & x, uint8_t out[128]) {
    for (int i = 0; i < 64; i++) {
        out[i] = (uint8_t) ((x.scales_lo[i] & 0xF) | (((x.scales_hi[i % 32] >> (2 * (i / 32))) & 3) << 4));
        out[64 + i] = (uint8_t) ((x.scales_lo[i] >> 4) | (((x.scales_hi[i % 32] >> (4 + 2 * (i / 32))) & 3) << 4));
    }
}

#if defined(__AVX2__)
// rapidmoe_q3_K_x8_scales by a few 256-bit operations (the 4-bit and 2-bit fields line up): the same 128 bytes
inline void rapidmoe_q3_K_x8_scales_simd(const rapidmoe_block_q3_Kx8 & x, uint8_t * sc) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i m2 = _mm256_set1_epi8(3);
    const __m256i lo0 = _mm256_loadu_si256((const __m256i *) x.scales_lo);
    const __m256i lo1 = _mm256_loadu_si256((const __m256i *) (x.scales_lo + 32));
    const __m256i hi = _mm256_loadu_si256((const __m256i *) x.scales_hi);
    // bits 2 j of the high bytes, moved to bits 4-5 (16-bit shifts: the masks drop what crosses a byte)
    const auto high = [&](int j) { return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 2 * j), m2), 4); };
    _mm256_storeu_si256((__m256i *) sc, _mm256_or_si256(_mm256_and_si256(lo0, m4), high(0)));
    _mm256_storeu_si256((__m256i *) (sc + 32), _mm256_or_si256(_mm256_and_si256(lo1, m4), high(1)));
    const auto top = [&](__m256i lo) { return _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4); };
    _mm256_storeu_si256((__m256i *) (sc + 64), _mm256_or_si256(top(lo0), high(2)));
    _mm256_storeu_si256((__m256i *) (sc + 96), _mm256_or_si256(top(lo1), high(3)));
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "rapidmoe-simd.h"

// The VNNI kernels' shared steps (our Q3_K gemv, the refine op's 8-row kernel): all 8 rows in a zmm, row c's 8
// bytes of a chunk in 64-bit lane c. acc += one 2-bit field's two sub-blocks (w: 4 chunks of unsigned values, 8 per
// row) against the activation's 32 values at aq, each sub-block's pair sums (16 bits) times its scales (vpdpwssd).
// STRIDE 1: a plain Q8_K row; 4: a row of block_q8_Kx4 (its runs of 8 values 32 bytes apart, aq at the first)
template <int STRIDE = 1>
inline __m512i rapidmoe_q3_K_x8_field_dot(__m512i acc, const __m512i w[4], const int8_t * aq, __m512i scales) {
    __m512i sums[2];
    for (int p = 0; p < 2; p++) {
        const __m512i a0 = broadcast_8_bytes_512(aq + STRIDE * 16 * p);
        const __m512i a1 = broadcast_8_bytes_512(aq + STRIDE * (16 * p + 8));
        sums[p] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w[2 * p], a0), w[2 * p + 1], a1);
    }
    return _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(sums[0], sums[1]), scales);
}

// the block's scales minus 32 from its decoded 128 (layout order): sc32[j] 16-bit lane 2c + p = row c's scale of
// sub-block 4j + p, lane 16 + 2c + p its scale of sub-block 4j + 2 + p
inline void rapidmoe_q3_K_x8_scales32(const uint8_t * sc, __m512i sc32[4]) {
    for (int j = 0; j < 4; j++) {
        sc32[j] = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *) (sc + 32 * j))),
                                   _mm512_set1_epi16(32));
    }
}

// per row c (int32 lane c): the sum over sub-blocks of (scale - 32) x the activation's 16-value sums, by one
// vpdpwssd per 4 sub-blocks (each 32-bit lane's pair of sums broadcast to its 8 rows); the exact integers a madd per
// pair of sub-blocks gives (it took 24 instructions a row and block, about a tenth of the gemm). The sums lie in the
// 32 int32 of (lo, hi), the pair of sub-blocks 4j + 2h, 4j + 2h + 1 at first + stride j + h
inline __m256i rapidmoe_q3_K_x8_scaled_pairs(const __m512i sc32[4], __m512i lo, __m512i hi, int first, int stride) {
    __m512i offs = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {  // lanes 0-7: the sums of sub-blocks 4j, 4j + 1; lanes 8-15: 4j + 2, 4j + 3
        const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi32(first + stride * j),
                                               _mm256_set1_epi32(first + stride * j + 1), 1);
        offs = _mm512_dpwssd_epi32(offs, sc32[j], _mm512_permutex2var_epi32(lo, idx, hi));
    }
    return _mm256_add_epi32(_mm512_castsi512_si256(offs), _mm512_extracti64x4_epi64(offs, 1));
}

// ... against a plain Q8_K row (bsums: its 16 int16, pair g at int32 g)
inline __m256i rapidmoe_q3_K_x8_scaled_bsums(const __m512i sc32[4], const void * bsums) {
    const __m512i pairs = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) bsums));
    return rapidmoe_q3_K_x8_scaled_pairs(sc32, pairs, pairs, 0, 2);
}

// ... against row r of a block_q8_Kx4 (bsums: its 64 int16, ggml_quantize_mat_q8_K_4x8's order: row r's sum of
// values 16 g .. 16 g + 15 at 16 (g / 4) + 4 r + g % 4, so its pair g' at int32 8 (g' / 2) + 2 r + g' % 2)
inline __m256i rapidmoe_q3_K_x8_scaled_bsums_x4(const __m512i sc32[4], const int16_t * bsums, int r) {
    return rapidmoe_q3_K_x8_scaled_pairs(sc32, _mm512_loadu_si512((const void *) bsums),
                                         _mm512_loadu_si512((const void *) (bsums + 32)), 2 * r, 8);
}
#endif

// 8 plain Q3_K blocks (rows[c]: row c's block, 110 bytes) -> one x8 block
inline void rapidmoe_q3_K_x8_pack(const uint8_t * const rows[8], rapidmoe_block_q3_Kx8 & out) {
    uint8_t sc[128];
    for (int c = 0; c < 8; c++) {
        std::memcpy(&out.d[c], rows[c] + RAPIDMOE_Q3K_D, 2);
        for (int j = 0; j < 16; j++) {
            sc[16 * (j / 2) + 2 * c + j % 2] = (uint8_t) rapidmoe_q3_K_scale(rows[c] + RAPIDMOE_Q3K_SCALES, j);
        }
        for (int g = 0; g < 8; g++) {
            std::memcpy(out.qs + 8 * (8 * g + c), rows[c] + RAPIDMOE_Q3K_QS + 8 * g, 8);
        }
        for (int g = 0; g < 4; g++) {
            std::memcpy(out.hmask + 8 * (8 * g + c), rows[c] + RAPIDMOE_Q3K_HMASK + 8 * g, 8);
        }
    }
    std::memset(out.scales_hi, 0, sizeof(out.scales_hi));
    for (int i = 0; i < 64; i++) {
        out.scales_lo[i] = (uint8_t) ((sc[i] & 0xF) | ((sc[64 + i] & 0xF) << 4));
    }
    for (int i = 0; i < 128; i++) {
        out.scales_hi[i % 32] |= (uint8_t) ((sc[i] >> 4) << (2 * (i / 32)));
    }
}

// one x8 block -> the 8 plain Q3_K blocks (rows[c], 110 bytes each), the bytes rapidmoe_q3_K_x8_pack read
inline void rapidmoe_q3_K_x8_unpack(const rapidmoe_block_q3_Kx8 & x, uint8_t * const rows[8]) {
    uint8_t sc[128];
    rapidmoe_q3_K_x8_scales(x, sc);
    for (int c = 0; c < 8; c++) {
        std::memcpy(rows[c] + RAPIDMOE_Q3K_D, &x.d[c], 2);
        for (int g = 0; g < 8; g++) {
            std::memcpy(rows[c] + RAPIDMOE_Q3K_QS + 8 * g, x.qs + 8 * (8 * g + c), 8);
        }
        for (int g = 0; g < 4; g++) {
            std::memcpy(rows[c] + RAPIDMOE_Q3K_HMASK + 8 * g, x.hmask + 8 * (8 * g + c), 8);
        }
        uint8_t * s = rows[c] + RAPIDMOE_Q3K_SCALES;
        std::memset(s, 0, 12);
        for (int j = 0; j < 16; j++) {
            const int v = sc[16 * (j / 2) + 2 * c + j % 2];
            s[j % 8] |= (uint8_t) ((v & 0xF) << (j < 8 ? 0 : 4));
            s[8 + j % 4] |= (uint8_t) ((v >> 4) << (2 * (j / 4)));
        }
    }
}
