// RapidMoE code compiled into libllama: the C API additions declared in rapidmoe-llama.h.
// The graph hooks (rapidmoe-graph.cpp) and the sidecar state (rapidmoe-residual.cpp) live beside it.
#include "rapidmoe-llama.h"

#include "rapidmoe-residual.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#ifndef RAPIDMOE_VERSION
#define RAPIDMOE_VERSION "dev"
#endif
#ifndef RAPIDMOE_LLAMA_COMMIT
#define RAPIDMOE_LLAMA_COMMIT "unknown"
#endif

static std::atomic<int64_t> g_probe{0};

const char * rapidmoe_llama_build_info(void) {
    return "rapidmoe " RAPIDMOE_VERSION " (llama.cpp " RAPIDMOE_LLAMA_COMMIT ")";
}

int64_t rapidmoe_llama_probe_add(int64_t delta) {
    return g_probe.fetch_add(delta) + delta;
}

int32_t rapidmoe_llama_attach_residual(const llama_model * model, const char * path, char * err, size_t err_size) {
    const std::string msg = rapidmoe_residual_attach(model, path);
    if (msg.empty()) {
        return 0;
    }
    if (err != nullptr && err_size > 0) {
        const size_t n = std::min(msg.size(), err_size - 1);
        std::memcpy(err, msg.data(), n);
        err[n] = '\0';
    }
    return -1;
}

int32_t rapidmoe_llama_detach_residual(const llama_model * model) {
    return rapidmoe_residual_detach(model) ? 1 : 0;
}

int32_t rapidmoe_llama_set_n_critical(const llama_model * model, int32_t n_critical) {
    rapidmoe_residual_state * st = rapidmoe_residual_get(model);
    if (st == nullptr) {
        return -1;
    }
    st->n_critical = std::clamp<int32_t>(n_critical, 0, st->n_expert_used);
    return st->n_critical;
}

int32_t rapidmoe_llama_counters(const llama_model * model, int64_t * out, int32_t n_layer_max, bool reset) {
    rapidmoe_residual_state * st = rapidmoe_residual_get(model);
    if (st == nullptr) {
        return 0;
    }
    const int32_t n = std::min<int32_t>(n_layer_max, (int32_t) st->layers.size());
    for (int32_t i = 0; i < n; ++i) {
        auto & c = *st->layers[i].counters;
        out[3 * i + 0] = reset ? c.tokens.exchange(0) : c.tokens.load();
        out[3 * i + 1] = reset ? c.slots.exchange(0) : c.slots.load();
        out[3 * i + 2] = reset ? c.critical_slots.exchange(0) : c.critical_slots.load();
    }
    return n;
}
