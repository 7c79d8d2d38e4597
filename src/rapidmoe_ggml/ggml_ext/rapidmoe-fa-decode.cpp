// Flash attention over an F16 KV cache, query heads grouped by KV head: decode steps first of all, and every batch
// (so a token's attention does not depend on the batch it was computed in).
//
// Why our own: llama.cpp's CPU kernel for a single query row handles each query head alone, so with grouped-query
// attention it reads every K and V row once per query head sharing it (4 times on Qwen3-MoE), converts the query
// to F16 first, and accumulates the weighted V rows in an F16 buffer, converting all of it back and forth for every
// cache position. Profiled on the bench model (decode, 2 threads, Zen 5 VM, 256 steps) attention took 5.2 CPU ms
// a token against ik_llama.cpp's 2.9.
//
// This kernel takes the query heads of one KV head together: each K row is converted once and dotted with all of
// them (F32 query, F32 sums), the softmax is exact in three passes (scores, then max and exp, then the weighted V
// rows, each V row converted once for all the heads, accumulated in F32 registers), and the output is divided by
// the sum as llama.cpp's is. Not bit-identical with llama.cpp (F32 where it rounds through F16, a two-pass softmax
// where it rescales online): tests/engine/test_fa_decode.py compares both with a float64 reference.
#include "rapidmoe-fa-decode.h"

#include "rapidmoe-claim.h"

#include "ggml.h"
#include "ggml-cpu-impl.h"
#include "vec.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int MAX_GROUP = 8;   // query heads taken together (a larger group: in sets of 8)
constexpr int MAX_DIM = 256;   // head size

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Prefetches the row's bytes (a head's slice of a cache row: 2 dk bytes) into L1
inline void prefetch_row(const char * row, int bytes) {
    for (int b = 0; b < bytes; b += 64) {
        _mm_prefetch(row + b, _MM_HINT_T0);
    }
}

// scores[h * n + i] = q_h . k_{pos[i]} * scale + mask, for the G heads of one KV head and the n visible positions.
// The cache is cold here (a decode step streams the weights through the caches between two attentions): the K rows
// are prefetched 8 positions ahead and each V row as its K row is read, so the V pass finds them in cache.
template <int G>
void scores_of(const float * const q[], const char * k, size_t k_stride, const char * v, size_t v_stride,
               const int32_t * pos, const float * mask, int64_t n, int dk, float scale, float * scores) {
    constexpr int64_t AHEAD = 8;
    for (int64_t i = 0; i < n && i < AHEAD; i++) {
        prefetch_row(k + pos[i] * k_stride, 2 * dk);
    }
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            prefetch_row(k + pos[i + AHEAD] * k_stride, 2 * dk);
        }
        prefetch_row(v + pos[i] * v_stride, 2 * dk);
        const auto * kr = (const ggml_fp16_t *) (k + pos[i] * k_stride);
        __m256 acc[G];
        for (int h = 0; h < G; h++) {
            acc[h] = _mm256_setzero_ps();
        }
        for (int d = 0; d < dk; d += 8) {
            const __m256 kf = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (kr + d)));
            for (int h = 0; h < G; h++) {
                acc[h] = _mm256_fmadd_ps(kf, _mm256_loadu_ps(q[h] + d), acc[h]);
            }
        }
        for (int h = 0; h < G; h++) {
            scores[h * n + i] = hsum(acc[h]) * scale + mask[i];
        }
    }
}

