// The refine codec's kernel over 8 rows of the repacked Q3_K layout at once (rapidmoe-refine-x8.h).
//
// Why: with WQ repacked (patch 0021) the non-critical slots run our 8-row VNNI gemv, while a critical slot read each
// row back from the interleave and ran the one-row AVX2 kernel on it: it decoded all 128 scales of a block for each
// of the 8 rows and spent about 5 ms of a 23 ms decode step (bench model, Zen 5) on one critical slot in eight.
// Here the 8 rows share a zmm as in the gemv (rapidmoe-gemv-q3k.cpp, the same register layout), and each value
// becomes the refined one's f = 2 (low + 4 high) + t in 0..15 where the gemv has low + 4 high:
//  - 2 low by one shift and mask, the high bit by a masked add of 8 (vptestmb against hmask, as in the gemv);
//  - the refinement bit t by a masked add of 1, its mask built from the 8 rows' bit planes: the bytes of column group
//    G (8 columns) of rows 0..7 are the 64 bits of one mask, gathered from a qword per row by vpshufbitqmb (BITALG)
//    after a qword transpose of the block's 8 x 32 plane bytes;
//  - vpdpbusd / vpackssdw / vpdpwssd as the gemv (sums of 8 values of f x: at most 15 x 128 x 8, 16 bits), then
//    per row the block sum 2 sum_j s_j sum f x - 17 sum_j s_j bsum_j = sum_j s_j sum (2f - 17) x, exact.
// Each row's block sum is rapidmoe_refine_dot_ref's integer; per block (d x dx) x sum added in block order, then
// x 0.25: its float operations in its order (this file and the reference's are built with -ffp-contract=off), so
// the op's output is the plain layout's bit for bit (tests/engine/test_refine_op.py).
#include "rapidmoe-refine-x8.h"

#include "rapidmoe-refine.h"

#include <cstdlib>
#include <cstring>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BITALG__)
#define RAPIDMOE_REFINE_X8 1
#include "rapidmoe-simd.h"

#include <immintrin.h>
#else
#define RAPIDMOE_REFINE_X8 0
#endif

bool rapidmoe_refine_x8_enabled() {
    static const bool on = [] {
        const char * env = std::getenv("RAPIDMOE_REFINE_X8");
        return RAPIDMOE_REFINE_X8 && (env == nullptr || env[0] != '0');
    }();
    return on;
}

#if RAPIDMOE_REFINE_X8
namespace {

constexpr size_t Q8K_QS = 4, Q8K_BSUMS = 260;  // in a Q8_K block (d, qs[256], bsums[16])
// as the Q3_K gemv: the block about to be used (its lines' misses issued at once). Against 2 KiB ahead, refine-hq
// r = 2 on the bench model (tools/profile_nodes.py, 3 alternating pairs, Zen 5): the 3 refine ops 2.7-3.0 ms a token
// instead of 3.3-3.4 (bench/results/prefetch-q3k-q6k-zen5-avx512.md)
constexpr int PREFETCH_BYTES = 0;

// one block's bit planes of the 8 rows (32 bytes each, bits_stride apart) -> planes[m]: 64-bit lane c = row c's
// plane bytes 8 m .. 8 m + 7 (columns 64 m .. 64 m + 63)
inline void planes_by_row(const uint8_t * bits, size_t stride, __m512i planes[4]) {
    __m512i pair[4];  // rows 2 i (qwords 0-3) and 2 i + 1 (qwords 4-7)
    for (int i = 0; i < 4; i++) {
        const __m256i even = _mm256_loadu_si256((const __m256i *) (bits + 2 * i * stride));
        const __m256i odd = _mm256_loadu_si256((const __m256i *) (bits + (2 * i + 1) * stride));
        pair[i] = _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1);
    }
    for (int m = 0; m < 4; m++) {
        const __m512i idx = _mm512_setr_epi64(m, 4 + m, 8 + m, 12 + m, m, 4 + m, 8 + m, 12 + m);
        const __m512i rows03 = _mm512_permutex2var_epi64(pair[0], idx, pair[1]);  // lanes 0-3: rows 0-3
        const __m512i rows47 = _mm512_permutex2var_epi64(pair[2], idx, pair[3]);  // lanes 0-3: rows 4-7
        planes[m] = _mm512_shuffle_i64x2(rows03, rows47, _MM_SHUFFLE(1, 0, 1, 0));
    }
}

