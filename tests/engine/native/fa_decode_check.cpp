// Runs GGML_OP_FLASH_ATTN_EXT on the CPU backend for decode-shaped inputs (one query row per head, F16 or Q8_0 K/V
// cache laid out as llama.cpp's: each cache row holds every KV head's slice side by side; F16 mask with masked
// positions) and compares the output with a float64 reference computed from the same rounded inputs (the cache's
// values as ggml dequantizes them). Run by tests/engine/test_fa_decode.py with and without RAPIDMOE_FA_DECODE=0 (our kernel,
// patch 0011, or llama.cpp's). Prints "case NAME max_rel_err E" per case (the largest error over the case's
// outputs, relative to the largest output magnitude), for a Q8_0 K also "qcase NAME max_rel_err E" (against the
// reference on the query quantized as our kernel's integer dots quantize it), and "checked N".
#include "ggml.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

struct Case {
    const char * name;
    int dk, n_kv, n_head, n_head_kv, n_q, threads;
    float masked_share;  // share of cache positions masked out
    ggml_type kt = GGML_TYPE_F16, vt = GGML_TYPE_F16;  // the cache's types
    bool causal = false;  // row t sees the cells up to n_kv - n_q + t (those not masked out for all rows): a prompt
};

// t's values (rows of ne[0]) as F32, as ggml dequantizes them
static std::vector<float> values_of(const ggml_tensor * t) {
    std::vector<float> out(ggml_nelements(t));
    const int64_t rows = ggml_nrows(t);
    for (int64_t r = 0; r < rows; r++) {
        ggml_get_type_traits(t->type)->to_float((const char *) t->data + r * t->nb[1], out.data() + r * t->ne[0],
                                                t->ne[0]);
    }
    return out;
}

// The case's output [dk, n_head, n_q] (as F32 values) and its largest error relative to the reference's magnitude;
// `threads` overrides the case's
struct Result {
    std::vector<float> out;
    double rel_err;
    double alone_diff = 0.0;  // the largest difference between a row's outputs in the batch and computed alone
    double rel_err_quantized = 0.0;  // against the reference on the query quantized (a Q8_0 K cache only)
};

