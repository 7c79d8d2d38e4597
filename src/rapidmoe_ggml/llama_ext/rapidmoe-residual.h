// A residual sidecar attached to a loaded model: its tensors in CPU memory, the critical-expert setting and
// per-layer counters. A graph build finds a layer's residual by the model's own up_exps tensor (what it sees).
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

struct llama_model;
struct llama_hparams;

struct rapidmoe_layer_counters {
    std::atomic<int64_t> tokens{0};         // tokens routed through this layer
    std::atomic<int64_t> slots{0};          // expert slots (tokens x n_expert_used)
    std::atomic<int64_t> critical_slots{0}; // slots computed in high precision
};

struct rapidmoe_residual_state;

struct rapidmoe_layer_residual {
    rapidmoe_residual_state * state = nullptr;
    int il = -1;
    const ggml_tensor * base_up = nullptr;   // the model's WQ tensors this residual belongs to
    const ggml_tensor * base_gate = nullptr;
    const ggml_tensor * base_down = nullptr;
    ggml_tensor * up_wr = nullptr;           // residuals [n_embd, n_ff, n_expert]
    ggml_tensor * gate_wr = nullptr;
    ggml_tensor * down_hi = nullptr;         // copy of down (down_is_copy) or its residual
    bool down_is_copy = true;
    std::unique_ptr<rapidmoe_layer_counters> counters = std::make_unique<rapidmoe_layer_counters>();
};

struct rapidmoe_residual_state {
    const llama_model * model = nullptr;
    int n_expert_used = 0;
    std::atomic<int32_t> n_critical{0};      // fixed r: the r highest-weight of each token's top-k
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    std::vector<rapidmoe_layer_residual> layers; // index = layer; layers without experts stay empty
    ~rapidmoe_residual_state();
};

// the residual of the layer whose routed-expert up tensor is `up_exps`; nullptr when none is attached
const rapidmoe_layer_residual * rapidmoe_residual_find(const ggml_tensor * up_exps);

// load `path` into CPU memory and attach it; returns an empty string or the reason it was refused
std::string rapidmoe_residual_attach(const llama_model * model, const char * path);
bool rapidmoe_residual_detach(const llama_model * model);
rapidmoe_residual_state * rapidmoe_residual_get(const llama_model * model);
