// The per-expert WQ cache (rapidmoe-expert-cache.h): copying chosen experts' WQ slices into a device buffer, the
// CPU route ops the graph hooks use, the hit counters, and their C API (rapidmoe-llama.h).
#include "rapidmoe-expert-cache.h"

#include "rapidmoe-compute.h"
#include "rapidmoe-llama.h"

#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

// The transfer queue of a cache device: a second backend instance on it (its own stream where the backend has
// streams), shared by the model's cached layers on that device.
struct rapidmoe_xfer_queue {
    ggml_backend_t backend = nullptr;
    bool async = true;
    ~rapidmoe_xfer_queue() {
        if (backend != nullptr) {
            ggml_backend_synchronize(backend);
            ggml_backend_free(backend);
        }
    }
};

namespace {

using layers_t = rapidmoe_expert_cache_layers; // index = layer, nullptr: no cache

std::mutex g_mutex;
// copy on write: a ubatch guard holds the vector it snapshotted (and so every cache in it) until its compute ends
std::map<const llama_model *, std::shared_ptr<const layers_t>> g_states;
// model's up_exps -> its cache (graph builds outside a ubatch guard: the context's reserve graphs)
std::map<const ggml_tensor *, const rapidmoe_expert_cache_layer *> g_layers;

// The buffer type of `name` (a device name such as "RPC0", or a buffer type name such as "RPC0[127.0.0.1:50052]"),
// among the model's own devices and the CPU: a device the model's contexts have no backend for could not run the
// cache's matmul.
ggml_backend_buffer_type_t find_buft(const llama_model * model, const std::string & name,
                                     ggml_backend_dev_t * dev_out = nullptr) {
    std::vector<ggml_backend_dev_t> devs;
    for (const auto & d : model->devices) {
        devs.push_back(d.dev);
    }
    devs.push_back(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU));
    for (ggml_backend_dev_t dev : devs) {
        if (dev == nullptr) {
            continue;
        }
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(dev);
        if (name == ggml_backend_dev_name(dev) || (buft != nullptr && name == ggml_backend_buft_name(buft))) {
            if (dev_out != nullptr) {
                *dev_out = dev;  // the CPU buffer type names no device of its own
            }
            return buft;
        }
    }
    return nullptr;
}

// Why this layer's experts cannot be cached, or "".
std::string check_layer(const llama_model * model, int il) {
    if (il < 0 || il >= (int) model->layers.size()) {
        return "layer " + std::to_string(il) + " is out of range (the model has " +
               std::to_string(model->layers.size()) + " layers)";
    }
    const auto & L = model->layers[il];
    if (L.ffn_gate_up_exps != nullptr) {
        return "layer " + std::to_string(il) + " has merged gate_up experts (not supported by the cache yet)";
    }
    if (L.ffn_up_exps == nullptr || L.ffn_gate_exps == nullptr || L.ffn_down_exps == nullptr) {
        return "layer " + std::to_string(il) + " is not an MoE layer (no routed expert tensors)";
    }
    if (L.ffn_up_exps_b != nullptr || L.ffn_gate_exps_b != nullptr || L.ffn_down_exps_b != nullptr ||
        L.ffn_up_exps_s != nullptr || L.ffn_gate_exps_s != nullptr || L.ffn_down_exps_s != nullptr) {
        return "layer " + std::to_string(il) + " has expert biases or scales (not supported by the cache yet)";
    }
    for (const ggml_tensor * t : { L.ffn_up_exps, L.ffn_gate_exps, L.ffn_down_exps }) {
        // the CPU reads the misses from the stacked tensor with a masked matmul and we copy slices from it: both
        // need the plain layout in host memory (not a device, not a repacked CPU buffer)
        if (t->buffer == nullptr || !ggml_backend_buffer_is_host(t->buffer) || !ggml_is_contiguous(t)) {
            return std::string("the experts of layer ") + std::to_string(il) + " are not in plain host memory (" +
                   ggml_get_name(t) + " is in " + (t->buffer ? ggml_backend_buffer_name(t->buffer) : "no buffer") +
                   "): load them with override_tensor=\"exps=CPU\" and without repacking";
        }
    }
    return "";
}

std::string check_ids(const int32_t * ids, int n, int64_t n_expert) {
    std::vector<bool> seen((size_t) n_expert, false);
    for (int i = 0; i < n; ++i) {
        if (ids[i] < 0 || ids[i] >= n_expert) {
            return "expert id " + std::to_string(ids[i]) + " is out of range (0.." + std::to_string(n_expert - 1) + ")";
        }
        if (seen[ids[i]]) {
            return "expert id " + std::to_string(ids[i]) + " is listed twice";
        }
        seen[ids[i]] = true;
    }
    return "";
}

// a [ne0, ne1, n] tensor for n slices of `base`, in the cache's context
ggml_tensor * new_slices(ggml_context * ctx, const ggml_tensor * base, int n, const char * role, int il) {
    ggml_tensor * t = ggml_new_tensor_3d(ctx, base->type, base->ne[0], base->ne[1], n);
    const std::string name = "blk." + std::to_string(il) + ".ffn_" + role + "_exps.cache";
    ggml_set_name(t, name.c_str());
    return t;
}