// R activations (Q8_K rows a[r]) against the group's nb blocks: acc[r] lane c += row c's block sums, scaled
template <int R>
void dot_x8(int64_t nb, const rapidmoe_block_q3_Kx8 * x, const uint8_t * bits, size_t stride,
            const uint8_t * const a[R], float * const out[R]) {
    const __m512i m6 = _mm512_set1_epi8(6);
    const __m512i eight = _mm512_set1_epi8(8);
    const __m512i one = _mm512_set1_epi8(1);
    const __m512i c32 = _mm512_set1_epi16(32);
    const __m512i scale_index = packed_pair_scale_index();
    __m512i select[8];  // vpshufbitqmb: bits 8 k .. 8 k + 7 of each qword (column group 8 m + k of its row)
    for (int k = 0; k < 8; k++) {
        select[k] = _mm512_set1_epi64((long long) (0x0706050403020100ULL + 0x0808080808080808ULL * (uint64_t) k));
    }
    __m256 acc_f[R];
    for (int r = 0; r < R; r++) {
        acc_f[r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++, bits += 32) {
        for (int i = 0; i < (int) sizeof(rapidmoe_block_q3_Kx8); i += 64) {
            _mm_prefetch((const char *) (x + b) + PREFETCH_BYTES + i, _MM_HINT_T0);
        }
        if (b % 2 == 0) {  // the planes 8 blocks ahead: one line per row every 2 blocks
            for (int c = 0; c < 8; c++) {
                _mm_prefetch((const char *) (bits + c * stride + 256), _MM_HINT_T0);
            }
        }
        alignas(32) uint8_t sc[128];
        rapidmoe_q3_K_x8_scales_simd(x[b], sc);
        __m512i planes[4];
        planes_by_row(bits, stride, planes);
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
                const __m512i bit = _mm512_set1_epi8((char) (1 << (4 * h + t)));
                __m512i f[4];  // chunk i (columns 128 h + 32 t + 8 i + 0..7 of each row): f = 2 low + 8 high + t
                for (int i = 0; i < 4; i++) {
                    const __m512i low2 = t == 0 ? _mm512_and_si512(_mm512_add_epi8(raw[i], raw[i]), m6)
                                                : _mm512_and_si512(_mm512_srl_epi16(raw[i], _mm_cvtsi32_si128(2 * t - 1)), m6);
                    const __m512i q2 = _mm512_mask_add_epi8(low2, _mm512_test_epi8_mask(hraw[i], bit), low2, eight);
                    const int group = 16 * h + 4 * t + i;  // column group: plane qword group / 8, byte group % 8
                    const __mmask64 refine = _mm512_bitshuffle_epi64_mask(planes[group / 8], select[group % 8]);
                    f[i] = _mm512_mask_add_epi8(q2, refine, q2, one);
                }
                const __m128i pair = _mm_load_si128((const __m128i *) (sc + 16 * (4 * h + t)));
                const __m512i scales =
                    _mm512_sub_epi16(_mm512_shuffle_epi8(_mm512_broadcast_i32x4(pair), scale_index), c32);
                for (int r = 0; r < R; r++) {
                    const auto * aq = (const int8_t *) (a[r] + b * RAPIDMOE_Q8K_BLOCK + Q8K_QS + 128 * h + 32 * t);
                    acc[r] = rapidmoe_q3_K_x8_field_dot(acc[r], f, aq, scales);
                }
            }
        }
        // the -17 of every 2f - 17: per row c, sum over sub-blocks 2g + p of (scale - 32) x bsum
        __m512i sc32[4];
        rapidmoe_q3_K_x8_scales32(sc, sc32);
        const __m256 row_d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) x[b].d));
        for (int r = 0; r < R; r++) {
            const uint8_t * xb = a[r] + b * RAPIDMOE_Q8K_BLOCK;
            const __m256i offs = rapidmoe_q3_K_x8_scaled_bsums(sc32, xb + Q8K_BSUMS);
            const __m256i fx = column_pairs_packed(acc[r]);
            const __m256i isum = _mm256_sub_epi32(_mm256_add_epi32(fx, fx), _mm256_mullo_epi32(offs, _mm256_set1_epi32(17)));
            float dx;
            std::memcpy(&dx, xb, sizeof(dx));
            // the reference's sum += (d * dx) * (float) isum, lane by lane
            acc_f[r] = _mm256_add_ps(acc_f[r], _mm256_mul_ps(_mm256_mul_ps(row_d, _mm256_set1_ps(dx)),
                                                             _mm256_cvtepi32_ps(isum)));
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out[r], _mm256_mul_ps(acc_f[r], _mm256_set1_ps(0.25f)));
    }
}

}  // namespace

void rapidmoe_refine_dot_x8(int64_t n, const rapidmoe_block_q3_Kx8 * group, const uint8_t * bits, size_t bits_stride,
                            const void * const * xs, int nx, float * out) {
    int i = 0;
    for (; i + 4 <= nx; i += 4) {  // each weight block unpacked once for 4 activations
        const uint8_t * a[4];
        float * o[4];
        for (int r = 0; r < 4; r++) {
            a[r] = (const uint8_t *) xs[i + r];
            o[r] = out + 8 * (i + r);
        }
        dot_x8<4>(n / 256, group, bits, bits_stride, a, o);
    }
    for (; i < nx; i++) {
        const uint8_t * a[1] = { (const uint8_t *) xs[i] };
        float * o[1] = { out + 8 * i };
        dot_x8<1>(n / 256, group, bits, bits_stride, a, o);
    }
}
#else
void rapidmoe_refine_dot_x8(int64_t, const rapidmoe_block_q3_Kx8 *, const uint8_t *, size_t, const void * const *,
                            int, float *) {
    std::abort();  // callers check rapidmoe_refine_x8_enabled(), false in this build
}
#endif
