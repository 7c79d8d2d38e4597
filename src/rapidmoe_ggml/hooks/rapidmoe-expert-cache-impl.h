// Between the expert cache's two halves (the interface the graph uses is rapidmoe-expert-cache.h):
//   rapidmoe-expert-cache.cpp        its state: the registry, the transfer queues, the counters' export, the C API
//   rapidmoe-expert-cache-admit.cpp  the lru and moepic admission (which experts the slots hold) and the graph ops
// Admission moves weights only through the transfers below; the registry sets a policy up only through the
// functions at the end, with its lock held (between decodes: no graph of the model computes meanwhile).
#pragma once

#include "rapidmoe-expert-cache.h"

#include <cstddef>
#include <cstdint>
#include <string>

// --- transfers (rapidmoe-expert-cache.cpp) ------------------------------------------------------------------------
// Every copy into a layer's cache goes through the transfer queue of its device (see the layer's struct), or, where
// the device has no backend of its own, is a synchronous copy.

// host -> device: size bytes from src (the model's host weights: they outlive the copy) at byte offset off of t
void rapidmoe_xfer_set(rapidmoe_expert_cache_layer * c, ggml_tensor * t, const void * src, size_t off, size_t size);
// the same for n rows of size bytes, stride_t apart in t and stride_src apart in src
void rapidmoe_xfer_set_2d(rapidmoe_expert_cache_layer * c, ggml_tensor * t, const void * src, size_t off, size_t size,
                          size_t n, size_t stride_t, size_t stride_src);
// expert e's WQ slices (up, gate, down) into cache slot `slot`
void rapidmoe_xfer_expert(rapidmoe_expert_cache_layer * c, int32_t e, int32_t slot);
// device -> device: a graph of copy nodes between the layer's buffers, run on the queue (aborts if it fails)
void rapidmoe_xfer_graph(rapidmoe_expert_cache_layer * c, ggml_cgraph * gf);
// after a batch of copies for the layer: fence them (the layer's device-side route ops wait), or wait now
void rapidmoe_xfer_fence(rapidmoe_expert_cache_layer * c);
// before the layer's device work: wait for its fenced copies (the time is counted in wait_us)
void rapidmoe_xfer_wait(rapidmoe_expert_cache_layer * c);

// --- policy set-up (rapidmoe-expert-cache-admit.cpp), under the registry's lock -----------------------------------

// switch the layer to the lru policy (lru) or back to static; its clocks start anew
void rapidmoe_expert_cache_lru_init(rapidmoe_expert_cache_layer & c, bool lru);
// switch the layer (its slots, a transfer queue and no dynamic policy yet: checked by the caller) to the moepic
// policy: top segments of n_top rows, up to capacity of them resident, the next MoE layer as the prediction target.
// Empty string or the reason it was refused.
std::string rapidmoe_expert_cache_moepic_init(const llama_model * model, rapidmoe_expert_cache_layer & c,
                                              int64_t n_top, int capacity);
