// Flash attention over an F16 or Q8_0 KV cache, query heads grouped by KV head: decode steps first of all, at any
// context depth, and every batch (so a token's attention does not depend on the batch it was computed in).
//
// Why our own: llama.cpp's CPU kernel for a single query row handles each query head alone, so with grouped-query
// attention it reads every K and V row once per query head sharing it (4 times on Qwen3-MoE), converts the query
// to F16 first, and accumulates the weighted V rows in an F16 buffer, converting all of it back and forth for every
// cache position. Profiled on the bench model (decode, 2 threads, Zen 5 VM, 256 steps) attention took 5.2 CPU ms
// a token against ik_llama.cpp's 2.9; at 16k tokens of context (a Qwen3-30B-shaped layer, 32 query heads on 4 KV
// heads, one thread, Xeon) llama.cpp's took 102 ms a layer and token.
//
// This kernel takes the query heads of one KV head together: each K row is converted once and dotted with all of
// them (F32 query, F32 sums), the softmax is exact in three passes (scores, then max and exp, then the weighted V
// rows, each V row converted once for all the heads, accumulated in F32 registers), and the output is divided by
// the sum as llama.cpp's is. Not bit-identical with llama.cpp (F32 where it rounds through F16, a two-pass softmax
// where it rescales online): tests/engine/test_fa_decode.py compares both with a float64 reference.
//
// At depth a decode step is this loop over the whole cache once per layer, so it must run at memory speed: the
// AVX-512 kernel (below) keeps 8-16 dot products in flight, reads the adjacent KV heads a thread takes as one stream
// of each cache row (llama.cpp's cache holds every KV head's slice of a position side by side), and runs pass 3 in
// tiles of positions whose V rows stay in L1 for every column chunk. A prompt batch's query rows share each pass
// over the cache (up to 16 / G rows on a KV head: the K and V rows read once for all of them) where their visible
// positions nest, as a causal prompt's do; each row's softmax and sums still cover its own positions only.
//
// A Q8_0 cache (llama.cpp's -ctk/-ctv q8_0, K and V each either type) is read the same way, a V row's 32-value blocks
// dequantized exactly (int8 times the block's F16 scale is exact in F32) as they are used. A Q8_0 K row, where the
// build has AVX-512 VNNI and the head size is a multiple of 64, is dotted in integers with the query quantized once
// per work item as llama.cpp's kernel quantizes it for a Q8_0 K (QueriesQ8); elsewhere its blocks are dequantized
// and the query stays F32. With integer dots a prompt tile takes up to 64 queries (16 rows of 4 heads): K tiles
// transposed so that no score needs a horizontal sum (scores_int_tiles), V rows converted once for all of them
// (weighted_values16_many); a 512-row prompt batch's attention at 4k cells took half the time it took in tiles of 16.
//
// At depth a decode step's cells are cut into fixed chunks of CELLS, spread over the threads and folded in order
// (each chunk's own softmax, rescaled to the running maximum): a thread then reads whole cache rows, one stream.
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
#include <memory>
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

// Prefetches the row's bytes (a head's slice of a cache row) into L1: every 64-byte line they touch (a Q8_0 row of
// 544 bytes starts half-way into a line every other position)
inline void prefetch_row(const char * row, int bytes) {
    const uintptr_t first = (uintptr_t) row & ~(uintptr_t) 63;
    const uintptr_t end = (uintptr_t) row + bytes;
    for (uintptr_t line = first; line < end; line += 64) {
        _mm_prefetch((const char *) line, _MM_HINT_T0);
    }
}

// The largest of s[0..n) (-INFINITY for none; NaN scores are passed over, as a scalar `s > m` does): 4 vectors of
// lanes at once, where a scalar loop waits on each comparison (15 % of a decode step's attention at 4k positions)
inline float max_of(const float * s, int64_t n) {
    __m256 m4[4] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY),
                    _mm256_set1_ps(-INFINITY)};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        for (int j = 0; j < 4; j++) {
            m4[j] = _mm256_max_ps(_mm256_loadu_ps(s + i + 8 * j), m4[j]); // the second operand where either is NaN
        }
    }
    const __m256 m2 = _mm256_max_ps(_mm256_max_ps(m4[0], m4[1]), _mm256_max_ps(m4[2], m4[3]));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m2);
    float m = -INFINITY;
    for (float x : lanes) {
        m = x > m ? x : m;
    }
    for (; i < n; i++) {
        m = s[i] > m ? s[i] : m;
    }
    return m;
}

constexpr int64_t TILE = 32;                   // positions pass 3 takes at a time
// A query's scores lie SCORES apart (a chunk's cells at most): a compile-time stride, so the V pass addresses every
// query's weight from one base register (with the count of cells as the stride, 16 queries' pointers spilled to the
// stack and each multiply-add waited on a reload: a prompt batch's V pass at half its speed)
constexpr int64_t SCORES = 512;

constexpr int Q8_0_BLOCK = 32;                  // values a Q8_0 block holds
constexpr int Q8_0_BYTES = 2 + Q8_0_BLOCK;      // its F16 scale, then 32 int8 (ggml's block_q8_0)

// The bytes of a head's slice of a cache row of dk values
template <ggml_type T>
constexpr int row_bytes(int dk) {
    return T == GGML_TYPE_F16 ? 2 * dk : dk / Q8_0_BLOCK * Q8_0_BYTES;
}

// Values d..d+7 of a cache row (d a multiple of 8) in F32: F16 converted, Q8_0 dequantized (exact)
template <ggml_type T>
inline __m256 load8(const char * row, int d) {
    if constexpr (T == GGML_TYPE_F16) {
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) ((const ggml_fp16_t *) row + d)));
    } else {
        const char * block = row + d / Q8_0_BLOCK * Q8_0_BYTES;
        const __m256 scale = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *) block));
        const __m128i q = _mm_loadl_epi64((const __m128i *) (block + 2 + d % Q8_0_BLOCK));
        return _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
}

// scores[h * SCORES + i] = q_h . k_{pos[i]} * scale + mask, for the G heads of one KV head and the n visible
// positions.
// The cache is cold here (a decode step streams the weights through the caches between two attentions): the K rows
// are prefetched 8 positions ahead and each V row as its K row is read, so the V pass finds them in cache.
template <int G, ggml_type KT, ggml_type VT>
void scores_of(const float * const q[], const char * k, size_t k_stride, const char * v, size_t v_stride,
               const int32_t * pos, const float * mask, int64_t n, int dk, float scale, float * scores) {
    constexpr int64_t AHEAD = 32;
    for (int64_t i = 0; i < n && i < AHEAD; i++) {
        prefetch_row(k + pos[i] * k_stride, row_bytes<KT>(dk));
    }
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            prefetch_row(k + pos[i + AHEAD] * k_stride, row_bytes<KT>(dk));
        }
        prefetch_row(v + pos[i] * v_stride, row_bytes<VT>(dk));
        const char * kr = k + pos[i] * k_stride;
        __m256 acc[G];
        for (int h = 0; h < G; h++) {
            acc[h] = _mm256_setzero_ps();
        }
        for (int d = 0; d < dk; d += 8) {
            const __m256 kf = load8<KT>(kr, d);
            for (int h = 0; h < G; h++) {
                acc[h] = _mm256_fmadd_ps(kf, _mm256_loadu_ps(q[h] + d), acc[h]);
            }
        }
        for (int h = 0; h < G; h++) {
            scores[h * SCORES + i] = hsum(acc[h]) * scale + mask[i];
        }
    }
}

