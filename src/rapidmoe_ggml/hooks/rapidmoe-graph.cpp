// Split expert routing inside llama.cpp's MoE FFN: per token, the r highest-weight of its top-k experts are
// critical and get their residual (WR) added to gate/up and their down from the high-precision copy; the
// others use WQ only. Residual matmuls use ggml_mul_mat_id_masked with -1 ids for non-critical slots, so the
// CPU reads residual weights only for critical experts. r comes from UMIA's op (rapidmoe-umia.h), which reads
// its policy tensor when the graph is computed (not built), so the policy changes between calls without
// rebuilding anything. When the WQ experts are on another device the residual work overlaps with theirs
// (rapidmoe-overlap.h). A layer with a per-expert cache (rapidmoe-expert-cache.h) first composes each WQ result
// from the cache's device (cached experts) and the CPU (the others); the residual work then adds to that. When such
// a layer overlaps ("auto" where experts are cached on a device, or "on") the worker computes the misses' WQ and
// the residuals while the device computes the hits: all three at once, summed as the serial graph does.
#include "rapidmoe-graph.h"

#include "rapidmoe-compute.h"
#include "rapidmoe-refine.h"
#include "rapidmoe-residual.h"
#include "rapidmoe-stream.h"

#include "llama-impl.h" // LLAMA_LOG_WARN

#include <initializer_list>

namespace {

// dst [1, k, T] f32 = 1 where the slot is not critical; src[0] = critical ids [k, T]
void keep_mask_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    (void) userdata;
    if (ith != 0) {
        return;
    }
    const ggml_tensor * ids = dst->src[0];
    for (int64_t t = 0; t < ids->ne[1]; ++t) {
        const auto * it = (const int32_t *) ((const char *) ids->data + t * ids->nb[1]);
        auto * out = (float *) ((char *) dst->data + t * dst->nb[2]);
        for (int64_t j = 0; j < ids->ne[0]; ++j) {
            *(float *) ((char *) out + j * dst->nb[1]) = it[j] < 0 ? 1.0f : 0.0f;
        }
    }
}

// whether a weight lives in CPU memory (the plain or a repacked CPU buffer): the CPU can run its masked matmul
bool in_cpu_memory(const ggml_tensor * w) {
    if (w->buffer == nullptr) {
        return false;
    }
    if (ggml_backend_buffer_is_host(w->buffer)) { // also llama.cpp's mmap'd weights (CPU_Mapped: no device)
        return true;
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(w->buffer));
    return dev != nullptr && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
}

// Run this node on the CPU backend whatever other devices claim (the scheduler's assignment, kept until the
// graph is rebuilt). Used for our custom ops and the residual matmuls, whose weights live in CPU memory.
void on_cpu(const llm_graph_context & g, ggml_tensor * t) {
    if (g.sched != nullptr && g.backend_cpu != nullptr) {
        ggml_backend_sched_set_tensor_backend(g.sched, t, g.backend_cpu);
    }
}

// the layer's residual when the sidecar belongs to exactly these expert tensors (separate gate/up, or merged gate_up:
// then up and gate are nullptr)
const rapidmoe_layer_residual * residual_of(ggml_tensor * selected, const ggml_tensor * up_exps,
                                            const ggml_tensor * gate_exps, const ggml_tensor * down_exps, int il) {
    const rapidmoe_layer_residual * found = down_exps != nullptr ? rapidmoe_residual_find(down_exps) : nullptr;
    if (found == nullptr || found->base_gate != gate_exps || found->base_up != up_exps || found->il != il ||
        selected->ne[0] > RAPIDMOE_UMIA_MAX_K) {
        return nullptr;
    }
    return found;
}

const rapidmoe_expert_cache_layer * cache_of(const llm_graph_context & g, const ggml_tensor * up_exps,
                                             const ggml_tensor * gate_exps, const ggml_tensor * down_exps, int il) {
    const rapidmoe_expert_cache_layer * c = up_exps != nullptr ? rapidmoe_expert_cache_find(up_exps) : nullptr;
    // a LoRA adds its own matmuls to build_lora_mm_id's result: the hooks would no longer see the plain WQ matmul
    if (c == nullptr || c->base_gate != gate_exps || c->base_down != down_exps || c->il != il ||
        (g.loras != nullptr && !g.loras->empty())) {
        return nullptr;
    }
    return c;
}