// Allocate the layer's cache tensors in `buft` and copy each chosen expert's slice into its slot.
std::string fill(rapidmoe_expert_cache_layer & c, ggml_backend_buffer_type_t buft) {
    const int n = (int) c.expert_of.size();
    ggml_init_params ip = { 4 * ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
    c.ctx = ggml_init(ip);
    c.up = new_slices(c.ctx, c.base_up, n, "up", c.il);
    c.gate = new_slices(c.ctx, c.base_gate, n, "gate", c.il);
    c.down = new_slices(c.ctx, c.base_down, n, "down", c.il);
    c.buf = ggml_backend_alloc_ctx_tensors_from_buft(c.ctx, buft);
    if (c.buf == nullptr) {
        return "out of memory allocating the cache of layer " + std::to_string(c.il) + " in " +
               ggml_backend_buft_name(buft);
    }
    // weights: the scheduler runs an op where its weight inputs live, so the cache's matmul runs on the device
    ggml_backend_buffer_set_usage(c.buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    const std::pair<const ggml_tensor *, ggml_tensor *> roles[3] = { { c.base_up, c.up }, { c.base_gate, c.gate },
                                                                     { c.base_down, c.down } };
    for (const auto & [base, cache] : roles) {
        for (int slot = 0; slot < n; ++slot) { // a contiguous [ne0, ne1] slice per expert
            const char * src = (const char *) base->data + (size_t) c.expert_of[slot] * base->nb[2];
            ggml_backend_tensor_set(cache, src, (size_t) slot * cache->nb[2], base->nb[2]);
        }
    }
    return "";
}

// The route ops: src[0] = selected [k, T] I32; userdata = the layer's cache. Single-threaded (ith 0): k x T ints.
template <typename F> void for_each_slot(const ggml_tensor * dst, F f) {
    const ggml_tensor * sel = dst->src[0];
    for (int64_t t = 0; t < sel->ne[1]; ++t) {
        for (int64_t j = 0; j < sel->ne[0]; ++j) {
            f(j, t, *(const int32_t *) ((const char *) sel->data + j * sel->nb[0] + t * sel->nb[1]));
        }
    }
}

int32_t slot_of(const rapidmoe_expert_cache_layer * c, int32_t e) {
    return e >= 0 && e < (int32_t) c->slot_of.size() ? c->slot_of[e] : -1;
}

// host -> device on the layer's transfer queue (the source is the model's host weights: it outlives the copy)
void xfer_set(rapidmoe_expert_cache_layer * c, ggml_tensor * t, const void * src, size_t off, size_t size) {
    if (size == 0) {
        return;
    }
    if (c->xfer != nullptr) {
        ggml_backend_tensor_set_async(c->xfer->backend, t, src, off, size);
    } else {
        ggml_backend_tensor_set(t, src, off, size);
    }
}

void xfer_set_2d(rapidmoe_expert_cache_layer * c, ggml_tensor * t, const void * src, size_t off, size_t size,
                 size_t n, size_t stride_t, size_t stride_src) {
    if (size == 0 || n == 0) {
        return;
    }
    if (c->xfer != nullptr) {
        ggml_backend_tensor_set_2d_async(c->xfer->backend, t, src, off, size, n, stride_t, stride_src);
    } else {
        ggml_backend_tensor_set_2d(t, src, off, size, n, stride_t, stride_src);
    }
}

// After a batch of copies for layer c: fence them (the layer's device-side route ops wait), or wait now.
void xfer_fence(rapidmoe_expert_cache_layer * c) {
    if (c->xfer == nullptr) {
        return;
    }
    if (c->xfer->async && c->event != nullptr) {
        ggml_backend_event_record(c->event, c->xfer->backend);
        c->xfer_pending = true;
    } else if (c->xfer->async) {
        c->xfer_pending = true;  // no events: the wait synchronizes the queue
    } else {
        const int64_t t0 = ggml_time_us();
        ggml_backend_synchronize(c->xfer->backend);
        c->wait_us += ggml_time_us() - t0;
    }
}

void xfer_wait(rapidmoe_expert_cache_layer * c) {
    if (!c->xfer_pending) {
        return;
    }
    const int64_t t0 = ggml_time_us();
    if (c->event != nullptr) {
        ggml_backend_event_synchronize(c->event);
    } else {
        ggml_backend_synchronize(c->xfer->backend);
    }
    c->wait_us += ggml_time_us() - t0;
    c->xfer_pending = false;
}

void copy_expert(rapidmoe_expert_cache_layer * c, int32_t e, int32_t slot) {
    const std::pair<const ggml_tensor *, ggml_tensor *> roles[3] = { { c->base_up, c->up }, { c->base_gate, c->gate },
                                                                     { c->base_down, c->down } };
    for (const auto & [base, cache] : roles) {
        const char * src = (const char *) base->data + (size_t) e * base->nb[2];
        xfer_set(c, cache, src, (size_t) slot * cache->nb[2], base->nb[2]);
    }
}

// --- moepic ------------------------------------------------------------------------------------------------------
// Layouts: gate/up [n_embd, n_ff, slot]: the top is the slot's first n_top rows (contiguous); down [n_ff, n_embd,
// slot]: the top is the first n_top columns of each of its n_embd rows (row_size(n_top) bytes at a stride of
// row_size(n_ff)); the top store keeps down's top compact, [n_top, n_embd, slot].

size_t down_top_row(const rapidmoe_expert_cache_layer * c) {
    return ggml_row_size(c->base_down->type, c->n_top);
}

// Host -> device: expert e's bottom (from_top = n_top) or all of it (from_top = 0) into work slot `slot`; returns
// the bytes moved.
size_t fetch_part(rapidmoe_expert_cache_layer * c, int32_t e, int32_t slot, int64_t from_top) {
    size_t moved = 0;
    for (auto [base, work] : { std::pair{ c->base_up, c->up }, std::pair{ c->base_gate, c->gate } }) {
        const size_t off = (size_t) from_top * base->nb[1];
        const size_t size = base->nb[2] - off;
        xfer_set(c, work, (const char *) base->data + (size_t) e * base->nb[2] + off, (size_t) slot * work->nb[2] + off,
                 size);
        moved += size;
    }
    const ggml_tensor * bd = c->base_down;
    const size_t col = from_top > 0 ? down_top_row(c) : 0;
    const size_t size = bd->nb[1] - col;
    xfer_set_2d(c, c->down, (const char *) bd->data + (size_t) e * bd->nb[2] + col,
                (size_t) slot * c->down->nb[2] + col, size, (size_t) bd->ne[1], c->down->nb[1], bd->nb[1]);
    return moved + size * (size_t) bd->ne[1];
}

// Device -> device copies (top store <-> work area) as one small graph of CPY nodes on the transfer queue.
struct d2d_batch {
    ggml_context * ctx = nullptr;
    ggml_cgraph * gf = nullptr;
    int n = 0;
};

// `rows` rows of `row_bytes` bytes, nb1 apart, at byte offset `off` of t, seen as F16 elements: every ggml type's
// block is an even number of bytes, so one same-type CPY moves any weight type bit for bit, strided or not, on
// every backend (CUDA copies non-contiguous F16, not non-contiguous quantized blocks)
ggml_tensor * carrier(ggml_context * ctx, ggml_tensor * t, size_t row_bytes, int64_t rows, size_t nb1, size_t off) {
    GGML_ASSERT(row_bytes % 2 == 0 && nb1 % 2 == 0 && off % 2 == 0);
    ggml_tensor * v = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, (int64_t) (row_bytes / 2), rows);
    v->nb[1] = nb1;
    v->nb[2] = v->nb[3] = nb1 * (size_t) rows;
    v->data = (char *) t->data + off;
    v->buffer = t->buffer;
    return v;
}

void d2d_add(d2d_batch & b, ggml_tensor * src, ggml_tensor * dst) {
    ggml_tensor * cpy = ggml_cpy(b.ctx, src, dst);
    ggml_backend_view_init(cpy);
    ggml_build_forward_expand(b.gf, cpy);
    b.n++;
}

// the top of expert slot `ws` in the work area <-> top slot `ts`: to_work copies the top store into the work area
void d2d_top(rapidmoe_expert_cache_layer * c, d2d_batch & b, int32_t ws, int32_t ts, bool to_work) {
    for (auto [top, work] : { std::pair{ c->top_up, c->up }, std::pair{ c->top_gate, c->gate } }) {
        const size_t bytes = (size_t) c->n_top * top->nb[1];  // the slot's first n_top rows, contiguous
        ggml_tensor * t = carrier(b.ctx, top, bytes, 1, bytes, (size_t) ts * top->nb[2]);
        ggml_tensor * w = carrier(b.ctx, work, bytes, 1, bytes, (size_t) ws * work->nb[2]);
        d2d_add(b, to_work ? t : w, to_work ? w : t);
    }
    const size_t row = down_top_row(c);  // the leading n_top columns of each of down's n_embd rows
    ggml_tensor * t = carrier(b.ctx, c->top_down, row, c->down->ne[1], c->top_down->nb[1],
                              (size_t) ts * c->top_down->nb[2]);
    ggml_tensor * w = carrier(b.ctx, c->down, row, c->down->ne[1], c->down->nb[1], (size_t) ws * c->down->nb[2]);
    d2d_add(b, to_work ? t : w, to_work ? w : t);
}

d2d_batch d2d_begin(int max_experts) {
    d2d_batch b;
    const size_t n_nodes = (size_t) max_experts * 3 * 2 + 16;
    ggml_init_params ip = { n_nodes * 4 * ggml_tensor_overhead() + ggml_graph_overhead_custom(n_nodes, false), nullptr,
                            /*no_alloc =*/ true };
    b.ctx = ggml_init(ip);
    b.gf = ggml_new_graph_custom(b.ctx, n_nodes, false);
    return b;
}

void d2d_run(rapidmoe_expert_cache_layer * c, d2d_batch & b) {
    if (b.n > 0) {
        ggml_backend_t be = c->xfer->backend;
        if (ggml_backend_graph_compute_async(be, b.gf) != GGML_STATUS_SUCCESS) {
            GGML_ABORT("rapidmoe: the expert cache's device copies failed");
        }
        // the nodes only describe the copies: the CPU and RPC backends have read them when compute returns; a
        // stream backend has enqueued its kernels
    }
    ggml_free(b.ctx);
    b.ctx = nullptr;
}

// Assemble expert e in work slot `slot` of layer c: its top from the top store when resident, the rest from host
// memory. Returns the host -> device bytes.
size_t assemble(rapidmoe_expert_cache_layer * c, d2d_batch & b, int32_t e, int32_t slot) {
    const int32_t ts = c->top_slot_of.empty() ? -1 : c->top_slot_of[e];
    if (ts >= 0) {
        d2d_top(c, b, slot, ts, true);
        return fetch_part(c, e, slot, c->n_top);
    }
    return fetch_part(c, e, slot, 0);
}

// Layer c's slots routed through this ubatch (sorted distinct expert ids), hits counted (top resident), the
// experts assembled in the work area (prefetched ones where they are), tops admitted (LRU).
void moepic_admit(rapidmoe_expert_cache_layer * c, const ggml_tensor * dst) {
    if (c->route_calls++ % 3 != 0) {
        return;
    }
    const int32_t n_expert = (int32_t) c->slot_of.size();
    std::vector<int32_t> need;
    int64_t hits = 0, slots = 0;
    for_each_slot(dst, [&](int64_t, int64_t, int32_t e) {
        if (e >= 0 && e < n_expert) {
            hits += c->top_slot_of.empty() ? 0 : c->top_slot_of[e] >= 0;
            need.push_back(e);
        }
        ++slots;
    });
    c->hits += hits;
    c->slots += slots;
    std::sort(need.begin(), need.end());
    need.erase(std::unique(need.begin(), need.end()), need.end());
    const int32_t n_work = (int32_t) c->expert_of.size();
    std::fill(c->slot_of.begin(), c->slot_of.end(), -1);
    std::vector<bool> taken((size_t) n_work, false);
    std::vector<bool> needed((size_t) n_expert, false);
    for (int32_t e : need) {
        needed[e] = true;
    }
    for (int32_t s = 0; s < n_work; ++s) {  // prefetched and needed: already there
        const int32_t e = c->prefetched[s];
        if (e >= 0 && needed[e]) {
            c->slot_of[e] = s;
            taken[s] = true;
        }
        c->expert_of[s] = -1;
    }
    d2d_batch b = d2d_begin(n_work * 2);
    size_t demand = 0;
    int32_t next_free = 0;
    for (int32_t e : need) {  // the rest on demand, in id order, while work slots last (then: the CPU)
        if (c->slot_of[e] >= 0) {
            continue;
        }
        while (next_free < n_work && taken[next_free]) {
            ++next_free;
        }
        if (next_free >= n_work) {
            break;
        }
        demand += assemble(c, b, e, next_free);
        c->slot_of[e] = next_free;
        taken[next_free] = true;
    }
    for (int32_t e : need) {
        if (c->slot_of[e] >= 0) {
            c->expert_of[c->slot_of[e]] = e;
        }
    }
    std::fill(c->prefetched.begin(), c->prefetched.end(), -1);
    // tops: every expert computed on the device this ubatch is touched, in id order; a new one takes the least
    // recently used top slot (its top copied from the work area, device -> device)
    if (c->top_capacity > 0 && c->n_top > 0) {
        for (int32_t e : need) {
            const int32_t ws = c->slot_of[e];
            if (ws < 0) {
                continue;
            }
            int32_t ts = c->top_slot_of[e];
            if (ts < 0) {
                ts = 0;
                for (int32_t t = 1; t < c->top_capacity; ++t) {
                    if (c->top_last_use[t] < c->top_last_use[ts]) {
                        ts = t;
                    }
                }
                if (c->top_expert_of[ts] >= 0) {
                    c->top_slot_of[c->top_expert_of[ts]] = -1;
                }
                c->top_expert_of[ts] = e;
                c->top_slot_of[e] = ts;
                d2d_top(c, b, ws, ts, false);
            }
            c->top_last_use[ts] = ++c->top_clock;
        }
    }
    d2d_run(c, b);
    c->bytes_demand += (int64_t) demand;
    xfer_fence(c);
}

// The lru policy's admission (see the header), by the first of the layer's three route ops in a ubatch; counts the
// hits before any copy. The route ops run one after another on one thread (ith 0), never concurrently.
void lru_admit(rapidmoe_expert_cache_layer * c, const ggml_tensor * dst) {
    if (c->route_calls++ % 3 != 0) {
        return;
    }
    std::vector<int32_t> need;
    int64_t hits = 0, slots = 0;
    for_each_slot(dst, [&](int64_t, int64_t, int32_t e) {
        hits += slot_of(c, e) >= 0;
        ++slots;
        if (e >= 0 && e < (int32_t) c->slot_of.size()) {
            need.push_back(e);
        }
    });
    c->hits += hits;
    c->slots += slots;
    std::sort(need.begin(), need.end());
    need.erase(std::unique(need.begin(), need.end()), need.end());
    std::vector<bool> needed(c->slot_of.size(), false);
    for (int32_t e : need) {
        needed[e] = true;
    }
    for (int32_t e : need) {
        int32_t slot = c->slot_of[e];
        if (slot < 0) {  // the least recently used slot whose expert this ubatch does not need (lowest slot on ties)
            for (int32_t s = 0; s < (int32_t) c->expert_of.size(); ++s) {
                if (!needed[c->expert_of[s]] && (slot < 0 || c->last_use[s] < c->last_use[slot])) {
                    slot = s;
                }
            }
            if (slot < 0) {
                continue;  // no slot left: this expert stays a miss, computed on the CPU
            }
            copy_expert(c, e, slot);
            c->slot_of[c->expert_of[slot]] = -1;
            c->slot_of[e] = slot;
            c->expert_of[slot] = e;
            c->copies += 1;
            c->bytes_demand += (int64_t) c->expert_bytes;
        }
        c->last_use[slot] = ++c->clock;
    }
    xfer_fence(c);
}

void slot_ids_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    auto * c = (rapidmoe_expert_cache_layer *) userdata;
    if (c->lru) {
        lru_admit(c, dst);
    } else if (c->moepic) {
        moepic_admit(c, dst);
    }
    xfer_wait(c);  // feeds the device's matmul: the layer's copies must be there
    for_each_slot(dst, [&](int64_t j, int64_t t, int32_t e) {
        *(int32_t *) ((char *) dst->data + j * dst->nb[0] + t * dst->nb[1]) = std::max(slot_of(c, e), 0);
    });
}

