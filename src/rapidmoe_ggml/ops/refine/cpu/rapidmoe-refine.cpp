// The refine codec's matmul: kernels (a scalar reference and an AVX2 one, which reads a plain row or a row of our
// repacked Q3_K layout) and the custom op (rapidmoe-refine.h). On repacked WQ the op runs 8 rows at once where the
// build has AVX-512 BITALG (rapidmoe-refine-x8.cpp), else this file's kernel on each row read back: the same bits.
#include "rapidmoe-refine.h"

#include "rapidmoe-refine-x8.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// offsets inside a Q8_K block (block_q8_K; a Q3_K block's are rapidmoe-q3k-x8.h's)
constexpr size_t Q8K_QS = 4, Q8K_BSUMS = 260;

float half_to_float(const uint8_t * p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    ggml_fp16_t v;
    std::memcpy(&v, &h, 2);
    return ggml_fp16_to_fp32(v);
#endif
}

float x_scale(const uint8_t * xb) {
    float d;
    std::memcpy(&d, xb, 4);
    return d;
}

} // namespace

float rapidmoe_refine_dot_ref(int64_t n, const uint8_t * wq, const uint8_t * bits, const void * x) {
    const auto * xb = (const uint8_t *) x;
    float sum = 0.0f;
    for (int64_t b = 0; b < n / 256; ++b, wq += RAPIDMOE_Q3K_BLOCK, bits += 32, xb += RAPIDMOE_Q8K_BLOCK) {
        const auto * xq = (const int8_t *) (xb + Q8K_QS);
        int32_t isum = 0;
        for (int j = 0; j < 16; ++j) {
            int32_t s = 0;
            for (int i = 16 * j; i < 16 * j + 16; ++i) {
                const int low = (wq[RAPIDMOE_Q3K_QS + (i / 128) * 32 + i % 32] >> (2 * ((i % 128) / 32))) & 3;
                const int high = (wq[RAPIDMOE_Q3K_HMASK + i % 32] >> (i / 32)) & 1;
                const int t = (bits[i / 8] >> (i % 8)) & 1;
                const int f = 2 * (low | (high << 2)) + t;
                s += (2 * f - 17) * xq[i];
            }
            isum += (rapidmoe_q3_K_scale(wq + RAPIDMOE_Q3K_SCALES, j) - 32) * s;
        }
        sum += half_to_float(wq + RAPIDMOE_Q3K_D) * x_scale(xb) * (float) isum;
    }
    return 0.25f * sum;
}

#if defined(__AVX2__)
namespace {

inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

// 32 bits -> 32 bytes of 0/1
inline __m256i bits_to_bytes(uint32_t m) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_set1_epi8((__mmask32) m, 1);
#else
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long) 0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int) m), shuf);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(1));
#endif
}

// the 16 scales sc_j - 32 of a Q3_K block as int8, from its 12 bytes (3 words: low nibbles, high nibbles, 2-bit tops)
inline __m128i q3k_scales_simd(const uint8_t * s) {
    uint32_t a, b, c;
    std::memcpy(&a, s, 4);
    std::memcpy(&b, s + 4, 4);
    std::memcpy(&c, s + 8, 4);
    const uint32_t lo = 0x0F0F0F0Fu, two = 0x03030303u;
    const __m128i v = _mm_setr_epi32((int) ((a & lo) | ((c & two) << 4)), (int) ((b & lo) | (((c >> 2) & two) << 4)),
                                     (int) (((a >> 4) & lo) | (((c >> 4) & two) << 4)),
                                     (int) (((b >> 4) & lo) | (((c >> 6) & two) << 4)));
    return _mm_sub_epi8(v, _mm_set1_epi8(32));
}

} // namespace

#ifndef RAPIDMOE_PREFETCH
#define RAPIDMOE_PREFETCH 2048
#endif

