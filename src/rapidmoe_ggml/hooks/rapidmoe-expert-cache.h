// A per-expert WQ cache on a device: copies of some routed experts' WQ slices (gate, up, down) of a layer in a
// device buffer, while the stacked expert tensors stay in host memory. llama.cpp's placement (-ngl, -ot) can
// only move a layer's experts all together (one stacked tensor per role); the planner's cache is per expert.
//
// In the graph (rapidmoe-graph.cpp), per cached layer and per WQ matmul:
//   route(selected) -> slot ids [k, T] (misses -> slot 0), hit mask [1, k, T], miss ids [k, T] (-1 on hits)
//   WQ = mul_mat_id_masked(stacked CPU weights, x, miss ids) + mul_mat_id(cache, x, slot ids) * hit mask
// so a hit is the device's value exactly and a miss the CPU's (the device computes slot 0 for a miss, a real
// expert's finite output, multiplied by 0). The route ops run on the CPU and count hits per layer.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

struct llama_model;

struct rapidmoe_expert_cache_layer {
    int il = -1;
    const ggml_tensor * base_up = nullptr;   // the model's stacked expert tensors (host memory)
    const ggml_tensor * base_gate = nullptr;
    const ggml_tensor * base_down = nullptr;
    ggml_tensor * up = nullptr;              // [.., .., n_cached] on the device; nullptr when nothing is cached
    ggml_tensor * gate = nullptr;
    ggml_tensor * down = nullptr;
    std::vector<int32_t> slot_of;            // expert id -> cache slot, -1 when not cached
    std::vector<int32_t> expert_of;          // cache slot -> expert id
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    std::atomic<int64_t> hits{0};            // expert slots (token x top-k) served from the cache
    std::atomic<int64_t> slots{0};           // all expert slots routed through this layer
    std::vector<std::atomic<int64_t>> uses;  // per expert: slots routed to it (the refresh policy's input)
    // lru policy (GPU-centric on-demand loading): before the layer computes, the ubatch's uncached experts are
    // copied into the slots of the least recently used experts it does not need; those that find no slot stay
    // misses (CPU). Done by the first of the layer's three route ops in each ubatch (each runs once per compute).
    bool lru = false;
    std::vector<int64_t> last_use;           // per slot: the admission clock when its expert was last needed
    int64_t clock = 0;
    int64_t route_calls = 0;
    std::atomic<int64_t> copies{0};          // experts copied host -> device by the lru policy
    std::atomic<int64_t> bytes_demand{0};    // host -> device bytes copied before the layer could compute
    std::atomic<int64_t> bytes_prefetch{0};  // host -> device bytes copied ahead (moepic's next-layer prefetch)
    std::atomic<int64_t> wait_us{0};         // time the computing thread waited for this layer's copies

    // Transfers (every policy): copies go through a second backend instance of the cache's device (its own
    // stream on CUDA; on RPC the client's queue), so they run while the calling thread and the device compute;
    // each layer's copies are fenced by its event, and the layer's device-side route ops (slot ids, hit mask)
    // wait for it. With async off every batch of copies is waited for at once.
    ggml_backend_dev_t dev = nullptr;
    std::shared_ptr<struct rapidmoe_xfer_queue> xfer;
    ggml_backend_event_t event = nullptr;    // nullptr where the device has no events: the queue is synchronized
    bool xfer_pending = false;

    // moepic policy (MoEpic's vertical split): each expert's leading n_top rows of the intermediate dimension
    // (gate/up rows, down's leading n_top columns) are its top segment. The tops of up to top_capacity experts
    // stay resident (LRU); the slots above (up/gate/down) are then a work area rebuilt each ubatch: a needed
    // expert's top is copied device -> device from the top store when resident, its bottom (or all of it) host
    // -> device; the next MoE layer's experts, predicted from this layer's input by its router, are assembled in
    // its work area ahead (while this layer computes). Experts that find no work slot run on the CPU.
    bool moepic = false;
    int64_t n_top = 0;
    int32_t top_capacity = 0;
    ggml_tensor * top_up = nullptr;          // [n_embd, n_top, top_capacity]
    ggml_tensor * top_gate = nullptr;
    ggml_tensor * top_down = nullptr;        // [n_top, n_embd, top_capacity]
    ggml_context * top_ctx = nullptr;
    ggml_backend_buffer_t top_buf = nullptr;
    std::vector<int32_t> top_slot_of;        // expert id -> top slot, -1
    std::vector<int32_t> top_expert_of;      // top slot -> expert id, -1 when empty
    std::vector<int64_t> top_last_use;
    int64_t top_clock = 0;
    std::vector<int32_t> prefetched;         // work slot -> expert assembled ahead for the coming ubatch, -1
    size_t expert_bytes = 0;                 // one expert's gate + up + down slices
    size_t top_bytes = 0;                    // its top segment
    // the prediction target: the next MoE layer (its router and selection bias, gating, whether it is the
    // model's last layer, which computes only the output rows)
    int next_il = -1;
    const ggml_tensor * next_up_exps = nullptr;
    ggml_tensor * next_router = nullptr;
    ggml_tensor * next_bias = nullptr;
    bool next_sigmoid = false;
    bool next_is_last = false;
    int32_t n_expert_used = 0;
    ~rapidmoe_expert_cache_layer();
};