void begin_split(rapidmoe_moe_split & s, const llm_graph_context & g, const rapidmoe_layer_residual & layer,
                 ggml_tensor * selected, ggml_tensor * weights, const ggml_tensor * up_exps) {
    // the phase this graph serves: generation steps put at most one token per sequence in a ubatch
    const int phase = g.ubatch.n_tokens <= g.ubatch.n_seqs_unq ? RAPIDMOE_UMIA_DECODE : RAPIDMOE_UMIA_PREFILL;
    const rapidmoe_umia_ids ids = rapidmoe_umia_critical_ids(g.ctx0, weights, selected, layer.state->policy,
                                                             layer.sites[phase].get()); // [k, T, 2]
    g.cb(ids.node, "rapidmoe_critical_ids", s.il);
    // our custom ops run on the CPU: a device that claims every op (RPC) must not get them (their function
    // pointers mean nothing in another process), and a GPU refuses them anyway
    on_cpu(g, ids.node);
    s.crit_ids = ids.critical;       // [k, T]
    s.noncrit_ids = ids.noncritical; // [k, T]: copy-mode down's WQ ids
    s.layer = &layer;
    s.skip_noncritical = layer.state->skip_noncritical.load();
    const int mode = layer.state->overlap_mode.load();
    const bool wq_on_device = up_exps->buffer != nullptr && !in_cpu_memory(up_exps); // repacked CPU is not host
    s.overlap = mode == RAPIDMOE_OVERLAP_ON || (mode == RAPIDMOE_OVERLAP_AUTO && wq_on_device);
    // the overlap ops know neither per-expert scales nor the merged gate_up: those layers add their residuals in the graph
    s.overlap = s.overlap && !layer.scaled && layer.gate_up_wr == nullptr &&
                layer.codec == RAPIDMOE_CODEC_RESIDUAL; // the overlap ops run the residual codec's matmuls
    layer.state->hooked[layer.il].store(true); // this architecture's MoE reaches the split (checked at load)
}

// moepic: the next MoE layer's router on this layer's input (the rows that layer will compute: the model's last
// layer computes only the output rows), and the op that assembles its predicted experts ahead. It runs after this
// layer's own copies were queued (its input) and before this layer's slot ids (their extra input), so the
// transfers overlap this layer's compute.
void moepic_prefetch(rapidmoe_moe_split & s, const llm_graph_context & g, const rapidmoe_expert_cache_layer & cache,
                     ggml_tensor * x) {
    const rapidmoe_expert_cache_layer * next =
        cache.next_up_exps != nullptr ? rapidmoe_expert_cache_find(cache.next_up_exps) : nullptr;
    if (next == nullptr || !next->moepic || next->il != cache.next_il || s.route.slot_ids == nullptr) {
        return;
    }
    ggml_context * ctx = g.ctx0;
    const int64_t n_embd = x->ne[0], T = ggml_nelements(x) / n_embd;
    ggml_tensor * x2 = ggml_reshape_2d(ctx, ggml_is_contiguous(x) ? x : ggml_cont(ctx, x), n_embd, T);
    const int64_t rows = cache.next_is_last && g.n_outputs < T ? g.n_outputs : T;
    if (rows <= 0) {  // the last layer computes no row of this ubatch (a prompt chunk without outputs)
        return;
    }
    if (rows < T) {
        x2 = ggml_view_2d(ctx, x2, n_embd, rows, x2->nb[1], (size_t) (T - rows) * x2->nb[1]);
    }
    ggml_tensor * logits = ggml_mul_mat(ctx, cache.next_router, x2);  // [n_expert, rows], where the router is
    g.cb(logits, "rapidmoe_cache_next_logits", s.il);
    ggml_tensor * bias = cache.next_sigmoid && cache.next_bias != nullptr && cache.next_bias->type == GGML_TYPE_F32
                             ? cache.next_bias : nullptr;
    ggml_tensor * pf = rapidmoe_expert_cache_prefetch_op(ctx, next, logits, s.route.miss_ids, bias);
    g.cb(pf, "rapidmoe_cache_prefetch", s.il);
    on_cpu(g, pf);
    s.route.slot_ids->src[1] = pf;
}

