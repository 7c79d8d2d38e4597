// quantize_row_q8_K with AVX2: the activation rows of every K-quant matmul in a decode step (and the gemv rows of a
// prompt batch) are quantized by it. On x86 llama.cpp runs the scalar reference (quantize_row_q8_K_ref), which a
// decode step of the bench model's cpu-fast file spends 1.1-1.4 CPU ms per token in (profile_decode.py, Zen 5).
//
// Byte for byte the reference's output, which is compiled without FMA (ggml-base: a multiply, then the magic-number
// add of nearest_int, both rounded to nearest even): the scale is -127 / the first value of the largest magnitude,
// each value is that scale times it, rounded to nearest even (cvtps under the default rounding mode: the same
// integer as nearest_int), 128 clipped to 127 (a pack saturates the same way), d = 1 / scale, and the 16-value sums
// in int. A block of zeros gets d = 0 and zero values, its sums left as they were, as the reference leaves them.
// tools/kernel_cost.py --check compares decode outputs with the stock build's, which quantize with the reference.
#include "rapidmoe-quantize-q8k.h"

#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstring>

extern "C" void rapidmoe_quantize_row_q8_K(const float * x, void * vy, int64_t k) {
#if defined(__AVX2__)
    auto * y = (block_q8_K *) vy;
    const int64_t nb = k / QK_K;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    // packs interleave the 128-bit lanes: this puts the 32 bytes back in order
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        __m256 amax8 = _mm256_setzero_ps();
        for (int j = 0; j < QK_K; j += 8) {
            amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        if (!amax) {
            y[i].d = 0;
            std::memset(y[i].qs, 0, QK_K);
            continue;
        }
        // the reference keeps the first value whose magnitude is the largest (a later one of the same magnitude
        // and the other sign does not replace it)
        float max = 0;
        const __m256 amax_v = _mm256_set1_ps(amax);
        for (int j = 0; j < QK_K; j += 8) {
            const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), amax_v,
                                                             _CMP_EQ_OQ));
            if (hit) {
                max = x[j + __builtin_ctz(hit)];
                break;
            }
        }
        const float iscale = -127.f / max;
        const __m256 scale = _mm256_set1_ps(iscale);
        for (int j = 0; j < QK_K; j += 32) {
            const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(scale, _mm256_loadu_ps(x + j)));
            const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(scale, _mm256_loadu_ps(x + j + 8)));
            const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(scale, _mm256_loadu_ps(x + j + 16)));
            const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(scale, _mm256_loadu_ps(x + j + 24)));
            const __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            _mm256_storeu_si256((__m256i *) (y[i].qs + j), _mm256_permutevar8x32_epi32(q, order));
        }
        for (int j = 0; j < QK_K / 16; ++j) {
            int sum = 0;
            for (int ii = 0; ii < 16; ++ii) {
                sum += y[i].qs[j * 16 + ii];
            }
            y[i].bsums[j] = (int16_t) sum;
        }
        y[i].d = 1 / iscale;
    }
#else
    (void) x; (void) vy; (void) k;
#endif
}

namespace {

// ggml-cpu's block_q8_Kx4 (repack.h): four Q8_K rows' blocks, interleaved
struct q8_K_x4 {
    float d[4];
    int8_t qs[QK_K * 4];
    int16_t bsums[QK_K / 4];
};
static_assert(sizeof(q8_K_x4) == 4 * sizeof(float) + QK_K * 4 + (QK_K / 4) * sizeof(int16_t), "block_q8_Kx4 layout");

}  // namespace

extern "C" void rapidmoe_interleave_q8_K_4x8(const void * const rows[4], void * vy, int64_t k) {
    auto * y = (q8_K_x4 *) vy;
    const int64_t nb = k / QK_K;
    for (int64_t i = 0; i < nb; i++) {
        for (int r = 0; r < 4; r++) {
            const block_q8_K & x = ((const block_q8_K *) rows[r])[i];
            y[i].d[r] = x.d;
            // value e of row r at (e / 8) * 32 + r * 8 + e % 8: 8 bytes of each row in turn
            for (int c = 0; c < QK_K / 8; c++) {
                std::memcpy(y[i].qs + (c * 4 + r) * 8, x.qs + c * 8, 8);
            }
            // sum g (values 16 g to 16 g + 15) of row r at (g / 4) * 16 + r * 4 + g % 4: four sums of each row in turn
            for (int g = 0; g < QK_K / 16; g++) {
                y[i].bsums[(g / 4) * 16 + r * 4 + g % 4] = x.bsums[g];
            }
        }
    }
}
