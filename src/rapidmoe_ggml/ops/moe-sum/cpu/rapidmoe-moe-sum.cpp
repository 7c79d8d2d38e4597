// The expert sum at the end of llama.cpp's MoE FFN (build_moe_ffn) as one node.
//
// Why: build_moe_ffn weights the k down results of each token by their routing weights (one MUL) and sums them by
// k - 1 ADDs of views; split routing adds the critical slots' down in front (one ADD) and the layer adds the sum to
// its residual stream after (one ADD). On the CPU each is a graph node that ends in a barrier of all threads, and
// for a decode token each ADD's single row goes to one thread while the other waits. With Qwen3-MoE's top-8 that is
// 9 to 10 nodes a layer for a few thousand floats of work. Here they are one: per output element the same float
// operations in the same order (so the same bits), the row split across the threads by columns when there are
// fewer rows than threads.
//
// This file is compiled with -ffp-contract=off (src/rapidmoe_ggml/CMakeLists.txt): x * w + s must round the product
// before the sum, as the separate MUL and ADD nodes do.
#include "rapidmoe-moe-sum.h"

#include "ggml-cpu-impl.h" // ggml_compute_params, ggml_barrier
#include "ggml-impl.h"     // ggml_can_fuse_subgraph, ggml_graph nodes

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

std::atomic<long long> fused_tails{ 0 };

bool enabled() {
    const char * env = std::getenv("RAPIDMOE_MOE_SUM");
    return env == nullptr || std::strcmp(env, "0") != 0;
}

constexpr int MAX_K = 32; // expert slots a token (ggml_can_fuse_subgraph takes fewer than 32 nodes: k <= 14)

struct moe_sum {
    const ggml_tensor * down;   // [n, k, T] down results (the MUL's src0, or the leading ADD's first source)
    const ggml_tensor * crit;   // [n, k, T] the leading ADD's second source (nullptr without one)
    const ggml_tensor * w;      // [1, k, T] routing weights
    const ggml_tensor * resid;  // [n, T] the trailing ADD's other source (nullptr without one)
    ggml_tensor * dst;          // [n, T] the last node's result
    int k;
    int covered;                // nodes after node_n this tail covers
};

bool f32_rows(const ggml_tensor * t) {
    return t->type == GGML_TYPE_F32 && t->nb[0] == sizeof(float);
}