using rapidmoe_expert_cache_layers = std::vector<std::shared_ptr<rapidmoe_expert_cache_layer>>; // index = layer

// The one cache lookup: the cache among `layers` of the layer whose routed-expert up tensor is `up_exps`, nullptr
// when there is none. A graph build searches through rapidmoe_expert_cache_find (rapidmoe-compute.h): the caches
// its ubatch guard holds, or outside one the registry:
const rapidmoe_expert_cache_layer * rapidmoe_expert_cache_layer_of(const rapidmoe_expert_cache_layers & layers,
                                                                   const ggml_tensor * up_exps);
// the same over every model's caches (the pointer is valid until the caches are cleared)
const rapidmoe_expert_cache_layer * rapidmoe_expert_cache_find_attached(const ggml_tensor * up_exps);
// the model's caches (index = layer), held by the caller; nullptr when none is set
std::shared_ptr<const rapidmoe_expert_cache_layers> rapidmoe_expert_cache_get(const llama_model * model);

// Cache experts ids[0..n) of layer il on the device (or buffer type) named `device`; an empty list caches nothing
// but still counts the layer's slots. Returns an empty string or the reason it was refused. Set before a context
// is created: graphs keep pointers to the cache tensors.
std::string rapidmoe_expert_cache_set(const llama_model * model, int il, const int32_t * ids, int n,
                                      const char * device);
bool rapidmoe_expert_cache_clear(const llama_model * model);
// Switch layer il's cache to the lru policy (on-demand loading into least recently used slots) or back to static.
std::string rapidmoe_expert_cache_set_lru(const llama_model * model, int il, bool lru);
// Switch layer il's cache to the moepic policy: top segments of n_top rows of the intermediate dimension, up to
// capacity of them resident; the layer's slots become its work area. Set before a context is created.
std::string rapidmoe_expert_cache_set_moepic(const llama_model * model, int il, int64_t n_top, int capacity);
// async: copies overlap (waited for by the consuming layer) or are waited for at once; every cached layer
std::string rapidmoe_expert_cache_set_async(const llama_model * model, bool async);
// Put in_expert into out_expert's slot (between decodes only); empty string or the reason it was refused.
std::string rapidmoe_expert_cache_replace(const llama_model * model, int il, int32_t out_expert, int32_t in_expert);
// the buffer name of a cache tensor ("blk.N.ffn_up_exps.cache"), nullptr when there is none
const char * rapidmoe_expert_cache_buffer_name(const llama_model * model, const char * name);

// The route ops for one layer, pinned to the CPU by the caller. selected [k, T] I32.
struct rapidmoe_expert_cache_route {
    ggml_tensor * slot_ids = nullptr; // I32 [k, T]: the slot of a hit, 0 for a miss (nullptr: nothing cached)
    ggml_tensor * hit_mask = nullptr; // F32 [1, k, T]: 1 hit, 0 miss (nullptr: nothing cached)
    ggml_tensor * miss_ids = nullptr; // I32 [k, T]: the expert id of a miss, -1 for a hit; counts the hits
};
rapidmoe_expert_cache_route rapidmoe_expert_cache_route_ops(ggml_context * ctx, const rapidmoe_expert_cache_layer * layer,
                                                            ggml_tensor * selected);
// moepic's prediction op for `next` (userdata): src[0] = the next router's logits [n_expert, rows], src[1] = this
// layer's miss ids (so it runs after this layer's own copies), src[2] = the selection bias when there is one.
// Assembles the union of the rows' top-k experts in next's work area. CPU only.
ggml_tensor * rapidmoe_expert_cache_prefetch_op(ggml_context * ctx, const rapidmoe_expert_cache_layer * next,
                                                ggml_tensor * logits, ggml_tensor * miss_ids, ggml_tensor * bias);