namespace {

// What the kernel reads of weight block b of one row: its hmask (32 bytes), qs (2 x 32), scales (16 x int16, minus
// 32) and d. PlainRow: a row of plain block_q3_K. X8Row: row c of a run of repacked blocks (patch 0021's layout,
// rapidmoe-q3k-x8.h): the same bytes, gathered from the 8-byte interleave, so the same bits.
struct PlainRow {
    const uint8_t * wq;
    void prefetch(int64_t b) const {
        // 2 KiB ahead (the next rows of the expert: its rows are contiguous), as our Q2_K gemv found best
        _mm_prefetch((const char *) wq + b * RAPIDMOE_Q3K_BLOCK + RAPIDMOE_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *) wq + b * RAPIDMOE_Q3K_BLOCK + RAPIDMOE_PREFETCH + 64, _MM_HINT_T0);
    }
    void load(int64_t b, __m256i & sc16, __m256i & hm, __m256i qs[2], float & d) const {
        const uint8_t * w = wq + b * RAPIDMOE_Q3K_BLOCK;
        sc16 = _mm256_cvtepi8_epi16(q3k_scales_simd(w + RAPIDMOE_Q3K_SCALES));
        hm = _mm256_loadu_si256((const __m256i *) (w + RAPIDMOE_Q3K_HMASK));
        qs[0] = _mm256_loadu_si256((const __m256i *) (w + RAPIDMOE_Q3K_QS));
        qs[1] = _mm256_loadu_si256((const __m256i *) (w + RAPIDMOE_Q3K_QS + 32));
        d = half_to_float(w + RAPIDMOE_Q3K_D);
    }
};

#if defined(__AVX512BW__)
struct X8Row {
    const rapidmoe_block_q3_Kx8 * x8;
    int c;
    void prefetch(int64_t b) const {
        if (c == 0) { // the group's first row brings its blocks in; the other 7 rows find them in L1/L2
            for (int i = 0; i < (int) sizeof(rapidmoe_block_q3_Kx8); i += 64) {
                _mm_prefetch((const char *) (x8 + b) + RAPIDMOE_PREFETCH + i, _MM_HINT_T0);
            }
        }
    }
    static int64_t chunk(const uint8_t * p) {
        int64_t v;
        std::memcpy(&v, p, 8);
        return v;
    }
    void load(int64_t b, __m256i & sc16, __m256i & hm, __m256i qs[2], float & d) const {
        const rapidmoe_block_q3_Kx8 & x = x8[b];
        alignas(64) uint8_t sc[128];
        rapidmoe_q3_K_x8_scales_simd(x, sc);
        // row c's scales are the 16-bit words 8 g + c (sub-blocks 2 g, 2 g + 1)
        alignas(64) static const int16_t words_of_row0[32] = { 0, 8, 16, 24, 32, 40, 48, 56 };
        const __m512i idx = _mm512_add_epi16(_mm512_load_si512(words_of_row0), _mm512_set1_epi16((short) c));
        const __m512i words = _mm512_permutex2var_epi16(_mm512_load_si512(sc), idx, _mm512_load_si512(sc + 64));
        sc16 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm512_castsi512_si128(words)), _mm256_set1_epi16(32));
        const uint8_t * h = x.hmask + 8 * c;
        hm = _mm256_setr_epi64x(chunk(h), chunk(h + 64), chunk(h + 128), chunk(h + 192));
        const uint8_t * q = x.qs + 8 * c;
        qs[0] = _mm256_setr_epi64x(chunk(q), chunk(q + 64), chunk(q + 128), chunk(q + 192));
        qs[1] = _mm256_setr_epi64x(chunk(q + 256), chunk(q + 320), chunk(q + 384), chunk(q + 448));
        uint16_t dh = x.d[c];
        d = half_to_float((const uint8_t *) &dh);
    }
};
#endif

