// The expert cache's admission and graph ops (the state they work on: rapidmoe-expert-cache.cpp, through
// rapidmoe-expert-cache-impl.h): the CPU route ops the graph hooks use (slot ids, hit mask, miss ids), which count
// the hits; the lru policy (on-demand loading into the least recently used slots) and the moepic policy (top
// segments resident, a work area assembled per ubatch, the next layer's predicted experts assembled ahead), run by
// the route ops before a layer computes; and the set-up of those policies.
#include "rapidmoe-expert-cache-impl.h"

#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace {

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

// The experts a ubatch routes through layer c: their sorted distinct ids, and per expert whether it is one of them.
struct ubatch_experts {
    std::vector<int32_t> ids;
    std::vector<bool> needed;
};

// What a dynamic policy admits from: the ubatch's experts (ids out of range are skipped), its slots and hits
// (is_hit(e), before any copy) counted into the layer.
template <typename Hit>
ubatch_experts count_needed(rapidmoe_expert_cache_layer * c, const ggml_tensor * dst, Hit is_hit) {
    const int32_t n_expert = (int32_t) c->slot_of.size();
    ubatch_experts u;
    int64_t hits = 0, slots = 0;
    for_each_slot(dst, [&](int64_t, int64_t, int32_t e) {
        if (e >= 0 && e < n_expert) {
            hits += is_hit(e);
            u.ids.push_back(e);
        }
        ++slots;
    });
    c->hits += hits;
    c->slots += slots;
    std::sort(u.ids.begin(), u.ids.end());
    u.ids.erase(std::unique(u.ids.begin(), u.ids.end()), u.ids.end());
    u.needed.assign((size_t) n_expert, false);
    for (int32_t e : u.ids) {
        u.needed[e] = true;
    }
    return u;
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
        rapidmoe_xfer_set(c, work, (const char *) base->data + (size_t) e * base->nb[2] + off,
                          (size_t) slot * work->nb[2] + off, size);
        moved += size;
    }
    const ggml_tensor * bd = c->base_down;
    const size_t col = from_top > 0 ? down_top_row(c) : 0;
    const size_t size = bd->nb[1] - col;
    rapidmoe_xfer_set_2d(c, c->down, (const char *) bd->data + (size_t) e * bd->nb[2] + col,
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
        rapidmoe_xfer_graph(c, b.gf);
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

// The moepic policy's admission: the ubatch's experts (hits: top resident) assembled in the work area (prefetched
// ones where they are), tops admitted (LRU).
void moepic_admit(rapidmoe_expert_cache_layer * c, const ggml_tensor * dst) {
    const ubatch_experts u = count_needed(c, dst, [&](int32_t e) {
        return c->top_slot_of.empty() ? false : c->top_slot_of[e] >= 0;
    });
    const std::vector<int32_t> & need = u.ids;
    const int32_t n_work = (int32_t) c->expert_of.size();
    std::fill(c->slot_of.begin(), c->slot_of.end(), -1);
    std::vector<bool> taken((size_t) n_work, false);
    for (int32_t s = 0; s < n_work; ++s) {  // prefetched and needed: already there
        const int32_t e = c->prefetched[s];
        if (e >= 0 && u.needed[e]) {
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
    rapidmoe_xfer_fence(c);
}

// The lru policy's admission (see the header): the ubatch's uncached experts copied into the least recently used
// slots it does not need.
void lru_admit(rapidmoe_expert_cache_layer * c, const ggml_tensor * dst) {
    const ubatch_experts u = count_needed(c, dst, [&](int32_t e) { return c->slot_of[e] >= 0; });
    const std::vector<bool> & needed = u.needed;
    for (int32_t e : u.ids) {
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
            rapidmoe_xfer_expert(c, e, slot);
            c->slot_of[c->expert_of[slot]] = -1;
            c->slot_of[e] = slot;
            c->expert_of[slot] = e;
            c->copies += 1;
            c->bytes_demand += (int64_t) c->expert_bytes;
        }
        c->last_use[slot] = ++c->clock;
    }
    rapidmoe_xfer_fence(c);
}

// The layer (userdata) of a route op on thread 0, nullptr on the others (a route op is single-threaded: k x T
// ints). The first of the layer's three route ops in a ubatch runs its dynamic policy's admission; the route ops
// run one after another on one thread, never concurrently, each once per compute.
rapidmoe_expert_cache_layer * route_op_layer(const ggml_tensor * dst, int ith, void * userdata) {
    if (ith != 0) {
        return nullptr;
    }
    auto * c = (rapidmoe_expert_cache_layer *) userdata;
    if ((c->lru || c->moepic) && c->route_calls++ % 3 == 0) {
        if (c->lru) {
            lru_admit(c, dst);
        } else {
            moepic_admit(c, dst);
        }
    }
    return c;
}

// The route ops that feed the device's matmul, after the layer's copies have arrived: the slot ids (I32 [k, T]: the
// slot of a hit, 0 for a miss) or the hit mask (HIT_MASK: F32 [1, k, T], 1 hit, 0 miss).
template <bool HIT_MASK>
void device_route_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    rapidmoe_expert_cache_layer * c = route_op_layer(dst, ith, userdata);
    if (c == nullptr) {
        return;
    }
    rapidmoe_xfer_wait(c);  // feeds the device's matmul: the layer's copies must be there
    for_each_slot(dst, [&](int64_t j, int64_t t, int32_t e) {
        if (HIT_MASK) {
            *(float *) ((char *) dst->data + j * dst->nb[1] + t * dst->nb[2]) = slot_of(c, e) >= 0 ? 1.0f : 0.0f;
        } else {
            *(int32_t *) ((char *) dst->data + j * dst->nb[0] + t * dst->nb[1]) = std::max(slot_of(c, e), 0);
        }
    });
}

// the one route op every cached layer has in its graph, so it is the one that counts
void miss_ids_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    rapidmoe_expert_cache_layer * c = route_op_layer(dst, ith, userdata);
    if (c == nullptr) {
        return;
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
    rapidmoe_xfer_fence(c);
}

}  // namespace

