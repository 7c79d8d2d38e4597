// Q6_K x Q8_K gemv and gemm over llama.cpp's repacked block_q6_Kx8 layout (8 columns interleaved in 8-byte chunks:
// ql[64 k + 8 c + i] is column c's ql byte 8 k + i, qh the same, scales[8 g + c] column c's scale of group g), for x86.
//
// Why our own: on x86 upstream keeps Q6_K plain (it repacks it on ARM only), so every Q6_K matmul runs
// ggml_vec_dot_q6_K_q8_K a weight row at a time. Q6_K is the output head of llama-quantize's Q4_K_M mixture (and so
// of our `cpu` preset) and half its attn_v / ffn_down: the head is the largest matmul of a decode step.
// Here, per super-block of 256 values and per half of the 8 columns (4 columns, 32 bytes):
//  - one load of ql and of qh gives 8 values of each of 4 columns for the 4 value streams a Q6_K byte pair carries
//    (values l, l + 32, l + 64, l + 96 of each 128), rebuilt as unsigned 6-bit values q (0..63) with masks and shifts;
//  - the activation's 8 bytes of the same values are broadcast (no shuffle): unsigned x signed multiply-adds
//    (vpdpbusd with AVX-512 VNNI, else maddubs + madd: the same exact integers) put column c's sums in int32 lanes
//    2c and 2c + 1;
//  - per group of 16 values the activation's bsum x 32 is taken off lane 2c (q - 32 is the signed value), the group
//    sum times its int8 scale added in int32 (at most 16 x 32 x 128 x 128 x 16 < 2^31), and once a super-block one
//    float conversion and one FMA with (column d x activation d);
//  - each block's cache lines are prefetched as its work starts: all its misses issued at once, in address order,
//    before the loads that stride through ql and qh.
// The exact integer sum of each super-block is the plain vec_dot's; only the float accumulation order differs
// (tolerance-equal: tools/kernel_cost.py --check). The gemm de-interleaves each group of 4 activation rows
// (block_q8_Kx4) into plain rows and runs the gemv on each: the gemv's bits.
#include "rapidmoe-gemv-q6k.h"

#include "rapidmoe-gemm.h"
#include "rapidmoe-gemm-loop.h"
#include "rapidmoe-simd.h"
#include "repack.h"
#include "simd-mappings.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

// 0: the block about to be used. On Zen 5 (2 threads) that took the head (128 MB of Q6_K) from 25 GB/s to 32-37;
// (tools/kernel_cost.py); 0.5-4 KiB ahead, or no software prefetch at all, left the AVX-512 kernel 34-97 % slower than
// a plain read of the same bytes (a standalone sweep: bench/results/prefetch-q3k-q6k-zen5-avx512.md)
constexpr int PREFETCH_BYTES = 0;

#if defined(__AVX2__)

constexpr bool HAVE_VNNI = RAPIDMOE_HAVE_VNNI_256;

// int8 scales of 4 columns (sc[0..3]) as int32 lanes 2c, 2c + 1
inline __m256i scale_lanes(const int8_t * sc) {
    int32_t v;
    std::memcpy(&v, sc, sizeof(v));
    const __m128i dup = _mm_shuffle_epi8(_mm_cvtsi32_si128(v), _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1,
                                                                             -1, -1, -1, -1));
    return _mm256_cvtepi8_epi32(dup);
}