// out[h][0..dv) = sum over i of p[h * SCORES + i] * v_{pos[i]}, in F32, 16 dimensions at a time for all G heads. The
// positions go in tiles of TILE: each tile's V rows are read from memory once (prefetched while the tile before is
// computed) and used for every 16 dimensions while they are in L1; the accumulators wait in `out` between tiles
// (stored and loaded unchanged: each output is the same chain of multiply-adds over i = 0..n-1 as without tiles).
template <int G, ggml_type VT>
void weighted_values(const float * p, const char * v, size_t v_stride, const int32_t * pos, int64_t n, int dv,
                     float * out) {
    const int vbytes = row_bytes<VT>(dv);
    if (n == 0) {
        std::fill(out, out + G * MAX_DIM, 0.0f);
    }
    for (int64_t i = 0; i < n && i < TILE; i++) {
        prefetch_row(v + pos[i] * v_stride, vbytes);
    }
    for (int64_t i0 = 0; i0 < n; i0 += TILE) {
        const int64_t i1 = std::min(n, i0 + TILE);
        for (int64_t i = i1; i < n && i < i1 + TILE; i++) {
            prefetch_row(v + pos[i] * v_stride, vbytes);
        }
        for (int d = 0; d < dv; d += 16) {
            const bool two = d + 8 < dv;
            __m256 lo[G];
            __m256 hi[G];
            for (int h = 0; h < G; h++) {
                lo[h] = i0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(out + h * MAX_DIM + d);
                hi[h] = i0 == 0 || !two ? _mm256_setzero_ps() : _mm256_load_ps(out + h * MAX_DIM + d + 8);
            }
            for (int64_t i = i0; i < i1; i++) {
                const char * vr = v + pos[i] * v_stride;
                const __m256 v0 = load8<VT>(vr, d);
                const __m256 v1 = two ? load8<VT>(vr, d + 8) : _mm256_setzero_ps();
                for (int h = 0; h < G; h++) {
                    const __m256 w = _mm256_broadcast_ss(p + h * SCORES + i);
                    lo[h] = _mm256_fmadd_ps(w, v0, lo[h]);
                    hi[h] = _mm256_fmadd_ps(w, v1, hi[h]);
                }
            }
            for (int h = 0; h < G; h++) {
                _mm256_store_ps(out + h * MAX_DIM + d, lo[h]);
                if (two) {
                    _mm256_store_ps(out + h * MAX_DIM + d + 8, hi[h]);
                }
            }
        }
    }
}

#if defined(__AVX512F__)
// The AVX-512 kernel (where the build has it, for head sizes a multiple of 16; RAPIDMOE_FA_DECODE=avx2 keeps the
// loops above): 16 dimensions a register, 8-16 dot products in flight in pass 1 and the weighted V rows for several
// queries and 16-column chunks at once in pass 3, so neither pass waits on one chain of multiply-adds. Timed alone
// on Qwen3-MoE-shaped layers with a cold cache (one thread, Xeon with AVX-512): 1.8-2.8x the speed of the AVX2 loops
// as they were before pass 3 took tiles, at 4k-16k positions; equal to them to float rounding, not bit for bit
// (16-lane sums), and the same bits however the work is cut (each score and sum one fixed chain of operations).

// Values d..d+15 of a cache row (d a multiple of 16) in F32: F16 converted, Q8_0 dequantized (exact)
template <ggml_type T>
inline __m512 load16(const char * row, int d) {
    if constexpr (T == GGML_TYPE_F16) {
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) ((const ggml_fp16_t *) row + d)));
    } else {
        const char * block = row + d / Q8_0_BLOCK * Q8_0_BYTES;
        const __m512 scale = _mm512_set1_ps(_cvtsh_ss(*(const uint16_t *) block));
        const __m128i q = _mm_loadu_si128((const __m128i *) (block + 2 + d % Q8_0_BLOCK));
        return _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
    }
}

// Values d..d+31 of a Q8_0 cache row (d a multiple of 32: one block) in F32, dequantized (exact) into lo and hi
inline void load32_q8(const char * row, int d, __m512 & lo, __m512 & hi) {
    const char * block = row + d / Q8_0_BLOCK * Q8_0_BYTES;
    const __m512 scale = _mm512_set1_ps(_cvtsh_ss(*(const uint16_t *) block));
    const __m128i q0 = _mm_loadu_si128((const __m128i *) (block + 2));
    const __m128i q1 = _mm_loadu_si128((const __m128i *) (block + 2 + 16));
    lo = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
    hi = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
}

// Lane j of the result: the sum of a[j]'s 16 lanes (halves added, then a transposing tree of horizontal adds)
inline __m256 hsum8(const __m512 a[8]) {
    __m256 s[8];
    for (int j = 0; j < 8; j++) {
        const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j]), 1));
        s[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]), hi);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// A Q8_0 K cache with integer dot products (VNNI), where converting each K value to F32 made pass 1 compute-bound
// (at 16k positions, 2 threads, Xeon: 8.5 GB/s against an F16 cache's 13; tools/fa_cost.py). The queries are
// quantized once per work item as llama.cpp's kernel quantizes its query for a Q8_0 K (blocks of 32, scale
// max|x| / 127, rounded to nearest even), the scale kept in F32; a K row's 64 values (two blocks) are then one
// 512-bit load and one vpdpbusd per query: K biased to unsigned (k + 128), the bias's share (128 times the query's
// sum over each lane's 4 values) taken off by starting the lane's sum from minus it, so each lane's integer is the
// exact dot product of its 4 values. A block's 8 lanes are then summed in integers (its exact dot product, whatever
// the order), and the score is one F32 chain over the blocks: s = fma(float(dot_b), K scale_b x query scale_b, s)
// for b = 0, 1, ..., then fma(s, scale, mask). Only the blocks' integer sums depend on how the work is cut (decode
// steps sum each dot across lanes, scores_of16; prompt tiles and 8 or more heads a KV head take 16 positions a
// register, scores_int_tiles), so every kernel gives a score the same bits.
struct QueriesQ8 {
    static constexpr int LANES = MAX_DIM / 4;   // a query's dpbusd lanes: 16 per 64 values
    alignas(64) int8_t q[MAX_DIM];             // the quantized values
    alignas(64) int32_t bias[LANES];           // -128 x the sum of each lane's 4 values
    float scale[MAX_DIM / Q8_0_BLOCK];         // each block's scale
    int32_t block_bias[MAX_DIM / Q8_0_BLOCK];  // -128 x the sum of each block's 32 values
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Quantizes dk values (a multiple of 64) of x into out
inline void quantize_query(const float * x, int dk, QueriesQ8 & out) {
    for (int b = 0; b < dk / Q8_0_BLOCK; b++) {
        const __m512 lo = _mm512_load_ps(x + b * Q8_0_BLOCK);
        const __m512 hi = _mm512_load_ps(x + b * Q8_0_BLOCK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float d = amax / 127.0f;
        const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, id));  // nearest even (the default rounding)
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, id));
        _mm_store_si128((__m128i *) (out.q + b * Q8_0_BLOCK), _mm512_cvtepi32_epi8(qlo));
        _mm_store_si128((__m128i *) (out.q + b * Q8_0_BLOCK + 16), _mm512_cvtepi32_epi8(qhi));
        out.scale[b] = d;
        out.block_bias[b] = 0;
        for (int l = 0; l < Q8_0_BLOCK / 4; l++) {
            const int8_t * v = out.q + b * Q8_0_BLOCK + 4 * l;
            out.bias[b * 8 + l] = -128 * (v[0] + v[1] + v[2] + v[3]);
            out.block_bias[b] += out.bias[b * 8 + l];
        }
    }
}

// A K row's values c * 64 .. c * 64 + 63 (blocks 2c and 2c + 1) as unsigned bytes (k + 128)
inline __m512i k_pair_biased(const char * row, int c) {
    const char * b0 = row + 2 * c * Q8_0_BYTES;
    const __m256i lo = _mm256_loadu_si256((const __m256i *) (b0 + 2));
    const __m256i hi = _mm256_loadu_si256((const __m256i *) (b0 + Q8_0_BYTES + 2));
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), _mm512_set1_epi8((char) 0x80));
}

// The block sums of 16 vpdpbusd results (lanes 0-7 one block's partial sums, 8-15 the next block's): lane a of even
// is the sum of x[a]'s lanes 0-7, of odd the sum of its lanes 8-15. Integer sums: exact, whatever their order.
inline void block_sums16(const __m512i x[16], __m512i & even, __m512i & odd) {
    __m512i y[8];
    for (int k = 0; k < 8; k++) {  // lanes (per 128 bits): x[2k]'s 0+2, x[2k+1]'s 0+2, x[2k]'s 1+3, x[2k+1]'s 1+3
        y[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(x[2 * k], x[2 * k + 1]),
                                _mm512_unpackhi_epi32(x[2 * k], x[2 * k + 1]));
    }
    __m512i z[4];
    for (int m = 0; m < 4; m++) {  // per 128 bits: the sums of x[4m..4m+3]'s 4 lanes there
        z[m] = _mm512_add_epi32(_mm512_unpacklo_epi64(y[2 * m], y[2 * m + 1]),
                                _mm512_unpackhi_epi64(y[2 * m], y[2 * m + 1]));
    }
    __m512i w[2];
    for (int h = 0; h < 2; h++) {  // 128-bit lanes: even x[8h..8h+3], odd x[8h..8h+3], even x[8h+4..], odd x[8h+4..]
        w[h] = _mm512_add_epi32(_mm512_shuffle_i32x4(z[2 * h], z[2 * h + 1], 0x88),
                                _mm512_shuffle_i32x4(z[2 * h], z[2 * h + 1], 0xDD));
    }
    even = _mm512_shuffle_i32x4(w[0], w[1], 0x88);
    odd = _mm512_shuffle_i32x4(w[0], w[1], 0xDD);
}