void begin_cache(rapidmoe_moe_split & s, const llm_graph_context & g, const rapidmoe_expert_cache_layer & cache,
                 ggml_tensor * selected) {
    s.cache = &cache;
    s.route = rapidmoe_expert_cache_route_ops(g.ctx0, &cache, selected);
    if (cache.moepic) {
        moepic_prefetch(s, g, cache, s.x);
    }
    // custom ops: CPU only, like UMIA's (the miss ids also feed the CPU's masked matmuls)
    for (auto [t, name] : { std::pair{ s.route.miss_ids, "rapidmoe_cache_miss_ids" },
                            std::pair{ s.route.slot_ids, "rapidmoe_cache_slot_ids" },
                            std::pair{ s.route.hit_mask, "rapidmoe_cache_hit_mask" } }) {
        if (t != nullptr) {
            g.cb(t, name, s.il);
            on_cpu(g, t);
        }
    }
}

// Prefill streaming (rapidmoe-stream.h): a ubatch of at least the model's threshold computes this cached layer's WQ
// on the cache's device, from the stacked host tensors the scheduler copies there. Not under the lru policy (it
// loads experts into the cache itself). The residuals then overlap with the device's work, as for WQ on a device.
void begin_stream(rapidmoe_moe_split & s, const llm_graph_context & g, const rapidmoe_expert_cache_layer & cache) {
    const int32_t min_batch = rapidmoe_stream_min_batch_of(cache.base_up);
    if (min_batch <= 0 || g.ubatch.n_tokens < (uint32_t) min_batch || cache.up == nullptr || cache.lru ||
        g.sched == nullptr) {
        return;
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(cache.up->buffer));
    for (int i = 0; dev != nullptr && i < ggml_backend_sched_get_n_backends(g.sched); ++i) {
        ggml_backend_t b = ggml_backend_sched_get_backend(g.sched, i);
        if (ggml_backend_get_device(b) == dev) {
            s.stream = b;
        }
    }
    if (s.stream != nullptr && s.layer != nullptr) {
        s.overlap = s.layer->state->overlap_mode.load() != RAPIDMOE_OVERLAP_OFF;
    }
}

}  // namespace

rapidmoe_moe_split rapidmoe_moe_begin(const llm_graph_context & g, ggml_tensor * x, ggml_tensor * selected,
                                      ggml_tensor * weights, const ggml_tensor * up_exps,
                                      const ggml_tensor * gate_exps, const ggml_tensor * down_exps, int il) {
    rapidmoe_moe_split s;
    const rapidmoe_layer_residual * layer = residual_of(selected, up_exps, gate_exps, down_exps, il);
    const rapidmoe_expert_cache_layer * cache = cache_of(g, up_exps, gate_exps, down_exps, il);
    if (layer == nullptr && cache == nullptr) {
        return s;
    }
    s.g = &g;
    s.x = x;
    s.selected = selected;
    s.il = il;
    if (layer != nullptr) {
        begin_split(s, g, *layer, selected, weights, up_exps != nullptr ? up_exps : down_exps);
    }
    // the drop baseline rewrites the WQ matmuls' ids to the critical ones: it is a CPU benchmark and keeps its
    // own meaning, so a layer under it ignores the cache (Python refuses the combination)
    if (cache != nullptr && !s.skip_noncritical) {
        begin_cache(s, g, *cache, selected);
        begin_stream(s, g, *cache);
    }
    return s;
}

