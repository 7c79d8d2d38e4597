// A residual sidecar attached to a loaded model: its tensors in CPU memory, the UMIA policy tensor and the
// per-layer r histograms. A graph build finds a layer's residual by the model's own down_exps tensor (what it sees).
//
// Lifetime: the registry holds each state by shared_ptr; every user holds one for its whole use (the C API
// calls, and a ubatch's graph build + compute through rapidmoe_ubatch_guard, rapidmoe-compute.h), so a detach
// while a graph computes frees the sidecar when that compute ends, never under it.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include "rapidmoe-overlap.h"
#include "rapidmoe-umia.h"

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

struct llama_model;
struct llama_hparams;
struct llama_file;
struct llama_mmap;

struct rapidmoe_residual_state;

// The sidecar's codec, from its rapidmoe.residual.codec key (absent: the residual codec; python/rapidmoe/resplit/
// codecs/ writes it): what its tensors are and which ops a layer's critical slots run (rapidmoe-graph.cpp switches on
// it). A codec with its own kernel adds its id here, its row to the loader's CODECS table and its case to the graph's
// switch.
enum rapidmoe_codec_id {
    RAPIDMOE_CODEC_RESIDUAL, // no key: WR residuals (.wr) and down's copy (.hi) in ggml types, masked matmuls
    RAPIDMOE_CODEC_REFINE,   // "q3k-refine1": bit planes (.rf) refining the model's own Q3_K experts, the refine op
};

struct rapidmoe_layer_residual {
    rapidmoe_residual_state * state = nullptr;
    int il = -1;
    const ggml_tensor * base_up = nullptr;   // the model's WQ tensors this residual belongs to
    const ggml_tensor * base_gate = nullptr;
    const ggml_tensor * base_down = nullptr;
    const ggml_tensor * base_gate_up = nullptr; // the merged gate_up tensor (then base_up/base_gate are nullptr)
    ggml_tensor * up_wr = nullptr;           // residuals [n_embd, n_ff, n_expert]
    ggml_tensor * gate_wr = nullptr;
    ggml_tensor * gate_up_wr = nullptr;      // merged layout: the residual of gate_up [n_embd, 2*n_ff, n_expert]
    bool scaled = false;                     // the model has per-expert scales (ffn_*_exps_s): no overlap
    ggml_tensor * down_hi = nullptr;         // copy of down (down_is_copy) or its residual
    bool down_is_copy = true;
    // the sidecar's codec; RAPIDMOE_CODEC_REFINE (rapidmoe-refine.h): up_wr, gate_wr and down_hi are then bit planes
    // I8 [n_in/8, n_out, n_expert] refining the model's own Q3_K experts, computed with them in one op
    rapidmoe_codec_id codec = RAPIDMOE_CODEC_RESIDUAL;
    // UMIA's op state and r histogram, one per phase (index rapidmoe_umia_phase)
    std::array<std::unique_ptr<rapidmoe_umia_site>, 2> sites = { std::make_unique<rapidmoe_umia_site>(),
                                                                 std::make_unique<rapidmoe_umia_site>() };
    // the begin/join ops' userdata when this layer overlaps its residual work with the device's (per stage)
    std::array<rapidmoe_overlap_site, RAPIDMOE_OVERLAP_N_STAGES> overlap;
};

struct rapidmoe_residual_state {
    const llama_model * model = nullptr;
    int n_expert_used = 0;
    // UMIA parameters (rapidmoe-umia.h), CPU memory, read at compute time. Written only while no ubatch of this
    // model computes (rapidmoe_residual_set_policy): a graph never sees a policy change halfway through.
    ggml_tensor * policy = nullptr;
    std::atomic<bool> skip_noncritical{false}; // "drop" baseline: non-critical slots are not computed at all
    std::atomic<int> overlap_mode{RAPIDMOE_OVERLAP_AUTO}; // rapidmoe_overlap_mode, read at graph build
    std::unique_ptr<rapidmoe_residual_worker> worker;     // runs the overlapped residual work
    std::array<rapidmoe_overlap_timing, RAPIDMOE_OVERLAP_N_STAGES> overlap_timing;
    ggml_context * ctx = nullptr;            // weights in the plain layout: used in place, in the file's mapping
    std::vector<std::unique_ptr<llama_file>> files;  // (with RAPIDMOE_SIDECAR_MMAP=0: read into `buf`)
    std::vector<std::unique_ptr<llama_mmap>> maps;   // one per file with plain weights, kept for the state's life
    std::vector<ggml_backend_buffer_t> bufs_mapped;  // CPU buffers over those mappings (they own no memory)
    ggml_backend_buffer_t buf = nullptr;
    ggml_context * ctx_policy = nullptr;     // the policy, in a plain CPU buffer
    ggml_backend_buffer_t buf_policy = nullptr;
    ggml_context * ctx_repack = nullptr;     // weights in the CPU backend's repacked layout (CPU_REPACK extra buffer)
    ggml_backend_buffer_t buf_repack = nullptr;
    std::vector<rapidmoe_layer_residual> layers; // index = layer; layers without experts stay empty
    // per layer: a graph build reached the layer's split through build_moe_ffn (an architecture whose MoE does
    // not go through it never sets this: split routing cannot apply there, and the load is refused)
    std::unique_ptr<std::atomic<bool>[]> hooked;

    // ubatches of this model between graph build and compute end, and a policy set while one was running
    std::mutex compute_mutex;
    int n_computing = 0;
    std::vector<float> pending_policy; // empty: none pending
    // the first residual worker error since it was last taken (join filled its output with NaN)
    std::mutex error_mutex;
    std::string worker_error;

    void compute_enter(); // applies a pending policy when no other ubatch computes
    void compute_leave(); // applies a pending policy when this was the last one
    ~rapidmoe_residual_state();
};

// the policy as set last (pending or applied); n floats
void rapidmoe_residual_get_policy(rapidmoe_residual_state & st, float * out);
// write the policy now when no ubatch of the model computes, else when the running ones have finished
void rapidmoe_residual_set_policy(rapidmoe_residual_state & st, const float * params);

// The one residual lookup: the layer of `st` whose routed-expert down tensor is `down_exps` (every layout has one;
// up is absent in the merged gate_up layout), nullptr when it has none. A graph build searches through
// rapidmoe_residual_find (rapidmoe-compute.h): the state its ubatch guard holds, or outside one the registry:
const rapidmoe_layer_residual * rapidmoe_residual_layer_of(const rapidmoe_residual_state & st,
                                                           const ggml_tensor * down_exps);
// the same over every attached sidecar (the pointer is valid until the sidecar is detached)
const rapidmoe_layer_residual * rapidmoe_residual_find_attached(const ggml_tensor * down_exps);
// layers with a residual that no graph build has reached through build_moe_ffn (see `hooked`)
std::vector<int> rapidmoe_residual_unhooked(const llama_model * model);

// load `path` into CPU memory and attach it; returns an empty string or the reason it was refused
std::string rapidmoe_residual_attach(const llama_model * model, const char * path);
// unregister the model's sidecar (graphs built from now on are stock; it is freed when its last user lets go)
bool rapidmoe_residual_detach(const llama_model * model);
std::shared_ptr<rapidmoe_residual_state> rapidmoe_residual_get(const llama_model * model);
