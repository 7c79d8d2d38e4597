// UMIA's arbitration op (see rapidmoe-umia.h and docs/umia.md). A ggml custom op: the CPU runs it, and a GPU
// backend's supports_op refuses GGML_OP_CUSTOM, so the scheduler keeps it (a few hundred bytes) on the CPU.
#include "rapidmoe-umia.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <vector>

int rapidmoe_umia_n_critical(const float * w, int k, size_t stride, float tau, int r_min, int r_max, int * order) {
    auto weight = [&](int j) { return *(const float *) ((const char *) w + j * stride); };
    for (int j = 0; j < k; ++j) { // insertion sort, descending and stable (k <= 64)
        int i = j;
        const float wj = weight(j);
        while (i > 0 && weight(order[i - 1]) < wj) {
            order[i] = order[i - 1];
            --i;
        }
        order[i] = j;
    }
    r_min = std::clamp(r_min, 0, k);
    r_max = std::clamp(r_max, r_min, k);
    double total = 0.0;
    for (int j = 0; j < k; ++j) {
        total += weight(order[j]);
    }
    int r = k;
    if (!(tau > 0.0f)) {
        r = 0;
    } else if (std::isfinite(total) && total > 0.0) {
        const double target = (double) std::min(tau, 1.0f) * total;
        double cum = 0.0;
        for (int j = 0; j < k; ++j) {
            cum += weight(order[j]);
            if (cum >= target) {
                r = j + 1;
                break;
            }
        }
    } // weights that do not sum to a positive finite mass: every slot is critical (r_max after the clamp)
    return std::clamp(r, r_min, r_max);
}

void rapidmoe_umia_critical_ids_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    auto * site = static_cast<rapidmoe_umia_site *>(userdata);
    const ggml_tensor * w = dst->src[0];
    const ggml_tensor * sel = dst->src[1];
    const ggml_tensor * policy = dst->src[2];
    const int k = (int) sel->ne[0];
    const int64_t T = sel->ne[1];
    const auto * head = (const float *) policy->data;
    const auto * row = (const float *) ((const char *) policy->data + (site->il + 1) * policy->nb[1]);
    const int phase = head[0] >= 0.0f ? (head[0] >= 0.5f ? RAPIDMOE_UMIA_PREFILL : RAPIDMOE_UMIA_DECODE) : site->phase;
    const float tau = row[phase == RAPIDMOE_UMIA_PREFILL ? 1 : 0];
    const int r_min = (int) row[2], r_max = (int) row[3];
    std::array<int, RAPIDMOE_UMIA_MAX_K> order{};
    std::array<int64_t, RAPIDMOE_UMIA_MAX_K + 1> hist{};
    for (int64_t t = 0; t < T; ++t) {
        const auto * wt = (const float *) ((const char *) w->data + t * w->nb[2]);
        const auto * st = (const int32_t *) ((const char *) sel->data + t * sel->nb[1]);
        auto * out = (int32_t *) ((char *) dst->data + t * dst->nb[1]);
        auto * rest = (int32_t *) ((char *) dst->data + t * dst->nb[1] + dst->nb[2]);
        const int r = rapidmoe_umia_n_critical(wt, k, w->nb[1], tau, r_min, r_max, order.data());
        for (int j = 0; j < k; ++j) {
            out[j] = -1;
            rest[j] = st[j];
        }
        for (int j = 0; j < r; ++j) {
            out[order[j]] = st[order[j]];
            rest[order[j]] = -1;
        }
        ++hist[r];
    }
    for (int r = 0; r <= k; ++r) {
        if (hist[r] != 0) {
            site->hist[r].fetch_add(hist[r], std::memory_order_relaxed);
        }
    }
}

void rapidmoe_umia_set_fixed(ggml_tensor * policy, int r) {
    rapidmoe_umia_fixed_policy((float *) policy->data, policy->ne[1], r);
}

void rapidmoe_umia_fixed_policy(float * p, int64_t n_rows, int r) {
    p[0] = -1.0f;
    p[1] = p[2] = p[3] = 0.0f;
    for (int64_t il = 1; il < n_rows; ++il) {
        float * row = p + RAPIDMOE_UMIA_ROW * il;
        row[0] = row[1] = 1.0f;
        row[2] = row[3] = (float) r;
    }
}

rapidmoe_umia_ids rapidmoe_umia_critical_ids(ggml_context * ctx, ggml_tensor * weights, ggml_tensor * selected,
                                             ggml_tensor * policy, rapidmoe_umia_site * site) {
    GGML_ASSERT(selected->ne[0] <= RAPIDMOE_UMIA_MAX_K);
    GGML_ASSERT(policy->type == GGML_TYPE_F32 && policy->ne[0] == RAPIDMOE_UMIA_ROW && site->il + 1 < policy->ne[1]);
    ggml_tensor * args[3] = { weights, selected, policy };
    rapidmoe_umia_ids ids;
    ids.node = ggml_custom_4d(ctx, GGML_TYPE_I32, selected->ne[0], selected->ne[1], 2, 1, args, 3,
                              rapidmoe_umia_critical_ids_op, 1, site); // [k, T, 2]
    ids.critical = ggml_view_2d(ctx, ids.node, ids.node->ne[0], ids.node->ne[1], ids.node->nb[1], 0);
    ids.noncritical = ggml_view_2d(ctx, ids.node, ids.node->ne[0], ids.node->ne[1], ids.node->nb[1], ids.node->nb[2]);
    return ids;
}

int32_t rapidmoe_umia_eval(const float * weights, int64_t n_tokens, int32_t k, const float * policy, int32_t n_layer,
                           int32_t il, int32_t phase, int32_t * ids_out, int64_t * hist_out) {
    if (weights == nullptr || policy == nullptr || ids_out == nullptr || n_tokens < 1 || k < 1 ||
        k > RAPIDMOE_UMIA_MAX_K || il < 0 || il >= n_layer || (phase != 0 && phase != 1)) {
        return -1;
    }
    ggml_backend_t cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    if (cpu == nullptr) {
        return -1;
    }
    ggml_init_params ip = { 10 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, /*no_alloc =*/ true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * w = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, k, n_tokens);
    ggml_tensor * sel = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, n_tokens);
    ggml_tensor * pol = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, RAPIDMOE_UMIA_ROW, n_layer + 1);
    rapidmoe_umia_site site;
    site.il = il;
    site.phase = phase;
    ggml_tensor * ids = rapidmoe_umia_critical_ids(ctx, w, sel, pol, &site).node;
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, ids);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, cpu);
    std::vector<int32_t> slots((size_t) (k * n_tokens));
    for (int64_t i = 0; i < (int64_t) slots.size(); ++i) {
        slots[i] = (int32_t) (i % k);
    }
    ggml_backend_tensor_set(w, weights, 0, ggml_nbytes(w));
    ggml_backend_tensor_set(sel, slots.data(), 0, ggml_nbytes(sel));
    ggml_backend_tensor_set(pol, policy, 0, ggml_nbytes(pol));
    const bool ok = ggml_backend_graph_compute(cpu, gf) == GGML_STATUS_SUCCESS;
    if (ok) {
        ggml_backend_tensor_get(ids, ids_out, 0, ggml_nbytes(ids) / 2); // plane 0: the critical ids
        for (int r = 0; r <= k && hist_out != nullptr; ++r) {
            hist_out[r] = site.hist[r].load();
        }
    }
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    ggml_backend_free(cpu);
    return ok ? 0 : -1;
}