static Result run_case(const Case & c, std::mt19937 & rng, int threads = 0) {
    const size_t mem = 64u << 20;
    ggml_init_params ip = {mem, nullptr, false};
    ggml_context * ctx = ggml_init(ip);
    const int pad = 64;  // a mask's rows are padded (GGML_KQ_MASK_PAD)
    const int n_gqa = c.dk * c.n_head_kv;
    ggml_tensor * q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, c.dk, c.n_q, c.n_head, 1);
    // the cache: one row of n_gqa values a position, its view per KV head as llama.cpp's
    ggml_tensor * kc = ggml_new_tensor_2d(ctx, c.kt, n_gqa, c.n_kv);
    ggml_tensor * vc = ggml_new_tensor_2d(ctx, c.vt, n_gqa, c.n_kv);
    ggml_tensor * k = ggml_view_3d(ctx, kc, c.dk, c.n_kv, c.n_head_kv, kc->nb[1], ggml_row_size(c.kt, c.dk), 0);
    ggml_tensor * v = ggml_view_3d(ctx, vc, c.dk, c.n_kv, c.n_head_kv, vc->nb[1], ggml_row_size(c.vt, c.dk), 0);
    ggml_tensor * m = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, c.n_kv, GGML_PAD(c.n_q, pad), 1, 1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    auto * qd = (float *) q->data;
    for (int64_t i = 0; i < ggml_nelements(q); i++) {
        qd[i] = normal(rng);
    }
    std::vector<float> k32(ggml_nelements(kc));
    std::vector<float> v32(ggml_nelements(vc));
    for (size_t i = 0; i < k32.size(); i++) {
        k32[i] = normal(rng) * 2.0f;
        v32[i] = normal(rng);
    }
    ggml_quantize_chunk(c.kt, k32.data(), kc->data, 0, c.n_kv, n_gqa, nullptr);
    ggml_quantize_chunk(c.vt, v32.data(), vc->data, 0, c.n_kv, n_gqa, nullptr);
    const std::vector<float> kd = values_of(kc);  // [n_kv][n_gqa]
    const std::vector<float> vd = values_of(vc);
    auto * md = (ggml_fp16_t *) m->data;
    for (int64_t i = 0; i < ggml_nelements(m); i++) {
        md[i] = ggml_fp32_to_fp16(unit(rng) < c.masked_share ? -INFINITY : 0.0f);
    }
    if (c.causal) {
        for (int j = 0; j < c.n_kv; j++) {
            const bool hole = ggml_fp16_to_fp32(md[j]) == -INFINITY;  // row 0's draw: masked for every row
            for (int r = 0; r < c.n_q; r++) {
                const bool seen = !hole && j <= c.n_kv - c.n_q + r;
                md[(size_t) r * c.n_kv + j] = ggml_fp32_to_fp16(seen ? 0.0f : -INFINITY);
            }
        }
    }
    for (int r = 0; r < c.n_q; r++) {  // at least one visible position per query row
        md[(size_t) r * c.n_kv] = ggml_fp32_to_fp16(0.0f);
    }
    const float scale = 1.0f / std::sqrt((float) c.dk);
    ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, m, scale, 0.0f, 0.0f);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_graph_compute_with_ctx(ctx, gf, threads > 0 ? threads : c.threads);
    // out: [dk, n_head, n_q]
    // each row again alone (one query row, its mask row): a token's attention must not depend on its batch
    double alone_diff = 0.0;
    for (int t = 0; t < c.n_q && c.n_q > 1; t++) {
        ggml_tensor * q1 = ggml_view_4d(ctx, q, c.dk, 1, c.n_head, 1, q->nb[1], q->nb[2], q->nb[3], t * q->nb[1]);
        ggml_tensor * m1 = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, c.n_kv, pad, 1, 1);
        std::memcpy(m1->data, md + (size_t) t * c.n_kv, c.n_kv * sizeof(ggml_fp16_t));
        ggml_tensor * o1 = ggml_flash_attn_ext(ctx, q1, k, v, m1, scale, 0.0f, 0.0f);
        ggml_cgraph * g1 = ggml_new_graph(ctx);
        ggml_build_forward_expand(g1, o1);
        ggml_graph_compute_with_ctx(ctx, g1, threads > 0 ? threads : c.threads);
        for (int h = 0; h < c.n_head; h++) {
            for (int d = 0; d < c.dk; d++) {
                const float a = ((const float *) ((const char *) out->data + h * out->nb[1] + t * out->nb[2]))[d];
                const float b = ((const float *) ((const char *) o1->data + h * o1->nb[1]))[d];
                alone_diff = std::max(alone_diff, (double) std::fabs(a - b));
            }
        }
    }
    const int group = c.n_head / c.n_head_kv;
    // the reference's largest error relative to its magnitude, for the query as given or (quantized) as our kernel
    // quantizes it for integer dot products with a Q8_0 K cache
    auto rel_err_of = [&](bool quantized) {
        std::vector<double> qv(qd, qd + ggml_nelements(q));
        if (quantized) {
            for (size_t b = 0; b < qv.size(); b += 32) {
                float amax = 0.0f;
                for (size_t i = b; i < b + 32; i++) {
                    amax = std::max(amax, std::fabs(qd[i]));
                }
                const float d = amax / 127.0f;
                const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
                for (size_t i = b; i < b + 32; i++) {
                    qv[i] = std::nearbyint(qd[i] * id) * (double) d;
                }
            }
        }
        double max_err = 0.0;
        double max_abs = 0.0;
        for (int t = 0; t < c.n_q; t++) {
            for (int h = 0; h < c.n_head; h++) {
                const int g = h / group;
                std::vector<double> s(c.n_kv);
                double mx = -INFINITY;
                for (int j = 0; j < c.n_kv; j++) {
                    const float mv = ggml_fp16_to_fp32(md[(size_t) t * c.n_kv + j]);
                    if (mv == -INFINITY) {
                        s[j] = -INFINITY;
                        continue;
                    }
                    double dot = 0.0;
                    for (int d = 0; d < c.dk; d++) {
                        dot += qv[((size_t) h * c.n_q + t) * c.dk + d] * kd[(size_t) j * n_gqa + g * c.dk + d];
                    }
                    s[j] = dot * scale;
                    mx = std::max(mx, s[j]);
                }
                double sum = 0.0;
                std::vector<double> acc(c.dk, 0.0);
                for (int j = 0; j < c.n_kv; j++) {
                    if (s[j] == -INFINITY) {
                        continue;
                    }
                    const double p = std::exp(s[j] - mx);
                    sum += p;
                    for (int d = 0; d < c.dk; d++) {
                        acc[d] += p * vd[(size_t) j * n_gqa + g * c.dk + d];
                    }
                }
                const float * o = (const float *) ((const char *) out->data + h * out->nb[1] + t * out->nb[2]);
                for (int d = 0; d < c.dk; d++) {
                    const double ref = acc[d] / sum;
                    max_abs = std::max(max_abs, std::fabs(ref));
                    max_err = std::max(max_err, std::fabs(ref - (double) o[d]));
                }
            }
        }
        return max_err / max_abs;
    };
    Result res{std::vector<float>((const float *) out->data, (const float *) out->data + ggml_nelements(out)),
               rel_err_of(false), alone_diff, c.kt == GGML_TYPE_Q8_0 ? rel_err_of(true) : 0.0};
    ggml_free(ctx);
    return res;
}