// out[h][0..dv) = sum over i of p[h * n + i] * v_{pos[i]}, in F32, 16 dimensions at a time for all G heads
template <int G>
void weighted_values(const float * p, const char * v, size_t v_stride, const int32_t * pos, int64_t n, int dv,
                     float * out) {
    for (int d = 0; d < dv; d += 16) {
        __m256 lo[G];
        __m256 hi[G];
        for (int h = 0; h < G; h++) {
            lo[h] = _mm256_setzero_ps();
            hi[h] = _mm256_setzero_ps();
        }
        const bool two = d + 8 < dv;
        for (int64_t i = 0; i < n; i++) {
            const auto * vr = (const ggml_fp16_t *) (v + pos[i] * v_stride) + d;
            const __m256 v0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) vr));
            const __m256 v1 = two ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (vr + 8))) : _mm256_setzero_ps();
            for (int h = 0; h < G; h++) {
                const __m256 w = _mm256_broadcast_ss(p + h * n + i);
                lo[h] = _mm256_fmadd_ps(w, v0, lo[h]);
                hi[h] = _mm256_fmadd_ps(w, v1, hi[h]);
            }
        }
        for (int h = 0; h < G; h++) {
            _mm256_storeu_ps(out + h * MAX_DIM + d, lo[h]);
            if (two) {
                _mm256_storeu_ps(out + h * MAX_DIM + d + 8, hi[h]);
            }
        }
    }
}

// Query row t's heads h0..h0+G-1 of stream i3 (a sequence's own cache when llama.cpp keeps one per sequence), all on
// KV head g
template <int G>
void kv_head(const ggml_tensor * dst, int64_t i3, int64_t t, int64_t g, int64_t h0, float scale) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    const ggml_tensor * mask = dst->src[3];
    const int64_t n_kv = k->ne[1];
    const int dk = (int) k->ne[0];
    const int dv = (int) v->ne[0];
    const float * qh[G];
    for (int h = 0; h < G; h++) {
        qh[h] = (const float *) ((const char *) q->data + t * q->nb[1] + (h0 + h) * q->nb[2] + i3 * q->nb[3]);
    }
    // the positions the query sees (the mask's row: one for all heads), so masked and padded cells cost nothing
    static thread_local std::vector<int32_t> pos;
    static thread_local std::vector<float> pos_mask;
    pos.clear();
    pos_mask.clear();
    const auto * mp = mask != nullptr ? (const ggml_fp16_t *) ((const char *) mask->data + t * mask->nb[1] +
                                                               (i3 % mask->ne[3]) * mask->nb[3]) : nullptr;
    for (int64_t ic = 0; ic < n_kv; ic++) {
        const float mv = mp != nullptr ? _cvtsh_ss(mp[ic]) : 0.0f;  // F16C inline: ggml_fp16_to_fp32 is a call
        if (mv != -INFINITY) {
            pos.push_back((int32_t) ic);
            pos_mask.push_back(mv);
        }
    }
    const int64_t n = (int64_t) pos.size();
    static thread_local std::vector<float> scores;
    scores.resize((size_t) G * n);
    const char * kg = (const char *) k->data + g * k->nb[2] + i3 * k->nb[3];
    const char * vg = (const char *) v->data + g * v->nb[2] + i3 * v->nb[3];
    scores_of<G>(qh, kg, k->nb[1], vg, v->nb[1], pos.data(), pos_mask.data(), n, dk, scale, scores.data());
    float sum[G];
    for (int h = 0; h < G; h++) {
        float * s = scores.data() + h * n;
        float m = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            m = s[i] > m ? s[i] : m;
        }
        // exp(s - m) in place and its sum: ggml's vectorized softmax step (llama.cpp's SOFT_MAX uses it), not a
        // scalar std::exp per score (profiled on the bench model, pp512: a quarter of the attention's time)
        sum[h] = (float) ggml_vec_soft_max_f32((int) n, s, s, m);
    }
    alignas(32) float out[G * MAX_DIM];
    weighted_values<G>(scores.data(), vg, v->nb[1], pos.data(), n, dv, out);
    for (int h = 0; h < G; h++) {
        const float inv = sum[h] == 0.0f ? 0.0f : 1.0f / sum[h];
        auto * row = (float *) ((char *) dst->data + (h0 + h) * dst->nb[1] + t * dst->nb[2] + i3 * dst->nb[3]);
        for (int d = 0; d < dv; d++) {
            row[d] = out[h * MAX_DIM + d] * inv;
        }
    }
}
#endif

}  // namespace