template <class Row>
void refine_dot_multi(int64_t n, const Row & row, const uint8_t * bits, const void * const * xs, int nx, float * out) {
    const __m256i m3 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
    // for 32 weights c (sub-blocks 2c, 2c + 1): int16 lanes 0-7 <- scale 2c, lanes 8-15 <- scale 2c + 1, from the
    // block's 16 int16 scales: a 32-bit word (scales 2c, 2c + 1) broadcast, then a byte shuffle per 128-bit half
    const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                          2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    float sum[RAPIDMOE_REFINE_MAX_X] = {};
    for (int64_t b = 0; b < n / 256; ++b, bits += 32) {
        row.prefetch(b);
        _mm_prefetch((const char *) bits + RAPIDMOE_PREFETCH / 4, _MM_HINT_T0);
        // the block's weights once, for every activation: f = 2 * (low + 4 * high) + t in 0..15, and the scales
        __m256i sc16, hm, qs[2];
        float dw;
        row.load(b, sc16, hm, qs, dw);
        __m256i f[8], s[8];
        for (int c = 0; c < 8; ++c) { // 32 weights: sub-blocks 2c and 2c + 1
            const __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs[c / 4], 2 * (c % 4)), m3);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hm, c), m1);
            uint32_t tb;
            std::memcpy(&tb, bits + 4 * c, 4);
            f[c] = _mm256_add_epi8(_mm256_add_epi8(_mm256_add_epi8(low, low), _mm256_slli_epi16(high, 3)),
                                   bits_to_bytes(tb));
            s[c] = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(c)), pick);
        }
        for (int i = 0; i < nx; ++i) {
            const auto * xb = (const uint8_t *) xs[i] + b * RAPIDMOE_Q8K_BLOCK;
            const auto * xq = (const int8_t *) (xb + Q8K_QS);
            __m256i acc = _mm256_setzero_si256();
            for (int c = 0; c < 8; ++c) {
                const __m256i p = _mm256_maddubs_epi16(f[c], _mm256_loadu_si256((const __m256i *) (xq + 32 * c)));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, s[c]));
            }
            // sum (2f - 17) x = 2 sum f x - 17 sum x, with Q8_K's sums of 16
            const __m256i c17 = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) (xb + Q8K_BSUMS)), sc16);
            const __m256i v = _mm256_sub_epi32(_mm256_add_epi32(acc, acc),
                                               _mm256_mullo_epi32(c17, _mm256_set1_epi32(17)));
            sum[i] += dw * x_scale(xb) * (float) hsum_i32(v);
        }
    }
    for (int i = 0; i < nx; ++i) {
        out[i] = 0.25f * sum[i];
    }
}

} // namespace

void rapidmoe_refine_dot_multi(int64_t n, const uint8_t * wq, const uint8_t * bits, const void * const * xs, int nx,
                               float * out) {
    refine_dot_multi(n, PlainRow{ wq }, bits, xs, nx, out);
}

#else
void rapidmoe_refine_dot_multi(int64_t n, const uint8_t * wq, const uint8_t * bits, const void * const * xs, int nx,
                               float * out) {
    for (int i = 0; i < nx; ++i) {
        out[i] = rapidmoe_refine_dot_ref(n, wq, bits, xs[i]);
    }
}
#endif

float rapidmoe_refine_dot(int64_t n, const uint8_t * wq, const uint8_t * bits, const void * x) {
    float out;
    rapidmoe_refine_dot_multi(n, wq, bits, &x, 1, &out);
    return out;
}