template <bool VNNI>
void gemv_impl(int n, float * s, const void * vx, const void * vy, int nc) {
    const int nb = n / QK_K;
    const auto * a = (const block_q8_K *) vy;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i m2 = _mm256_set1_epi8(0x03);
    const __m256i m2_2 = _mm256_set1_epi8(0x0C);
    const __m256i m2_4 = _mm256_set1_epi8(0x30);
    for (int x = 0; x < nc / 8; x++) {
        const block_q6_Kx8 * b = (const block_q6_Kx8 *) vx + (int64_t) x * nb;
        __m256 acc[2] = { _mm256_setzero_ps(), _mm256_setzero_ps() };
        for (int l = 0; l < nb; l++) {
            const char * ahead = (const char *) (b + l) + PREFETCH_BYTES;
            for (int p = 0; p < (int) sizeof(block_q6_Kx8); p += 64) {
                _mm_prefetch(ahead + p, _MM_HINT_T0);
            }
            const int8_t * aq = a[l].qs;
            __m256i isum[2] = { _mm256_setzero_si256(), _mm256_setzero_si256() };
            for (int nh = 0; nh < 2; nh++) {      // the two halves of 128 values
                for (int m = 0; m < 2; m++) {     // the group (of 16 values) within each 32-value stream
                    __m256i dots[4][2];
                    for (auto & d : dots) {
                        d[0] = d[1] = _mm256_setzero_si256();
                    }
                    for (int tt = 0; tt < 2; tt++) {
                        const int t = 2 * m + tt;  // 8 values l = 8t .. 8t + 7 of each stream
                        const int e0 = 128 * nh + 8 * t;
                        const __m256i a0 = broadcast_8_bytes(aq + e0);
                        const __m256i a1 = broadcast_8_bytes(aq + e0 + 32);
                        const __m256i a2 = broadcast_8_bytes(aq + e0 + 64);
                        const __m256i a3 = broadcast_8_bytes(aq + e0 + 96);
                        for (int h = 0; h < 2; h++) {
                            const __m256i qla = _mm256_loadu_si256((const __m256i *) (b[l].ql + (8 * nh + t) * 64 + 32 * h));
                            const __m256i qlb = _mm256_loadu_si256((const __m256i *) (b[l].ql + (8 * nh + 4 + t) * 64 + 32 * h));
                            const __m256i qh = _mm256_loadu_si256((const __m256i *) (b[l].qh + (4 * nh + t) * 64 + 32 * h));
                            const __m256i q0 = _mm256_or_si256(_mm256_and_si256(qla, m4),
                                                               _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
                            const __m256i q1 = _mm256_or_si256(_mm256_and_si256(qlb, m4),
                                                               _mm256_slli_epi16(_mm256_and_si256(qh, m2_2), 2));
                            const __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qla, 4), m4),
                                                               _mm256_and_si256(qh, m2_4));
                            const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qlb, 4), m4),
                                                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2_4));
                            dots[0][h] = dot_add_u8s8<VNNI>(dots[0][h], q0, a0);
                            dots[1][h] = dot_add_u8s8<VNNI>(dots[1][h], q1, a1);
                            dots[2][h] = dot_add_u8s8<VNNI>(dots[2][h], q2, a2);
                            dots[3][h] = dot_add_u8s8<VNNI>(dots[3][h], q3, a3);
                        }
                    }
                    for (int st = 0; st < 4; st++) {
                        const int g = 8 * nh + m + 2 * st;  // the stream's group of 16 values: its scale and bsum
                        // (q - 32) . a = q . a - 32 bsum: taken off the even lane of each column
                        const __m256i corr = _mm256_and_si256(_mm256_set1_epi32(32 * a[l].bsums[g]),
                                                              _mm256_setr_epi32(-1, 0, -1, 0, -1, 0, -1, 0));
                        for (int h = 0; h < 2; h++) {
                            const __m256i sc = scale_lanes(b[l].scales + 8 * g + 4 * h);
                            isum[h] = _mm256_add_epi32(isum[h],
                                                       _mm256_mullo_epi32(_mm256_sub_epi32(dots[st][h], corr), sc));
                        }
                    }
                }
            }
            for (int h = 0; h < 2; h++) {
                acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h]), pair_scales_4(b[l].d + 4 * h, a[l].d), acc[h]);
            }
        }
        for (int h = 0; h < 2; h++) {
            alignas(32) float v[8];
            _mm256_store_ps(v, acc[h]);
            for (int c = 0; c < 4; c++) {
                s[8 * x + 4 * h + c] = v[2 * c] + v[2 * c + 1];
            }
        }
    }
}


#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool HAVE_512 = true;

// the 8 columns' int8 scales of group g as 32 int16 lanes: lanes 4c .. 4c + 3 = column c
inline __m512i scale_lanes_512(const int8_t * sc8) {
    int64_t v;
    std::memcpy(&v, sc8, sizeof(v));
    const __m256i dup = _mm256_shuffle_epi8(_mm256_set1_epi64x(v),
        _mm256_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7));
    return _mm512_cvtepi8_epi16(dup);
}

// the 8 columns' d times the activation's, each twice: lanes 2c, 2c + 1 = column c
inline __m512 block_scales_512(const ggml_half * d8, float da) {
    const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) d8)), _mm256_set1_ps(da));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                                 _mm512_castps256_ps512(d));
}