// block_sums16 of 8 results: lanes 0-7 the even block's sums of x[0..7], 8-15 the odd block's
inline __m512i block_sums8(const __m512i x[8]) {
    __m512i y[4];
    for (int k = 0; k < 4; k++) {
        y[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(x[2 * k], x[2 * k + 1]),
                                _mm512_unpackhi_epi32(x[2 * k], x[2 * k + 1]));
    }
    __m512i z[2];
    for (int m = 0; m < 2; m++) {
        z[m] = _mm512_add_epi32(_mm512_unpacklo_epi64(y[2 * m], y[2 * m + 1]),
                                _mm512_unpackhi_epi64(y[2 * m], y[2 * m + 1]));
    }
    const __m512i w = _mm512_add_epi32(_mm512_shuffle_i32x4(z[0], z[1], 0x88), _mm512_shuffle_i32x4(z[0], z[1], 0xDD));
    return _mm512_shuffle_i32x4(w, w, 0xD8);  // 128-bit lanes 0, 2, 1, 3
}

// Transposes 16 rows of 16 32-bit values: x[m] lane j = x[j] lane m before
inline void transpose16(__m512i x[16]) {
    __m512i t[16];
    for (int k = 0; k < 8; k++) {
        t[2 * k] = _mm512_unpacklo_epi32(x[2 * k], x[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(x[2 * k], x[2 * k + 1]);
    }
    __m512i u[16];  // u[4k + e], 128-bit lane L: value 4L + e of rows 4k..4k+3
    for (int k = 0; k < 4; k++) {
        u[4 * k + 0] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    for (int e = 0; e < 4; e++) {  // 128-bit lanes of u[e], u[4 + e], u[8 + e], u[12 + e] transposed
        const __m512i s0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44);
        const __m512i s1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
        const __m512i s2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
        const __m512i s3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
        x[0 + e] = _mm512_shuffle_i32x4(s0, s2, 0x88);
        x[4 + e] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
        x[8 + e] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        x[12 + e] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
    }
}

// Pass 1 with integer dots for NQ queries on one KV head (a prompt tile's, or a decode step's 8 or more query heads):
// 16 positions a step, their K values transposed (a 16 x 16 transposition of 4-value groups per 64 values) so that
// a register holds one 4-value group of the 16 positions and each query's group is broadcast to it: one vpdpbusd per
// 64 products and no horizontal sums, the 16 scores landing side by side as pass 1 stores them (scores_of16 takes
// each score's dot across lanes and sums them after: perf of a 512-row prompt batch at 4k cells had that half of the
// node). Each block's integer dot is exact however it is summed, and the F32 chain over blocks is scores_of16's: the
// same bits as it, so a row's scores do not depend on the kernel that took them.
template <int G, int R, ggml_type VT>
void scores_int_tiles(const QueriesQ8 * qs, const char * k, size_t k_stride, const char * v, size_t v_stride,
                      const int32_t * pos, const float * const * masks, int64_t n, int dk, float scale,
                      float * scores) {
    constexpr int NQ = G * R;
    constexpr int QB = 4;  // queries at a time
    static_assert(NQ % QB == 0, "whole groups of queries");
    constexpr int64_t AHEAD = 32;
    const int nb = dk / Q8_0_BLOCK;
    const int kbytes = row_bytes<GGML_TYPE_Q8_0>(dk);
    const int vbytes = row_bytes<VT>(dk);
    alignas(64) int32_t kt[MAX_DIM / 4 * 16];            // [4-value group][position], K biased to unsigned
    alignas(64) float ks[MAX_DIM / Q8_0_BLOCK * 16];     // [block][position], K's scales
    alignas(32) uint16_t sc[16];
    for (int64_t i = 0; i < n && i < AHEAD; i++) {
        prefetch_row(k + pos[i] * k_stride, kbytes);
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 16) {
        const char * kr[16];
        for (int j = 0; j < 16; j++) {
            const int64_t ij = std::min(i + j, n - 1);
            kr[j] = k + pos[ij] * k_stride;
            if (ij + AHEAD < n && i + j < n) {
                prefetch_row(k + pos[ij + AHEAD] * k_stride, kbytes);
            }
            if (i + j < TILE && i + j < n) {  // pass 3's first tile
                prefetch_row(v + pos[i + j] * v_stride, vbytes);
            }
        }
        for (int c = 0; c < dk / 64; c++) {
            __m512i x[16];
            for (int j = 0; j < 16; j++) {
                x[j] = k_pair_biased(kr[j], c);
            }
            transpose16(x);
            for (int m = 0; m < 16; m++) {
                _mm512_store_si512(kt + (c * 16 + m) * 16, x[m]);
            }
        }
        for (int b = 0; b < nb; b++) {
            for (int j = 0; j < 16; j++) {
                sc[j] = *(const uint16_t *) (kr[j] + b * Q8_0_BYTES);
            }
            _mm512_store_ps(ks + b * 16, _mm512_cvtph_ps(_mm256_load_si256((const __m256i *) sc)));
        }
        const __mmask16 keep = n - i >= 16 ? (__mmask16) 0xFFFF : (__mmask16) ((1u << (n - i)) - 1);
        for (int q0 = 0; q0 < NQ; q0 += QB) {
            __m512 sum[QB];
            for (auto & a : sum) {
                a = _mm512_setzero_ps();
            }
            for (int b = 0; b < nb; b++) {
                const __m512i * t = (const __m512i *) (kt + b * 8 * 16);
                const __m512 kscale = _mm512_load_ps(ks + b * 16);
                for (int h = 0; h < QB; h++) {
                    const QueriesQ8 & qh = qs[q0 + h];
                    const int32_t * qw = (const int32_t *) (qh.q + b * Q8_0_BLOCK);
                    __m512i a0 = _mm512_set1_epi32(qh.block_bias[b]);
                    __m512i a1 = _mm512_setzero_si512();
                    for (int u = 0; u < 8; u += 2) {
                        a0 = _mm512_dpbusd_epi32(a0, _mm512_load_si512(t + u), _mm512_set1_epi32(qw[u]));
                        a1 = _mm512_dpbusd_epi32(a1, _mm512_load_si512(t + u + 1), _mm512_set1_epi32(qw[u + 1]));
                    }
                    sum[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)),
                                             _mm512_mul_ps(kscale, _mm512_set1_ps(qh.scale[b])), sum[h]);
                }
            }
            for (int h = 0; h < QB; h++) {
                const int qq = q0 + h;
                const __m512 mv = _mm512_loadu_ps(masks[qq / G % R] + i);
                _mm512_mask_storeu_ps(scores + qq * SCORES + i, keep, _mm512_fmadd_ps(sum[h], vscale, mv));
            }
        }
    }
}

#endif

