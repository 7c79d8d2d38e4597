// What one ubatch's graph (built or reused, then computed) may rely on while it runs: the model's residual
// sidecar and expert cache stay alive, the UMIA policy does not change, and a graph built before either was
// attached or detached is not reused. llama_context::process_ubatch holds a guard from before it builds or
// reuses the graph until the compute returns (patches/0004-context-ubatch-guard.patch).
//
//   guard(model, slot)     snapshot the model's sidecar and cache (shared_ptr), count the ubatch as computing
//   can_reuse()            the slot's graph was built under the attachments this guard holds
//   ... build: rapidmoe_residual_find / rapidmoe_expert_cache_find search the snapshot (this thread) ...
//   built()                the slot's graph now matches the snapshot
//   ~guard                 let go; a detached sidecar is freed here if this was its last user
//
// Dependencies run one way: the guard uses the sidecar (rapidmoe-residual.h) and cache (rapidmoe-expert-cache.h)
// registries and their lookups; they know nothing of it (they bump the generation, rapidmoe-generation.h).
#pragma once

#include "ggml.h"

#include "rapidmoe-expert-cache.h"
#include "rapidmoe-generation.h"

#include <cstdint>
#include <memory>

struct llama_model;
struct rapidmoe_residual_state;
struct rapidmoe_layer_residual;

class rapidmoe_ubatch_guard {
  public:
    // graph_slot: the llm_graph_result the ubatch's graph lives in (what llama.cpp reuses)
    rapidmoe_ubatch_guard(const llama_model & model, const void * graph_slot);
    ~rapidmoe_ubatch_guard();
    rapidmoe_ubatch_guard(const rapidmoe_ubatch_guard &) = delete;
    rapidmoe_ubatch_guard & operator=(const rapidmoe_ubatch_guard &) = delete;

    bool can_reuse() const;
    void built();

  private:
    friend const rapidmoe_layer_residual * rapidmoe_residual_find(const ggml_tensor * down_exps);
    friend const rapidmoe_expert_cache_layer * rapidmoe_expert_cache_find(const ggml_tensor * up_exps);

    const void * slot_;
    uint64_t generation_;  // when the snapshot was taken
    bool consistent_;      // nothing was attached or detached while it was taken
    std::shared_ptr<rapidmoe_residual_state> residual_;
    std::shared_ptr<const rapidmoe_expert_cache_layers> cache_;
    const rapidmoe_ubatch_guard * outer_;
};

// A graph build's lookups: the residual of the layer whose routed-expert down tensor is `down_exps` (every layout
// has one; up is absent in the merged gate_up layout), and the cache of the layer whose up tensor is `up_exps`;
// nullptr when there is none. Inside a guard (a graph build for a compute) only the snapshot the calling thread's
// guard holds is searched, so the pointer stays valid until the compute ends; outside one (the context's reserve
// graphs, never computed) the registries.
const rapidmoe_layer_residual * rapidmoe_residual_find(const ggml_tensor * down_exps);
const rapidmoe_expert_cache_layer * rapidmoe_expert_cache_find(const ggml_tensor * up_exps);
