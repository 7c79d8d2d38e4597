// The fused MoE expert sum (patch 0012, ops/moe-sum/cpu/rapidmoe-moe-sum.cpp) against llama.cpp's separate nodes and a
// scalar reference, bit for bit: builds build_moe_ffn's tail (optional split-routing ADD, the routing-weight MUL, k
// views, k - 1 ADDs, optional residual ADD) with ggml, computes it through the CPU backend with RAPIDMOE_MOE_SUM=0
// and then with it unset, and prints per case whether the fused node ran (the intermediate tensors keep a sentinel
// only when nothing wrote them) and whether both outputs equal the reference's bits. Compiled with
// -ffp-contract=off by tests/engine/test_moe_sum.py so the reference rounds each product, as ggml does.
#include "ggml-cpu.h"
#include "ggml.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

struct Case {
    std::string name;
    int64_t n, k, T;
    bool lead, resid, extra_use;
    int threads;
    bool out_over_down = false; // the output's memory inside the down results' (ggml's allocator may reuse it)
};

void fill(ggml_tensor * t, std::mt19937 & rng) {
    std::normal_distribution<float> d(0.0f, 1.0f);
    auto * p = (float *) t->data;
    for (int64_t i = 0; i < ggml_nelements(t); ++i) {
        p[i] = d(rng);
    }
}

const uint32_t SENTINEL = 0x7fc0beefu; // a quiet NaN no op produces

void mark(ggml_tensor * t) {
    auto * p = (uint32_t *) t->data;
    for (int64_t i = 0; i < ggml_nelements(t); ++i) {
        p[i] = SENTINEL;
    }
}

bool marked(const ggml_tensor * t) {
    const auto * p = (const uint32_t *) t->data;
    for (int64_t i = 0; i < ggml_nelements(t); ++i) {
        if (p[i] != SENTINEL) {
            return false;
        }
    }
    return true;
}

float at(const ggml_tensor * t, int64_t i0, int64_t i1, int64_t i2) {
    return *(const float *) ((const char *) t->data + i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2]);
}

// runs one case; returns false when something is wrong
bool run(const Case & c) {
    ggml_init_params ip = { (size_t) 64 << 20, nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    std::mt19937 rng(42);
    ggml_tensor * down = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, c.n, c.k, c.T);
    ggml_tensor * crit = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, c.n, c.k, c.T);
    ggml_tensor * w = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, c.k, c.T);
    ggml_tensor * res = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, c.n, c.T);
    for (ggml_tensor * t : { down, crit, w, res }) {
        fill(t, rng);
    }
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_tensor * x = c.lead ? ggml_add(ctx, down, crit) : down;
    ggml_tensor * mul = ggml_mul(ctx, x, w);
    ggml_build_forward_expand(gf, mul);
    std::vector<ggml_tensor *> views;
    for (int64_t j = 0; j < c.k; ++j) {
        views.push_back(ggml_view_2d(ctx, mul, c.n, c.T, mul->nb[2], j * mul->nb[1]));
        ggml_build_forward_expand(gf, views.back());
    }
    std::vector<ggml_tensor *> sums;
    ggml_tensor * out = views[0];
    for (int64_t j = 1; j < c.k; ++j) {
        out = ggml_add(ctx, out, views[j]);
        sums.push_back(out);
        ggml_build_forward_expand(gf, out);
    }
    if (c.resid) {
        out = ggml_add(ctx, out, res);
        ggml_build_forward_expand(gf, out);
    }
    if (c.out_over_down) { // rows from token 1's second slot on: writing row 0 would clobber sources not yet read
        out->data = (char *) down->data + down->nb[2] + down->nb[1];
    }
    if (c.extra_use) { // the weighted results read by another node too: the tail must not be fused
        ggml_build_forward_expand(gf, ggml_scale(ctx, mul, 2.0f));
    }
    const std::vector<char> down_saved((const char *) down->data, (const char *) down->data + ggml_nbytes(down));
    // the reference: llama.cpp's nodes' float operations, in their order
    std::vector<float> ref((size_t) (c.n * c.T));
    for (int64_t t = 0; t < c.T; ++t) {
        for (int64_t i = 0; i < c.n; ++i) {
            float s = 0.0f;
            for (int64_t j = 0; j < c.k; ++j) {
                const float xv = c.lead ? at(down, i, j, t) + at(crit, i, j, t) : at(down, i, j, t);
                const float p = xv * at(w, 0, j, t);
                s = j == 0 ? p : s + p;
            }
            ref[(size_t) (t * c.n + i)] = c.resid ? s + at(res, i, t, 0) : s;
        }
    }
    bool ok = true;
    bool ran[2] = { false, false };
    bool equal[2] = { false, false };
    for (int fused = 0; fused < 2; ++fused) {
        if (fused) {
            unsetenv("RAPIDMOE_MOE_SUM");
        } else {
            setenv("RAPIDMOE_MOE_SUM", "0", 1);
        }
        mark(mul);
        for (ggml_tensor * s : sums) {
            if (s != out) {
                mark(s);
            }
        }
        mark(out);
        std::memcpy(down->data, down_saved.data(), down_saved.size()); // under the output in out_over_down
        if (ggml_graph_compute_with_ctx(ctx, gf, c.threads) != GGML_STATUS_SUCCESS) {
            std::printf("case %s compute failed\n", c.name.c_str());
            return false;
        }
        ran[fused] = marked(mul); // (nothing else wrote it: it is not under the output)
        equal[fused] = std::memcmp(out->data, ref.data(), ref.size() * sizeof(float)) == 0;
        ok = ok && equal[fused];
    }
    std::printf("case %s unfused_equal %d fused_equal %d fused_ran %d unfused_ran %d\n", c.name.c_str(), equal[0],
                equal[1], ran[1], ran[0]);
    ggml_free(ctx);
    return ok;
}

}  // namespace

int main() {
    const std::vector<Case> cases = {
        { "decode-k8", 1024, 8, 1, false, false, false, 2 },
        { "decode-k8-split-resid", 1024, 8, 1, true, true, false, 2 },
        { "decode-odd-width", 1000, 8, 1, true, true, false, 3 },
        { "decode-k2", 64, 2, 1, false, true, false, 4 },
        { "prompt-rows", 256, 4, 37, true, true, false, 2 },
        { "one-thread", 512, 6, 3, false, true, false, 1 },
        { "used-elsewhere", 256, 8, 1, false, true, true, 2 },
        { "out-over-down-rows", 256, 4, 9, true, true, false, 2, true },
        { "out-over-down-decode", 1024, 8, 2, false, false, false, 4, true },
        { "no-rows", 256, 8, 0, true, true, false, 2 }, // a layer that computes no row (no outputs in a chunk)
    };
    int bad = 0;
    for (const Case & c : cases) {
        bad += run(c) ? 0 : 1;
    }
    std::printf("checked %zu cases, %d wrong\n", cases.size(), bad);
    return bad == 0 ? 0 : 1;
}