// Pass 1 as scores_of, for query vectors qq = (g * R + r) * G + h: head h of the G on each of KH adjacent KV heads
// (their slices of a cache row lie side by side: one stream of the row's bytes instead of KH strided ones), of R
// query rows (which share every K row read: a prompt batch's), the query's values at q + qq * MAX_DIM. P positions
// at a time, so that NA = G * R * KH * P (8 or 16) dot products are in flight; the last positions padded with the
// last one, whose extra scores are dropped (every score is the same chain of operations wherever it sits). Scores
// at scores[qq * SCORES + i], row r's mask values masks[r][i]. K rows are prefetched 32 positions ahead, the V rows of
// pass 3's first tile while K is read.
template <int G, int R, int KH, ggml_type KT, ggml_type VT>
void scores_of16(const float * q, const char * k, size_t k_stride, size_t k_head,
                 const char * v, size_t v_stride, size_t v_head, const int32_t * pos, const float * const * masks,
                 int64_t n, int dk, float scale, float * scores) {
    constexpr int RG = R * G;  // queries a KV head
    constexpr int NQ = RG * KH;
    constexpr int P = NQ >= 8 ? 1 : 8 / NQ;
    constexpr int NA = NQ * P;
    static_assert(NA == 8 || NA == 16, "8 or 16 accumulators");
    constexpr int64_t AHEAD = 32;
    const int kbytes = (int) ((KH - 1) * k_head) + row_bytes<KT>(dk);  // a position's bytes of the KH heads
    const int vbytes = (int) ((KH - 1) * v_head) + row_bytes<VT>(dk);
    for (int64_t i = 0; i < n && i < AHEAD; i++) {
        prefetch_row(k + pos[i] * k_stride, kbytes);
    }
    for (int64_t i = 0; i < n; i += P) {
        const char * kr[P];
        for (int j = 0; j < P; j++) {
            const int64_t ij = std::min(i + j, n - 1);
            kr[j] = k + pos[ij] * k_stride;
            if (ij + AHEAD < n) {
                prefetch_row(k + pos[ij + AHEAD] * k_stride, kbytes);
            }
            if (i + j < TILE && i + j < n) { // pass 3's first tile
                prefetch_row(v + pos[i + j] * v_stride, vbytes);
            }
        }
        __m512 acc[NA];
        for (auto & a : acc) {
            a = _mm512_setzero_ps();
        }
        {
            for (int d = 0; d < dk; d += 16) {
                for (int g = 0; g < KH; g++) {
                    __m512 kf[P];
                    for (int j = 0; j < P; j++) {
                        kf[j] = load16<KT>(kr[j] + g * k_head, d);
                    }
                    for (int rh = 0; rh < RG; rh++) {
                        const int qq = g * RG + rh;
                        const __m512 qv = _mm512_load_ps(q + qq * MAX_DIM + d);
                        for (int j = 0; j < P; j++) {
                            acc[qq * P + j] = _mm512_fmadd_ps(kf[j], qv, acc[qq * P + j]);
                        }
                    }
                }
            }
        }
        alignas(32) float dots[NA];
        for (int a = 0; a < NA; a += 8) {
            _mm256_store_ps(dots + a, hsum8(acc + a));
        }
        for (int j = 0; j < P && i + j < n; j++) {
            for (int qq = 0; qq < NQ; qq++) {
                scores[qq * SCORES + i + j] = dots[qq * P + j] * scale + masks[qq / G % R][i + j];
            }
        }
    }
}


#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// scores_of16 for a Q8_0 K with integer dots (VNNI; the queries quantized, qs): per 64 values one vpdpbusd per dot,
// each block's 8 lanes summed in integers (block_sums16/8: exact) and the F32 chain over blocks (QueriesQ8); 8 or
// more queries on one KV head by scores_int_tiles, the same bits. Its walk over the positions is scores_of16's,
// copied: a helper shared by both made GCC keep scores_of16's accumulators on the stack (an F16 prompt node 25 %
// slower, fa_cost pp512 at 4k).
template <int G, int R, int KH, ggml_type VT>
void scores_int_rows(const QueriesQ8 * qs, const char * k, size_t k_stride, size_t k_head, const char * v,
                     size_t v_stride, size_t v_head, const int32_t * pos, const float * const * masks, int64_t n,
                     int dk, float scale, float * scores) {
    constexpr ggml_type KT = GGML_TYPE_Q8_0;
    constexpr int RG = R * G;  // queries a KV head
    constexpr int NQ = RG * KH;
    constexpr int P = NQ >= 8 ? 1 : 8 / NQ;
    constexpr int NA = NQ * P;
    static_assert(NA == 8 || NA == 16, "8 or 16 accumulators");
    static_assert(KH * P <= 8, "the K scales of a step: two 64-bit registers");
    constexpr int64_t AHEAD = 32;
    const int kbytes = (int) ((KH - 1) * k_head) + row_bytes<KT>(dk);  // a position's bytes of the KH heads
    const int vbytes = (int) ((KH - 1) * v_head) + row_bytes<VT>(dk);
    if constexpr (KH == 1 && P == 1) {  // 8 or more queries on one KV head
        scores_int_tiles<G, R, VT>(qs, k, k_stride, v, v_stride, pos, masks, n, dk, scale, scores);
        return;
    }
    // dot a = (query qq, position j) = (a / P, a % P) takes the K scale of head g = qq / RG's slice of
    // position j, the (g * P + j)-th gathered; the query's scale of block b is qscale[b * 16 + a]
    alignas(64) float qscale[MAX_DIM / Q8_0_BLOCK * 16] = {};
    alignas(64) int32_t kidx_lanes[16] = {};
    for (int a = 0; a < NA; a++) {
        kidx_lanes[a] = a / P / RG * P + a % P;
        for (int b = 0; b < dk / Q8_0_BLOCK; b++) {
            qscale[b * 16 + a] = qs[a / P].scale[b];
        }
    }
    const __m512i kidx = _mm512_load_si512(kidx_lanes);
    for (int64_t i = 0; i < n && i < AHEAD; i++) {
        prefetch_row(k + pos[i] * k_stride, kbytes);
    }
    for (int64_t i = 0; i < n; i += P) {
        const char * kr[P];
        for (int j = 0; j < P; j++) {
            const int64_t ij = std::min(i + j, n - 1);
            kr[j] = k + pos[ij] * k_stride;
            if (ij + AHEAD < n) {
                prefetch_row(k + pos[ij + AHEAD] * k_stride, kbytes);
            }
            if (i + j < TILE && i + j < n) { // pass 3's first tile
                prefetch_row(v + pos[i + j] * v_stride, vbytes);
            }
        }
        alignas(64) float dots[16];
        __m512 sum = _mm512_setzero_ps();  // lane a: dot a (the first 8 lanes where NA = 8)
        for (int c = 0; c < dk / 64; c++) {
            __m512i dot[NA];
            for (int g = 0; g < KH; g++) {
                __m512i kb[P];
                for (int j = 0; j < P; j++) {
                    kb[j] = k_pair_biased(kr[j] + g * k_head, c);
                }
                for (int rh = 0; rh < RG; rh++) {
                    const int qq = g * RG + rh;
                    const __m512i qv = _mm512_load_si512(qs[qq].q + 64 * c);
                    const __m512i bias = _mm512_load_si512(qs[qq].bias + 16 * c);
                    for (int j = 0; j < P; j++) {
                        dot[qq * P + j] = _mm512_dpbusd_epi32(bias, kb[j], qv);
                    }
                }
            }
            __m512 weight[2];  // each dot's (K scale x query scale) of blocks 2c and 2c + 1
            for (int half = 0; half < 2; half++) {
                const int b = 2 * c + half;
                // the KH x P scales gathered in two 64-bit registers: 16-bit stores read back by one load
                // would wait for each store (no forwarding from several stores)
                uint64_t packed[2] = {0, 0};
                for (int g = 0; g < KH; g++) {
                    for (int j = 0; j < P; j++) {
                        const int at = g * P + j;
                        packed[at / 4] |= (uint64_t) *(const uint16_t *) (kr[j] + g * k_head + b * Q8_0_BYTES)
                                          << (16 * (at % 4));
                    }
                }
                const __m128i halves = _mm_set_epi64x((int64_t) packed[1], (int64_t) packed[0]);
                const __m512 kscale = _mm512_permutexvar_ps(
                    kidx, _mm512_cvtph_ps(_mm256_castsi128_si256(halves)));
                weight[half] = _mm512_mul_ps(kscale, _mm512_load_ps(qscale + b * 16));
            }
            if constexpr (NA == 16) {
                __m512i even;
                __m512i odd;
                block_sums16(dot, even, odd);
                sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(even), weight[0], sum);
                sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(odd), weight[1], sum);
            } else {
                const __m512 both = _mm512_cvtepi32_ps(block_sums8(dot));  // lanes 8-15: the odd block's
                sum = _mm512_fmadd_ps(both, weight[0], sum);
                sum = _mm512_fmadd_ps(_mm512_shuffle_f32x4(both, both, 0x4E), weight[1], sum);
            }
        }
        _mm512_store_ps(dots, sum);
        for (int j = 0; j < P && i + j < n; j++) {
            for (int qq = 0; qq < NQ; qq++) {
                const float mv = masks[qq / G % R][i + j];
                // one rounding, as scores_int_tiles' vector multiply-add
                scores[qq * SCORES + i + j] = std::fma(dots[qq * P + j], scale, mv);
            }
        }
    }
}
#endif