// AVX-512: all 8 columns in one zmm (a 64-byte chunk), R activation rows against each weight load. Per group of 16
// values: maddubs gives int16 pair sums (q <= 63, |a| <= 127: two of them at most 32004), vpdpwssd multiplies them
// by the column's scale into int32 lanes 2c, 2c + 1, and a second vpdpwssd collects scale x bsum on lane 2c for the
// -32 offset: the super-block's exact integer sum, as the 256-bit path's
template <int R>
void gemv_512(int nb, const block_q6_Kx8 * b, const block_q8_K * const * a, float * const * out) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i m2 = _mm512_set1_epi8(0x03);
    const __m512i m2_2 = _mm512_set1_epi8(0x0C);
    const __m512i m2_4 = _mm512_set1_epi8(0x30);
    __m512 acc[R];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
    }
    for (int l = 0; l < nb; l++) {
        const char * ahead = (const char *) (b + l) + PREFETCH_BYTES;
        for (int p = 0; p < (int) sizeof(block_q6_Kx8); p += 64) {
            _mm_prefetch(ahead + p, _MM_HINT_T0);
        }
        __m512i isum[R], icorr[R];
        for (int r = 0; r < R; r++) {
            isum[r] = icorr[r] = _mm512_setzero_si512();
        }
        for (int nh = 0; nh < 2; nh++) {
            for (int m = 0; m < 2; m++) {
                __m512i p16[4][R];
                for (int tt = 0; tt < 2; tt++) {
                    const int t = 2 * m + tt;
                    const __m512i qla = _mm512_loadu_si512((const void *) (b[l].ql + (8 * nh + t) * 64));
                    const __m512i qlb = _mm512_loadu_si512((const void *) (b[l].ql + (8 * nh + 4 + t) * 64));
                    const __m512i qh = _mm512_loadu_si512((const void *) (b[l].qh + (4 * nh + t) * 64));
                    const __m512i q[4] = {
                        _mm512_or_si512(_mm512_and_si512(qla, m4), _mm512_slli_epi16(_mm512_and_si512(qh, m2), 4)),
                        _mm512_or_si512(_mm512_and_si512(qlb, m4), _mm512_slli_epi16(_mm512_and_si512(qh, m2_2), 2)),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(qla, 4), m4), _mm512_and_si512(qh, m2_4)),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(qlb, 4), m4),
                                        _mm512_and_si512(_mm512_srli_epi16(qh, 2), m2_4)),
                    };
                    for (int r = 0; r < R; r++) {
                        const int8_t * aq = a[r][l].qs + 128 * nh + 8 * t;
                        for (int st = 0; st < 4; st++) {
                            const __m512i prod = _mm512_maddubs_epi16(q[st], broadcast_8_bytes_512(aq + 32 * st));
                            p16[st][r] = tt == 0 ? prod : _mm512_add_epi16(p16[st][r], prod);
                        }
                    }
                }
                for (int st = 0; st < 4; st++) {
                    const int g = 8 * nh + m + 2 * st;
                    const __m512i sc = scale_lanes_512(b[l].scales + 8 * g);
                    for (int r = 0; r < R; r++) {
                        isum[r] = _mm512_dpwssd_epi32(isum[r], p16[st][r], sc);
                        icorr[r] = _mm512_dpwssd_epi32(icorr[r], sc, _mm512_set1_epi64((uint16_t) a[r][l].bsums[g]));
                    }
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const __m512i total = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(icorr[r], 5));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), block_scales_512(b[l].d, a[r][l].d), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        alignas(64) float v[16];
        _mm512_store_ps(v, acc[r]);
        for (int c = 0; c < 8; c++) {
            out[r][c] = v[2 * c] + v[2 * c + 1];
        }
    }
}
#else
constexpr bool HAVE_512 = false;
#endif
#endif

}  // namespace

bool rapidmoe_q6_K_repack() {
    const char * env = std::getenv("RAPIDMOE_Q6_K_REPACK");
    return env == nullptr || env[0] != '0';
}

void rapidmoe_gemv_q6_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) {
    (void) bs;
    (void) nr;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (HAVE_512 && !rapidmoe_gemm_avx2_only()) {
        const int nb = n / QK_K;
        const block_q8_K * rows[1] = { (const block_q8_K *) vy };
        for (int x = 0; x < nc / 8; x++) {
            float * out[1] = { s + 8 * x };
            gemv_512<1>(nb, (const block_q6_Kx8 *) vx + (int64_t) x * nb, rows, out);
        }
        return;
    }
#endif
#if defined(__AVX2__)
    if (HAVE_VNNI && !rapidmoe_gemm_avx2_only()) {
        gemv_impl<HAVE_VNNI>(n, s, vx, vy, nc);
    } else {
        gemv_impl<false>(n, s, vx, vy, nc);
    }
#else
    (void) n; (void) s; (void) vx; (void) vy; (void) nc;
#endif
}

void rapidmoe_gemm_q6_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) {
    const int nb = n / QK_K;
    thread_local std::vector<block_q8_K> rows;
    rows.resize((size_t) 4 * nb);
    for (int y = 0; y < nr / 4; y++) {
        rapidmoe_q8_Kx4_rows((const block_q8_Kx4 *) vy + (int64_t) y * nb, nb, rows.data());
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
        if (HAVE_512 && !rapidmoe_gemm_avx2_only()) {  // each weight chunk loaded once for the 4 rows
            const block_q8_K * ra[4];
            for (int r = 0; r < 4; r++) {
                ra[r] = rows.data() + (size_t) r * nb;
            }
            for (int x = 0; x < nc / 8; x++) {
                float * out[4];
                for (int r = 0; r < 4; r++) {
                    out[r] = s + (int64_t) (4 * y + r) * bs + 8 * x;
                }
                gemv_512<4>(nb, (const block_q6_Kx8 *) vx + (int64_t) x * nb, ra, out);
            }
            continue;
        }
#endif
        for (int r = 0; r < 4; r++) {
            rapidmoe_gemv_q6_K_8x8_q8_K(n, s + (int64_t) (4 * y + r) * bs, bs, vx, rows.data() + (size_t) r * nb, 1, nc);
        }
    }
}