// The tail that starts at node_n, or false. Cheap checks first: the hook runs for every node of every graph.
bool match(const ggml_cgraph * g, int node_n, moe_sum & m) {
    const int n_nodes = g->n_nodes;
    int i = node_n;
    const ggml_tensor * lead = nullptr;
    if (g->nodes[i]->op == GGML_OP_ADD) {
        if (i + 2 >= n_nodes || g->nodes[i + 1]->op != GGML_OP_MUL || g->nodes[i + 1]->src[0] != g->nodes[i]) {
            return false;
        }
        lead = g->nodes[i++];
    } else if (g->nodes[i]->op != GGML_OP_MUL || i + 1 >= n_nodes || g->nodes[i + 1]->op != GGML_OP_VIEW) {
        return false;
    }
    const ggml_tensor * mul = g->nodes[i];
    const ggml_tensor * x = mul->src[0];
    const ggml_tensor * w = mul->src[1];
    const int64_t n = x->ne[0], k = x->ne[1], T = x->ne[2];
    // T = 0: a layer may compute no row (the last one, in a prompt chunk without outputs)
    if (k < 2 || T < 1 || n < 1 || k > MAX_K || x->ne[3] != 1 || w->ne[0] != 1 || w->ne[1] != k ||
        w->ne[2] != T || w->ne[3] != 1 || !f32_rows(mul) || !f32_rows(x) || w->type != GGML_TYPE_F32 ||
        !ggml_are_same_shape(mul, x)) {
        return false;
    }
    const int first = node_n;
    const int count = (i - first) + 1 + (int) k + (int) (k - 1);
    if (first + count > n_nodes) {
        return false;
    }
    // the views: slot j of every token, in slot order
    for (int64_t j = 0; j < k; ++j) {
        const ggml_tensor * v = g->nodes[i + 1 + j];
        if (v->op != GGML_OP_VIEW || v->view_src != mul || v->view_offs != (size_t) j * mul->nb[1] ||
            v->ne[0] != n || v->ne[1] != T || v->ne[2] != 1 || v->ne[3] != 1 || v->nb[1] != mul->nb[2]) {
            return false;
        }
    }
    // the sum: ((v0 + v1) + v2) + ...
    const int a0 = i + 1 + (int) k;
    for (int64_t j = 1; j < k; ++j) {
        const ggml_tensor * a = g->nodes[a0 + j - 1];
        const ggml_tensor * prev = j == 1 ? g->nodes[i + 1] : g->nodes[a0 + j - 2];
        if (a->op != GGML_OP_ADD || a->src[0] != prev || a->src[1] != g->nodes[i + 1 + j] || !f32_rows(a) ||
            a->ne[0] != n || a->ne[1] != T || a->ne[2] != 1 || a->ne[3] != 1) {
            return false;
        }
    }
    int total = count;
    const ggml_tensor * resid = nullptr;
    // the residual stream: one more ADD of the sum and a same-shaped F32 tensor, where it follows directly
    const int last = first + count - 1;
    if (last + 1 < n_nodes) {
        const ggml_tensor * sum = g->nodes[last];
        const ggml_tensor * r = g->nodes[last + 1];
        if (r->op == GGML_OP_ADD && (r->src[0] == sum) != (r->src[1] == sum) && f32_rows(r) &&
            ggml_are_same_shape(r, sum)) {
            const ggml_tensor * other = r->src[0] == sum ? r->src[1] : r->src[0];
            if (ggml_are_same_shape(other, sum) && f32_rows(other)) {
                resid = other;
                total += 1;
            }
        }
    }
    if (lead != nullptr) {
        const ggml_tensor * c = lead->src[1];
        if (lead->src[0]->type != GGML_TYPE_F32 || !f32_rows(c) || !ggml_are_same_shape(lead->src[0], x) ||
            !ggml_are_same_shape(c, x) || !f32_rows(lead->src[0])) {
            return false;
        }
    }
    // every intermediate used inside the tail only (not an output, not read by another node)
    enum ggml_op ops[32];
    if (total >= 32) { // ggml_can_fuse_subgraph's limit
        return false;
    }
    for (int j = 0; j < total; ++j) {
        ops[j] = g->nodes[first + j]->op;
    }
    const int outputs[1] = { first + total - 1 };
    if (!ggml_can_fuse_subgraph(g, first, total, ops, outputs, 1)) {
        return false;
    }
    m.down = lead != nullptr ? lead->src[0] : x;
    m.crit = lead != nullptr ? lead->src[1] : nullptr;
    m.w = w;
    m.resid = resid;
    m.dst = g->nodes[first + total - 1];
    m.k = (int) k;
    m.covered = total - 1;
    return true;
}

// out[0, c1 - c0) = token t's output columns c0 to c1
void sum_row(const moe_sum & m, int64_t t, int64_t c0, int64_t c1, float * out) {
    const ggml_tensor * d = m.down;
    const float * resid = m.resid != nullptr ? (const float *) ((const char *) m.resid->data + t * m.resid->nb[1])
                                             : nullptr;
    float wt[MAX_K];
    const float * xs[MAX_K];
    const float * cs[MAX_K];
    for (int j = 0; j < m.k; ++j) {
        wt[j] = *(const float *) ((const char *) m.w->data + j * m.w->nb[1] + t * m.w->nb[2]);
        xs[j] = (const float *) ((const char *) d->data + j * d->nb[1] + t * d->nb[2]);
        cs[j] = m.crit != nullptr ? (const float *) ((const char *) m.crit->data + j * m.crit->nb[1] +
                                                     t * m.crit->nb[2])
                                  : nullptr;
    }
    // the output may lie over the residual stream (ggml's allocator computes in place, element for element): each
    // block of a row is read before it is written
    constexpr int64_t BLOCK = 256;
    for (int64_t b0 = c0; b0 < c1; b0 += BLOCK) {
        const int64_t nb = std::min(BLOCK, c1 - b0);
        float s[BLOCK];
        float xc[BLOCK]; // a slot's down result with its critical part added (split routing)
        for (int j = 0; j < m.k; ++j) {
            const float * x = xs[j] + b0;
            if (cs[j] != nullptr) {
                for (int64_t c = 0; c < nb; ++c) {
                    xc[c] = x[c] + cs[j][b0 + c];
                }
                x = xc;
            }
            const float wj = wt[j];
            if (j == 0) {
                for (int64_t c = 0; c < nb; ++c) {
                    s[c] = x[c] * wj;
                }
            } else {
                for (int64_t c = 0; c < nb; ++c) {
                    s[c] = s[c] + x[c] * wj;
                }
            }
        }
        float * o = out + (b0 - c0);
        if (resid != nullptr) {
            const float * r = resid + b0;
            for (int64_t c = 0; c < nb; ++c) {
                o[c] = s[c] + r[c];
            }
        } else {
            std::copy(s, s + nb, o);
        }
    }
}