// Pass 3's accumulators for H queries x C 16-column chunks, query h's at out + h * MAX_DIM + d0: loaded from out
// (zero for a chunk's first tile), each output's next multiply-add (acc[h][c] += p[h * SCORES] x vv[c]), stored back
template <int H, int C>
inline void load_acc(__m512 (&acc)[H][C], const float * out, int d0, bool first) {
    for (int h = 0; h < H; h++) {
        for (int c = 0; c < C; c++) {
            acc[h][c] = first ? _mm512_setzero_ps() : _mm512_load_ps(out + h * MAX_DIM + d0 + 16 * c);
        }
    }
}

template <int H, int C>
inline void add_weighted(__m512 (&acc)[H][C], const float * p, const __m512 (&vv)[C]) {
    for (int h = 0; h < H; h++) {
        const __m512 w = _mm512_set1_ps(p[h * SCORES]);
        for (int c = 0; c < C; c++) {
            acc[h][c] = _mm512_fmadd_ps(w, vv[c], acc[h][c]);
        }
    }
}

template <int H, int C>
inline void store_acc(const __m512 (&acc)[H][C], float * out, int d0) {
    for (int h = 0; h < H; h++) {
        for (int c = 0; c < C; c++) {
            _mm512_store_ps(out + h * MAX_DIM + d0 + 16 * c, acc[h][c]);
        }
    }
}

// Pass 3 as weighted_values for the G query heads of each of KH adjacent KV heads: tiles of TILE positions (the next
// tile's rows prefetched, one a position), C 16-column chunks of a KV head's G accumulators at once (G * C <= 16
// registers); out[hh * MAX_DIM + d] for query head hh = g * G + h, each output the same chain over i = 0..n-1
template <int G, int KH, ggml_type VT, int C>
void weighted_values16(const float * p, const char * v, size_t v_stride, size_t v_head, const int32_t * pos,
                       int64_t n, int dv, float * out) {
    const int vbytes = (int) ((KH - 1) * v_head) + row_bytes<VT>(dv);
    if (n == 0) {
        std::fill(out, out + G * KH * MAX_DIM, 0.0f);
    }
    for (int64_t i0 = 0; i0 < n; i0 += TILE) {
        const int64_t i1 = std::min(n, i0 + TILE);
        // the next tile's rows, a few lines every position of every chunk (a burst of prefetches would stall): the
        // line `off` bytes into the next tile's row `row`
        const int64_t next_lines = (std::min(n, i1 + TILE) - i1) * ((vbytes + 63) / 64);
        const int64_t steps = (i1 - i0) * KH * (dv / (16 * C));
        const int per_step = (int) ((next_lines + steps - 1) / steps);
        int64_t row = i1;
        int off = 0;
        for (int g = 0; g < KH; g++) {
            const char * vg = v + g * v_head;
            const float * pg = p + g * G * SCORES;
            float * og = out + g * G * MAX_DIM;
            for (int d0 = 0; d0 < dv; d0 += 16 * C) {
                __m512 acc[G][C];
                load_acc(acc, og, d0, i0 == 0);
                for (int64_t i = i0; i < i1; i++) {
                    for (int j = 0; j < per_step && row < n && row < i1 + TILE; j++) {
                        _mm_prefetch(v + pos[row] * v_stride + off, _MM_HINT_T0);
                        off += 64;
                        if (off >= vbytes) {
                            off = 0;
                            row++;
                        }
                    }
                    const char * vr = vg + pos[i] * v_stride;
                    __m512 vv[C];
                    if constexpr (VT == GGML_TYPE_Q8_0 && C % 2 == 0) {
                        for (int c = 0; c < C; c += 2) {  // a block's two halves: its scale read once
                            load32_q8(vr, d0 + 16 * c, vv[c], vv[c + 1]);
                        }
                    } else {
                        for (int c = 0; c < C; c++) {
                            vv[c] = load16<VT>(vr, d0 + 16 * c);
                        }
                    }
                    add_weighted(acc, pg + i, vv);
                }
                store_acc(acc, og, d0);
            }
        }
    }
}

// Pass 3 for a prompt tile's queries on one KV head (G of them, 8 or more: sets of heads of several rows), dv a
// multiple of 64: each tile's TILE V rows converted to F32 once, into a buffer that stays in L1, then QB queries x CB
// 16-column chunks at a time (16 accumulators; per position QB broadcast weights and CB loads for 16 multiply-adds),
// so that any number of queries shares each conversion (weighted_values16 holds all G queries' accumulators of a
// chunk in registers: at most 16). Each output the same chain over i = 0..n-1 as weighted_values16's: the same bits.
template <int G, ggml_type VT>
void weighted_values16_many(const float * p, const char * v, size_t v_stride, const int32_t * pos, int64_t n, int dv,
                            float * out) {
    constexpr int QB = 4;
    constexpr int CB = 4;
    static_assert(G % QB == 0, "whole groups of queries");
    const int vbytes = row_bytes<VT>(dv);
    if (n == 0) {
        std::fill(out, out + G * MAX_DIM, 0.0f);
    }
    alignas(64) float vf[TILE * MAX_DIM];
    for (int64_t i0 = 0; i0 < n; i0 += TILE) {
        const int64_t i1 = std::min(n, i0 + TILE);
        for (int64_t i = i0; i < i1; i++) {
            if (i + TILE < n) {
                prefetch_row(v + pos[i + TILE] * v_stride, vbytes);
            }
            const char * vr = v + pos[i] * v_stride;
            float * row = vf + (i - i0) * MAX_DIM;
            for (int d = 0; d < dv; d += 32) {
                __m512 lo;
                __m512 hi;
                if constexpr (VT == GGML_TYPE_Q8_0) {
                    load32_q8(vr, d, lo, hi);
                } else {
                    lo = load16<VT>(vr, d);
                    hi = load16<VT>(vr, d + 16);
                }
                _mm512_store_ps(row + d, lo);
                _mm512_store_ps(row + d + 16, hi);
            }
        }
        for (int h0 = 0; h0 < G; h0 += QB) {
            const float * ph = p + h0 * SCORES;
            for (int d0 = 0; d0 < dv; d0 += 16 * CB) {
                __m512 acc[QB][CB];
                load_acc(acc, out + h0 * MAX_DIM, d0, i0 == 0);
                for (int64_t i = i0; i < i1; i++) {
                    const float * row = vf + (i - i0) * MAX_DIM + d0;
                    __m512 vv[CB];
                    for (int c = 0; c < CB; c++) {
                        vv[c] = _mm512_load_ps(row + 16 * c);
                    }
                    add_weighted(acc, ph + i, vv);
                }
                store_acc(acc, out + h0 * MAX_DIM, d0);
            }
        }
    }
}

// weighted_values16 with the most chunks at once (up to 16 / G) that divide dv's 16-column chunks (G here: the queries
// of one KV head, a set of heads of each of R rows); more than 16 queries on one KV head by weighted_values16_many
template <int G, int KH, ggml_type VT>
void weighted_values16_any(const float * p, const char * v, size_t v_stride, size_t v_head, const int32_t * pos,
                           int64_t n, int dv, float * out) {
    if constexpr (G > 16) {
        static_assert(KH == 1, "more than 16 queries: on one KV head");
        if (dv % 64 != 0) {
            GGML_ABORT("rapidmoe_flash_attn_decode: more than 16 queries need a head size multiple of 64");
        }
        weighted_values16_many<G, VT>(p, v, v_stride, pos, n, dv, out);
        return;
    }
    constexpr int CMAX = G >= 16 ? 1 : G >= 8 ? 2 : G == 4 ? 4 : 8;
    const int chunks = dv / 16;
    if (CMAX >= 8 && chunks % 8 == 0) {
        weighted_values16<G, KH, VT, CMAX >= 8 ? 8 : 1>(p, v, v_stride, v_head, pos, n, dv, out);
    } else if (CMAX >= 4 && chunks % 4 == 0) {
        weighted_values16<G, KH, VT, CMAX >= 4 ? 4 : 1>(p, v, v_stride, v_head, pos, n, dv, out);
    } else if (CMAX >= 2 && chunks % 2 == 0) {
        weighted_values16<G, KH, VT, CMAX >= 2 ? 2 : 1>(p, v, v_stride, v_head, pos, n, dv, out);
    } else {
        weighted_values16<G, KH, VT, 1>(p, v, v_stride, v_head, pos, n, dv, out);
    }
}