namespace {

// The "drop" baseline: the WQ matmul computes critical slots only (its ids become the critical ids, masked).
void wq_critical_only(const rapidmoe_moe_split & s, ggml_tensor * wq) {
    if (s.skip_noncritical && wq->op == GGML_OP_MUL_MAT_ID) {
        wq->src[2] = s.crit_ids;
        wq->op = GGML_OP_MUL_MAT_ID_MASKED; // same shapes and sources as the plain node
    }
}

// r times the per-expert scale build_lora_mm_id gave the WQ result `wq` (its ggml_mul by the selected experts'
// scales, under an expert bias if one was added), so the critical path is scaled as WQ is; r when there is none
ggml_tensor * scaled_like(const rapidmoe_moe_split & s, ggml_tensor * r, const ggml_tensor * wq) {
    if (wq->op == GGML_OP_ADD_ID) {
        wq = wq->src[0];
    }
    if (wq->op != GGML_OP_MUL || wq->src[0]->op != GGML_OP_MUL_MAT_ID) {
        return r;
    }
    return ggml_mul(s.g->ctx0, r, wq->src[1]);
}

// t + the residual matmul of the critical slots (zeros elsewhere): [n_ff, k, T]
ggml_tensor * add_residual(const rapidmoe_moe_split & s, ggml_tensor * t, ggml_tensor * wr, const char * name) {
    ggml_tensor * r = ggml_mul_mat_id_masked(s.g->ctx0, wr, s.x, s.crit_ids);
    s.g->cb(r, name, s.il);
    on_cpu(*s.g, r); // the sidecar is in CPU memory: the residual work is the CPU's
    return ggml_add(s.g->ctx0, t, scaled_like(s, r, t));
}

// The refine codec: the WQ matmul `wq` (llama.cpp's plain MUL_MAT_ID of the model's Q3_K experts) computes the
// non-critical slots only (masked ids) and the refine op the critical ones from the same WQ rows and the sidecar's
// bit plane: each slot computed once, by its path, summed. Returns `wq` unchanged (WQ only, with a warning) where the
// node is not that plain matmul (a LoRA, a bias) or its weights are not in CPU memory: the loader refuses the layouts
// it knows of, so this is a safety net.
ggml_tensor * refine_split(const rapidmoe_moe_split & s, ggml_tensor * wq, ggml_tensor * plane, const char * name) {
    ggml_context * ctx = s.g->ctx0;
    if (wq->op != GGML_OP_MUL_MAT_ID || !rapidmoe_refine_takes(wq->src[0]) || !in_cpu_memory(wq->src[0]) ||
        s.cache != nullptr || s.stream != nullptr) {
        static bool warned = false;
        if (!warned) {
            warned = true;
            LLAMA_LOG_WARN("rapidmoe: layer %d: the refine codec cannot apply to %s here; the layer runs WQ only\n",
                          s.il, ggml_get_name(wq));
        }
        return wq;
    }
    ggml_tensor * fine = rapidmoe_refine_mul_mat_id(ctx, wq->src[0], plane, wq->src[1], s.crit_ids);
    s.g->cb(fine, name, s.il);
    on_cpu(*s.g, fine);
    if (s.skip_noncritical) { // drop baseline: no WQ slot at all
        return fine;
    }
    wq->src[2] = s.noncrit_ids; // UMIA's op wrote them beside the critical ids
    wq->op = GGML_OP_MUL_MAT_ID_MASKED;
    on_cpu(*s.g, wq);
    return ggml_add(ctx, wq, fine);
}

rapidmoe_overlap_site * site(const rapidmoe_moe_split & s, int stage) {
    return const_cast<rapidmoe_overlap_site *>(&s.layer->overlap[stage]);
}

// One WQ matmul of a cached layer: llama.cpp's stacked matmul (CPU weights) computes the misses only (masked ids:
// hits give zero rows, no weights read) and the cache's matmul on its device computes every slot from the slot
// ids (a miss reads slot 0: a real expert's finite output) times the hit mask. Per slot the sum is exactly one
// backend's value: CPU + device * 0 for a miss, 0 + device * 1 for a hit. The parked misses do add rows to slot 0's
// expert, and ggml-cpu (the RPC stand-in) picks its kernel by rows per expert: that expert's hits may round as the
// tiled kernel does where a CPU run used vec_dot (docs/execution.md, "Comparing with a CPU run").
ggml_tensor * cached_wq(const rapidmoe_moe_split & s, ggml_tensor * wq, ggml_tensor * cache, const char * name) {
    if (wq->op != GGML_OP_MUL_MAT_ID) { // not build_lora_mm_id's plain matmul (cache_of and the cache's checks
        return wq;                      // exclude LoRAs, biases and scales): computed on the CPU as loaded
    }
    ggml_context * ctx = s.g->ctx0;
    wq->src[2] = s.route.miss_ids;
    wq->op = GGML_OP_MUL_MAT_ID_MASKED;
    on_cpu(*s.g, wq); // its weights are in host memory, and a device could not skip the masked slots
    if (cache == nullptr) { // nothing of this layer is cached: the CPU computes every slot (and the op counts them)
        return wq;
    }
    // not pinned: the scheduler runs it where the cache's weights are
    ggml_tensor * dev = ggml_mul_mat_id(ctx, cache, wq->src[1], s.route.slot_ids);
    s.g->cb(dev, name, s.il);
    return ggml_add(ctx, wq, ggml_mul(ctx, dev, s.route.hit_mask));
}

// down in copy mode with WQ in CPU memory: each slot computed once, by the path it takes. The WQ matmul gets the
// non-critical slots' ids (masked: the critical slots read no WQ weights) and the Q4 copy the critical ones; the
// sum is exactly one of the two per slot. No WQ work is thrown away and no keep mask multiplies the result.
ggml_tensor * down_copy_split(const rapidmoe_moe_split & s, ggml_tensor * experts, ggml_tensor * act) {
    ggml_context * ctx = s.g->ctx0;
    ggml_tensor * hi = ggml_mul_mat_id_masked(ctx, s.layer->down_hi, act, s.crit_ids); // [n_embd, k, T]
    s.g->cb(hi, "rapidmoe_down_hi", s.il);
    on_cpu(*s.g, hi);
    if (s.skip_noncritical) { // drop baseline: no WQ slot at all
        return hi;
    }
    experts->src[2] = s.noncrit_ids; // UMIA's op wrote them beside the critical ids
    experts->op = GGML_OP_MUL_MAT_ID_MASKED;
    on_cpu(*s.g, experts);
    return ggml_add(ctx, experts, hi);
}

// A cached split layer whose WQ matmuls are llama.cpp's plain ones, with experts cached on a device, overlaps ("on",
// or "auto": the device has the hits to compute): the worker computes the misses and the residuals while the
// device computes the hits (rapidmoe-overlap.h). A layer with nothing cached keeps all its work on the CPU.
bool concurrent(const rapidmoe_moe_split & s, std::initializer_list<const ggml_tensor *> wq) {
    if (s.cache == nullptr || s.layer == nullptr || s.skip_noncritical || s.cache->up == nullptr) {
        return false;
    }
    const bool on_device = !in_cpu_memory(s.cache->up);
    if (!s.overlap && !(s.layer->state->overlap_mode.load() == RAPIDMOE_OVERLAP_AUTO && on_device)) {
        return false;
    }
    for (const ggml_tensor * t : wq) {
        if (t->op != GGML_OP_MUL_MAT_ID) {
            return false;
        }
    }
    return true;
}

// a WQ matmul of a streamed layer: llama.cpp's own node (stacked weights, every slot) on the cache's device
void stream_wq(const rapidmoe_moe_split & s, ggml_tensor * wq) {
    if (wq->op == GGML_OP_MUL_MAT_ID) {
        ggml_backend_sched_set_tensor_backend(s.g->sched, wq, s.stream);
    }
}

// the device's matmul of one cached WQ role: every slot from the slot ids (a miss reads slot 0; the hit mask drops it)
ggml_tensor * cache_matmul(const rapidmoe_moe_split & s, ggml_tensor * cache, ggml_tensor * in, const char * name) {
    ggml_tensor * dev = ggml_mul_mat_id(s.g->ctx0, cache, in, s.route.slot_ids);
    s.g->cb(dev, name, s.il);
    return dev; // not pinned: the scheduler runs it where the cache's weights are
}

void concurrent_gate_up(const rapidmoe_moe_split & s, ggml_tensor *& gate, ggml_tensor *& up) {
    ggml_context * ctx = s.g->ctx0;
    rapidmoe_overlap_site * st = site(s, RAPIDMOE_OVERLAP_GATE_UP);
    // begin comes first in the graph's order (join's first input): the worker starts before the device split
    ggml_tensor * r = rapidmoe_overlap_begin_cached_gate_up(ctx, st, s.x, s.crit_ids, s.route.miss_ids, gate->src[0],
                                                            up->src[0]);
    s.g->cb(r, "rapidmoe_cached_gate_up_begin", s.il);
    on_cpu(*s.g, r);
    ggml_tensor * gd = cache_matmul(s, s.cache->gate, s.x, "rapidmoe_gate_cache");
    ggml_tensor * ud = cache_matmul(s, s.cache->up, s.x, "rapidmoe_up_cache");
    ggml_tensor * j = rapidmoe_overlap_join_cached_gate_up(ctx, st, r, gd, ud, s.route.hit_mask);
    s.g->cb(j, "rapidmoe_cached_gate_up_join", s.il);
    on_cpu(*s.g, j);
    gate = ggml_view_3d(ctx, j, j->ne[0], j->ne[1], j->ne[2], j->nb[1], j->nb[2], 0);
    up = ggml_view_3d(ctx, j, j->ne[0], j->ne[1], j->ne[2], j->nb[1], j->nb[2], j->nb[3]);
}

ggml_tensor * concurrent_down(const rapidmoe_moe_split & s, ggml_tensor * experts, ggml_tensor * act) {
    ggml_context * ctx = s.g->ctx0;
    rapidmoe_overlap_site * st = site(s, RAPIDMOE_OVERLAP_DOWN);
    ggml_tensor * r = rapidmoe_overlap_begin_cached_down(ctx, st, act, s.crit_ids, s.route.miss_ids, experts->src[0]);
    s.g->cb(r, "rapidmoe_cached_down_begin", s.il);
    on_cpu(*s.g, r);
    ggml_tensor * dd = cache_matmul(s, s.cache->down, act, "rapidmoe_down_cache");
    ggml_tensor * j = rapidmoe_overlap_join_cached_down(ctx, st, r, dd, s.route.hit_mask, s.crit_ids);
    s.g->cb(j, "rapidmoe_cached_down_join", s.il);
    on_cpu(*s.g, j);
    return j;
}

}  // namespace