void hit_mask_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    auto * c = (rapidmoe_expert_cache_layer *) userdata;
    if (c->lru) {
        lru_admit(c, dst);
    } else if (c->moepic) {
        moepic_admit(c, dst);
    }
    xfer_wait(c);
    for_each_slot(dst, [&](int64_t j, int64_t t, int32_t e) {
        *(float *) ((char *) dst->data + j * dst->nb[1] + t * dst->nb[2]) = slot_of(c, e) >= 0 ? 1.0f : 0.0f;
    });
}

// the one route op every cached layer has in its graph, so it is the one that counts
void miss_ids_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    auto * c = (rapidmoe_expert_cache_layer *) userdata;
    if (c->lru) {
        lru_admit(c, dst);
    } else if (c->moepic) {
        moepic_admit(c, dst);
    }
    int64_t hits = 0, slots = 0;
    for_each_slot(dst, [&](int64_t j, int64_t t, int32_t e) {
        const bool hit = slot_of(c, e) >= 0;
        *(int32_t *) ((char *) dst->data + j * dst->nb[0] + t * dst->nb[1]) = hit ? -1 : e;
        hits += hit;
        ++slots;
        if (e >= 0 && e < (int32_t) c->uses.size()) {
            c->uses[e] += 1;
        }
    });
    if (!c->lru && !c->moepic) {  // these policies counted before their copies
        c->hits += hits;
        c->slots += slots;
    }
}

