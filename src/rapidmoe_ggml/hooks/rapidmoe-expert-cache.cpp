// The per-expert WQ cache's state (rapidmoe-expert-cache.h): the registry of the models' caches, copying chosen
// experts' WQ slices into a device buffer, the transfer queues every copy goes through, and the C API
// (rapidmoe-llama.h) with the counters' export. The admission of the lru and moepic policies and the graph ops are
// in rapidmoe-expert-cache-admit.cpp; rapidmoe-expert-cache-impl.h is the interface between the two.
#include "rapidmoe-expert-cache-impl.h"

#include "rapidmoe-export.h"
#include "rapidmoe-llama.h"
#include "rapidmoe-registry.h"

#include "llama-model.h"

#include <algorithm>
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

// copy on write: a ubatch guard holds the vector it snapshotted (and so every cache in it) until its compute ends
rapidmoe_registry<const layers_t> g_caches;
std::mutex & g_mutex = g_caches.mutex;

// the model's caches, nullptr when none is set (g_mutex held)
const layers_t * state_of(const llama_model * model) {
    return g_caches.at(model);
}

// layer il's cache, nullptr when it has none (g_mutex held)
rapidmoe_expert_cache_layer * layer_at(const llama_model * model, int il) {
    const layers_t * st = state_of(model);
    return st != nullptr && il >= 0 && il < (int) st->size() ? (*st)[il].get() : nullptr;
}

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

}  // namespace

// --- transfers (rapidmoe-expert-cache-impl.h) ---------------------------------------------------------------------

// host -> device on the layer's transfer queue (the source is the model's host weights: it outlives the copy)
void rapidmoe_xfer_set(rapidmoe_expert_cache_layer * c, ggml_tensor * t, const void * src, size_t off, size_t size) {
    if (size == 0) {
        return;
    }
    if (c->xfer != nullptr) {
        ggml_backend_tensor_set_async(c->xfer->backend, t, src, off, size);
    } else {
        ggml_backend_tensor_set(t, src, off, size);
    }
}

