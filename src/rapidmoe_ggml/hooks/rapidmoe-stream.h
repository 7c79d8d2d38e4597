// Prefill streaming for layers with a per-expert WQ cache (rapidmoe-expert-cache.h): a ubatch of at least the
// model's threshold of tokens computes every WQ slot of such a layer on the cache's device from the stacked host
// tensors, which ggml's scheduler copies there for the split (as stock llama.cpp's op offload streams CPU-resident
// experts to a GPU for batches of 32+ tokens), instead of the misses on the CPU and the hits on the device. Worth it
// when the misses' compute on the CPU costs more than moving the layer's experts over the link: the threshold
// comes from the latency model (python/rapidmoe/umia/device.py). The residuals stay on the CPU (overlapped with the
// device's work unless overlap is off). Exact: each slot is the same expert's WQ matmul, on another backend.
#pragma once

#include "ggml.h"

#include <cstdint>

struct llama_model;

// ubatches of at least n_tokens tokens stream (0: never); read when a graph is built (set it before a context)
void rapidmoe_stream_set_min_batch(const llama_model * model, int32_t n_tokens);
int32_t rapidmoe_stream_get_min_batch(const llama_model * model);
// the threshold of the model whose expert cache holds the layer with routed-expert up tensor `up_exps` (0: none)
int32_t rapidmoe_stream_min_batch_of(const ggml_tensor * up_exps);
