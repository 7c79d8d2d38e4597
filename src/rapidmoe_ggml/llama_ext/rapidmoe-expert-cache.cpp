// The per-expert WQ cache (rapidmoe-expert-cache.h): copying chosen experts' WQ slices into a device buffer, the
// CPU route ops the graph hooks use, the hit counters, and their C API (rapidmoe-llama.h).
#include "rapidmoe-expert-cache.h"

#include "rapidmoe-compute.h"
#include "rapidmoe-llama.h"

#include "llama-model.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

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
ggml_backend_buffer_type_t find_buft(const llama_model * model, const std::string & name) {
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

void copy_expert(rapidmoe_expert_cache_layer * c, int32_t e, int32_t slot) {
    const std::pair<const ggml_tensor *, ggml_tensor *> roles[3] = { { c->base_up, c->up }, { c->base_gate, c->gate },
                                                                     { c->base_down, c->down } };
    for (const auto & [base, cache] : roles) {
        const char * src = (const char *) base->data + (size_t) e * base->nb[2];
        ggml_backend_tensor_set(cache, src, (size_t) slot * cache->nb[2], base->nb[2]);
    }
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
        }
        c->last_use[slot] = ++c->clock;
    }
}

void slot_ids_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    auto * c = (rapidmoe_expert_cache_layer *) userdata;
    if (c->lru) {
        lru_admit(c, dst);
    }
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
    }
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
    if (!c->lru) {  // the lru policy counted before its copies
        c->hits += hits;
        c->slots += slots;
    }
}

const layers_t * state_of(const llama_model * model) {
    auto it = g_states.find(model);
    return it == g_states.end() ? nullptr : it->second.get();
}

}  // namespace

rapidmoe_expert_cache_layer::~rapidmoe_expert_cache_layer() {
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
    ggml_backend_buffer_type_t buft = find_buft(model, device);
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
    copy_expert(c, in_expert, slot);
    c->slot_of[out_expert] = -1;
    c->slot_of[in_expert] = slot;
    c->expert_of[slot] = in_expert;
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
        if (c != nullptr && c->ctx != nullptr) {
            if (const ggml_tensor * t = ggml_get_tensor(c->ctx, name)) {
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