// moepic's prediction and prefetch (rapidmoe_expert_cache_prefetch_op): userdata = the next layer's cache
void prefetch_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    auto * c = (rapidmoe_expert_cache_layer *) userdata;
    const ggml_tensor * logits = dst->src[0];
    const ggml_tensor * bias = dst->src[2];  // nullptr without a selection bias
    const int64_t n_expert = logits->ne[0];
    const int k = c->n_expert_used;
    std::vector<bool> pred((size_t) n_expert, false);
    std::vector<std::pair<float, int32_t>> score((size_t) n_expert);
    for (int64_t r = 0; r < logits->ne[1]; ++r) {
        const auto * l = (const float *) ((const char *) logits->data + r * logits->nb[1]);
        for (int64_t e = 0; e < n_expert; ++e) {
            float v = l[e];
            if (c->next_sigmoid) {
                v = 1.0f / (1.0f + std::exp(-v));
                if (bias != nullptr) {
                    v += ((const float *) bias->data)[e];
                }
            }
            score[e] = { -v, (int32_t) e };  // ascending: highest score first, lower id on ties (stable order)
        }
        std::partial_sort(score.begin(), score.begin() + std::min<int64_t>(k, n_expert), score.end());
        for (int j = 0; j < k && j < n_expert; ++j) {
            pred[score[j].second] = true;
        }
    }
    const int32_t n_work = (int32_t) c->expert_of.size();
    std::fill(c->prefetched.begin(), c->prefetched.end(), -1);
    d2d_batch b = d2d_begin(n_work);
    size_t moved = 0;
    int32_t slot = 0;
    for (int64_t e = 0; e < n_expert && slot < n_work; ++e) {  // in id order while the work area lasts
        if (pred[e]) {
            moved += assemble(c, b, (int32_t) e, slot);
            c->prefetched[slot++] = (int32_t) e;
        }
    }
    d2d_run(c, b);
    c->bytes_prefetch += (int64_t) moved;
    xfer_fence(c);
}

