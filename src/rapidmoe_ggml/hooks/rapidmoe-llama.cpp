// RapidMoE code compiled into libllama: the C API additions declared in rapidmoe-llama.h.
// The graph hooks (rapidmoe-graph.cpp) and the sidecar state (rapidmoe-residual.cpp) live beside it.
#include "rapidmoe-llama.h"

#include "rapidmoe-expert-cache.h"
#include "rapidmoe-export.h"
#include "rapidmoe-refine-x8.h"
#include "rapidmoe-refine.h"
#include "rapidmoe-residual.h"

#include "ggml-cpu.h"

#include "llama-model.h" // llama_internal_get_tensor_map

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

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

ggml_tensor * rapidmoe_llama_refine_mul_mat_id(ggml_context * ctx, ggml_tensor * wq, ggml_tensor * bits, ggml_tensor * b,
                                               ggml_tensor * ids) {
    return rapidmoe_refine_mul_mat_id(ctx, wq, bits, b, ids);
}

float rapidmoe_llama_refine_dot(int64_t n, const uint8_t * wq, const uint8_t * bits, const float * x, bool reference) {
    std::vector<uint8_t> q8((size_t) (n / 256) * RAPIDMOE_Q8K_BLOCK);
    ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float(x, q8.data(), n);
    return reference ? rapidmoe_refine_dot_ref(n, wq, bits, q8.data()) : rapidmoe_refine_dot(n, wq, bits, q8.data());
}

bool rapidmoe_llama_refine_x8_enabled(void) {
    return rapidmoe_refine_x8_enabled();
}

int32_t rapidmoe_llama_attach_residual(const llama_model * model, const char * path, char * err, size_t err_size) {
    return rapidmoe_report(rapidmoe_residual_attach(model, path), err, err_size);
}

int32_t rapidmoe_llama_residual_unhooked(const llama_model * model, int32_t * out, int32_t n_max) {
    const std::vector<int> layers = rapidmoe_residual_unhooked(model);
    for (int32_t i = 0; i < n_max && i < (int32_t) layers.size(); ++i) {
        out[i] = layers[i];
    }
    return (int32_t) layers.size();
}

int32_t rapidmoe_llama_detach_residual(const llama_model * model) {
    return rapidmoe_residual_detach(model) ? 1 : 0;
}

// Every function below holds the model's sidecar (a shared_ptr) for its whole use: a concurrent detach frees it
// after the last holder lets go, never while one reads it.

int32_t rapidmoe_llama_set_n_critical(const llama_model * model, int32_t n_critical) {
    const auto st = rapidmoe_residual_get(model);
    if (st == nullptr) {
        return -1;
    }
    const int32_t r = std::clamp<int32_t>(n_critical, 0, st->n_expert_used);
    std::vector<float> p((size_t) ggml_nelements(st->policy));
    rapidmoe_umia_fixed_policy(p.data(), st->policy->ne[1], r);
    rapidmoe_residual_set_policy(*st, p.data());
    return r;
}

int32_t rapidmoe_llama_set_policy(const llama_model * model, const float * params, int64_t n_params) {
    const auto st = rapidmoe_residual_get(model);
    if (st == nullptr || params == nullptr || n_params != ggml_nelements(st->policy)) {
        return -1;
    }
    rapidmoe_residual_set_policy(*st, params);
    return 0;
}

int64_t rapidmoe_llama_get_policy(const llama_model * model, float * out, int64_t n_max) {
    const auto st = rapidmoe_residual_get(model);
    if (st == nullptr) {
        return -1;
    }
    const int64_t n = ggml_nelements(st->policy);
    if (out != nullptr && n_max >= n) {
        rapidmoe_residual_get_policy(*st, out);
    }
    return n;
}

int32_t rapidmoe_llama_set_skip_noncritical(const llama_model * model, bool skip) {
    const auto st = rapidmoe_residual_get(model);
    if (st == nullptr) {
        return -1;
    }
    st->skip_noncritical = skip;
    return 0;
}

int32_t rapidmoe_llama_set_overlap(const llama_model * model, int32_t mode, int32_t n_threads) {
    const auto st = rapidmoe_residual_get(model);
    if (st == nullptr || mode < RAPIDMOE_OVERLAP_OFF || mode > RAPIDMOE_OVERLAP_ON || st->worker == nullptr) {
        return -1;
    }
    st->overlap_mode = mode;
    st->worker->set_n_threads(n_threads);
    return 0;
}

int32_t rapidmoe_llama_overlap_stats(const llama_model * model, int64_t * out, bool reset) {
    const auto st = rapidmoe_residual_get(model);
    if (st == nullptr || out == nullptr) {
        return 0;
    }
    return rapidmoe_export_rows(out, RAPIDMOE_OVERLAP_N_STAGES, RAPIDMOE_OVERLAP_N_STAGES, 5,
                                [&](int32_t stage, int64_t * row) {
                                    auto & t = st->overlap_timing[stage];
                                    std::atomic<int64_t> * f[5] = { &t.n, &t.cpu_ns, &t.device_ns, &t.wait_ns,
                                                                    &t.wall_ns };
                                    for (int i = 0; i < 5; ++i) {
                                        row[i] = rapidmoe_take(*f[i], reset);
                                    }
                                });
}

