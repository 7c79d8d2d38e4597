// Q3_K x Q8_K dot product over llama.cpp's plain block_q3_K rows, for the refine codec's WQ experts (a stock Q3_K
// tensor: resplit/refine.py) and any Q3_K weight: a decode step runs it once per row of every routed expert's
// non-critical slot. Upstream has no repacked Q3_K layout, and its one x86 kernel (AVX2, also what an AVX-512 build
// runs) took 33-43 ps per weight through ggml on 2 threads of the AMD Zen 5 machine (tools/kernel_cost.py), 10-13 GB/s
// of weights where the machine streams 25-35: the loads wait on memory, and each 32 weights cost about 12
// instructions. This kernel
//  - prefetches the row PREFETCH_BYTES ahead (the rows of a matmul are consecutive: the prefetch runs on into the
//    next row, which is the next one computed);
//  - with AVX-512 (BW, VL) decodes the 16 sub-block scales in vector registers and works on 64 weights per
//    instruction: the 2-bit values of two 32-weight chunks from one variable shift of the 32 packed bytes broadcast
//    to both halves, the high bits as a mask register (vptestnmb) that selects the 4 to subtract (one masked move),
//    the 16-bit scales of four sub-blocks by one vpermw, multiplied and added by one vpdpwssd with VNNI;
//  - with AVX2 only, the same steps 32 weights at a time (a compare for the high bits, scalar scale unpacking).
// Measured (tools/kernel_cost.py, same machine): 1.1-1.2x upstream's kernel, still compute-bound (12-15 GB/s).
// A Q3_K value is ql + 4 h - 4 (ql the 2 low bits, h the high bit). Each 32-bit lane l of the integer accumulator
// holds what upstream's lane l holds (for every 32-weight chunk, scale x the sum over its weights 4l..4l+3 of
// value x activation: the 512-bit lanes l and l + 8 are two chunks' and are added before the conversion), every
// sum is exact, and the float operations per block (d = y.d x x.d, one fma of the 8 lanes, the final horizontal sum)
// are upstream's in its order: the output is bit-identical (tools/kernel_cost.py --check against the stock build).
#include "rapidmoe-vecdot-q3k.h"

#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"

#if defined(__AVX2__) && defined(__F16C__)
#define RAPIDMOE_Q3_K_SIMD 1
#include <immintrin.h>
#else
#define RAPIDMOE_Q3_K_SIMD 0
#endif

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int PREFETCH_BYTES = 512; // about 5 blocks ahead (512, 1024 and 2048 measured alike)

#if RAPIDMOE_Q3_K_SIMD
// upstream's hsum_float_8, in its order
inline float hsum_float_8(__m256 x) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

inline void prefetch_block(const block_q3_K * x) {
    _mm_prefetch((const char *) x + PREFETCH_BYTES, _MM_HINT_T0);
    _mm_prefetch((const char *) x + PREFETCH_BYTES + 64, _MM_HINT_T0); // a block is 110 bytes: two lines a block
}
#endif

#if RAPIDMOE_Q3_K_SIMD && defined(__AVX512BW__) && defined(__AVX512VL__)
// The 16 sub-block scales of a block as 16-bit lanes, in sub-block order, decoded in vector registers: sub-block s
// has 4 low bits in scales[s % 8] (s < 8: low nibble, else high) and 2 high bits in scales[8 + s % 4] at bit 2 (s / 4)
inline __m256i q3_K_scales_16(const block_q3_K & x) {
    static_assert(offsetof(block_q3_K, scales) == 96 && sizeof(block_q3_K) == 110, "block_q3_K layout");
    // 16 bytes ending with the block (the scales at 2..13): nothing read beyond it
    const __m128i v = _mm_loadu_si128((const __m128i *) ((const uint8_t *) &x + 94));
    const __m256i lo = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(v, _mm_setr_epi8(2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7, 8, 9)));
    const __m256i hi = _mm256_cvtepu8_epi16(
        _mm_shuffle_epi8(v, _mm_setr_epi8(10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13)));
    const __m256i lo_shift = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
    const __m256i hi_shift = _mm256_setr_epi16(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
    const __m256i low4 = _mm256_and_si256(_mm256_srlv_epi16(lo, lo_shift), _mm256_set1_epi16(0xF));
    const __m256i high2 = _mm256_and_si256(_mm256_srlv_epi16(hi, hi_shift), _mm256_set1_epi16(3));
    return _mm256_sub_epi16(_mm256_or_si256(low4, _mm256_slli_epi16(high2, 4)), _mm256_set1_epi16(32));
}