// The visible cells c0..c1-1 of a mask row (!= -INFINITY, as the scalar loop) and their mask values, 16 cells at a
// time; pos and pos_mask have room for c1 - c0 + 16. Returns their count.
inline int64_t visible16(const ggml_fp16_t * mp, int64_t c0, int64_t c1, int32_t * pos, float * pos_mask) {
    int64_t count = 0;
    const __m512 drop = _mm512_set1_ps(-INFINITY);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t ic = c0;
    for (; ic + 16 <= c1; ic += 16) {
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (mp + ic)));
        const __mmask16 keep = _mm512_cmp_ps_mask(mv, drop, _CMP_NEQ_UQ);
        const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int32_t) ic), iota);
        // compressed in registers, stored whole (a compressing store is microcoded on some cores)
        _mm512_storeu_si512(pos + count, _mm512_maskz_compress_epi32(keep, idx));
        _mm512_storeu_ps(pos_mask + count, _mm512_maskz_compress_ps(keep, mv));
        count += __builtin_popcount((unsigned) keep);
    }
    for (; ic < c1; ic++) {
        const float mv = _cvtsh_ss(mp[ic]);
        if (mv != -INFINITY) {
            pos[count] = (int32_t) ic;
            pos_mask[count] = mv;
            count++;
        }
    }
    return count;
}
#endif

// The visible cells c0..c1-1 of query row t of stream i3 (its mask row: one for all heads; every cell without a
// mask) into pos and their mask values into pos_mask, both with room for c1 - c0 + 16; returns their count
inline int64_t visible_of(const ggml_tensor * mask, int64_t c0, int64_t c1, int64_t i3, int64_t t, bool wide,
                          std::vector<int32_t> & pos, std::vector<float> & pos_mask) {
    pos.resize((size_t) (c1 - c0) + 16);
    pos_mask.resize((size_t) (c1 - c0) + 16);
    if (mask == nullptr) {
        for (int64_t ic = c0; ic < c1; ic++) {
            pos[ic - c0] = (int32_t) ic;
            pos_mask[ic - c0] = 0.0f;
        }
        return c1 - c0;
    }
    const auto * mp = (const ggml_fp16_t *) ((const char *) mask->data + t * mask->nb[1] +
                                             (i3 % mask->ne[3]) * mask->nb[3]);
#if defined(__AVX512F__)
    if (wide) {
        return visible16(mp, c0, c1, pos.data(), pos_mask.data());
    }
#else
    (void) wide;
#endif
    int64_t n = 0;
    for (int64_t ic = c0; ic < c1; ic++) {
        const float mv = _cvtsh_ss(mp[ic]);  // F16C inline: ggml_fp16_to_fp32 is a call
        if (mv != -INFINITY) {
            pos[n] = (int32_t) ic;
            pos_mask[n] = mv;
            n++;
        }
    }
    return n;
}

// A row's attention is computed in chunks of CELLS cache cells, each chunk's softmax and weighted V rows on their
// own (its largest score m, the sum s of exp(score - m), the unnormalized sum of weighted V rows), folded in order:
// a decode step's chunks are spread over the threads (at depth each thread then reads whole cache rows, one stream,
// where a cut by KV heads read every row in interleaved pieces: 1.4x at 16k positions, tools/fa_cost.py) and folded
// after a barrier, a prompt tile's are folded as they are computed. The chunks are fixed cells, not a share of a
// thread count or of the cache's size, and the fold's order is fixed: a row gets the same bits whatever the threads,
// the batch or the cache's length around it.
constexpr int64_t CELLS = SCORES;

// A chunk's (or the chunks before it, folded) result for the queries of a work item: their maxima m, sums s and
// unnormalized outputs o (MAX_DIM apart), laid out as one block of floats so a thread can hand it to another
struct Partial {
    static constexpr int MAX_Q = 64;  // 16 with F32 dots (scores_of16's registers), 64 with scores_int_tiles
    float m[MAX_Q];
    float s[MAX_Q];
    alignas(64) float o[MAX_Q * MAX_DIM];
};

// The calling thread's Partials: [0] a chunk's result, [1] the chunks folded so far, [2] a split decode step's fold.
// On the heap, one set a thread: a thread_local Partial in each kernel instantiation would put megabytes into the
// library's static TLS, which glibc places on every thread's stack (an OpenMP worker's overflowed).
inline Partial * thread_partials() {
    static thread_local std::unique_ptr<Partial[]> partials(new Partial[3]);
    return partials.get();
}

// Folds query qq's chunk result `c` into the running result `run` of the chunks before it: the first chunk with a
// visible cell is taken as it is (a row whose cells fit one chunk gets the bits of a single pass), a chunk without
// one (s = 0) leaves it unchanged
inline void fold(const Partial & c, int qq, int dv, Partial & run) {
    const float s = c.s[qq];
    if (s == 0.0f) {
        return;
    }
    float * o = run.o + qq * MAX_DIM;
    const float * co = c.o + qq * MAX_DIM;
    if (run.s[qq] == 0.0f) {
        run.m[qq] = c.m[qq];
        run.s[qq] = s;
        std::memcpy(o, co, dv * sizeof(float));
        return;
    }
    const float mx = std::max(run.m[qq], c.m[qq]);
    const float a = std::exp(run.m[qq] - mx);
    const float b = std::exp(c.m[qq] - mx);
    for (int d = 0; d < dv; d += 8) {
        _mm256_store_ps(o + d, _mm256_fmadd_ps(_mm256_load_ps(o + d), _mm256_set1_ps(a),
                                               _mm256_mul_ps(_mm256_load_ps(co + d), _mm256_set1_ps(b))));
    }
    run.m[qq] = mx;
    run.s[qq] = run.s[qq] * a + s * b;
}

// dst's rows for an item's queries (as kv_heads numbers them) from their folded result: o / s (0 where no cell is
// visible)
template <int G, int R, int KH>
void write_rows(const ggml_tensor * dst, int64_t i3, int64_t t0, int64_t h0, int64_t rows, const Partial & run,
                int nq = R * G * KH) {
    constexpr int RG = R * G;
    const int dv = (int) dst->ne[0];
    for (int qq = 0; qq < nq; qq++) {
        const int64_t r = qq / G % R;
        if (r >= rows) {
            continue;
        }
        const int64_t head = h0 + qq / RG * G + qq % G;
        const float inv = run.s[qq] == 0.0f ? 0.0f : 1.0f / run.s[qq];
        auto * row = (float *) ((char *) dst->data + head * dst->nb[1] + (t0 + r) * dst->nb[2] + i3 * dst->nb[3]);
        for (int d = 0; d < dv; d++) {
            row[d] = run.o[qq * MAX_DIM + d] * inv;
        }
    }
}

