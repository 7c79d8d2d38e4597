// Small SIMD helpers shared by RapidMoE's CPU kernels (ops/*/cpu/): activation loads, K-quant scale unpacking.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>

// 8 activation bytes broadcast to every 64-bit lane: a memcpy, not an int64 dereference (block_q8_K's qs sit at 4
// mod 8 after its float d: a misaligned int64 read is undefined behaviour, which UBSan reports); the same vpbroadcastq
inline __m256i broadcast_8_bytes(const int8_t * p) {
    int64_t v;
    std::memcpy(&v, p, sizeof(v));
    return _mm256_set1_epi64x(v);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool RAPIDMOE_HAVE_VNNI_256 = true;
#else
constexpr bool RAPIDMOE_HAVE_VNNI_256 = false;
#endif

// acc (8 int32 lanes) += per 4-byte group sums of u (unsigned bytes) x s (signed bytes). VNNI: one vpdpbusd; else
// maddubs + madd, exact where two products fit an int16 (the callers' weights: |w| <= 127 for Q8_0, q <= 63 for Q6_K,
// against |a| <= 127): the same integers either way
template <bool VNNI>
inline __m256i dot_add_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    if constexpr (VNNI) {
        return _mm256_dpbusd_epi32(acc, u, s);
    }
#endif
    const __m256i p16 = _mm256_maddubs_epi16(u, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

// 4 fp16 column scales (d4) times the activation's scale, each twice: lanes 2c, 2c + 1 = column c
inline __m256 pair_scales_4(const void * d4, float da) {
    const __m128 d = _mm_mul_ps(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *) d4)), _mm_set1_ps(da));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}

// A pshufb mask that makes 16-bit lanes of scale bytes: columns c0..c0+3, each column c's byte (at stride * c + offset
// of the 16 bytes shuffled) 4 times, high bytes zero. Q2_K: stride 2, offset the sub-block's parity; Q4_K: stride 1.
inline __m256i scale_lanes_mask(int c0, int stride, int offset) {
    const char Z = (char) 0x80; // pshufb: a zero byte
    const char b0 = (char) (stride * c0 + offset);
    const char b1 = (char) (stride * (c0 + 1) + offset);
    const char b2 = (char) (stride * (c0 + 2) + offset);
    const char b3 = (char) (stride * (c0 + 3) + offset);
    return _mm256_setr_epi8(b0, Z, b0, Z, b0, Z, b0, Z, b1, Z, b1, Z, b1, Z, b1, Z, b2, Z, b2, Z, b2, Z, b2, Z, b3, Z,
                            b3, Z, b3, Z, b3, Z);
}

// The 12 bytes of one sub-block's 6-bit scales and mins of the 8 columns: bytes 0-7 the columns' scales, 8-15
// their mins (as upstream unpacks them)
inline __m128i unpack_scales_mins(const uint8_t * packed) {
    constexpr uint32_t kmask1 = 0x3f3f3f3f;
    constexpr uint32_t kmask2 = 0x0f0f0f0f;
    constexpr uint32_t kmask3 = 0x03030303;
    uint32_t u[4];
    std::memcpy(u, packed, 12);
    u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
    const uint32_t mins_lo = u[1] & kmask1;
    u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
    u[2] = mins_lo;
    u[0] &= kmask1;
    return _mm_set_epi32((int) u[3], (int) u[2], (int) u[1], (int) u[0]);
}
#if defined(__AVX512F__)
// broadcast_8_bytes to every 64-bit lane of a zmm (the AVX-512 gemms' activation operand)
inline __m512i broadcast_8_bytes_512(const void * p) {
    int64_t v;
    std::memcpy(&v, p, sizeof(v));
    return _mm512_set1_epi64(v);
}

// 8 columns' sums from 16 32-bit lanes holding each column's two halves (lanes 2c, 2c + 1)
inline __m256i column_pairs(__m512i v) {
    return _mm512_cvtepi64_epi32(_mm512_add_epi32(v, _mm512_srli_epi64(v, 32)));
}

// The pshufb index that lines the scales up with that layout: within each 128-bit lane j, whose 16 bytes hold the
// scales of one pair of sub-blocks p = 0, 1 of the 8 columns (byte 2c + p), 16-bit lanes (zero-extended) of
// columns 2j, 2j, 2j + 1, 2j + 1 for p = 0 (bytes 4j, 4j + 2), then the same for p = 1 (bytes 4j + 1, 4j + 3)
inline __m512i packed_pair_scale_index() {
    static const struct Index {
        __m512i v;
        Index() {
            alignas(64) int8_t idx[64];
            for (int j = 0; j < 4; j++) {
                const int8_t order[8] = { 0, 0, 2, 2, 1, 1, 3, 3 };
                for (int k = 0; k < 8; k++) {
                    idx[16 * j + 2 * k] = (int8_t) (4 * j + order[k]);
                    idx[16 * j + 2 * k + 1] = (int8_t) 0x80;
                }
            }
            v = _mm512_load_si512(idx);
        }
    } index;
    return index.v;
}

// 8 columns' sums from the layout the VNNI gemvs leave after vpackssdw + vpdpwssd (128-bit lane j: columns 2j, 2j + 1
// of one sub-block, then of the other): the two added, columns in order
inline __m256i column_pairs_packed(__m512i v) {
    const __m512i folded = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_BADC));
    return _mm512_castsi512_si256(
        _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 0, 0, 0, 0, 0, 0, 0, 0), folded));
}
#endif
#endif
