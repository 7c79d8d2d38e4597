// RapidMoE code compiled into libllama: the C API additions declared in rapidmoe-llama.h.
// The graph hooks (rapidmoe-graph.cpp) and the sidecar state (rapidmoe-residual.cpp) live beside it.
#include "rapidmoe-llama.h"

#include "rapidmoe-expert-cache.h"
#include "rapidmoe-residual.h"

#include "llama-model.h" // llama_internal_get_tensor_map

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

// 0 for no error; else the message copied (truncated, NUL-terminated) into err and -1
static int32_t report(const std::string & msg, char * err, size_t err_size) {
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

int32_t rapidmoe_llama_attach_residual(const llama_model * model, const char * path, char * err, size_t err_size) {
    return report(rapidmoe_residual_attach(model, path), err, err_size);
}

int32_t rapidmoe_llama_expert_cache_set(const llama_model * model, int32_t il, const int32_t * ids, int32_t n_ids,
                                        const char * device, char * err, size_t err_size) {
    return report(rapidmoe_expert_cache_set(model, il, ids, n_ids, device), err, err_size);
}

int32_t rapidmoe_llama_detach_residual(const llama_model * model) {
    return rapidmoe_residual_detach(model) ? 1 : 0;
}

int32_t rapidmoe_llama_set_n_critical(const llama_model * model, int32_t n_critical) {
    rapidmoe_residual_state * st = rapidmoe_residual_get(model);
    if (st == nullptr) {
        return -1;
    }
    const int32_t r = std::clamp<int32_t>(n_critical, 0, st->n_expert_used);
    rapidmoe_umia_set_fixed(st->policy, r);
    return r;
}

int32_t rapidmoe_llama_set_policy(const llama_model * model, const float * params, int64_t n_params) {
    rapidmoe_residual_state * st = rapidmoe_residual_get(model);
    if (st == nullptr || params == nullptr || n_params != ggml_nelements(st->policy)) {
        return -1;
    }
    std::memcpy(st->policy->data, params, ggml_nbytes(st->policy));
    return 0;
}

int64_t rapidmoe_llama_get_policy(const llama_model * model, float * out, int64_t n_max) {
    rapidmoe_residual_state * st = rapidmoe_residual_get(model);
    if (st == nullptr) {
        return -1;
    }
    const int64_t n = ggml_nelements(st->policy);
    if (out != nullptr && n_max >= n) {
        std::memcpy(out, st->policy->data, ggml_nbytes(st->policy));
    }
    return n;
}

int32_t rapidmoe_llama_set_skip_noncritical(const llama_model * model, bool skip) {
    rapidmoe_residual_state * st = rapidmoe_residual_get(model);
    if (st == nullptr) {
        return -1;
    }
    st->skip_noncritical = skip;
    return 0;
}

int32_t rapidmoe_llama_set_overlap(const llama_model * model, int32_t mode, int32_t n_threads) {
    rapidmoe_residual_state * st = rapidmoe_residual_get(model);
    if (st == nullptr || mode < RAPIDMOE_OVERLAP_OFF || mode > RAPIDMOE_OVERLAP_ON || st->worker == nullptr) {
        return -1;
    }
    st->overlap_mode = mode;
    st->worker->set_n_threads(n_threads);
    return 0;
}

int32_t rapidmoe_llama_overlap_stats(const llama_model * model, int64_t * out, bool reset) {
    rapidmoe_residual_state * st = rapidmoe_residual_get(model);
    if (st == nullptr) {
        return 0;
    }
    for (int stage = 0; stage < RAPIDMOE_OVERLAP_N_STAGES; ++stage) {
        auto & t = st->overlap_timing[stage];
        std::atomic<int64_t> * f[5] = { &t.n, &t.cpu_ns, &t.device_ns, &t.wait_ns, &t.wall_ns };
        for (int i = 0; i < 5; ++i) {
            out[5 * stage + i] = reset ? f[i]->exchange(0) : f[i]->load();
        }
    }
    return RAPIDMOE_OVERLAP_N_STAGES;
}

int32_t rapidmoe_llama_r_histogram(const llama_model * model, int64_t * out, int32_t n_layer_max, bool reset) {
    rapidmoe_residual_state * st = rapidmoe_residual_get(model);
    if (st == nullptr) {
        return 0;
    }
    const int32_t n = std::min<int32_t>(n_layer_max, (int32_t) st->layers.size());
    const int w = RAPIDMOE_UMIA_MAX_K + 1;
    for (int32_t i = 0; i < n; ++i) {
        for (int phase = 0; phase < 2; ++phase) {
            auto & h = st->layers[i].sites[phase]->hist;
            for (int r = 0; r < w; ++r) {
                out[((int64_t) i * 2 + phase) * w + r] = reset ? h[r].exchange(0) : h[r].load();
            }
        }
    }
    return n;
}

int32_t rapidmoe_llama_counters(const llama_model * model, int64_t * out, int32_t n_layer_max, bool reset) {
    rapidmoe_residual_state * st = rapidmoe_residual_get(model);
    if (st == nullptr) {
        return 0;
    }
    const int32_t n = std::min<int32_t>(n_layer_max, (int32_t) st->layers.size());
    for (int32_t i = 0; i < n; ++i) {
        int64_t tokens = 0, crit = 0;
        for (int phase = 0; phase < 2; ++phase) {
            auto & h = st->layers[i].sites[phase]->hist;
            for (int r = 0; r <= RAPIDMOE_UMIA_MAX_K; ++r) {
                const int64_t c = reset ? h[r].exchange(0) : h[r].load();
                tokens += c;
                crit += c * r;
            }
        }
        out[3 * i + 0] = tokens;
        out[3 * i + 1] = tokens * st->n_expert_used;
        out[3 * i + 2] = crit;
    }
    return n;
}

int32_t rapidmoe_llama_umia_eval(const float * weights, int64_t n_tokens, int32_t k, const float * policy,
                                 int32_t n_layer, int32_t il, int32_t phase, int32_t * ids_out, int64_t * hist_out) {
    return rapidmoe_umia_eval(weights, n_tokens, k, policy, n_layer, il, phase, ids_out, hist_out);
}

const char * rapidmoe_llama_tensor_buffer(const llama_model * model, const char * name) {
    if (model == nullptr || name == nullptr) {
        return nullptr;
    }
    const ggml_tensor * t = nullptr;
    for (const auto & [tname, tensor] : llama_internal_get_tensor_map(model)) {
        if (tname == name) {
            t = tensor;
            break;
        }
    }
    if (t == nullptr) {
        const rapidmoe_residual_state * st = rapidmoe_residual_get(model);
        t = st != nullptr && st->ctx != nullptr ? ggml_get_tensor(st->ctx, name) : nullptr;
    }
    if (t == nullptr) {
        t = rapidmoe_expert_cache_tensor(model, name);
    }
    return t != nullptr && t->buffer != nullptr ? ggml_backend_buffer_name(t->buffer) : nullptr;
}
