// RapidMoE's split expert routing hooks in llama.cpp's MoE FFN builder (called by
// patches/0001-graph-moe-split-hooks.patch). Internal to libllama: it sees llama.cpp's private graph types.
//
//   [Router] -> selected, weights -> begin: critical ids (UMIA: top-r by weight, -1 elsewhere), keep mask
//   [gate, up] WQ all k slots  + WR residual, critical slots only (masked mul_mat_id)
//   [down]     copy mode: WQ for the non-critical slots only (masked; when WQ is in CPU memory) + the Q4 copy
//              for the critical ones; residual mode: WQ all k slots + the WR residual of the critical ones
//   -> weighting and sum: stock
// The residual work is either plain graph nodes pinned to the CPU (computed after the device's WQ work) or,
// when the layer overlaps (rapidmoe-overlap.h), begin/join ops around the WQ matmuls.
// A layer with a per-expert WQ cache (rapidmoe-expert-cache.h) computes each WQ matmul from the cache on its
// device for cached experts and from the stacked CPU tensor for the others, before any residual is added.
#pragma once

#include "llama-graph.h"

#include "rapidmoe-expert-cache.h"

struct rapidmoe_layer_residual;

// One layer's split inside one graph build. Inactive (no residual layer, no cache): every hook returns its input.
struct rapidmoe_moe_split {
    const llm_graph_context *       g        = nullptr;
    const rapidmoe_layer_residual * layer    = nullptr; // the sidecar's layer (split routing), or nullptr
    const rapidmoe_expert_cache_layer * cache = nullptr; // the layer's expert cache, or nullptr
    rapidmoe_expert_cache_route     route;              // the cache's slot ids, hit mask and miss ids
    ggml_tensor *                   x        = nullptr; // expert input  [n_embd, 1, n_tokens]
    ggml_tensor *                   selected = nullptr; // the router's experts [n_expert_used, n_tokens]
    ggml_tensor *                   crit_ids = nullptr; // [n_expert_used, n_tokens], -1 for non-critical slots
    ggml_tensor *                   noncrit_ids = nullptr; // [n_expert_used, n_tokens], -1 for critical slots
    int                             il       = -1;
    bool                            skip_noncritical = false; // drop baseline: WQ computes critical slots only
    bool                            overlap = false;          // begin/join around the WQ matmuls
    ggml_backend_t                  stream = nullptr;         // prefill streaming: WQ on this backend (the cache's)
};

rapidmoe_moe_split rapidmoe_moe_begin(const llm_graph_context & g, ggml_tensor * x, ggml_tensor * selected,
                                      ggml_tensor * weights, const ggml_tensor * up_exps,
                                      const ggml_tensor * gate_exps, const ggml_tensor * down_exps, int il);
// gate and up [n_ff, n_expert_used, n_tokens], both WQ results, replaced by WQ + the critical slots' residual
void rapidmoe_moe_gate_up(const rapidmoe_moe_split & s, ggml_tensor *& gate, ggml_tensor *& up);
// the merged layout's single WQ matmul [2*n_ff, k, T] + its critical slots' residual (before gate/up are split)
ggml_tensor * rapidmoe_moe_gate_up_merged(const rapidmoe_moe_split & s, ggml_tensor * gate_up);
ggml_tensor * rapidmoe_moe_down(const rapidmoe_moe_split & s, ggml_tensor * experts, ggml_tensor * act);