namespace {

// per thread: the Q8_K rows of b this op needs, quantized once per call ((j % n_b, t) -> row)
thread_local std::vector<uint8_t> tl_q8;
thread_local std::vector<int32_t> tl_row_of;

struct refine_slot {
    int32_t expert;
    int64_t j, t;
};

// whether wq lives in the CPU's repacked buffer: Q3_K there is in rapidmoe_block_q3_Kx8 groups of 8 rows
bool repacked(const ggml_tensor * wq) {
    return wq->buffer != nullptr && wq->extra != nullptr &&
           std::strcmp(ggml_backend_buft_name(ggml_backend_buffer_get_type(wq->buffer)), "CPU_REPACK") == 0;
}

// dot products of row r of expert e of a repacked wq (patch 0021's layout) with nx activations: the plain row's bits
void refine_dot_multi_repacked(const ggml_tensor * wq, int32_t e, int64_t r, const uint8_t * bits,
                               const void * const * xs, int nx, float * out) {
#if defined(__AVX2__) && defined(__AVX512BW__)
    const char * rows = (const char *) wq->data + e * wq->nb[2] + r / 8 * 8 * wq->nb[1]; // its group of 8 rows
    const auto * group = (const rapidmoe_block_q3_Kx8 *) rows;
    refine_dot_multi(wq->ne[0], X8Row{ group, (int) (r % 8) }, bits, xs, nx, out);
#else
    // ggml-cpu repacks Q3_K only where it has AVX-512 VNNI, and this file is built for the same CPU (GGML_NATIVE)
    (void) wq; (void) e; (void) r; (void) bits; (void) xs; (void) nx; (void) out;
    GGML_ABORT("the refine op was built without AVX-512 but its Q3_K experts are repacked");
#endif
}

void refine_mul_mat_id_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const ggml_tensor * wq = dst->src[0];
    const ggml_tensor * bits = dst->src[1];
    const ggml_tensor * b = dst->src[2];
    const ggml_tensor * ids = dst->src[3];
    const int64_t n_in = wq->ne[0], n_out = wq->ne[1], k = ids->ne[0], T = ids->ne[1], n_b = b->ne[1];
    const size_t q8_row = (size_t) (n_in / 256) * RAPIDMOE_Q8K_BLOCK;
    const ggml_from_float_t quantize = ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float;

    // this thread's output rows (every slot); the slots to compute, grouped by expert so that a block of weight rows
    // stays in cache across a batch's tokens
    const bool x8 = repacked(wq);
    const bool x8_kernel = x8 && rapidmoe_refine_x8_enabled();  // 8 rows at once: threads split whole groups
    const int64_t unit = x8_kernel ? 8 : 1;
    const int64_t r0 = n_out / unit * ith / nth * unit, r1 = n_out / unit * (ith + 1) / nth * unit;
    std::vector<refine_slot> slots;
    tl_row_of.assign((size_t) (n_b * T), -1);
    int32_t n_rows = 0;
    for (int64_t t = 0; t < T; ++t) {
        const auto * it = (const int32_t *) ((const char *) ids->data + t * ids->nb[1]);
        for (int64_t j = 0; j < k; ++j) {
            float * out = (float *) ((char *) dst->data + j * dst->nb[1] + t * dst->nb[2]);
            if (it[j] < 0 || it[j] >= wq->ne[2]) {
                std::fill(out + r0, out + r1, 0.0f);
                continue;
            }
            slots.push_back({ it[j], j, t });
            int32_t & row = tl_row_of[(size_t) (t * n_b + j % n_b)];
            if (row < 0) {
                row = n_rows++;
            }
        }
    }
    if (slots.empty() || r0 >= r1) {
        return;
    }
    tl_q8.resize((size_t) n_rows * q8_row);
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t jb = 0; jb < n_b; ++jb) {
            const int32_t row = tl_row_of[(size_t) (t * n_b + jb)];
            if (row >= 0) {
                quantize((const float *) ((const char *) b->data + jb * b->nb[1] + t * b->nb[2]),
                         tl_q8.data() + (size_t) row * q8_row, n_in);
            }
        }
    }
    std::stable_sort(slots.begin(), slots.end(),
                     [](const refine_slot & a, const refine_slot & c) { return a.expert < c.expert; });
    constexpr int64_t ROWS = 16;
    for (size_t s0 = 0; s0 < slots.size();) {
        size_t s1 = s0;
        while (s1 < slots.size() && slots[s1].expert == slots[s0].expert) {
            ++s1;
        }
        const int32_t e = slots[s0].expert;
        for (int64_t rb = r0; rb < r1; rb += ROWS) {
            const int64_t re = std::min(rb + ROWS, r1);
            // up to RAPIDMOE_REFINE_MAX_X of the expert's slots at once: each weight block is unpacked once for them
            for (size_t g0 = s0; g0 < s1; g0 += RAPIDMOE_REFINE_MAX_X) {
                const int nx = (int) std::min<size_t>(RAPIDMOE_REFINE_MAX_X, s1 - g0);
                const void * xs[RAPIDMOE_REFINE_MAX_X];
                float * outs[RAPIDMOE_REFINE_MAX_X];
                for (int i = 0; i < nx; ++i) {
                    const refine_slot & sl = slots[g0 + i];
                    xs[i] = tl_q8.data() + (size_t) tl_row_of[(size_t) (sl.t * n_b + sl.j % n_b)] * q8_row;
                    outs[i] = (float *) ((char *) dst->data + sl.j * dst->nb[1] + sl.t * dst->nb[2]);
                }
                if (x8_kernel) {
                    for (int64_t r = rb; r < re; r += 8) {  // rb, re: multiples of 8
                        const auto * group = (const rapidmoe_block_q3_Kx8 *) ((const char *) wq->data +
                                                                              e * wq->nb[2] + r * wq->nb[1]);
                        const auto * tb = (const uint8_t *) bits->data + r * bits->nb[1] + e * bits->nb[2];
                        float res[8 * RAPIDMOE_REFINE_MAX_X];
                        rapidmoe_refine_dot_x8(n_in, group, tb, bits->nb[1], xs, nx, res);
                        for (int i = 0; i < nx; ++i) {
                            std::memcpy(outs[i] + r, res + 8 * i, 8 * sizeof(float));
                        }
                    }
                    continue;
                }
                for (int64_t r = rb; r < re; ++r) {
                    const auto * tb = (const uint8_t *) bits->data + r * bits->nb[1] + e * bits->nb[2];
                    float res[RAPIDMOE_REFINE_MAX_X];
                    if (x8) {
                        refine_dot_multi_repacked(wq, e, r, tb, xs, nx, res);
                    } else {
                        rapidmoe_refine_dot_multi(n_in, (const uint8_t *) wq->data + r * wq->nb[1] + e * wq->nb[2], tb,
                                                  xs, nx, res);
                    }
                    for (int i = 0; i < nx; ++i) {
                        outs[i][r] = res[i];
                    }
                }
            }
        }
        s0 = s1;
    }
}

} // namespace

