// Q8_0 x Q8_0 gemv and gemm over llama.cpp's repacked block_q8_0x4 layout (4 columns interleaved in 8-byte chunks:
// qs[32 k + 8 c + i] is column c's value 8 k + i of the block), for x86.
//
// Why our own: on x86 upstream keeps Q8_0 plain, so a decode step runs ggml_vec_dot_q8_0_q8_0 once per weight row
// (a function call, a horizontal sum and a scale product per 32 values). Our cpu-q8 preset keeps attention and the
// output head in Q8_0 (302 MB a token on the 8.1 GB bench model), and there that vec_dot was 26 of 45 CPU ms a token
// (docs/split-routing.md, CPU performance). Here
//  - one 32-byte load holds 8 values of each of 4 columns, multiplied against the activation's 8 bytes broadcast
//    (no shuffle); the signs move onto the activation (abs of the weights, sign of the activation by them) so the
//    unsigned x signed multiply-add applies; |weights| <= 127 as Q8_0 writes them;
//  - the int32 lanes 2c and 2c + 1 hold column c's two halves of the block: one float conversion and one FMA with
//    (column scale x activation scale) per block and 4 columns, the halves added once at the end of the row;
//  - with AVX-512 VNNI (256-bit form) vpdpbusd does the multiply and both sums in one instruction (the same exact
//    integers, so the same bits as the AVX2 path);
//  - the weights are prefetched PREFETCH_BYTES ahead.
// The gemm multiplies each weight chunk, loaded once, with 4 activation rows, the weights of 4 columns staying in
// L1 while every row group of the call passes; per output the same integers and float operations in the same order
// as the gemv, so the same bits for an activation row quantized the same way.
#include "rapidmoe-gemv-q8-0.h"

#include "rapidmoe-gemm.h"
#include "rapidmoe-simd.h"
#include "repack.h"
#include "simd-mappings.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstdlib>

namespace {

constexpr int PREFETCH_BYTES = 2048;

#if defined(__AVX2__)

constexpr bool HAVE_VNNI = RAPIDMOE_HAVE_VNNI_256;

// out[c] = acc[2c] + acc[2c + 1]
inline void store_columns(float * out, __m256 acc) {
    alignas(32) float v[8];
    _mm256_store_ps(v, acc);
    for (int c = 0; c < 4; c++) {
        out[c] = v[2 * c] + v[2 * c + 1];
    }
}

#endif

}  // namespace

bool rapidmoe_q8_0_repack() {
    const char * env = std::getenv("RAPIDMOE_Q8_0_REPACK");
    return env == nullptr || env[0] != '0';
}

void rapidmoe_gemv_q8_0_4x8_q8_0(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) {
    (void) bs;
    (void) nr;
#if defined(__AVX2__)
    const int nb = n / QK8_0;
    const auto * a = (const block_q8_0 *) vy;
    for (int x = 0; x < nc / 4; x++) {
        const block_q8_0x4 * b = (const block_q8_0x4 *) vx + (int64_t) x * nb;
        __m256 acc = _mm256_setzero_ps();
        for (int l = 0; l < nb; l++) {
            const char * ahead = (const char *) (b + l) + PREFETCH_BYTES;
            _mm_prefetch(ahead, _MM_HINT_T0);
            _mm_prefetch(ahead + 64, _MM_HINT_T0);
            _mm_prefetch(ahead + 128, _MM_HINT_T0);
            __m256i isum = _mm256_setzero_si256();
            for (int k = 0; k < 4; k++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *) (b[l].qs + 32 * k));
                const __m256i av = broadcast_8_bytes(a[l].qs + 8 * k);
                isum = dot_add_u8s8<HAVE_VNNI>(isum, _mm256_sign_epi8(w, w), _mm256_sign_epi8(av, w));
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), pair_scales_4(b[l].d, GGML_CPU_FP16_TO_FP32(a[l].d)), acc);
        }
        store_columns(s + 4 * x, acc);
    }
#else
    (void) n; (void) s; (void) vx; (void) vy; (void) nc;
#endif
}

#if defined(__AVX2__)
namespace {

template <bool VNNI>
void gemm_impl(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) {
    const int nb = n / QK8_0;
    for (int x = 0; x < nc / 4; x++) {
        const block_q8_0x4 * b = (const block_q8_0x4 *) vx + (int64_t) x * nb;
        for (int y = 0; y < nr / 4; y++) {
            const block_q8_0x4 * a = (const block_q8_0x4 *) vy + (int64_t) y * nb;
            __m256 acc[4] = { _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps() };
            for (int l = 0; l < nb; l++) {
                __m256i isum[4] = { _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                                    _mm256_setzero_si256() };
                for (int k = 0; k < 4; k++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *) (b[l].qs + 32 * k));
                    const __m256i w_abs = _mm256_sign_epi8(w, w);
                    for (int r = 0; r < 4; r++) { // activation row r's 8 bytes of chunk k
                        const __m256i av = broadcast_8_bytes(a[l].qs + 32 * k + 8 * r);
                        isum[r] = dot_add_u8s8<VNNI>(isum[r], w_abs, _mm256_sign_epi8(av, w));
                    }
                }
                for (int r = 0; r < 4; r++) {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]),
                                             pair_scales_4(b[l].d, GGML_CPU_FP16_TO_FP32(a[l].d[r])), acc[r]);
                }
            }
            for (int r = 0; r < 4; r++) {
                store_columns(s + (int64_t) (4 * y + r) * bs + 4 * x, acc[r]);
            }
        }
    }
}

}  // namespace
#endif

void rapidmoe_gemm_q8_0_4x8_q8_0(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) {
#if defined(__AVX2__)
    if (HAVE_VNNI && !rapidmoe_gemm_avx2_only()) {
        gemm_impl<HAVE_VNNI>(n, s, bs, vx, vy, nr, nc);
    } else {
        gemm_impl<false>(n, s, bs, vx, vy, nr, nc);
    }
#else
    (void) n; (void) s; (void) bs; (void) vx; (void) vy; (void) nr; (void) nc;
#endif
}