void rapidmoe_moe_gate_up(const rapidmoe_moe_split & s, ggml_tensor *& gate, ggml_tensor *& up) {
    if (s.stream != nullptr) {
        stream_wq(s, gate);
        stream_wq(s, up);
    } else if (concurrent(s, { gate, up })) {
        concurrent_gate_up(s, gate, up);
        return;
    } else if (s.cache != nullptr) {
        gate = cached_wq(s, gate, s.cache->gate, "rapidmoe_gate_cache");
        up = cached_wq(s, up, s.cache->up, "rapidmoe_up_cache");
    }
    if (s.layer == nullptr) {
        return;
    }
    switch (s.layer->codec) {
        case RAPIDMOE_CODEC_REFINE:
            up = refine_split(s, up, s.layer->up_wr, "rapidmoe_up_refine");
            gate = refine_split(s, gate, s.layer->gate_wr, "rapidmoe_gate_refine");
            return;
        case RAPIDMOE_CODEC_RESIDUAL:
            break; // below: WQ masked to the non-critical slots, the residuals' matmuls added
    }
    wq_critical_only(s, gate);
    wq_critical_only(s, up);
    if (!s.overlap) {
        up = add_residual(s, up, s.layer->up_wr, "rapidmoe_up_wr");
        gate = add_residual(s, gate, s.layer->gate_wr, "rapidmoe_gate_wr");
        return;
    }
    ggml_context * ctx = s.g->ctx0;
    // begin comes before the WQ matmuls in the graph's order (join's first input), join after them
    ggml_tensor * r = rapidmoe_overlap_begin_gate_up(ctx, site(s, RAPIDMOE_OVERLAP_GATE_UP), s.x, s.crit_ids);
    s.g->cb(r, "rapidmoe_gate_up_wr_begin", s.il);
    on_cpu(*s.g, r);
    ggml_tensor * j = rapidmoe_overlap_join_gate_up(ctx, site(s, RAPIDMOE_OVERLAP_GATE_UP), r, gate, up);
    s.g->cb(j, "rapidmoe_gate_up_wr_join", s.il);
    on_cpu(*s.g, j);
    gate = ggml_view_3d(ctx, j, j->ne[0], j->ne[1], j->ne[2], j->nb[1], j->nb[2], 0);
    up = ggml_view_3d(ctx, j, j->ne[0], j->ne[1], j->ne[2], j->nb[1], j->nb[2], j->nb[3]);
}