int32_t rapidmoe_llama_r_histogram(const llama_model * model, int64_t * out, int32_t n_layer_max, bool reset) {
    const auto st = rapidmoe_residual_get(model);
    if (st == nullptr) {
        return 0;
    }
    const int w = RAPIDMOE_UMIA_MAX_K + 1;
    return rapidmoe_export_rows(out, n_layer_max, (int32_t) st->layers.size(), 2 * w, [&](int32_t i, int64_t * row) {
        for (int phase = 0; phase < 2; ++phase) {
            auto & h = st->layers[i].sites[phase]->hist;
            for (int r = 0; r < w; ++r) {
                row[phase * w + r] = rapidmoe_take(h[r], reset);
            }
        }
    });
}

int32_t rapidmoe_llama_counters(const llama_model * model, int64_t * out, int32_t n_layer_max, bool reset) {
    const auto st = rapidmoe_residual_get(model);
    if (st == nullptr) {
        return 0;
    }
    return rapidmoe_export_rows(out, n_layer_max, (int32_t) st->layers.size(), 3, [&](int32_t i, int64_t * row) {
        int64_t tokens = 0, crit = 0;
        for (int phase = 0; phase < 2; ++phase) {
            auto & h = st->layers[i].sites[phase]->hist;
            for (int r = 0; r <= RAPIDMOE_UMIA_MAX_K; ++r) {
                const int64_t c = rapidmoe_take(h[r], reset);
                tokens += c;
                crit += c * r;
            }
        }
        row[0] = tokens;
        row[1] = tokens * st->n_expert_used;
        row[2] = crit;
    });
}

int32_t rapidmoe_llama_take_worker_error(const llama_model * model, char * err, size_t err_size) {
    const auto st = rapidmoe_residual_get(model);
    if (st == nullptr) {
        return -1;
    }
    std::string msg;
    {
        std::lock_guard<std::mutex> lock(st->error_mutex);
        msg.swap(st->worker_error);
    }
    return msg.empty() ? 0 : (rapidmoe_report(msg, err, err_size), 1);
}

void rapidmoe_llama_worker_fail_next(void) {
    rapidmoe_overlap_fail_next_task();
}

int32_t rapidmoe_llama_worker_selftest(char * out, size_t out_size) {
    std::string fail;
    auto check = [&](bool ok, const char * what) {
        if (!ok && fail.empty()) {
            fail = what;
        }
    };
    {
        rapidmoe_residual_worker w(1);
        std::atomic<bool> ran{false};
        const uint64_t a = w.submit([&](ggml_backend_t) { ran = true; }, 0);
        check(w.wait(a, 1, nullptr, nullptr) == rapidmoe_residual_worker::DONE && ran, "a task runs and is done");
        check(w.n_tasks() == 0, "a task is forgotten after its wait");
        check(w.wait(a, 1, nullptr, nullptr) == rapidmoe_residual_worker::UNKNOWN, "a forgotten task is unknown");
        std::string err;
        const uint64_t b = w.submit([](ggml_backend_t) { throw std::runtime_error("boom"); }, 0);
        check(b != a, "every task gets a new id");
        check(w.wait(b, 1, nullptr, &err) == rapidmoe_residual_worker::FAILED && err == "boom",
              "an exception reaches wait as the task's error");
        ran = false;
        const uint64_t c = w.submit([&](ggml_backend_t) { ran = true; }, 0);
        check(w.wait(c, 1, nullptr, nullptr) == rapidmoe_residual_worker::DONE && ran, "the worker runs on after one");
        const uint64_t d = w.complete(0);
        check(w.wait(d, 2, nullptr, nullptr) == rapidmoe_residual_worker::DONE && w.n_tasks() == 1,
              "a task waits for all of its join's threads");
        check(w.wait(d, 2, nullptr, nullptr) == rapidmoe_residual_worker::DONE && w.n_tasks() == 0,
              "the last of them forgets it");
        const uint64_t e = w.complete(0, "begin failed");
        check(w.wait(e, 1, nullptr, &err) == rapidmoe_residual_worker::FAILED && err == "begin failed",
              "a task completed as failed reports its error");
    }
    rapidmoe_report(fail.empty() ? std::string("ok") : fail, out, out_size);
    return fail.empty() ? 0 : -1;
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
        const auto st = rapidmoe_residual_get(model); // held while its tensor's buffer is named
        t = st != nullptr && st->ctx != nullptr ? ggml_get_tensor(st->ctx, name) : nullptr;
        if (t == nullptr && st != nullptr && st->ctx_repack != nullptr) { // the sidecar's repacked weights
            t = ggml_get_tensor(st->ctx_repack, name);
        }
        if (t != nullptr) {
            return t->buffer != nullptr ? ggml_backend_buffer_name(t->buffer) : nullptr;
        }
        return rapidmoe_expert_cache_buffer_name(model, name);
    }
    return t->buffer != nullptr ? ggml_backend_buffer_name(t->buffer) : nullptr;
}
