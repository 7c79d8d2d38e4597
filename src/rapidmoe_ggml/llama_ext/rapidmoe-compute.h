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
#pragma once

#include "ggml.h"

#include <cstdint>
#include <memory>
#include <vector>

struct llama_model;
struct rapidmoe_residual_state;
struct rapidmoe_layer_residual;
struct rapidmoe_expert_cache_layer;

using rapidmoe_expert_cache_layers = std::vector<std::shared_ptr<rapidmoe_expert_cache_layer>>; // index = layer

// bumped by every attach, detach and cache change (of any model): graphs built before are rebuilt
uint64_t rapidmoe_attach_generation();
void rapidmoe_attach_generation_bump();

class rapidmoe_ubatch_guard {
  public:
    // graph_slot: the llm_graph_result the ubatch's graph lives in (what llama.cpp reuses)
    rapidmoe_ubatch_guard(const llama_model & model, const void * graph_slot);
    ~rapidmoe_ubatch_guard();
    rapidmoe_ubatch_guard(const rapidmoe_ubatch_guard &) = delete;
    rapidmoe_ubatch_guard & operator=(const rapidmoe_ubatch_guard &) = delete;

    bool can_reuse() const;
    void built();

    // the innermost guard of the calling thread, nullptr outside one
    static const rapidmoe_ubatch_guard * current();
    const rapidmoe_layer_residual * find_residual(const ggml_tensor * down_exps) const;
    const rapidmoe_expert_cache_layer * find_cache(const ggml_tensor * up_exps) const;

  private:
    const void * slot_;
    uint64_t generation_;  // when the snapshot was taken
    bool consistent_;      // nothing was attached or detached while it was taken
    std::shared_ptr<rapidmoe_residual_state> residual_;
    std::shared_ptr<const rapidmoe_expert_cache_layers> cache_;
    const rapidmoe_ubatch_guard * outer_;
};