ggml_tensor * rapidmoe_moe_down(const rapidmoe_moe_split & s, ggml_tensor * experts, ggml_tensor * act) {
    if (s.stream != nullptr) {
        stream_wq(s, experts);
    } else if (concurrent(s, { experts })) {
        return concurrent_down(s, experts, act);
    } else if (s.cache != nullptr) {
        experts = cached_wq(s, experts, s.cache->down, "rapidmoe_down_cache");
    }
    if (s.layer == nullptr) {
        return experts;
    }
    switch (s.layer->codec) {
        case RAPIDMOE_CODEC_REFINE:
            return refine_split(s, experts, s.layer->down_hi, "rapidmoe_down_refine");
        case RAPIDMOE_CODEC_RESIDUAL:
            break; // below: down's copy, or its residual
    }
    ggml_context * ctx = s.g->ctx0;
    if (!s.overlap && s.layer->down_is_copy && s.cache == nullptr && experts->op == GGML_OP_MUL_MAT_ID &&
        in_cpu_memory(experts->src[0])) {
        return down_copy_split(s, experts, act);
    }
    wq_critical_only(s, experts);
    if (s.overlap) {
        ggml_tensor * r = rapidmoe_overlap_begin_down(ctx, site(s, RAPIDMOE_OVERLAP_DOWN), act, s.crit_ids);
        s.g->cb(r, "rapidmoe_down_begin", s.il);
        on_cpu(*s.g, r);
        ggml_tensor * j = rapidmoe_overlap_join_down(ctx, site(s, RAPIDMOE_OVERLAP_DOWN), r, experts, s.crit_ids);
        s.g->cb(j, "rapidmoe_down_join", s.il);
        on_cpu(*s.g, j);
        return j;
    }
    ggml_tensor * hi = ggml_mul_mat_id_masked(ctx, s.layer->down_hi, act, s.crit_ids); // [n_embd, k, T]
    s.g->cb(hi, s.layer->down_is_copy ? "rapidmoe_down_hi" : "rapidmoe_down_wr", s.il);
    on_cpu(*s.g, hi);
    hi = scaled_like(s, hi, experts);
    if (s.layer->down_is_copy) { // WQ result only where the slot is not critical
        ggml_tensor * ids = s.crit_ids;
        ggml_tensor * keep = ggml_custom_4d(ctx, GGML_TYPE_F32, 1, act->ne[1], act->ne[2], 1, &ids, 1,
                                            keep_mask_op, 1, nullptr); // [1, k, T]
        s.g->cb(keep, "rapidmoe_keep", s.il);
        on_cpu(*s.g, keep);
        experts = ggml_mul(ctx, experts, keep);
    }
    return ggml_add(ctx, experts, hi);
}

ggml_tensor * rapidmoe_moe_gate_up_merged(const rapidmoe_moe_split & s, ggml_tensor * gate_up) {
    if (s.layer == nullptr || s.layer->gate_up_wr == nullptr) {
        return gate_up;
    }
    wq_critical_only(s, gate_up);
    return add_residual(s, gate_up, s.layer->gate_up_wr, "rapidmoe_gate_up_wr");
}