rapidmoe_expert_cache_route rapidmoe_expert_cache_route_ops(ggml_context * ctx, const rapidmoe_expert_cache_layer * layer,
                                                            ggml_tensor * selected) {
    auto * ud = const_cast<rapidmoe_expert_cache_layer *>(layer); // the ops' userdata; miss_ids counts into it
    const int64_t k = selected->ne[0], T = selected->ne[1];
    rapidmoe_expert_cache_route r;
    r.miss_ids = ggml_custom_4d(ctx, GGML_TYPE_I32, k, T, 1, 1, &selected, 1, miss_ids_op, 1, ud);
    if (!layer->expert_of.empty()) {
        r.slot_ids = ggml_custom_4d(ctx, GGML_TYPE_I32, k, T, 1, 1, &selected, 1, device_route_op<false>, 1, ud);
        r.hit_mask = ggml_custom_4d(ctx, GGML_TYPE_F32, 1, k, T, 1, &selected, 1, device_route_op<true>, 1, ud);
    }
    return r;
}

ggml_tensor * rapidmoe_expert_cache_prefetch_op(ggml_context * ctx, const rapidmoe_expert_cache_layer * next,
                                                ggml_tensor * logits, ggml_tensor * miss_ids, ggml_tensor * bias) {
    ggml_tensor * srcs[3] = { logits, miss_ids, bias };
    return ggml_custom_4d(ctx, GGML_TYPE_I32, 1, 1, 1, 1, srcs, bias != nullptr ? 3 : 2, prefetch_op, 1,
                          const_cast<rapidmoe_expert_cache_layer *>(next));
}

void rapidmoe_expert_cache_lru_init(rapidmoe_expert_cache_layer & c, bool lru) {
    c.lru = lru;
    c.last_use.assign(c.expert_of.size(), 0);
    c.clock = 0;
    c.route_calls = 0;
}

std::string rapidmoe_expert_cache_moepic_init(const llama_model * model, rapidmoe_expert_cache_layer & c,
                                              int64_t n_top, int capacity) {
    const int il = c.il;
    const int64_t n_ff = c.base_up->ne[1];
    const int64_t blck = ggml_blck_size(c.base_down->type);
    if (n_top < 0 || n_top > n_ff || capacity < 0 || (n_top % blck) != 0 || c.base_gate->ne[1] != n_ff ||
        c.base_down->ne[0] != n_ff) {
        return "moepic: the top segment must be 0.." + std::to_string(n_ff) + " rows of the intermediate dimension, " +
               "a multiple of " + std::to_string(blck) + " (the down projection's block), and the capacity >= 0";
    }
    capacity = (int) std::min<int64_t>(capacity, (int64_t) c.slot_of.size());
    c.n_top = n_top;
    c.top_capacity = n_top > 0 ? capacity : 0;
    if (c.top_capacity > 0) {
        ggml_init_params ip = { 4 * ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
        c.top_ctx = ggml_init(ip);
        const std::string p = "blk." + std::to_string(il) + ".ffn_";
        c.top_up = ggml_new_tensor_3d(c.top_ctx, c.base_up->type, c.base_up->ne[0], n_top, c.top_capacity);
        ggml_set_name(c.top_up, (p + "up_exps.top").c_str());
        c.top_gate = ggml_new_tensor_3d(c.top_ctx, c.base_gate->type, c.base_gate->ne[0], n_top, c.top_capacity);
        ggml_set_name(c.top_gate, (p + "gate_exps.top").c_str());
        c.top_down = ggml_new_tensor_3d(c.top_ctx, c.base_down->type, n_top, c.base_down->ne[1], c.top_capacity);
        ggml_set_name(c.top_down, (p + "down_exps.top").c_str());
        c.top_buf = ggml_backend_alloc_ctx_tensors_from_buft(c.top_ctx, ggml_backend_buffer_get_type(c.buf));
        if (c.top_buf == nullptr) {
            return "out of memory allocating the top segments of layer " + std::to_string(il);
        }
        ggml_backend_buffer_set_usage(c.top_buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }
    c.top_bytes = (size_t) n_top * (c.base_up->nb[1] + c.base_gate->nb[1]) +
                  ggml_row_size(c.base_down->type, n_top) * (size_t) c.base_down->ne[1];
    c.top_slot_of.assign(c.slot_of.size(), -1);
    c.top_expert_of.assign((size_t) c.top_capacity, -1);
    c.top_last_use.assign((size_t) c.top_capacity, 0);
    c.top_clock = 0;
    c.prefetched.assign(c.expert_of.size(), -1);
    std::fill(c.slot_of.begin(), c.slot_of.end(), -1);  // the work area holds nothing until a ubatch needs it
    std::fill(c.expert_of.begin(), c.expert_of.end(), -1);
    c.route_calls = 0;
    // the prediction target: the next MoE layer
    c.next_il = -1;
    for (int j = il + 1; j < (int) model->layers.size(); ++j) {
        const auto & L = model->layers[j];
        if (L.ffn_up_exps != nullptr && L.ffn_gate_inp != nullptr) {
            c.next_il = j;
            c.next_up_exps = L.ffn_up_exps;
            c.next_router = L.ffn_gate_inp;
            c.next_bias = L.ffn_exp_probs_b;
            c.next_is_last = j == (int) model->layers.size() - 1;
            break;
        }
    }
    c.next_sigmoid = model->hparams.expert_gating_func == LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID;
    c.moepic = true;
    return "";
}