bool rapidmoe_refine_takes(const ggml_tensor * wq) {
    return wq->type == GGML_TYPE_Q3_K && wq->ne[0] % 256 == 0;
}

std::string rapidmoe_refine_plane_error(const ggml_tensor * wq, const ggml_tensor * plane) {
    const std::string name = ggml_get_name(plane);
    if (plane->type != GGML_TYPE_I8 || plane->ne[0] * 8 != wq->ne[0] || plane->ne[1] != wq->ne[1] ||
        plane->ne[2] != wq->ne[2] || plane->ne[3] != 1) {
        return "sidecar tensor " + name + " does not match the model's expert tensor (a bit plane of its shape)";
    }
    if (!rapidmoe_refine_takes(wq)) {
        return "sidecar tensor " + name + " refines Q3_K experts, but the model's are " + ggml_type_name(wq->type) +
               " (the sidecar belongs to another .wq.gguf)";
    }
    return "";
}

ggml_tensor * rapidmoe_refine_mul_mat_id(ggml_context * ctx, ggml_tensor * wq, ggml_tensor * bits, ggml_tensor * b,
                                         ggml_tensor * ids) {
    GGML_ASSERT(rapidmoe_refine_takes(wq));
    GGML_ASSERT(bits->ne[0] * 8 == wq->ne[0] && bits->ne[1] == wq->ne[1] && bits->ne[2] == wq->ne[2]);
    GGML_ASSERT(b->type == GGML_TYPE_F32 && b->ne[0] == wq->ne[0] && b->nb[0] == sizeof(float));
    GGML_ASSERT(ids->type == GGML_TYPE_I32 && ids->ne[1] == b->ne[2]);
    ggml_tensor * args[4] = { wq, bits, b, ids };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, wq->ne[1], ids->ne[0], ids->ne[1], 1, args, 4, refine_mul_mat_id_op,
                          GGML_N_TASKS_MAX,
                          RAPIDMOE_Q3K_X8_READER);  // it reads a repacked wq (CPU_REPACK: patch 0021)
}