int main() {
    const Case cases[] = {
        // Qwen3-MoE's shape (16 query heads on 4 KV heads, 128 dims) at short and long contexts, 2 threads
        {"gqa4-d128-kv37", 128, 37, 16, 4, 1, 2, 0.0f},
        {"gqa4-d128-kv700-masked", 128, 700, 16, 4, 1, 2, 0.3f},
        {"gqa8-d64-kv256", 64, 256, 16, 2, 1, 2, 0.1f},
        {"mha-d80-kv100", 80, 100, 4, 4, 1, 1, 0.0f},
        // 16 query heads a KV head (Qwen3-235B-A22B's grouping): two sets of 8, one per thread
        {"gqa16-d128-kv300", 128, 300, 16, 1, 1, 2, 0.2f},
        // a short batch (7 query rows, each its own mask row: the causal mask of a prompt's tail)
        {"seven-rows", 128, 90, 8, 2, 7, 2, 0.3f},
        // a prompt batch (70 rows: past upstream's 64-row tile, which it runs tiled)
        {"prompt-rows", 64, 80, 4, 2, 70, 2, 0.2f},
        // a prompt's causal batch after a context (each row sees the one before's cells and its own: rows share
        // their passes over the cache), 8 and 4 query heads a KV head, F16 and Q8_0
        {"causal-gqa8", 128, 400, 16, 2, 21, 2, 0.05f, GGML_TYPE_F16, GGML_TYPE_F16, true},
        {"causal-gqa4-q8", 128, 300, 16, 4, 37, 2, 0.05f, GGML_TYPE_Q8_0, GGML_TYPE_Q8_0, true},
        // one thread: every KV head in one work item (the AVX-512 kernel reads them as one stream)
        {"gqa4-d128-kv500-t1", 128, 500, 16, 4, 1, 1, 0.1f},
        // a Q8_0 cache (-ctk/-ctv q8_0): both, K alone, V alone; a decode step and a prompt batch
        {"q8-gqa8-d128-kv600", 128, 600, 32, 4, 1, 2, 0.1f, GGML_TYPE_Q8_0, GGML_TYPE_Q8_0},
        {"q8k-gqa4-d128-kv300", 128, 300, 16, 4, 1, 2, 0.2f, GGML_TYPE_Q8_0, GGML_TYPE_F16},
        {"q8v-gqa4-d64-kv300", 64, 300, 8, 2, 1, 2, 0.2f, GGML_TYPE_F16, GGML_TYPE_Q8_0},
        {"q8-prompt-rows", 64, 80, 4, 2, 70, 2, 0.2f, GGML_TYPE_Q8_0, GGML_TYPE_Q8_0},
        // several chunks of 512 cells (a decode step's spread over the threads, folded), a prompt across them, and
        // cells so sparse that some chunks hold none
        {"deep-gqa4-kv1800", 128, 1800, 16, 4, 1, 2, 0.1f},
        {"deep-q8-gqa4-kv1800", 128, 1800, 16, 4, 1, 2, 0.1f, GGML_TYPE_Q8_0, GGML_TYPE_Q8_0},
        {"causal-deep-q8", 128, 1300, 16, 4, 37, 2, 0.05f, GGML_TYPE_Q8_0, GGML_TYPE_Q8_0, true},
        {"sparse-deep", 64, 2100, 8, 2, 1, 2, 0.995f},
        // shapes our kernel leaves to llama.cpp's: a group of 3, fewer sets of heads than threads
        {"gqa3", 64, 50, 6, 2, 1, 2, 0.0f},
        {"sets-below-threads", 64, 50, 4, 1, 1, 2, 0.0f},
    };
    std::mt19937 rng(5);
    int n = 0;
    for (const Case & c : cases) {
        const Result r = run_case(c, rng);
        std::printf("case %s max_rel_err %.3g\n", c.name, r.rel_err);
        if (c.kt == GGML_TYPE_Q8_0) {
            std::printf("qcase %s max_rel_err %.3g\n", c.name, r.rel_err_quantized);
        }
        if (c.n_q > 1) {
            std::printf("alone %s max_abs_diff %.3g\n", c.name, r.alone_diff);
        }
        n++;
    }
    std::printf("checked %d\n", n);
    // the same inputs with 1 to 4 threads (work items of 4, 2 or 1 KV heads, dealt out differently): the same bits
    for (const Case & c : {Case{"threads-f16", 128, 300, 16, 4, 1, 1, 0.2f},
                           Case{"threads-q8", 128, 300, 16, 4, 1, 1, 0.2f, GGML_TYPE_Q8_0, GGML_TYPE_Q8_0},
                           Case{"threads-rows", 64, 90, 8, 4, 9, 1, 0.3f},
                           Case{"threads-deep-q8", 128, 1700, 16, 4, 1, 1, 0.2f, GGML_TYPE_Q8_0, GGML_TYPE_Q8_0},
                           Case{"threads-sparse", 64, 2100, 16, 4, 1, 1, 0.995f}}) {
        std::vector<float> first;
        double diff = 0.0;
        for (int threads = 1; threads <= 4; threads++) {
            std::mt19937 same(11);
            const Result r = run_case(c, same, threads);
            if (first.empty()) {
                first = r.out;
            }
            for (size_t i = 0; i < first.size(); i++) {
                diff = std::max(diff, (double) std::fabs(first[i] - r.out[i]));
            }
        }
        std::printf("threads %s max_abs_diff %.3g\n", c.name, diff);
    }
    return 0;
}
