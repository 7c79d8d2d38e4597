// RapidMoE's split expert routing hooks in llama.cpp's MoE FFN builder (called by
// patches/0001-graph-moe-split-hooks.patch). Internal to libllama: it sees llama.cpp's private graph types.
//
//   [Router] -> selected, weights -> begin: critical ids (UMIA: top-r by weight, -1 elsewhere), keep mask
//   [up]   WQ all k slots  + WR residual, critical slots only (masked mul_mat_id)
//   [gate] WQ all k slots  + WR residual, critical slots only
//   [down] WQ all k slots, critical slots replaced by the Q4 copy (or + the WR residual)
//   -> weighting and sum: stock
#pragma once

#include "llama-graph.h"

struct rapidmoe_layer_residual;

// One layer's split inside one graph build. Inactive (layer == nullptr): every hook returns its input.
struct rapidmoe_moe_split {
    const llm_graph_context *       g        = nullptr;
    const rapidmoe_layer_residual * layer    = nullptr;
    ggml_tensor *                   x        = nullptr; // expert input  [n_embd, 1, n_tokens]
    ggml_tensor *                   crit_ids = nullptr; // [n_expert_used, n_tokens], -1 for non-critical slots
    ggml_tensor *                   keep     = nullptr; // [1, n_expert_used, n_tokens], 1 non-critical, 0 critical
    int                             il       = -1;
    bool                            skip_noncritical = false; // drop baseline: WQ computes critical slots only
};

rapidmoe_moe_split rapidmoe_moe_begin(const llm_graph_context & g, ggml_tensor * x, ggml_tensor * selected,
                                      ggml_tensor * weights, const ggml_tensor * up_exps,
                                      const ggml_tensor * gate_exps, const ggml_tensor * down_exps, int il);
ggml_tensor * rapidmoe_moe_up(const rapidmoe_moe_split & s, ggml_tensor * up);     // [n_ff, n_expert_used, n_tokens]
ggml_tensor * rapidmoe_moe_gate(const rapidmoe_moe_split & s, ggml_tensor * gate); // [n_ff, n_expert_used, n_tokens]
ggml_tensor * rapidmoe_moe_down(const rapidmoe_moe_split & s, ggml_tensor * experts, ggml_tensor * act);