// Query rows t0..t0+R-1 of stream i3 (a sequence's own cache when llama.cpp keeps one per sequence; rows past the
// batch's end are computed as its last and not written), heads h0..h0+G*KH-1 of each: G on each of the KV heads
// g0..g0+KH-1. `wide`: the AVX-512 kernel (R or KH > 1 only there). chunk < 0: every chunk of cells, folded, the
// rows written to dst; chunk >= 0 (one row): that chunk's result into *part, for the caller to fold.
// With R > 1 the rows share each pass over a chunk's cells: the cells the longest row sees, which must begin with
// the cells every other row sees (a causal batch appended to a sequence's cells); each row's softmax and weighted
// sum still run over its own cells only, so a row gets the bits it gets alone. Returns false, writing nothing, where
// the rows' cells are not so nested (the caller then takes them one at a time).
template <int G, int R, int KH, ggml_type KT, ggml_type VT>
bool kv_heads(const ggml_tensor * dst, int64_t i3, int64_t t0, int64_t g0, int64_t h0, float scale, bool wide,
              int64_t chunk, Partial * part) {
    constexpr int RG = R * G;
    constexpr int NQ = RG * KH;
    static_assert(NQ <= Partial::MAX_Q, "queries of an item");
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    const ggml_tensor * mask = dst->src[3];
    const int64_t n_kv = k->ne[1];
    const int dk = (int) k->ne[0];
    const int dv = (int) v->ne[0];
    const int64_t rows = std::min<int64_t>(R, q->ne[1] - t0);
    GGML_ASSERT(chunk < 0 || R == 1);
    const char * kg = (const char *) k->data + g0 * k->nb[2] + i3 * k->nb[3];
    const char * vg = (const char *) v->data + g0 * v->nb[2] + i3 * v->nb[3];
    // query vector qq = (g * R + r) * G + h: row t0 + r, head h0 + g * G + h
    auto query = [&](int qq) {
        const int64_t r = std::min<int64_t>(qq / G % R, rows - 1);
        const int64_t head = h0 + qq / RG * G + qq % G;
        return (const float *) ((const char *) q->data + (t0 + r) * q->nb[1] + head * q->nb[2] + i3 * q->nb[3]);
    };
#if defined(__AVX512F__)
    // the queries side by side in one buffer: one base register for all of them (16 pointers would spill)
    alignas(64) float qbuf[NQ * MAX_DIM];
    if (wide) {
        for (int qq = 0; qq < NQ; qq++) {
            std::memcpy(qbuf + qq * MAX_DIM, query(qq), dk * sizeof(float));
        }
    }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const bool int_dots = wide && KT == GGML_TYPE_Q8_0 && dk % 64 == 0;
    QueriesQ8 qs[NQ];
    if (int_dots) {
        for (int qq = 0; qq < NQ; qq++) {
            quantize_query(qbuf + qq * MAX_DIM, dk, qs[qq]);
        }
    }
#endif
#endif
    const float * qh[G];
    for (int h = 0; h < G; h++) {
        qh[h] = query(h);
    }
    // each row's visible cells of the chunk (masked and padded cells cost nothing), the longest row's for all
    static thread_local std::vector<int32_t> pos[R];
    static thread_local std::vector<float> pos_mask[R];
    static thread_local std::vector<float> scores;
    Partial & cur = thread_partials()[0];
    Partial & run = thread_partials()[1];
    Partial & res = chunk >= 0 ? *part : cur;
    for (int qq = 0; qq < NQ; qq++) {
        run.s[qq] = 0.0f;
    }
    const int64_t n_chunks = (n_kv + CELLS - 1) / CELLS;
    for (int64_t c = std::max<int64_t>(chunk, 0); c < (chunk >= 0 ? chunk + 1 : n_chunks); c++) {
        const int64_t c0 = c * CELLS;
        const int64_t c1 = std::min(n_kv, c0 + CELLS);
        int64_t n_row[R];
        int longest = 0;
        for (int r = 0; r < rows; r++) {
            n_row[r] = visible_of(mask, c0, c1, i3, t0 + r, wide, pos[r], pos_mask[r]);
            longest = n_row[r] > n_row[longest] ? r : longest;
        }
        const int64_t n = n_row[longest];
        const float * masks[R];
        for (int r = 0; r < R; r++) {
            const int rr = (int) std::min<int64_t>(r, rows - 1);
            if (r < rows && r != longest) {
                if (std::memcmp(pos[r].data(), pos[longest].data(), n_row[r] * sizeof(int32_t)) != 0) {
                    return false;
                }
                std::fill(pos_mask[r].begin() + n_row[r], pos_mask[r].begin() + n, -INFINITY); // seen by others only
            }
            n_row[r] = n_row[rr];
            masks[r] = pos_mask[rr].data();
        }
        const int32_t * ps = pos[longest].data();
        scores.resize((size_t) NQ * SCORES);
        if (n > 0) {
#if defined(__AVX512F__)
            if (wide) {
                if constexpr (NQ > 16) {  // only with integer dots (cut_of)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
                    GGML_ASSERT(int_dots);
                    scores_int_tiles<G, R, VT>(qs, kg, k->nb[1], vg, v->nb[1], ps, masks, n, dk, scale,
                                               scores.data());
#endif
                } else {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
                    if (int_dots) {
                        scores_int_rows<G, R, KH, VT>(qs, kg, k->nb[1], k->nb[2], vg, v->nb[1], v->nb[2], ps, masks,
                                                      n, dk, scale, scores.data());
                    } else
#endif
                    scores_of16<G, R, KH, KT, VT>(qbuf, kg, k->nb[1], k->nb[2], vg, v->nb[1], v->nb[2], ps, masks, n,
                                                  dk, scale, scores.data());
                }
            } else
#endif
            if constexpr (R == 1 && KH == 1) {
                scores_of<G, KT, VT>(qh, kg, k->nb[1], vg, v->nb[1], ps, masks[0], n, dk, scale, scores.data());
            } else {
                GGML_ABORT("rapidmoe_flash_attn_decode: rows or KV heads taken together without the AVX-512 kernel");
            }
        }
        for (int qq = 0; qq < NQ; qq++) {
            float * sc = scores.data() + qq * SCORES;
            const int64_t nr = n_row[qq / G % R];
            res.m[qq] = max_of(sc, nr);
            // exp(s - m) in place and its sum over the row's own cells: ggml's vectorized softmax step (llama.cpp's
            // SOFT_MAX uses it), not a scalar std::exp per score (profiled on the bench model, pp512: a quarter of
            // the attention's time); the cells only other rows see weigh 0 in pass 3; a chunk without cells sums to 0
            res.s[qq] = nr > 0 ? (float) ggml_vec_soft_max_f32((int) nr, sc, sc, res.m[qq]) : 0.0f;
            std::fill(sc + nr, sc + n, 0.0f);
        }
#if defined(__AVX512F__)
        if (wide) {
            weighted_values16_any<RG, KH, VT>(scores.data(), vg, v->nb[1], v->nb[2], ps, n, dv, res.o);
        } else
#endif
        if constexpr (R == 1 && KH == 1) {
            weighted_values<G, VT>(scores.data(), vg, v->nb[1], ps, n, dv, res.o);
        }
        if (chunk < 0) {
            for (int qq = 0; qq < NQ; qq++) {
                fold(res, qq, dv, run);
            }
        }
    }
    if (chunk < 0) {
        write_rows<G, R, KH>(dst, i3, t0, h0, rows, run);
    }
    return true;
}

using kv_heads_fn = bool (*)(const ggml_tensor *, int64_t, int64_t, int64_t, int64_t, float, bool, int64_t,
                             Partial *);

#if defined(__AVX512F__)
// The queries an item of R rows' sets of G heads may hold: 16 (scores_of16's accumulators), Partial::MAX_Q on one KV
// head with a Q8_0 K where the build has integer dots (scores_int_tiles, weighted_values16_many)
template <ggml_type KT>
constexpr int max_queries(int kh) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return KT == GGML_TYPE_Q8_0 && kh == 1 ? Partial::MAX_Q : 16;
#else
    return 16;
#endif
}
#endif

template <int G, ggml_type KT, ggml_type VT>
kv_heads_fn kv_heads_of(int64_t rows, int64_t kh) {
#if defined(__AVX512F__)
    switch (rows * 32 + kh) {
        case 1 * 32 + 2: if constexpr (G * 2 <= 16) { return kv_heads<G, 1, 2, KT, VT>; } break;
        case 1 * 32 + 4: if constexpr (G * 4 <= 16) { return kv_heads<G, 1, 4, KT, VT>; } break;
        case 2 * 32 + 1: if constexpr (G * 2 <= max_queries<KT>(1)) { return kv_heads<G, 2, 1, KT, VT>; } break;
        case 4 * 32 + 1: if constexpr (G * 4 <= max_queries<KT>(1)) { return kv_heads<G, 4, 1, KT, VT>; } break;
        case 8 * 32 + 1: if constexpr (G * 8 <= max_queries<KT>(1)) { return kv_heads<G, 8, 1, KT, VT>; } break;
        case 16 * 32 + 1: if constexpr (G * 16 <= max_queries<KT>(1)) { return kv_heads<G, 16, 1, KT, VT>; } break;
        default: break;
    }
#endif
    return rows == 1 && kh == 1 ? kv_heads<G, 1, 1, KT, VT> : nullptr;
}

template <ggml_type KT, ggml_type VT>
kv_heads_fn kv_heads_of_types(int64_t set, int64_t rows, int64_t kh) {
    switch (set) {
        case 1: return kv_heads_of<1, KT, VT>(rows, kh);
        case 2: return kv_heads_of<2, KT, VT>(rows, kh);
        case 4: return kv_heads_of<4, KT, VT>(rows, kh);
        case 8: return kv_heads_of<8, KT, VT>(rows, kh);
        default: return nullptr;
    }
}

// The kernel for sets of `set` query heads on `kh` adjacent KV heads and `rows` query rows, over a K and a V cache of
// these types (F16 or Q8_0 each); nullptr for a combination not compiled
kv_heads_fn kv_heads_for(int64_t set, int64_t rows, int64_t kh, ggml_type kt, ggml_type vt) {
    const bool k16 = kt == GGML_TYPE_F16;
    const bool v16 = vt == GGML_TYPE_F16;
    return k16 ? (v16 ? kv_heads_of_types<GGML_TYPE_F16, GGML_TYPE_F16>(set, rows, kh)
                      : kv_heads_of_types<GGML_TYPE_F16, GGML_TYPE_Q8_0>(set, rows, kh))
               : (v16 ? kv_heads_of_types<GGML_TYPE_Q8_0, GGML_TYPE_F16>(set, rows, kh)
                      : kv_heads_of_types<GGML_TYPE_Q8_0, GGML_TYPE_Q8_0>(set, rows, kh));
}