void rapidmoe_xfer_set_2d(rapidmoe_expert_cache_layer * c, ggml_tensor * t, const void * src, size_t off, size_t size,
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
void rapidmoe_xfer_fence(rapidmoe_expert_cache_layer * c) {
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

void rapidmoe_xfer_wait(rapidmoe_expert_cache_layer * c) {
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

void rapidmoe_xfer_expert(rapidmoe_expert_cache_layer * c, int32_t e, int32_t slot) {
    const std::pair<const ggml_tensor *, ggml_tensor *> roles[3] = { { c->base_up, c->up }, { c->base_gate, c->gate },
                                                                     { c->base_down, c->down } };
    for (const auto & [base, cache] : roles) {
        const char * src = (const char *) base->data + (size_t) e * base->nb[2];
        rapidmoe_xfer_set(c, cache, src, (size_t) slot * cache->nb[2], base->nb[2]);
    }
}

void rapidmoe_xfer_graph(rapidmoe_expert_cache_layer * c, ggml_cgraph * gf) {
    if (ggml_backend_graph_compute_async(c->xfer->backend, gf) != GGML_STATUS_SUCCESS) {
        GGML_ABORT("rapidmoe: the expert cache's device copies failed");
    }
    // the nodes only describe the copies: the CPU and RPC backends have read them when compute returns; a stream
    // backend has enqueued its kernels
}

// --- the registry (rapidmoe-expert-cache.h) ----------------------------------------------------------------------

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
    return g_caches.get(model);
}

const rapidmoe_expert_cache_layer * rapidmoe_expert_cache_layer_of(const rapidmoe_expert_cache_layers & layers,
                                                                   const ggml_tensor * up_exps) {
    for (const auto & c : layers) {
        if (c != nullptr && c->base_up == up_exps) {
            return c.get();
        }
    }
    return nullptr;
}

const rapidmoe_expert_cache_layer * rapidmoe_expert_cache_find_attached(const ggml_tensor * up_exps) {
    return g_caches.find_any([&](const layers_t & layers) { return rapidmoe_expert_cache_layer_of(layers, up_exps); });
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
    (*st)[il] = std::move(c);
    g_caches.states[model] = std::move(st);
    rapidmoe_attach_generation_bump();
    return "";
}

std::string rapidmoe_expert_cache_replace(const llama_model * model, int il, int32_t out_expert, int32_t in_expert) {
    std::lock_guard<std::mutex> lock(g_mutex);
    rapidmoe_expert_cache_layer * c = layer_at(model, il);
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
    rapidmoe_xfer_expert(c, in_expert, slot);
    rapidmoe_xfer_fence(c);  // the layer's next compute waits for it
    c->slot_of[out_expert] = -1;
    c->slot_of[in_expert] = slot;
    c->expert_of[slot] = in_expert;
    return "";
}

std::string rapidmoe_expert_cache_set_moepic(const llama_model * model, int il, int64_t n_top, int capacity) {
    std::lock_guard<std::mutex> lock(g_mutex);
    rapidmoe_expert_cache_layer * c = layer_at(model, il);
    if (c == nullptr || c->expert_of.empty()) {
        return "layer " + std::to_string(il) + " has no expert cache slots (the moepic policy needs a work area)";
    }
    if (c->lru || c->moepic) {
        return "layer " + std::to_string(il) + " already has a dynamic cache policy";
    }
    if (c->xfer == nullptr) {
        return "the cache device of layer " + std::to_string(il) + " has no backend for device copies";
    }
    const std::string err = rapidmoe_expert_cache_moepic_init(model, *c, n_top, capacity);
    if (!err.empty()) {
        return err;
    }
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
    rapidmoe_expert_cache_layer * c = layer_at(model, il);
    if (c == nullptr || (lru && c->expert_of.empty())) {
        return "layer " + std::to_string(il) + " has no expert cache slots (the lru policy needs at least one)";
    }
    rapidmoe_expert_cache_lru_init(*c, lru);
    return "";
}

bool rapidmoe_expert_cache_clear(const llama_model * model) {
    return g_caches.remove(model);
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

// --- C API (rapidmoe-llama.h) ------------------------------------------------------------------------------------

int32_t rapidmoe_llama_expert_cache_set(const llama_model * model, int32_t il, const int32_t * ids, int32_t n_ids,
                                        const char * device, char * err, size_t err_size) {
    return rapidmoe_report(rapidmoe_expert_cache_set(model, il, ids, n_ids, device), err, err_size);
}

int32_t rapidmoe_llama_expert_cache_clear(const llama_model * model) {
    return rapidmoe_expert_cache_clear(model) ? 1 : 0;
}

int32_t rapidmoe_llama_expert_cache_replace(const llama_model * model, int32_t il, int32_t out_expert,
                                            int32_t in_expert, char * err, size_t err_size) {
    return rapidmoe_report(model == nullptr ? std::string("bad arguments")
                                            : rapidmoe_expert_cache_replace(model, il, out_expert, in_expert),
                           err, err_size);
}

int32_t rapidmoe_llama_expert_cache_set_lru(const llama_model * model, int32_t il, bool lru, char * err,
                                            size_t err_size) {
    return rapidmoe_report(model == nullptr ? std::string("bad arguments")
                                            : rapidmoe_expert_cache_set_lru(model, il, lru),
                           err, err_size);
}

int32_t rapidmoe_llama_expert_cache_set_moepic(const llama_model * model, int32_t il, int64_t n_top, int32_t capacity,
                                               char * err, size_t err_size) {
    return rapidmoe_report(model == nullptr ? std::string("bad arguments")
                                            : rapidmoe_expert_cache_set_moepic(model, il, n_top, capacity),
                           err, err_size);
}

int32_t rapidmoe_llama_expert_cache_set_async(const llama_model * model, bool async) {
    return model != nullptr && rapidmoe_expert_cache_set_async(model, async).empty() ? 0 : -1;
}

// The per-layer counters: one row per layer of the model (a layer without a cache: zeros, or -1 cached experts),
// through the counter protocol (rapidmoe-export.h). 0 rows without a cache.
template <typename Row>
static int32_t export_layers(const llama_model * model, int64_t * out, int32_t n_layer_max, int32_t width, Row row) {
    std::lock_guard<std::mutex> lock(g_mutex);
    const layers_t * st = state_of(model);
    if (st == nullptr) {
        return 0;
    }
    return rapidmoe_export_rows(out, n_layer_max, (int32_t) st->size(), width,
                                [&](int32_t i, int64_t * dst) { row((*st)[i].get(), dst); });
}

int32_t rapidmoe_llama_expert_cache_stats(const llama_model * model, int64_t * out, int32_t n_layer_max, bool reset) {
    return export_layers(model, out, n_layer_max, 3, [&](rapidmoe_expert_cache_layer * c, int64_t * dst) {
        dst[0] = c != nullptr ? (int64_t) c->expert_of.size() : -1;
        dst[1] = c != nullptr ? rapidmoe_take(c->hits, reset) : 0;
        dst[2] = c != nullptr ? rapidmoe_take(c->slots, reset) : 0;
    });
}

int32_t rapidmoe_llama_expert_cache_bytes(const llama_model * model, int64_t * out, int32_t n_layer_max, bool reset) {
    return export_layers(model, out, n_layer_max, 3, [&](rapidmoe_expert_cache_layer * c, int64_t * dst) {
        dst[0] = c != nullptr ? rapidmoe_take(c->bytes_demand, reset) : 0;
        dst[1] = c != nullptr ? rapidmoe_take(c->bytes_prefetch, reset) : 0;
        dst[2] = c != nullptr ? rapidmoe_take(c->wait_us, reset) : 0;
    });
}

int32_t rapidmoe_llama_expert_cache_copies(const llama_model * model, int64_t * out, int32_t n_layer_max, bool reset) {
    return export_layers(model, out, n_layer_max, 1, [&](rapidmoe_expert_cache_layer * c, int64_t * dst) {
        dst[0] = c != nullptr ? rapidmoe_take(c->copies, reset) : 0;
    });
}

int32_t rapidmoe_llama_expert_cache_expert_counts(const llama_model * model, int32_t il, int64_t * out, int32_t n_max,
                                                  bool reset) {
    std::lock_guard<std::mutex> lock(g_mutex);
    rapidmoe_expert_cache_layer * c = layer_at(model, il);
    if (c == nullptr) {
        return 0;
    }
    const int32_t n = (int32_t) c->uses.size();
    rapidmoe_export_rows(out, n_max, n, 1,
                         [&](int32_t e, int64_t * dst) { dst[0] = rapidmoe_take(c->uses[e], reset); });
    return n; // the layer's expert count, however many were written
}