const layers_t * state_of(const llama_model * model) {
    auto it = g_states.find(model);
    return it == g_states.end() ? nullptr : it->second.get();
}

}  // namespace

rapidmoe_expert_cache_layer::~rapidmoe_expert_cache_layer() {
    if (xfer != nullptr) {
        ggml_backend_synchronize(xfer->backend);  // no copy may still write into the buffers freed below
    }
    if (event != nullptr) {
        ggml_backend_event_free(event);
    }
    if (top_buf != nullptr) {
        ggml_backend_buffer_free(top_buf);
    }
    if (top_ctx != nullptr) {
        ggml_free(top_ctx);
    }
    if (buf != nullptr) {
        ggml_backend_buffer_free(buf);
    }
    if (ctx != nullptr) {
        ggml_free(ctx);
    }
}

std::shared_ptr<const rapidmoe_expert_cache_layers> rapidmoe_expert_cache_get(const llama_model * model) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_states.find(model);
    return it == g_states.end() ? nullptr : it->second;
}

const rapidmoe_expert_cache_layer * rapidmoe_expert_cache_find(const ggml_tensor * up_exps) {
    if (const rapidmoe_ubatch_guard * guard = rapidmoe_ubatch_guard::current()) {
        return guard->find_cache(up_exps);
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_layers.find(up_exps);
    return it == g_layers.end() ? nullptr : it->second;
}

std::string rapidmoe_expert_cache_set(const llama_model * model, int il, const int32_t * ids, int n,
                                      const char * device) {
    if (model == nullptr || device == nullptr || (n > 0 && ids == nullptr) || n < 0) {
        return "bad arguments";
    }
    std::string err = check_layer(model, il);
    if (!err.empty()) {
        return err;
    }
    const auto & L = model->layers[il];
    err = check_ids(ids, n, L.ffn_up_exps->ne[2]);
    if (!err.empty()) {
        return err;
    }
    ggml_backend_dev_t found_dev = nullptr;
    ggml_backend_buffer_type_t buft = find_buft(model, device, &found_dev);
    if (buft == nullptr) {
        return std::string("no device or buffer type named ") + device +
               " among this model's devices (an RPC device needs rpc_servers=...)";
    }
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        const layers_t * st = state_of(model);
        if (st != nullptr && il < (int) st->size() && (*st)[il] != nullptr) {
            return "layer " + std::to_string(il) + " already has an expert cache";
        }
    }
    auto c = std::make_shared<rapidmoe_expert_cache_layer>();
    c->il = il;
    c->base_up = L.ffn_up_exps;
    c->base_gate = L.ffn_gate_exps;
    c->base_down = L.ffn_down_exps;
    c->slot_of.assign((size_t) L.ffn_up_exps->ne[2], -1);
    c->uses = std::vector<std::atomic<int64_t>>((size_t) L.ffn_up_exps->ne[2]);
    c->expert_of.assign(ids, ids + n);
    for (int slot = 0; slot < n; ++slot) {
        c->slot_of[ids[slot]] = slot;
    }
    for (const ggml_tensor * t : { L.ffn_up_exps, L.ffn_gate_exps, L.ffn_down_exps }) {
        c->expert_bytes += t->nb[2];
    }
    c->n_expert_used = (int32_t) model->hparams.n_expert_used((uint32_t) il);
    c->dev = ggml_backend_buft_get_device(buft) != nullptr ? ggml_backend_buft_get_device(buft) : found_dev;
    {
        std::lock_guard<std::mutex> lock(g_mutex);  // one transfer queue per model and device
        if (const layers_t * st = state_of(model)) {
            for (const auto & o : *st) {
                if (o != nullptr && o->dev == c->dev && o->xfer != nullptr) {
                    c->xfer = o->xfer;
                    break;
                }
            }
        }
    }
    if (c->xfer == nullptr && c->dev != nullptr) {
        ggml_backend_t be = ggml_backend_dev_init(c->dev, nullptr);
        if (be != nullptr) {
            c->xfer = std::make_shared<rapidmoe_xfer_queue>();
            c->xfer->backend = be;
        }
    }
    if (c->dev != nullptr) {
        c->event = ggml_backend_event_new(c->dev);  // nullptr where the device has none
    }
    if (n > 0) {
        err = fill(*c, buft);
        if (!err.empty()) {
            return err;
        }
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    const layers_t * old = state_of(model);
    auto st = std::make_shared<layers_t>(old != nullptr ? *old : layers_t{});
    st->resize(model->layers.size());
    if ((*st)[il] != nullptr) {
        return "layer " + std::to_string(il) + " already has an expert cache";
    }
    g_layers[c->base_up] = c.get();
    (*st)[il] = std::move(c);
    g_states[model] = std::move(st);
    rapidmoe_attach_generation_bump();
    return "";
}

std::string rapidmoe_expert_cache_replace(const llama_model * model, int il, int32_t out_expert, int32_t in_expert) {
    std::lock_guard<std::mutex> lock(g_mutex);
    const layers_t * st = state_of(model);
    rapidmoe_expert_cache_layer * c = st != nullptr && il >= 0 && il < (int) st->size() ? (*st)[il].get() : nullptr;
    if (c == nullptr) {
        return "layer " + std::to_string(il) + " has no expert cache";
    }
    const int32_t n_expert = (int32_t) c->slot_of.size();
    if (out_expert < 0 || out_expert >= n_expert || in_expert < 0 || in_expert >= n_expert) {
        return "expert id out of range (0.." + std::to_string(n_expert - 1) + ")";
    }
    const int32_t slot = c->slot_of[out_expert];
    if (slot < 0) {
        return "expert " + std::to_string(out_expert) + " of layer " + std::to_string(il) + " is not cached";
    }
    if (c->slot_of[in_expert] >= 0) {
        return "expert " + std::to_string(in_expert) + " of layer " + std::to_string(il) + " is already cached";
    }
    if (c->moepic) {
        return "layer " + std::to_string(il) + " uses the moepic policy (its slots are a work area)";
    }
    copy_expert(c, in_expert, slot);
    xfer_fence(c);  // the layer's next compute waits for it
    c->slot_of[out_expert] = -1;
    c->slot_of[in_expert] = slot;
    c->expert_of[slot] = in_expert;
    return "";
}

std::string rapidmoe_expert_cache_set_moepic(const llama_model * model, int il, int64_t n_top, int capacity) {
    std::lock_guard<std::mutex> lock(g_mutex);
    const layers_t * st = state_of(model);
    rapidmoe_expert_cache_layer * c = st != nullptr && il >= 0 && il < (int) st->size() ? (*st)[il].get() : nullptr;
    if (c == nullptr || c->expert_of.empty()) {
        return "layer " + std::to_string(il) + " has no expert cache slots (the moepic policy needs a work area)";
    }
    if (c->lru || c->moepic) {
        return "layer " + std::to_string(il) + " already has a dynamic cache policy";
    }
    if (c->xfer == nullptr) {
        return "the cache device of layer " + std::to_string(il) + " has no backend for device copies";
    }
    const int64_t n_ff = c->base_up->ne[1];
    const int64_t blck = ggml_blck_size(c->base_down->type);
    if (n_top < 0 || n_top > n_ff || capacity < 0 || (n_top % blck) != 0 || c->base_gate->ne[1] != n_ff ||
        c->base_down->ne[0] != n_ff) {
        return "moepic: the top segment must be 0.." + std::to_string(n_ff) + " rows of the intermediate dimension, " +
               "a multiple of " + std::to_string(blck) + " (the down projection's block), and the capacity >= 0";
    }
    capacity = (int) std::min<int64_t>(capacity, (int64_t) c->slot_of.size());
    c->n_top = n_top;
    c->top_capacity = n_top > 0 ? capacity : 0;
    if (c->top_capacity > 0) {
        ggml_init_params ip = { 4 * ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
        c->top_ctx = ggml_init(ip);
        const std::string p = "blk." + std::to_string(il) + ".ffn_";
        c->top_up = ggml_new_tensor_3d(c->top_ctx, c->base_up->type, c->base_up->ne[0], n_top, c->top_capacity);
        ggml_set_name(c->top_up, (p + "up_exps.top").c_str());
        c->top_gate = ggml_new_tensor_3d(c->top_ctx, c->base_gate->type, c->base_gate->ne[0], n_top, c->top_capacity);
        ggml_set_name(c->top_gate, (p + "gate_exps.top").c_str());
        c->top_down = ggml_new_tensor_3d(c->top_ctx, c->base_down->type, n_top, c->base_down->ne[1], c->top_capacity);
        ggml_set_name(c->top_down, (p + "down_exps.top").c_str());
        c->top_buf = ggml_backend_alloc_ctx_tensors_from_buft(c->top_ctx, ggml_backend_buffer_get_type(c->buf));
        if (c->top_buf == nullptr) {
            return "out of memory allocating the top segments of layer " + std::to_string(il);
        }
        ggml_backend_buffer_set_usage(c->top_buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }
    c->top_bytes = (size_t) n_top * (c->base_up->nb[1] + c->base_gate->nb[1]) +
                   ggml_row_size(c->base_down->type, n_top) * (size_t) c->base_down->ne[1];
    c->top_slot_of.assign(c->slot_of.size(), -1);
    c->top_expert_of.assign((size_t) c->top_capacity, -1);
    c->top_last_use.assign((size_t) c->top_capacity, 0);
    c->top_clock = 0;
    c->prefetched.assign(c->expert_of.size(), -1);
    std::fill(c->slot_of.begin(), c->slot_of.end(), -1);  // the work area holds nothing until a ubatch needs it
    std::fill(c->expert_of.begin(), c->expert_of.end(), -1);
    c->route_calls = 0;
    // the prediction target: the next MoE layer
    c->next_il = -1;
    for (int j = il + 1; j < (int) model->layers.size(); ++j) {
        const auto & L = model->layers[j];
        if (L.ffn_up_exps != nullptr && L.ffn_gate_inp != nullptr) {
            c->next_il = j;
            c->next_up_exps = L.ffn_up_exps;
            c->next_router = L.ffn_gate_inp;
            c->next_bias = L.ffn_exp_probs_b;
            c->next_is_last = j == (int) model->layers.size() - 1;
            break;
        }
    }
    c->next_sigmoid = model->hparams.expert_gating_func == LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID;
    c->moepic = true;
    rapidmoe_attach_generation_bump();  // graphs gain the prediction ops
    return "";
}

std::string rapidmoe_expert_cache_set_async(const llama_model * model, bool async) {
    std::lock_guard<std::mutex> lock(g_mutex);
    const layers_t * st = state_of(model);
    if (st == nullptr) {
        return "the model has no expert cache";
    }
    for (const auto & c : *st) {
        if (c != nullptr && c->xfer != nullptr) {
            c->xfer->async = async;
        }
    }
    return "";
}

std::string rapidmoe_expert_cache_set_lru(const llama_model * model, int il, bool lru) {
    std::lock_guard<std::mutex> lock(g_mutex);
    const layers_t * st = state_of(model);
    rapidmoe_expert_cache_layer * c = st != nullptr && il >= 0 && il < (int) st->size() ? (*st)[il].get() : nullptr;
    if (c == nullptr || (lru && c->expert_of.empty())) {
        return "layer " + std::to_string(il) + " has no expert cache slots (the lru policy needs at least one)";
    }
    c->lru = lru;
    c->last_use.assign(c->expert_of.size(), 0);
    c->clock = 0;
    c->route_calls = 0;
    return "";
}

bool rapidmoe_expert_cache_clear(const llama_model * model) {
    std::shared_ptr<const layers_t> gone; // freed after the lock, unless a ubatch still holds it
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        auto it = g_states.find(model);
        if (it == g_states.end()) {
            return false;
        }
        for (const auto & c : *it->second) {
            if (c != nullptr) {
                g_layers.erase(c->base_up);
            }
        }
        gone = std::move(it->second);
        g_states.erase(it);
        rapidmoe_attach_generation_bump();
    }
    return true;
}

const char * rapidmoe_expert_cache_buffer_name(const llama_model * model, const char * name) {
    std::lock_guard<std::mutex> lock(g_mutex); // the cache cannot be cleared while its buffer is named
    const layers_t * st = state_of(model);
    if (st == nullptr) {
        return nullptr;
    }
    for (const auto & c : *st) {
        for (ggml_context * ctx : { c != nullptr ? c->ctx : nullptr, c != nullptr ? c->top_ctx : nullptr }) {
            if (ctx == nullptr) {
                continue;
            }
            if (const ggml_tensor * t = ggml_get_tensor(ctx, name)) {
                return t->buffer != nullptr ? ggml_backend_buffer_name(t->buffer) : nullptr;
            }
        }
    }
    return nullptr;
}

rapidmoe_expert_cache_route rapidmoe_expert_cache_route_ops(ggml_context * ctx, const rapidmoe_expert_cache_layer * layer,
                                                            ggml_tensor * selected) {
    auto * ud = const_cast<rapidmoe_expert_cache_layer *>(layer); // the ops' userdata; miss_ids counts into it
    const int64_t k = selected->ne[0], T = selected->ne[1];
    rapidmoe_expert_cache_route r;
    r.miss_ids = ggml_custom_4d(ctx, GGML_TYPE_I32, k, T, 1, 1, &selected, 1, miss_ids_op, 1, ud);
    if (!layer->expert_of.empty()) {
        r.slot_ids = ggml_custom_4d(ctx, GGML_TYPE_I32, k, T, 1, 1, &selected, 1, slot_ids_op, 1, ud);
        r.hit_mask = ggml_custom_4d(ctx, GGML_TYPE_F32, 1, k, T, 1, &selected, 1, hit_mask_op, 1, ud);
    }
    return r;
}

ggml_tensor * rapidmoe_expert_cache_prefetch_op(ggml_context * ctx, const rapidmoe_expert_cache_layer * next,
                                                ggml_tensor * logits, ggml_tensor * miss_ids, ggml_tensor * bias) {
    ggml_tensor * srcs[3] = { logits, miss_ids, bias };
    return ggml_custom_4d(ctx, GGML_TYPE_I32, 1, 1, 1, 1, srcs, bias != nullptr ? 3 : 2, prefetch_op, 1,
                          const_cast<rapidmoe_expert_cache_layer *>(next));
}

// C API (rapidmoe-llama.h)

int32_t rapidmoe_llama_expert_cache_clear(const llama_model * model) {
    return rapidmoe_expert_cache_clear(model) ? 1 : 0;
}

int32_t rapidmoe_llama_expert_cache_stats(const llama_model * model, int64_t * out, int32_t n_layer_max, bool reset) {
    std::lock_guard<std::mutex> lock(g_mutex);
    const layers_t * st = state_of(model);
    if (st == nullptr) {
        return 0;
    }
    if (out == nullptr) {
        return (int32_t) st->size();
    }
    const int32_t n = std::min<int32_t>(n_layer_max, (int32_t) st->size());
    for (int32_t i = 0; i < n; ++i) {
        rapidmoe_expert_cache_layer * c = (*st)[i].get();
        out[3 * i + 0] = c != nullptr ? (int64_t) c->expert_of.size() : -1;
        out[3 * i + 1] = c == nullptr ? 0 : reset ? c->hits.exchange(0) : c->hits.load();
        out[3 * i + 2] = c == nullptr ? 0 : reset ? c->slots.exchange(0) : c->slots.load();
    }
    return n;
}

int32_t rapidmoe_llama_expert_cache_replace(const llama_model * model, int32_t il, int32_t out_expert,
                                            int32_t in_expert, char * err, size_t err_size) {
    const std::string msg = model == nullptr ? std::string("bad arguments")
                                             : rapidmoe_expert_cache_replace(model, il, out_expert, in_expert);
    if (msg.empty()) {
        return 0;
    }
    if (err != nullptr && err_size > 0) {
        std::snprintf(err, err_size, "%s", msg.c_str());
    }
    return -1;
}

int32_t rapidmoe_llama_expert_cache_expert_counts(const llama_model * model, int32_t il, int64_t * out, int32_t n_max,
                                                  bool reset) {
    std::lock_guard<std::mutex> lock(g_mutex);
    const layers_t * st = state_of(model);
    rapidmoe_expert_cache_layer * c = st != nullptr && il >= 0 && il < (int) st->size() ? (*st)[il].get() : nullptr;
    if (c == nullptr) {
        return 0;
    }
    const int32_t n = (int32_t) c->uses.size();
    if (out != nullptr) {
        for (int32_t e = 0; e < std::min(n, n_max); ++e) {
            out[e] = reset ? c->uses[e].exchange(0) : c->uses[e].load();
        }
    }
    return n;
}

int32_t rapidmoe_llama_expert_cache_set_lru(const llama_model * model, int32_t il, bool lru, char * err,
                                            size_t err_size) {
    const std::string msg = model == nullptr ? std::string("bad arguments") : rapidmoe_expert_cache_set_lru(model, il, lru);
    if (msg.empty()) {
        return 0;
    }
    if (err != nullptr && err_size > 0) {
        std::snprintf(err, err_size, "%s", msg.c_str());
    }
    return -1;
}

int32_t rapidmoe_llama_expert_cache_copies(const llama_model * model, int64_t * out, int32_t n_layer_max, bool reset) {
    std::lock_guard<std::mutex> lock(g_mutex);
    const layers_t * st = state_of(model);
    if (st == nullptr) {
        return 0;
    }
    if (out == nullptr) {
        return (int32_t) st->size();
    }
    const int32_t n = std::min<int32_t>(n_layer_max, (int32_t) st->size());
    for (int32_t i = 0; i < n; ++i) {
        rapidmoe_expert_cache_layer * c = (*st)[i].get();
        out[i] = c == nullptr ? 0 : reset ? c->copies.exchange(0) : c->copies.load();
    }
    return n;
}

int32_t rapidmoe_llama_expert_cache_set_moepic(const llama_model * model, int32_t il, int64_t n_top, int32_t capacity,
                                               char * err, size_t err_size) {
    const std::string msg = model == nullptr ? std::string("bad arguments")
                                             : rapidmoe_expert_cache_set_moepic(model, il, n_top, capacity);
    if (msg.empty()) {
        return 0;
    }
    if (err != nullptr && err_size > 0) {
        std::snprintf(err, err_size, "%s", msg.c_str());
    }
    return -1;
}

int32_t rapidmoe_llama_expert_cache_set_async(const llama_model * model, bool async) {
    return model != nullptr && rapidmoe_expert_cache_set_async(model, async).empty() ? 0 : -1;
}

int32_t rapidmoe_llama_expert_cache_bytes(const llama_model * model, int64_t * out, int32_t n_layer_max, bool reset) {
    std::lock_guard<std::mutex> lock(g_mutex);
    const layers_t * st = state_of(model);
    if (st == nullptr) {
        return 0;
    }
    if (out == nullptr) {
        return (int32_t) st->size();
    }
    const int32_t n = std::min<int32_t>(n_layer_max, (int32_t) st->size());
    for (int32_t i = 0; i < n; ++i) {
        rapidmoe_expert_cache_layer * c = (*st)[i].get();
        out[3 * i + 0] = c == nullptr ? 0 : reset ? c->bytes_demand.exchange(0) : c->bytes_demand.load();
        out[3 * i + 1] = c == nullptr ? 0 : reset ? c->bytes_prefetch.exchange(0) : c->bytes_prefetch.load();
        out[3 * i + 2] = c == nullptr ? 0 : reset ? c->wait_us.exchange(0) : c->wait_us.load();
    }
    return n;
}