bool rapidmoe_flash_attn_decode(const ggml_compute_params * params, ggml_tensor * dst) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    const int ith = params->ith;
    const int nth = params->nth;
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    const ggml_tensor * mask = dst->src[3];
    float scale = 1.0f;
    float max_bias = 0.0f;
    float softcap = 0.0f;
    std::memcpy(&scale, (const float *) dst->op_params + 0, sizeof(float));
    std::memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    std::memcpy(&softcap, (const float *) dst->op_params + 2, sizeof(float));
    const int64_t n_head = q->ne[2];
    const int64_t n_head_kv = k->ne[2];
    const bool applies = rapidmoe_fa_decode_enabled() && q->type == GGML_TYPE_F32 && k->type == GGML_TYPE_F16 &&
        v->type == GGML_TYPE_F16 && k->ne[3] == q->ne[3] && v->ne[3] == q->ne[3] &&
        dst->src[4] == nullptr && softcap == 0.0f && max_bias == 0.0f && k->ne[0] == q->ne[0] &&
        v->ne[0] == k->ne[0] && k->ne[0] % 8 == 0 && k->ne[0] <= MAX_DIM && v->ne[2] == n_head_kv &&
        v->ne[1] == k->ne[1] && n_head_kv > 0 && n_head % n_head_kv == 0 &&
        ((n_head / n_head_kv) & (n_head / n_head_kv - 1)) == 0 &&  // a power of two query heads per KV head
        // at least one set of heads per thread
        q->ne[3] * q->ne[1] * n_head_kv * std::max<int64_t>(1, n_head / n_head_kv / MAX_GROUP) >= nth &&
        k->nb[0] == sizeof(ggml_fp16_t) && v->nb[0] == sizeof(ggml_fp16_t) &&
        q->nb[0] == sizeof(float) && dst->nb[0] == sizeof(float) && dst->ne[0] == v->ne[0] &&
        dst->ne[1] == n_head && dst->ne[2] == q->ne[1] && dst->ne[3] == q->ne[3] &&
        (mask == nullptr || (mask->type == GGML_TYPE_F16 && mask->ne[0] >= k->ne[1] && mask->ne[1] >= q->ne[1] &&
                             mask->ne[2] == 1 && (mask->ne[3] == 1 || mask->ne[3] == q->ne[3])));
    if (!applies) {
        return false;
    }
    const int64_t group = n_head / n_head_kv;
    const int64_t set = std::min<int64_t>(group, MAX_GROUP); // query heads taken together
    const int64_t sets = n_head / set;                         // per query row
    const int64_t per_stream = q->ne[1] * sets;
    const int64_t n_items = q->ne[3] * per_stream;
    // work items (a query row's set of heads): a decode step's few are dealt out, every nth to a thread; a prompt
    // batch's are claimed as the threads go (the threadpool's chunk counter, set before the threads meet), from the
    // last query row back (the longest first), so a thread slowed by the machine takes fewer of them. Either way each
    // item is computed alone, so the values do not depend on the thread that takes it.
    const bool claimed = q->ne[1] > 1 && nth > 1 && rapidmoe_claim_enabled();
    if (claimed) {
        if (ith == 0) {
            ggml_threadpool_chunk_set(params->threadpool, nth);
        }
        ggml_barrier(params->threadpool);
    }
    for (int64_t next = ith; next < n_items;
         next = claimed ? ggml_threadpool_chunk_add(params->threadpool, 1) : next + nth) {
        const int64_t item = claimed ? n_items - 1 - next : next;
        const int64_t i3 = item / per_stream;
        const int64_t t = item % per_stream / sets;
        const int64_t h0 = item % sets * set;
        const int64_t g = h0 / group;
        switch (set) {
            case 1: kv_head<1>(dst, i3, t, g, h0, scale); break;
            case 2: kv_head<2>(dst, i3, t, g, h0, scale); break;
            case 4: kv_head<4>(dst, i3, t, g, h0, scale); break;
            case 8: kv_head<8>(dst, i3, t, g, h0, scale); break;
            default: GGML_ABORT("rapidmoe_flash_attn_decode: %d query heads per KV head not checked", (int) group);
        }
    }
    return true;
#else
    (void) params;
    (void) dst;
    return false;
#endif
}