// What the 64 weights of chunk pair p (chunks 2p, 2p + 1, in the low and high 256 bits) of half j need: the shift of
// their 2 low bits, their hmask bits, and which of the 16 scales each 16-bit lane of products takes
struct PairConsts {
    __m512i shift;
    __m512i bitmask;
    __m512i scale_idx;
};

inline PairConsts pair_consts(int j, int p) {
    const int chunk = 2 * p;
    const int bit = 4 * j + chunk;
    alignas(64) int16_t idx[32];
    for (int i = 0; i < 32; i++) {
        idx[i] = (int16_t) (8 * j + 2 * chunk + i / 8); // 16-bit lane i: weights 2i, 2i + 1 of the pair
    }
    return { _mm512_inserti64x4(_mm512_set1_epi16((short) (2 * chunk)), _mm256_set1_epi16((short) (2 * chunk + 2)), 1),
             _mm512_inserti64x4(_mm512_set1_epi8((char) (1 << bit)), _mm256_set1_epi8((char) (1 << (bit + 1))), 1),
             _mm512_load_si512((const void *) idx) };
}

// The block's integer lanes (upstream's 8) over 64 weights at a time; pc[2j + p] from pair_consts(j, p)
inline __m256i block_sums_avx512(const block_q3_K & x, const block_q8_K & y, const PairConsts * pc) {
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m512i four = _mm512_set1_epi8(4);
    const __m512i scales = _mm512_castsi256_si512(q3_K_scales_16(x));
    const __m512i hbits = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) x.hmask));
    __m512i sumi[2] = { _mm512_setzero_si512(), _mm512_setzero_si512() }; // two chains: vpdpwssd's latency
#pragma GCC unroll 2
    for (int j = 0; j < 2; j++) {
        const __m512i q3 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (x.qs + 32 * j)));
#pragma GCC unroll 2
        for (int p = 0; p < 2; p++) {
            const PairConsts & c = pc[2 * j + p];
            const __m512i ql = _mm512_and_si512(_mm512_srlv_epi16(q3, c.shift), m3);
            const __m512i q3h = _mm512_maskz_mov_epi8(_mm512_testn_epi8_mask(hbits, c.bitmask), four);
            const __m512i q8 = _mm512_loadu_si512((const void *) (y.qs + 128 * j + 64 * p));
            const __m512i p16 = _mm512_sub_epi16(_mm512_maddubs_epi16(ql, q8), _mm512_maddubs_epi16(q3h, q8));
            const __m512i sc = _mm512_permutexvar_epi16(c.scale_idx, scales);
#if defined(__AVX512VNNI__)
            sumi[p] = _mm512_dpwssd_epi32(sumi[p], sc, p16); // madd and add in one
#else
            sumi[p] = _mm512_add_epi32(sumi[p], _mm512_madd_epi16(sc, p16));
#endif
        }
    }
    const __m512i both = _mm512_add_epi32(sumi[0], sumi[1]);
    return _mm256_add_epi32(_mm512_castsi512_si256(both), _mm512_extracti64x4_epi64(both, 1));
}
#elif RAPIDMOE_Q3_K_SIMD
// The 16 sub-block scales of a block as signed bytes, in sub-block order (6 bits each, stored minus 32)
inline __m128i q3_K_scales(const uint8_t * packed) {
    constexpr uint32_t kmask1 = 0x03030303;
    constexpr uint32_t kmask2 = 0x0f0f0f0f;
    uint32_t aux[3];
    std::memcpy(aux, packed, 12);
    const __m128i s = _mm_set_epi32((int) (((aux[1] >> 4) & kmask2) | (((aux[2] >> 6) & kmask1) << 4)),
                                    (int) (((aux[0] >> 4) & kmask2) | (((aux[2] >> 4) & kmask1) << 4)),
                                    (int) ((aux[1] & kmask2) | (((aux[2] >> 2) & kmask1) << 4)),
                                    (int) ((aux[0] & kmask2) | (((aux[2] >> 0) & kmask1) << 4)));
    return _mm_sub_epi8(s, _mm_set1_epi8(32));
}