// How a work item is cut, for the AVX-512 kernel (`wide`; else one query row on one KV head): a decode step's
// adjacent KV heads read as one stream (up to 16 / G query heads' worth, as many as still leave each thread an
// item, counting a split decode step's chunks: at depth a thread then reads whole cache rows), a prompt batch's
// query rows sharing each pass over the cache (up to 16 of them and 16 / G, 64 / G with integer dots, as many as
// still leave each thread an item).
// With more than MAX_GROUP query heads a KV head, one set.
struct Cut {
    int64_t rows = 1;
    int64_t kh = 1;
};

Cut cut_of(const ggml_tensor * q, const ggml_tensor * k, const ggml_tensor * v, int64_t group, int nth, bool wide,
           int64_t chunks) {
    Cut c;
    const int64_t n_head_kv = k->ne[2];
    const bool side_by_side = k->nb[2] == ggml_row_size(k->type, k->ne[0]) &&
                              v->nb[2] == ggml_row_size(v->type, v->ne[0]);
    if (!wide || group > MAX_GROUP) {
        return c;
    }
    if (q->ne[1] > 1) {
        // up to 64 queries with integer dots (kv_heads' int_dots): each K and V row then read for 4x the queries
        const int64_t most = k->ne[0] % 64 != 0 ? 16
                           : k->type == GGML_TYPE_Q8_0 ? max_queries<GGML_TYPE_Q8_0>(1) : max_queries<GGML_TYPE_F16>(1);
        for (int64_t rows = 16; rows > 1; rows /= 2) {
            const int64_t tiles = (q->ne[1] + rows - 1) / rows;
            if (group * rows <= most && rows <= q->ne[1] && q->ne[3] * tiles * n_head_kv >= nth) {
                c.rows = rows;
                return c;
            }
        }
        return c;
    }
    for (int64_t kh = 4; kh > 1 && side_by_side; kh /= 2) {
        if (group * kh <= 16 && n_head_kv % kh == 0 && q->ne[3] * (n_head_kv / kh) * chunks >= nth) {
            c.kh = kh;
            return c;
        }
    }
    return c;
}

// A cache type the kernel reads, and the row layout it expects of it (contiguous values or whole Q8_0 blocks)
bool kv_type_ok(const ggml_tensor * t) {
    if (t->type == GGML_TYPE_F16) {
        return t->nb[0] == sizeof(ggml_fp16_t);
    }
    return t->type == GGML_TYPE_Q8_0 && t->ne[0] % Q8_0_BLOCK == 0 && t->nb[0] == Q8_0_BYTES;
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
    const bool applies = rapidmoe_fa_decode_enabled() && q->type == GGML_TYPE_F32 && kv_type_ok(k) && kv_type_ok(v) &&
        k->ne[3] == q->ne[3] && v->ne[3] == q->ne[3] &&
        dst->src[4] == nullptr && softcap == 0.0f && max_bias == 0.0f && k->ne[0] == q->ne[0] &&
        v->ne[0] == k->ne[0] && k->ne[0] % 8 == 0 && k->ne[0] <= MAX_DIM && v->ne[2] == n_head_kv &&
        v->ne[1] == k->ne[1] && n_head_kv > 0 && n_head % n_head_kv == 0 &&
        ((n_head / n_head_kv) & (n_head / n_head_kv - 1)) == 0 &&  // a power of two query heads per KV head
        // at least one set of heads per thread
        q->ne[3] * q->ne[1] * n_head_kv * std::max<int64_t>(1, n_head / n_head_kv / MAX_GROUP) >= nth &&
        q->nb[0] == sizeof(float) && dst->nb[0] == sizeof(float) && dst->ne[0] == v->ne[0] &&
        dst->ne[1] == n_head && dst->ne[2] == q->ne[1] && dst->ne[3] == q->ne[3] &&
        (mask == nullptr || (mask->type == GGML_TYPE_F16 && mask->ne[0] >= k->ne[1] && mask->ne[1] >= q->ne[1] &&
                             mask->ne[2] == 1 && (mask->ne[3] == 1 || mask->ne[3] == q->ne[3])));
    if (!applies) {
        return false;
    }
    const int64_t group = n_head / n_head_kv;
    const int64_t set = std::min<int64_t>(group, MAX_GROUP); // query heads of one KV head taken together
#if defined(__AVX512F__)
    const bool wide = k->ne[0] % 16 == 0 && v->ne[0] % 16 == 0 && !rapidmoe_fa_decode_avx2_only();
#else
    const bool wide = false;
#endif
    // a decode step at depth: its chunks of cells spread over the threads, each thread's results handed over through
    // the node's work buffer (a pointer a thread) and folded after a barrier
    const int64_t n_chunks = (k->ne[1] + CELLS - 1) / CELLS;
    const bool split = q->ne[1] == 1 && nth > 1 && n_chunks > 1 && params->wdata != nullptr &&
                       params->wsize >= (size_t) nth * sizeof(Partial *);
    const Cut cut = cut_of(q, k, v, group, nth, wide, split ? n_chunks : 1);
    const int64_t sets = n_head / (set * cut.kh);             // items per tile of query rows
    const kv_heads_fn kernel = kv_heads_for(set, cut.rows, cut.kh, k->type, v->type);
    const kv_heads_fn one_row = kv_heads_for(set, 1, 1, k->type, v->type);
    if (kernel == nullptr || one_row == nullptr) {
        GGML_ABORT("rapidmoe_flash_attn_decode: %d query heads per KV head not checked", (int) group);
    }
    if (split) {
        const int64_t n_items = q->ne[3] * sets * n_chunks;   // item: (stream, set of heads, chunk)
        static thread_local std::vector<Partial> mine;         // this thread's items' results, in its order
        mine.resize((size_t) ((n_items + nth - 1) / nth));
        for (int64_t item = ith; item < n_items; item += nth) {
            const int64_t i3 = item / (sets * n_chunks);
            const int64_t h0 = item / n_chunks % sets * set * cut.kh;
            kernel(dst, i3, 0, h0 / group, h0, scale, wide, item % n_chunks, &mine[item / nth]);
        }
        auto ** handed = (Partial **) params->wdata;
        handed[ith] = mine.data();
        ggml_barrier(params->threadpool);
        Partial & run = thread_partials()[2];
        const int nq = (int) (set * cut.kh);
        for (int64_t task = ith; task < q->ne[3] * sets; task += nth) {  // task: (stream, set of heads)
            for (int qq = 0; qq < nq; qq++) {
                run.s[qq] = 0.0f;
            }
            for (int64_t c = 0; c < n_chunks; c++) {
                const int64_t item = task * n_chunks + c;
                const Partial & part = handed[item % nth][item / nth];
                for (int qq = 0; qq < nq; qq++) {
                    fold(part, qq, (int) v->ne[0], run);
                }
            }
            // a decode row's queries are numbered head by head (qq = g * set + h: head h0 + qq)
            write_rows<1, 1, 1>(dst, task / sets, 0, task % sets * nq, 1, run, nq);
        }
        return true;
    }
    const int64_t tiles = (q->ne[1] + cut.rows - 1) / cut.rows;
    const int64_t per_stream = tiles * sets;
    const int64_t n_items = q->ne[3] * per_stream;
    // work items (a tile of query rows' set of heads, on one KV head or kh side by side): a decode step's few are
    // dealt out, every nth to a thread; a prompt batch's are claimed as the threads go (the threadpool's chunk
    // counter, set before the threads meet), from the last tile back (the longest first), so a thread slowed by the
    // machine takes fewer of them. Either way each row's values do not depend on the thread or the item that takes it.
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
        const int64_t t0 = item % per_stream / sets * cut.rows;
        const int64_t h0 = item % sets * set * cut.kh;
        if (!kernel(dst, i3, t0, h0 / group, h0, scale, wide, -1, nullptr)) {
            for (int64_t t = t0; t < std::min(t0 + cut.rows, q->ne[1]); t++) { // rows not nested: one at a time
                one_row(dst, i3, t, h0 / group, h0, scale, wide, -1, nullptr);
            }
        }
    }
    return true;
#else
    (void) params;
    (void) dst;
    return false;
#endif
}
