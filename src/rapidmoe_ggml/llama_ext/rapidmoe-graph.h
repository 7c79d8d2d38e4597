// RapidMoE's hook into llama.cpp's MoE FFN builder (called by patches/0001-graph-moe-ffn-hook.patch).
// Internal to libllama: it sees llama.cpp's private graph types, so it is compiled as part of libllama.
#pragma once

#include "llama-graph.h"

// Every argument of llm_graph_context::build_moe_ffn, by name, so the hook's signature does not track theirs.
struct rapidmoe_moe_args {
    ggml_tensor * cur;           // [n_embd, n_tokens]
    ggml_tensor * gate_inp;      // router [n_embd, n_expert]
    ggml_tensor * gate_inp_b;
    ggml_tensor * up_exps;       // [n_embd, n_ff, n_expert]
    ggml_tensor * up_exps_b;
    ggml_tensor * gate_exps;     // [n_embd, n_ff, n_expert]
    ggml_tensor * gate_exps_b;
    ggml_tensor * down_exps;     // [n_ff, n_embd, n_expert]
    ggml_tensor * down_exps_b;
    ggml_tensor * exp_probs_b;   // selection bias (DeepSeek-V3), [n_expert]
    int64_t       n_expert;
    int64_t       n_expert_used;
    llm_ffn_op_type type_op;
    bool          norm_w;
    float         w_scale;
    llama_expert_gating_func_type gating_op;
    int           il;
    ggml_tensor * probs_in;
    ggml_tensor * gate_up_exps;  // merged gate+up form, [n_embd, 2*n_ff, n_expert]
    ggml_tensor * gate_up_exps_b;
    ggml_tensor * up_exps_s;
    ggml_tensor * gate_exps_s;
    ggml_tensor * down_exps_s;
    ggml_tensor * selected_experts_in;
};

// Returns the MoE FFN output built our way when the graph's model has a residual sidecar attached,
// nullptr otherwise (the caller then builds the stock graph, so behaviour and speed are stock).
ggml_tensor * rapidmoe_build_moe_ffn(const llm_graph_context & g, const rapidmoe_moe_args & a);
