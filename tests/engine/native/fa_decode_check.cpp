// Runs GGML_OP_FLASH_ATTN_EXT on the CPU backend for decode-shaped inputs (one query row per head, F16 K/V cache,
// F16 mask with masked positions) and compares the output with a float64 reference computed from the same
// F16-rounded inputs. Run by tests/engine/test_fa_decode.py with and without RAPIDMOE_FA_DECODE=0 (our kernel,
// patch 0011, or llama.cpp's). Prints "case NAME max_rel_err E" per case (the largest error over the case's
// outputs, relative to the largest output magnitude) and "checked N".
#include "ggml.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

struct Case {
    const char * name;
    int dk, n_kv, n_head, n_head_kv, n_q, threads;
    float masked_share;  // share of cache positions masked out
};

static double run_case(const Case & c, std::mt19937 & rng) {
    const size_t mem = 64u << 20;
    ggml_init_params ip = {mem, nullptr, false};
    ggml_context * ctx = ggml_init(ip);
    const int pad = 64;  // a mask's rows are padded (GGML_KQ_MASK_PAD)
    ggml_tensor * q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, c.dk, c.n_q, c.n_head, 1);
    ggml_tensor * k = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, c.dk, c.n_kv, c.n_head_kv, 1);
    ggml_tensor * v = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, c.dk, c.n_kv, c.n_head_kv, 1);
    ggml_tensor * m = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, c.n_kv, GGML_PAD(c.n_q, pad), 1, 1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    auto * qd = (float *) q->data;
    for (int64_t i = 0; i < ggml_nelements(q); i++) {
        qd[i] = normal(rng);
    }
    auto * kd = (ggml_fp16_t *) k->data;
    auto * vd = (ggml_fp16_t *) v->data;
    for (int64_t i = 0; i < ggml_nelements(k); i++) {
        kd[i] = ggml_fp32_to_fp16(normal(rng) * 2.0f);
        vd[i] = ggml_fp32_to_fp16(normal(rng));
    }
    auto * md = (ggml_fp16_t *) m->data;
    for (int64_t i = 0; i < ggml_nelements(m); i++) {
        md[i] = ggml_fp32_to_fp16(unit(rng) < c.masked_share ? -INFINITY : 0.0f);
    }
    for (int r = 0; r < c.n_q; r++) {  // at least one visible position per query row
        md[(size_t) r * c.n_kv] = ggml_fp32_to_fp16(0.0f);
    }
    const float scale = 1.0f / std::sqrt((float) c.dk);
    ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, m, scale, 0.0f, 0.0f);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_graph_compute_with_ctx(ctx, gf, c.threads);
    // out: [dk, n_head, n_q]
    const int group = c.n_head / c.n_head_kv;
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
                    dot += (double) qd[((size_t) h * c.n_q + t) * c.dk + d] *
                           ggml_fp16_to_fp32(kd[((size_t) g * c.n_kv + j) * c.dk + d]);
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
                    acc[d] += p * ggml_fp16_to_fp32(vd[((size_t) g * c.n_kv + j) * c.dk + d]);
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
    ggml_free(ctx);
    return max_err / max_abs;
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
        // shapes our kernel leaves to llama.cpp's: a group of 3, fewer sets of heads than threads
        {"gqa3", 64, 50, 6, 2, 1, 2, 0.0f},
        {"sets-below-threads", 64, 50, 4, 1, 1, 2, 0.0f},
    };
    std::mt19937 rng(5);
    int n = 0;
    for (const Case & c : cases) {
        std::printf("case %s max_rel_err %.3g\n", c.name, run_case(c, rng));
        n++;
    }
    std::printf("checked %d\n", n);
    return 0;
}
