// UMIA (Unified Multi-Level Importance Arbitration): how many of a token's top-k experts are critical, decided
// inside the graph from the token's routing weights, its layer and the phase, by parameters Python rewrites
// between calls (a small F32 tensor) without rebuilding anything. The formula and its parameters: docs/umia.md.
//
// Policy tensor, F32 ne = [RAPIDMOE_UMIA_ROW, n_layer + 1]:
//   row 0        [phase_mode, 0, 0, 0]     phase_mode -1: the phase the graph was built for; 0 decode; 1 prefill
//   row 1 + il   [tau_decode, tau_prefill, r_min, r_max] of layer il
// For a token with top-k weights w sorted descending, r = the smallest count whose cumulative weight reaches
// tau * sum(w) (tau <= 0 gives 0), then clamped to [r_min, r_max]; ties keep the router's slot order.
#pragma once

#include "ggml.h"
#include "rapidmoe-llama.h"

#include <array>
#include <atomic>
#include <cstdint>

constexpr int RAPIDMOE_UMIA_MAX_K = RAPIDMOE_LLAMA_MAX_TOP_K;
constexpr int RAPIDMOE_UMIA_ROW = 4;

enum rapidmoe_umia_phase : int { RAPIDMOE_UMIA_DECODE = 0, RAPIDMOE_UMIA_PREFILL = 1 };

// One MoE layer in one phase (the graph's): what the op needs besides its tensors, and the r histogram.
struct rapidmoe_umia_site {
    int il = -1;
    int phase = RAPIDMOE_UMIA_DECODE;
    std::array<std::atomic<int64_t>, RAPIDMOE_UMIA_MAX_K + 1> hist{}; // hist[r]: tokens given r critical slots
};

// r for one token: w points at k weights `stride` bytes apart; order receives the slots by weight, descending.
int rapidmoe_umia_n_critical(const float * w, int k, size_t stride, float tau, int r_min, int r_max, int * order);

// dst I32 [k, T, 2]: plane 0 = the token's expert id in its critical slots, -1 elsewhere; plane 1 = the expert id in
// its non-critical slots, -1 elsewhere (the ids of copy-mode down's WQ matmul: no node of its own).
// src[0] weights [1, k, T] F32, src[1] selected [k, T] I32, src[2] policy; userdata: rapidmoe_umia_site.
void rapidmoe_umia_critical_ids_op(ggml_tensor * dst, int ith, int nth, void * userdata);

// Write the fixed-r policy (every layer, both phases: r_min = r_max = r, phase from the graph) into `policy`.
void rapidmoe_umia_set_fixed(ggml_tensor * policy, int r);
// The same into p [n_rows, RAPIDMOE_UMIA_ROW] (n_rows = n_layer + 1).
void rapidmoe_umia_fixed_policy(float * p, int64_t n_rows, int r);

// Test entry behind rapidmoe_llama_umia_eval (rapidmoe-llama.h): the op alone on the CPU backend.
int32_t rapidmoe_umia_eval(const float * weights, int64_t n_tokens, int32_t k, const float * policy, int32_t n_layer,
                           int32_t il, int32_t phase, int32_t * ids_out, int64_t * hist_out);

// Build the op over `weights` [1, k, T] and `selected` [k, T] in ctx (no_alloc is fine): the op's node [k, T, 2]
// (the one to name and place), the critical ids [k, T] (a view of plane 0) and the non-critical ids [k, T] (a view
// of plane 1).
struct rapidmoe_umia_ids {
    ggml_tensor * node = nullptr;
    ggml_tensor * critical = nullptr;
    ggml_tensor * noncritical = nullptr;
};
rapidmoe_umia_ids rapidmoe_umia_critical_ids(ggml_context * ctx, ggml_tensor * weights, ggml_tensor * selected,
                                             ggml_tensor * policy, rapidmoe_umia_site * site);