// The block's integer lanes over 32 weights at a time
inline __m256i block_sums_avx2(const block_q3_K & x, const block_q8_K & y) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i four = _mm256_set1_epi8(4);
    const __m256i all = _mm256_cvtepi8_epi16(q3_K_scales(x.scales));
    // sub-blocks 8j .. 8j + 7 as 16-bit lanes, in both 128-bit halves
    const __m256i scales[2] = { _mm256_permute2x128_si256(all, all, 0x00), _mm256_permute2x128_si256(all, all, 0x11) };
    const __m256i hbits = _mm256_loadu_si256((const __m256i *) x.hmask);
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < 2; j++) {
        const __m256i q3 = _mm256_loadu_si256((const __m256i *) (x.qs + 32 * j));
        for (int k = 0; k < 4; k++) {
            const __m256i ql = _mm256_and_si256(_mm256_srli_epi16(q3, 2 * k), m3);
            const __m256i unset = _mm256_cmpeq_epi8(_mm256_and_si256(hbits, _mm256_set1_epi8((char) (1 << (4 * j + k)))),
                                                    _mm256_setzero_si256());
            const __m256i q3h = _mm256_and_si256(unset, four);
            const __m256i q8 = _mm256_loadu_si256((const __m256i *) (y.qs + 128 * j + 32 * k));
            const __m256i p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(ql, q8), _mm256_maddubs_epi16(q3h, q8));
            // 16-bit lanes 0-7 (weights 0-15 of the chunk): sub-block 8j + 2k; lanes 8-15: 8j + 2k + 1
            const __m256i pick = _mm256_setr_epi8(
                (char) (4 * k), (char) (4 * k + 1), (char) (4 * k), (char) (4 * k + 1), (char) (4 * k), (char) (4 * k + 1),
                (char) (4 * k), (char) (4 * k + 1), (char) (4 * k), (char) (4 * k + 1), (char) (4 * k), (char) (4 * k + 1),
                (char) (4 * k), (char) (4 * k + 1), (char) (4 * k), (char) (4 * k + 1), (char) (4 * k + 2), (char) (4 * k + 3),
                (char) (4 * k + 2), (char) (4 * k + 3), (char) (4 * k + 2), (char) (4 * k + 3), (char) (4 * k + 2),
                (char) (4 * k + 3), (char) (4 * k + 2), (char) (4 * k + 3), (char) (4 * k + 2), (char) (4 * k + 3),
                (char) (4 * k + 2), (char) (4 * k + 3), (char) (4 * k + 2), (char) (4 * k + 3));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_shuffle_epi8(scales[j], pick), p16));
        }
    }
    return sumi;
}
#endif

}  // namespace

extern "C" int rapidmoe_vec_dot_q3_K_enabled(void) {
#if !RAPIDMOE_Q3_K_SIMD
    return 0; // built without AVX2 and F16C: upstream's kernel runs
#endif
    static const bool enabled = [] {
        const char * env = std::getenv("RAPIDMOE_VEC_DOT_Q3_K");
        return env == nullptr || std::strcmp(env, "0") != 0;
    }();
    return enabled ? 1 : 0;
}

extern "C" void rapidmoe_vec_dot_q3_K_q8_K(int n, float * s, const void * vx, const void * vy) {
#if RAPIDMOE_Q3_K_SIMD
    const auto * x = (const block_q3_K *) vx;
    const auto * y = (const block_q8_K *) vy;
    const int nb = n / QK_K;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const PairConsts pc[4] = { pair_consts(0, 0), pair_consts(0, 1), pair_consts(1, 0), pair_consts(1, 1) };
#endif
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++) {
        prefetch_block(x + i);
        const float d = y[i].d * _cvtsh_ss(x[i].d); // F16C: exact, as ggml's table
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        const __m256i sumi = block_sums_avx512(x[i], y[i], pc);
#else
        const __m256i sumi = block_sums_avx2(x[i], y[i]);
#endif
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = hsum_float_8(acc);
#else
    (void) n; (void) s; (void) vx; (void) vy;
#endif
}
