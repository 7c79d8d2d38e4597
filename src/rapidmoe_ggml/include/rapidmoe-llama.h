// RapidMoE's additions to libllama's C API. They are compiled into libllama itself (see
// hooks/), so the ctypes layer and rapidmoe._core reach them in one library instance.
// Additions only: no existing llama.h signature or struct changes (llama-cpp-python mirrors those).
#pragma once

#include "llama.h"

#include <stddef.h>
#include <stdint.h>

// The most experts per token (top-k) split routing handles; the r histogram has RAPIDMOE_LLAMA_MAX_TOP_K + 1 bins
// (r = 0..k) per layer and phase.
#define RAPIDMOE_LLAMA_MAX_TOP_K 64

#ifdef __cplusplus
extern "C" {
#endif

// "rapidmoe <version> (llama.cpp <commit>)": present only in our build of libllama.
LLAMA_API const char * rapidmoe_llama_build_info(void);

// A process-wide counter living in libllama: adds delta and returns the new value.
// Two callers that see each other's additions share one copy of the library.
LLAMA_API int64_t rapidmoe_llama_probe_add(int64_t delta);

// The refine codec's matmul (ops/refine/cpu/rapidmoe-refine.h), for tests: the graph node (a CPU custom op) and one
// row's dot product with x (n floats, quantized to Q8_K first) by the SIMD kernel, or by the scalar reference.
LLAMA_API struct ggml_tensor * rapidmoe_llama_refine_mul_mat_id(struct ggml_context * ctx, struct ggml_tensor * wq,
                                                                struct ggml_tensor * bits, struct ggml_tensor * b,
                                                                struct ggml_tensor * ids);
LLAMA_API float rapidmoe_llama_refine_dot(int64_t n, const uint8_t * wq, const uint8_t * bits, const float * x,
                                          bool reference);
// Whether the op runs its 8-row kernel on repacked WQ (ops/refine/cpu/rapidmoe-refine-x8.h: AVX-512 VNNI and BITALG in
// this build, RAPIDMOE_REFINE_X8 not "0"); otherwise it reads repacked rows back one at a time (the same bits)
LLAMA_API bool rapidmoe_llama_refine_x8_enabled(void);

// Attach a residual sidecar (.wr.gguf) to a loaded model: its tensors are read into CPU memory and every
// later graph of this model runs split expert routing. Returns 0, or -1 with the reason in err.
LLAMA_API int32_t rapidmoe_llama_attach_residual(const struct llama_model * model, const char * path,
                                                 char * err, size_t err_size);
// Layers of the attached sidecar that no graph build has reached through llama.cpp's shared MoE builder
// (build_moe_ffn): an architecture whose MoE is computed elsewhere cannot run split routing. Check after creating a
// context (its reserved graphs are built then). Writes up to n_max layer indices into out; returns their count.
LLAMA_API int32_t rapidmoe_llama_residual_unhooked(const struct llama_model * model, int32_t * out, int32_t n_max);
// Detach the sidecar; returns 1 if one was attached. Safe while a context of the model decodes (on another thread):
// the ubatch computing keeps the sidecar until it ends, then it is freed, and later graphs are rebuilt without it.
// Call before llama_model_free.
LLAMA_API int32_t rapidmoe_llama_detach_residual(const struct llama_model * model);
// UMIA policy (see hooks/rapidmoe-umia.h for the layout and docs/umia.md for the formula): n_params floats,
// 4 x (n_layer + 1): a header row [phase_mode, 0, 0, 0], then per layer [tau_decode, tau_prefill, r_min, r_max].
// Read when a graph is computed, so it applies to the next decode without rebuilding anything; written only between
// ubatches of the model (set while one computes, it applies when that one ends: a graph never sees half a change).
// 0, or -1 when no sidecar is attached or n_params is not the model's size.
LLAMA_API int32_t rapidmoe_llama_set_policy(const struct llama_model * model, const float * params, int64_t n_params);
// Copies the policy (as last set) into out when n_max is large enough; returns its size (-1 without a sidecar).
LLAMA_API int64_t rapidmoe_llama_get_policy(const struct llama_model * model, float * out, int64_t n_max);
// Fixed r: the policy that makes each token's r highest-weight experts critical in every layer and phase
// (0..k, clamped). Returns r, or -1 without a sidecar.
LLAMA_API int32_t rapidmoe_llama_set_n_critical(const struct llama_model * model, int32_t n_critical);
// The "drop" baseline: non-critical slots are not computed at all (no WQ either). Read when a graph is built:
// set it before creating a context. 0, or -1 without a sidecar.
LLAMA_API int32_t rapidmoe_llama_set_skip_noncritical(const struct llama_model * model, bool skip);
// Overlap of the CPU's residual work with the device's WQ work (docs/execution.md): mode 0 off (residual nodes in
// the graph, computed after the device's work), 1 auto (layers whose WQ experts are not in host memory), 2 on
// (every split layer, also all-CPU); n_threads: the residual worker's CPU threads. The mode is read when a graph
// is built (set it before creating a context); the threads apply from the next task. 0, or -1 without a sidecar
// or for a bad mode.
LLAMA_API int32_t rapidmoe_llama_set_overlap(const struct llama_model * model, int32_t mode, int32_t n_threads);
// Overlap timing per stage (0 gate/up, 1 down) since the last reset: out[5*stage + 0] begin/join pairs, then the
// sums in ns of [1] the worker's residual matmuls, [2] begin returned -> join started (the device's work and
// copies), [3] join blocked on the worker after that, [4] begin started -> join done. 2, or 0 without a sidecar.
LLAMA_API int32_t rapidmoe_llama_overlap_stats(const struct llama_model * model, int64_t * out, bool reset);
// The first error of the residual worker (overlap) since the last call, copied into err: 1 if there was one (the
// join it reached filled its output with NaN and the decode's results are not to be used), else 0 (-1 without a
// sidecar). A worker error never terminates the process.
LLAMA_API int32_t rapidmoe_llama_take_worker_error(const struct llama_model * model, char * err, size_t err_size);
// Test entry: run the residual worker alone: one task that succeeds and one that throws (what = its message);
// writes "ok" or the first discrepancy into out. 0 when every check passed.
LLAMA_API int32_t rapidmoe_llama_worker_selftest(char * out, size_t out_size);
// Test entry: the next residual task any worker runs throws (an error for its join to carry).
LLAMA_API void rapidmoe_llama_worker_fail_next(void);
// Per layer i: out[3*i + 0] tokens, [3*i + 1] expert slots, [3*i + 2] critical slots, since the last reset
// (of these counters or of the histogram: they share it). Returns the number of layers written (0 without a sidecar).
// The per-layer functions (counters, r_histogram, expert_cache_stats) given out = NULL return the model's layer
// count without writing or resetting anything: what to allocate.
LLAMA_API int32_t rapidmoe_llama_counters(const struct llama_model * model, int64_t * out, int32_t n_layer_max,
                                          bool reset);
// The r histogram: out[((i * 2 + phase) * (RAPIDMOE_LLAMA_MAX_TOP_K + 1)) + r] = tokens of layer i in phase (0 decode, 1 prefill) given r
// critical slots, since the last reset. Returns the number of layers written (0 without a sidecar).
LLAMA_API int32_t rapidmoe_llama_r_histogram(const struct llama_model * model, int64_t * out, int32_t n_layer_max,
                                             bool reset);
// The name of the backend buffer holding the model's tensor `name` (e.g. "CPU", "CUDA0", "RPC0[127.0.0.1:50052]"),
// or of the attached sidecar's tensor of that name (e.g. "blk.0.ffn_up_exps.wr") or of an expert cache tensor
// ("blk.0.ffn_up_exps.cache"); NULL when there is none.
// Where placement (-ngl, -ot) really put a weight.
LLAMA_API const char * rapidmoe_llama_tensor_buffer(const struct llama_model * model, const char * name);
// Per-expert WQ cache (hooks/rapidmoe-expert-cache.h): copy the WQ gate/up/down slices of experts ids[0..n_ids)
// of MoE layer il into new tensors "blk.<il>.ffn_{up,gate,down}_exps.cache" [.., .., n_ids] in the buffer of
// `device` (a device name such as "RPC0" or a buffer type name such as "RPC0[127.0.0.1:50052]"; one of the model's
// devices, or the CPU). The layer's stacked expert tensors must be in plain host memory (-ot exps=CPU, no repack).
// From then on the layer's graphs compute cached experts on that device and the others on the CPU, with the same
// results per slot as each backend alone. n_ids = 0 caches nothing but counts the layer's slots. Set before a
// context is created, once per layer. 0, or -1 with the reason in err.
LLAMA_API int32_t rapidmoe_llama_expert_cache_set(const struct llama_model * model, int32_t il, const int32_t * ids,
                                                  int32_t n_ids, const char * device, char * err, size_t err_size);
// Free every layer's cache; returns 1 if there was one. Call before llama_model_free.
LLAMA_API int32_t rapidmoe_llama_expert_cache_clear(const struct llama_model * model);
// Per layer i: out[3*i + 0] cached experts (-1: no cache set for the layer), [3*i + 1] expert slots (token x top-k)
// served from the cache, [3*i + 2] all expert slots, since the last reset. Returns the number of layers written
// (0 without a cache).
LLAMA_API int32_t rapidmoe_llama_expert_cache_stats(const struct llama_model * model, int64_t * out,
                                                    int32_t n_layer_max, bool reset);
// Refresh (the rapidmoe policy): put expert in_expert of layer il into the cache slot that held out_expert (its WQ
// slices copied there, then the slot map switched). Between decodes only: not while the model computes a ubatch.
// 0, or -1 with the reason in err (no cache for the layer, out_expert not cached, in_expert cached or out of range).
LLAMA_API int32_t rapidmoe_llama_expert_cache_replace(const struct llama_model * model, int32_t il,
                                                      int32_t out_expert, int32_t in_expert, char * err,
                                                      size_t err_size);
// The lru policy for cached layer il (lru = true): before the layer computes a ubatch, its experts that are not
// cached are copied into the slots of the least recently used experts the ubatch does not need (in expert id
// order); those finding no slot run on the CPU. Hits are counted before the copies. 0, or -1 with the reason.
LLAMA_API int32_t rapidmoe_llama_expert_cache_set_lru(const struct llama_model * model, int32_t il, bool lru,
                                                      char * err, size_t err_size);
// The moepic policy for cached layer il (its slots become a work area): the leading n_top rows of the intermediate
// dimension are an expert's top segment (a multiple of the down type's block), up to `capacity` tops stay resident
// (LRU); before the layer computes, the ubatch's experts are assembled in the work area (resident tops copied
// device -> device, the rest host -> device), and the next MoE layer's predicted experts are assembled ahead. Set
// before a context is created. 0, or -1 with the reason in err.
LLAMA_API int32_t rapidmoe_llama_expert_cache_set_moepic(const struct llama_model * model, int32_t il, int64_t n_top,
                                                         int32_t capacity, char * err, size_t err_size);
// Copies on the cache device's transfer queue overlap compute (async, the default: each layer waits for its own
// copies right before its device work) or are waited for as soon as they are queued. 0, or -1 without a cache.
LLAMA_API int32_t rapidmoe_llama_expert_cache_set_async(const struct llama_model * model, bool async);
// Per layer i: out[3i] = host -> device bytes copied before the layer could compute (lru, moepic), out[3i+1] =
// bytes copied ahead by moepic's prefetch, out[3i+2] = microseconds the computing thread waited for the layer's
// copies, since the last reset. Returns the layer count (out = NULL: just that).
LLAMA_API int32_t rapidmoe_llama_expert_cache_bytes(const struct llama_model * model, int64_t * out,
                                                    int32_t n_layer_max, bool reset);
// Per layer i: out[i] = experts the lru policy copied host -> device since the last reset. Returns the layer count.
LLAMA_API int32_t rapidmoe_llama_expert_cache_copies(const struct llama_model * model, int64_t * out,
                                                     int32_t n_layer_max, bool reset);
// Per expert e of cached layer il: out[e] = expert slots (token x top-k) routed to e since the last reset, cached
// or not. Returns the layer's expert count (out = NULL: just that), 0 when the layer has no cache.
LLAMA_API int32_t rapidmoe_llama_expert_cache_expert_counts(const struct llama_model * model, int32_t il,
                                                            int64_t * out, int32_t n_max, bool reset);
// Prefill streaming (hooks/rapidmoe-stream.h): a ubatch of at least n_tokens tokens computes every WQ slot of each
// layer with a per-expert cache on the cache's device, the stacked host experts copied there for the split, instead
// of the misses on the CPU; n_tokens <= 0 turns it off. Read when a graph is built (set it before a context). Layers
// under the lru policy never stream. Returns the threshold now in force (0: off).
LLAMA_API int32_t rapidmoe_llama_set_stream_min_batch(const struct llama_model * model, int32_t n_tokens);
// Test entry: run UMIA's op on the CPU backend for one layer il of a policy, weights F32 [n_tokens, k] (selected
// ids are the slot numbers 0..k-1), in the given phase (0 decode, 1 prefill; the policy's phase_mode applies).
// ids_out [n_tokens, k], hist_out [k + 1]. 0, or -1 on bad arguments.
LLAMA_API int32_t rapidmoe_llama_umia_eval(const float * weights, int64_t n_tokens, int32_t k, const float * policy,
                                           int32_t n_layer, int32_t il, int32_t phase, int32_t * ids_out,
                                           int64_t * hist_out);

// llama-quantize's type choice for every tensor of the model file at path under llama_ftype ftype (Q4_K_M, ...),
// without quantizing or writing anything: cb(user_data, name, ggml_type) per tensor, in file order. 0, or -1
// when the file cannot be planned (unreadable, unknown architecture, an ftype llama.cpp refuses).
typedef void (*rapidmoe_quant_type_cb)(void * user_data, const char * name, int32_t type);
LLAMA_API int32_t rapidmoe_llama_quant_types(const char * path, int32_t ftype, rapidmoe_quant_type_cb cb,
                                             void * user_data);

#ifdef __cplusplus
}
#endif
