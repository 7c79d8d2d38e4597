// Time of GGML_OP_FLASH_ATTN_EXT on the CPU backend with the KV cache read from memory, the way a decode step or a
// prompt batch at depth finds it (the expert weights streamed through the caches since the layer before): the
// node's microseconds a layer, for one cache type and depth, with our kernel or llama.cpp's (RAPIDMOE_FA_DECODE=0 in
// the environment, read at each call). Run by tools/fa_cost.py, which compiles it against a build's ggml.
//
// usage: fa_cost N_KV N_Q TYPE_K TYPE_V THREADS REPS [N_HEAD N_HEAD_KV DK]
//   N_KV cache positions before the batch; N_Q query rows (1: a decode step; more: a causal prompt batch appended
//   after the N_KV positions, each row seeing its own prefix); TYPE_* f16 or q8_0.
// Prints "us_per_layer U gb_per_s G layers L" (G: the cache bytes a layer reads over its time).
//
// Cold cache: as many layers as make 1.5 GB of K and V (at least 4), each its own cache and query, taken in turn, so
// a layer's cache has left every cache level before its next turn (a prompt batch, compute-bound: 8 layers). The
// fastest of REPS runs of all layers is reported.
#include "ggml.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static ggml_type type_of(const std::string & s) {
    if (s == "f16") {
        return GGML_TYPE_F16;
    }
    if (s == "q8_0") {
        return GGML_TYPE_Q8_0;
    }
    std::fprintf(stderr, "fa_cost: cache type %s: f16 or q8_0\n", s.c_str());
    std::exit(2);
}

int main(int argc, char ** argv) {
    if (argc != 7 && argc != 10) {
        std::fprintf(stderr, "usage: fa_cost N_KV N_Q TYPE_K TYPE_V THREADS REPS [N_HEAD N_HEAD_KV DK]\n");
        return 2;
    }
    const int n_past = std::atoi(argv[1]);
    const int n_q = std::atoi(argv[2]);
    const ggml_type kt = type_of(argv[3]);
    const ggml_type vt = type_of(argv[4]);
    const int threads = std::atoi(argv[5]);
    const int reps = std::atoi(argv[6]);
    const int n_head = argc == 10 ? std::atoi(argv[7]) : 16;      // the bench model's (Qwen3-30B-A3B's proportions)
    const int n_head_kv = argc == 10 ? std::atoi(argv[8]) : 4;
    const int dk = argc == 10 ? std::atoi(argv[9]) : 128;
    const int n_kv = n_past + n_q;                                  // the cache holds the batch's own rows too
    const int n_kv_pad = (n_kv + 255) / 256 * 256;                 // llama.cpp's cache views are padded to 256
    const int n_gqa = dk * n_head_kv;
    const size_t layer_bytes = ggml_row_size(kt, n_gqa) * n_kv + ggml_row_size(vt, n_gqa) * n_kv;
    // a prompt batch is compute-bound: 8 layers, each with its own cache (more only make a run longer)
    const int layers = n_q > 1 ? 8 : (int) std::max<size_t>(4, (size_t) 1536 * 1024 * 1024 / layer_bytes + 1);

    const size_t mask_rows = (size_t) n_q;
    const size_t per_layer = ggml_row_size(kt, n_gqa) * n_kv_pad + ggml_row_size(vt, n_gqa) * n_kv_pad +
                             (size_t) dk * n_q * n_head * 4 * 2 + 8 * 1024;
    const size_t mem = per_layer * layers + (size_t) n_kv_pad * mask_rows * 2 + ((size_t) 64 << 20);
    ggml_init_params ip = {mem, nullptr, false};
    ggml_context * ctx = ggml_init(ip);
    if (ctx == nullptr) {
        std::fprintf(stderr, "fa_cost: cannot allocate %zu bytes\n", mem);
        return 1;
    }
    // the causal mask of the batch: row t sees positions 0..n_past+t; padded positions (up to n_kv_pad) masked
    ggml_tensor * m = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n_kv_pad, mask_rows, 1, 1);
    auto * md = (ggml_fp16_t *) m->data;
    for (size_t r = 0; r < mask_rows; r++) {
        for (int j = 0; j < n_kv_pad; j++) {
            md[r * n_kv_pad + j] = ggml_fp32_to_fp16((int) r < n_q && j <= n_past + (int) r ? 0.0f : -INFINITY);
        }
    }
    std::mt19937 rng(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    // 256 cache rows of values a few units wide, quantized once and copied into every layer's cache
    std::vector<float> rows((size_t) n_gqa * 256);
    for (float & x : rows) {
        x = normal(rng) * 2.0f;
    }
    std::vector<char> krows(ggml_row_size(kt, n_gqa) * 256);
    std::vector<char> vrows(ggml_row_size(vt, n_gqa) * 256);
    ggml_quantize_chunk(kt, rows.data(), krows.data(), 0, 256, n_gqa, nullptr);
    ggml_quantize_chunk(vt, rows.data(), vrows.data(), 0, 256, n_gqa, nullptr);
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, 4 * layers + 16, false);
    std::vector<ggml_tensor *> outs;
    const float scale = 1.0f / std::sqrt((float) dk);
    for (int l = 0; l < layers; l++) {
        ggml_tensor * q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, dk, n_q, n_head, 1);
        for (int64_t i = 0; i < ggml_nelements(q); i++) {
            ((float *) q->data)[i] = normal(rng);
        }
        ggml_tensor * kc = ggml_new_tensor_2d(ctx, kt, n_gqa, n_kv_pad);
        ggml_tensor * vc = ggml_new_tensor_2d(ctx, vt, n_gqa, n_kv_pad);
        for (int r0 = 0; r0 < n_kv_pad; r0 += 256) {
            std::memcpy((char *) kc->data + r0 * kc->nb[1], krows.data(), krows.size());
            std::memcpy((char *) vc->data + r0 * vc->nb[1], vrows.data(), vrows.size());
        }
        ggml_tensor * k = ggml_view_3d(ctx, kc, dk, n_kv_pad, n_head_kv, kc->nb[1], ggml_row_size(kt, dk), 0);
        ggml_tensor * v = ggml_view_3d(ctx, vc, dk, n_kv_pad, n_head_kv, vc->nb[1], ggml_row_size(vt, dk), 0);
        ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, m, scale, 0.0f, 0.0f);
        ggml_prec_set_acc(out, GGML_PREC_F32);
        ggml_build_forward_expand(gf, out);
    }
    ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
    ggml_threadpool * tp = ggml_threadpool_new(&tpp);
    ggml_cplan plan = ggml_graph_plan(gf, threads, tp);
    std::vector<uint8_t> work(plan.work_size + 64);
    plan.work_data = work.data();
    ggml_graph_compute(gf, &plan);  // warm-up: page faults, thread start
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        const auto t0 = std::chrono::steady_clock::now();
        ggml_graph_compute(gf, &plan);
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        best = std::min(best, us / layers);
    }
    std::printf("us_per_layer %.1f gb_per_s %.2f layers %d\n", best, layer_bytes / best / 1e3, layers);
    ggml_threadpool_free(tp);
    ggml_free(ctx);
    return 0;
}