bool overlap(const ggml_tensor * a, const ggml_tensor * b) {
    const char * a0 = (const char *) a->data;
    const char * b0 = (const char *) b->data;
    return a0 < b0 + ggml_nbytes(b) && b0 < a0 + ggml_nbytes(a);
}

// Whether the output's memory overlaps a source's other than element for element (the residual stream in place):
// the separate nodes had read those sources before the last one wrote, ours reads them as it writes
bool output_over_sources(const moe_sum & m) {
    const ggml_tensor * d = m.dst;
    if (overlap(d, m.down) || (m.crit != nullptr && overlap(d, m.crit)) || overlap(d, m.w)) {
        return true;
    }
    return m.resid != nullptr && overlap(d, m.resid) && !(d->data == m.resid->data && d->nb[1] == m.resid->nb[1]);
}

}  // namespace

int rapidmoe_moe_sum_try_fuse(const ggml_cgraph * cgraph, int node_n, const ggml_compute_params * params) {
    moe_sum m;
    if (!match(cgraph, node_n, m) || !enabled()) {
        return 0;
    }
    const int ith = params->ith, nth = params->nth;
    if (ith == 0) {
        fused_tails.fetch_add(1, std::memory_order_relaxed);
    }
    // this thread's share: rows [t0, t1) and columns [c0, c1) of each
    const int64_t n = m.down->ne[0], T = m.down->ne[2];
    int64_t t0 = 0, t1 = 0, c0 = 0, c1 = n;
    if (T >= nth) { // whole rows, split by tokens
        const int64_t per = (T + nth - 1) / nth;
        t0 = std::min(T, ith * per);
        t1 = std::min(T, t0 + per);
    } else if (ith / (nth / T) < T) { // fewer rows than threads (a decode step): rows split by columns, 16 at a time
        const int64_t parts = nth / T, p = ith % parts;
        const int64_t per = ((n + parts - 1) / parts + 15) / 16 * 16;
        t0 = ith / parts;
        t1 = t0 + 1;
        c0 = std::min(n, p * per);
        c1 = std::min(n, (p + 1) * per);
    }
    if (!output_over_sources(m)) {
        for (int64_t t = t0; t < t1; ++t) {
            sum_row(m, t, c0, c1, (float *) ((char *) m.dst->data + t * m.dst->nb[1]) + c0);
        }
        return m.covered;
    }
    // The allocator gave the output memory that a source held until its last reader, a node this one replaces:
    // every thread computes its share aside, and writes it once all threads have read their sources.
    thread_local std::vector<float> aside;
    aside.resize((size_t) ((t1 - t0) * (c1 - c0)));
    for (int64_t t = t0; t < t1; ++t) {
        sum_row(m, t, c0, c1, aside.data() + (t - t0) * (c1 - c0));
    }
    if (nth > 1) {
        ggml_barrier(params->threadpool);
    }
    for (int64_t t = t0; t < t1; ++t) {
        float * row = (float *) ((char *) m.dst->data + t * m.dst->nb[1]);
        std::copy_n(aside.data() + (t - t0) * (c1 - c0), c1 - c0, row + c0);
    }
    return m.covered;
}

int rapidmoe_moe_sum_tail_length(const ggml_cgraph * cgraph, int node_n) {
    moe_sum m;
    return match(cgraph, node_n, m) ? m.covered + 1 : 0;
}

long long rapidmoe_moe_sum_count(void) {
    return fused_tails.load(std::memory_order_relaxed);
}
