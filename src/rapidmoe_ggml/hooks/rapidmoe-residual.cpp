// Loading a residual sidecar (.wr.gguf, written by rapidmoe.resplit; one file or llama.cpp's split parts) into CPU
// memory and attaching it to a loaded model. Python has already checked the pairing (pair id, base hash); here every
// tensor's shape is checked against the model's own expert tensors, so a mismatched file is refused rather than
// misread. Weights the CPU repacks are read into the repacked buffer (no mapping left behind); weights in the plain
// layout (the refine codec's bit planes, or any the model keeps plain) are used in place in the file's mapping,
// faulted in at attach: file-backed memory, no anonymous copy (RAPIDMOE_SIDECAR_MMAP=0 reads them into one).
#include "rapidmoe-residual.h"

#include "rapidmoe-refine.h"
#include "rapidmoe-registry.h"

#include "gguf.h"
#include "llama-mmap.h"
#include "llama-model.h"
#include "llama.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <map>
#include <mutex>

namespace {

rapidmoe_registry<rapidmoe_residual_state> g_sidecars;

bool same_shape(const ggml_tensor * a, const ggml_tensor * b) {
    return a->ne[0] == b->ne[0] && a->ne[1] == b->ne[1] && a->ne[2] == b->ne[2] && a->ne[3] == b->ne[3];
}

// "blk.<il>.ffn_<role>_exps.<form>" -> il, role (up/gate/down/gate_up), form (wr/hi)
bool parse_name(const std::string & name, int & il, std::string & role, std::string & form) {
    const std::string pre = "blk.", mid = ".ffn_", exps = "_exps.";
    if (name.rfind(pre, 0) != 0) {
        return false;
    }
    const size_t a = name.find(mid), b = name.find(exps);
    if (a == std::string::npos || b == std::string::npos || b < a) {
        return false;
    }
    try {
        il = std::stoi(name.substr(pre.size(), a - pre.size()));
    } catch (...) {
        return false;
    }
    role = name.substr(a + mid.size(), b - a - mid.size());
    form = name.substr(b + exps.size());
    return il >= 0;
}

// The CPU backend's repacked weight layout (llama.cpp's CPU_REPACK extra buffer type), when the CPU backend has one
ggml_backend_buffer_type_t repack_buft() {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (cpu == nullptr) {
        return nullptr;
    }
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(cpu), "ggml_backend_dev_get_extra_bufts");
    for (ggml_backend_buffer_type_t * b = get_extra ? get_extra(cpu) : nullptr; b != nullptr && *b != nullptr; ++b) {
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) {
            return *b;
        }
    }
    return nullptr;
}

// The sidecar follows the model's own choice of CPU layout: a layer whose experts llama.cpp put in the plain CPU
// buffer (repacking off: use_extra_bufts = false, or -ot ...=CPU for an expert cache) keeps the plain layout;
// otherwise (repacked, or on a device) the sidecar gets the repacked layout where its type has one.
bool model_keeps_plain_layout(const ggml_tensor * base) {
    return base != nullptr && base->buffer != nullptr && ggml_backend_buffer_is_host(base->buffer); // CPU, CPU_Mapped
}

// A refinement bit plane (form "rf") must be one the refine op takes (rapidmoe-refine.h: Q3_K experts, its shape) of
// experts in CPU memory
std::string refine_plane_error(const ggml_tensor * base, const ggml_tensor * plane) {
    if (std::string err = rapidmoe_refine_plane_error(base, plane); !err.empty()) {
        return err;
    }
    // CPU memory: plain (host) or repacked (our Q3_K layout, which the op reads: patch 0021)
    if (base->buffer != nullptr && !ggml_backend_buffer_is_host(base->buffer) &&
        ggml_backend_buffer_get_type(base->buffer) != repack_buft()) {
        return "the refine codec computes on the CPU and reads the model's own experts: keep them in CPU memory "
               "(no --n-gpu-layers or -ot moving " + std::string(ggml_get_name(base)) + " to a device)";
    }
    return "";
}

// The codecs this build runs (rapidmoe-residual.h), one row each: the sidecar's rapidmoe.residual.codec key (nullptr:
// the key is absent), the tensor forms its sidecar holds, and how messages name it (python/rapidmoe/resplit/codecs/
// writes the sidecars)
struct codec_info {
    rapidmoe_codec_id id;
    const char * key;
    const char * forms[2];
    const char * title;
};
const codec_info CODECS[] = {
    { RAPIDMOE_CODEC_RESIDUAL, nullptr, { "wr", "hi" }, "the residual codec (no rapidmoe.residual.codec key): .wr/.hi" },
    { RAPIDMOE_CODEC_REFINE, "q3k-refine1", { "rf", nullptr }, "the refine codec (q3k-refine1): .rf bit planes" },
};

const codec_info & codec_of(rapidmoe_codec_id id) {
    for (const auto & c : CODECS) {
        if (c.id == id) {
            return c;
        }
    }
    GGML_ABORT("rapidmoe: codec id %d has no row in CODECS", (int) id);
}

// The sidecar's codec from its rapidmoe.residual.codec key: absent, the residual codec; a key this build does not
// know is refused
std::string read_codec(const gguf_context * gg, rapidmoe_codec_id & codec) {
    codec = RAPIDMOE_CODEC_RESIDUAL;
    const int64_t k = gguf_find_key(gg, "rapidmoe.residual.codec");
    if (k < 0) {
        return "";
    }
    if (gguf_get_kv_type(gg, k) != GGUF_TYPE_STRING) {
        return "the sidecar's rapidmoe.residual.codec is not a string";
    }
    const std::string key = gguf_get_val_str(gg, k);
    std::string known;
    for (const auto & c : CODECS) {
        if (c.key != nullptr && key == c.key) {
            codec = c.id;
            return "";
        }
        known += c.key != nullptr ? std::string(", ") + c.key : "";
    }
    return "the sidecar's codec \"" + key + "\" is not one this build runs (none: the residual codec" + known + ")";
}

bool codec_has_form(const codec_info & codec, const std::string & form) {
    for (const char * f : codec.forms) {
        if (f != nullptr && form == f) {
            return true;
        }
    }
    return false;
}

// Whether the CPU runs the masked matmul of `w` (the residual matmuls' op) from `buft`: the question llama.cpp's
// loader asks before it places a weight in an extra buffer type (a dummy node whose weight claims that buffer).
bool cpu_runs_masked_from(ggml_backend_buffer_type_t buft, const ggml_tensor * w, int n_expert_used) {
    ggml_init_params ip = { 8 * ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * a = ggml_dup_tensor(ctx, w);
    ggml_tensor * b = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, w->ne[0], n_expert_used, 1);
    ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_expert_used, 1);
    ggml_tensor * op = ggml_mul_mat_id_masked(ctx, a, b, ids);
    ggml_backend_buffer_t dummy = ggml_backend_buft_alloc_buffer(buft, 0);
    a->buffer = dummy;
    const bool ok = dummy != nullptr &&
                    ggml_backend_dev_supports_op(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU), op);
    if (dummy != nullptr) {
        ggml_backend_buffer_free(dummy);
    }
    ggml_free(ctx);
    return ok;
}

}  // namespace

rapidmoe_residual_state::~rapidmoe_residual_state() {
    worker.reset(); // finishes any queued residual task before the weights it reads are freed
    for (ggml_backend_buffer_t b : { buf, buf_policy, buf_repack }) {
        if (b != nullptr) {
            ggml_backend_buffer_free(b);
        }
    }
    for (ggml_backend_buffer_t b : bufs_mapped) {
        ggml_backend_buffer_free(b);
    }
    maps.clear(); // unmapped after the buffers over them are gone
    files.clear();
    for (ggml_context * c : { ctx, ctx_policy, ctx_repack }) {
        if (c != nullptr) {
            ggml_free(c);
        }
    }
}

void rapidmoe_residual_state::compute_enter() {
    std::lock_guard<std::mutex> lock(compute_mutex);
    if (n_computing == 0 && !pending_policy.empty()) {
        std::memcpy(policy->data, pending_policy.data(), ggml_nbytes(policy));
        pending_policy.clear();
    }
    ++n_computing;
}

void rapidmoe_residual_state::compute_leave() {
    std::lock_guard<std::mutex> lock(compute_mutex);
    if (--n_computing == 0 && !pending_policy.empty()) {
        std::memcpy(policy->data, pending_policy.data(), ggml_nbytes(policy));
        pending_policy.clear();
    }
}

void rapidmoe_residual_get_policy(rapidmoe_residual_state & st, float * out) {
    std::lock_guard<std::mutex> lock(st.compute_mutex);
    std::memcpy(out, st.pending_policy.empty() ? (const float *) st.policy->data : st.pending_policy.data(),
                ggml_nbytes(st.policy));
}

void rapidmoe_residual_set_policy(rapidmoe_residual_state & st, const float * params) {
    std::lock_guard<std::mutex> lock(st.compute_mutex);
    if (st.n_computing == 0) {
        std::memcpy(st.policy->data, params, ggml_nbytes(st.policy));
        st.pending_policy.clear();
    } else { // a graph is reading the policy: the last ubatch to finish writes it
        st.pending_policy.assign(params, params + ggml_nelements(st.policy));
    }
}

const rapidmoe_layer_residual * rapidmoe_residual_layer_of(const rapidmoe_residual_state & st,
                                                           const ggml_tensor * down_exps) {
    for (const auto & lr : st.layers) {
        if (lr.down_hi != nullptr && lr.base_down == down_exps) {
            return &lr;
        }
    }
    return nullptr;
}

const rapidmoe_layer_residual * rapidmoe_residual_find_attached(const ggml_tensor * down_exps) {
    return g_sidecars.find_any(
        [&](const rapidmoe_residual_state & st) { return rapidmoe_residual_layer_of(st, down_exps); });
}

std::vector<int> rapidmoe_residual_unhooked(const llama_model * model) {
    std::vector<int> out;
    std::shared_ptr<rapidmoe_residual_state> st = rapidmoe_residual_get(model);
    if (st != nullptr) {
        for (const auto & lr : st->layers) {
            if (lr.down_hi != nullptr && !st->hooked[lr.il].load()) {
                out.push_back(lr.il);
            }
        }
    }
    return out;
}

std::shared_ptr<rapidmoe_residual_state> rapidmoe_residual_get(const llama_model * model) {
    return g_sidecars.get(model);
}

bool rapidmoe_residual_detach(const llama_model * model) {
    return g_sidecars.remove(model);
}

namespace {

// one file of the sidecar (a split sidecar has several: llama.cpp's gguf-split naming and split.* keys)
struct sidecar_part {
    std::string path;
    gguf_context * gg = nullptr;
    ggml_context * meta = nullptr;
    sidecar_part() = default;
    sidecar_part(const sidecar_part &) = delete;
    sidecar_part & operator=(const sidecar_part &) = delete;
    sidecar_part(sidecar_part && o) noexcept : path(std::move(o.path)), gg(o.gg), meta(o.meta) {
        o.gg = nullptr;
        o.meta = nullptr;
    }
    ~sidecar_part() {
        if (gg != nullptr) {
            gguf_free(gg);
        }
        if (meta != nullptr) {
            ggml_free(meta);
        }
    }
};

int split_key(const gguf_context * gg, const char * key, int otherwise) {
    const int64_t k = gguf_find_key(gg, key);
    if (k < 0) {
        return otherwise;
    }
    switch (gguf_get_kv_type(gg, k)) {
        case GGUF_TYPE_UINT16: return gguf_get_val_u16(gg, k);
        case GGUF_TYPE_INT32:  return gguf_get_val_i32(gg, k);
        case GGUF_TYPE_UINT32: return (int) gguf_get_val_u32(gg, k);
        default:               return -1;
    }
}

std::string open_part(const std::string & path, sidecar_part & part) {
    part.path = path;
    gguf_init_params gp = { /*no_alloc =*/ true, /*ctx =*/ &part.meta };
    part.gg = gguf_init_from_file(path.c_str(), gp);
    return part.gg == nullptr ? "cannot read " + path + " as GGUF" : "";
}

// the sidecar's files: `path`, and the other parts when it is the first of a split sidecar
std::string open_parts(const char * path, std::vector<sidecar_part> & parts) {
    parts.emplace_back();
    if (std::string err = open_part(path, parts[0]); !err.empty()) {
        return err;
    }
    const int n = split_key(parts[0].gg, "split.count", 1);
    if (n <= 1) {
        return n == 1 ? "" : std::string(path) + " has a bad split.count";
    }
    char prefix[4096], part_path[4096];
    if (split_key(parts[0].gg, "split.no", 0) != 0 ||
        llama_split_prefix(prefix, sizeof(prefix), path, 0, n) == 0) {
        return std::string(path) + " is a part of a split sidecar, not its first (...-00001-of-...gguf)";
    }
    for (int i = 1; i < n; ++i) {
        llama_split_path(part_path, sizeof(part_path), prefix, i, n);
        parts.emplace_back();
        if (std::string err = open_part(part_path, parts.back()); !err.empty()) {
            return err;
        }
        if (split_key(parts.back().gg, "split.no", -1) != i || split_key(parts.back().gg, "split.count", -1) != n) {
            return std::string(part_path) + " is not part " + std::to_string(i + 1) + " of " + std::to_string(n) +
                   " of " + path;
        }
    }
    return "";
}

bool mmap_in_place() {
    const char * env = getenv("RAPIDMOE_SIDECAR_MMAP");
    return llama_mmap::SUPPORTED && (env == nullptr || strcmp(env, "0") != 0);
}

// the plain-layout tensors of one part, in place in its mapping (faulted in now, as a read would)
std::string map_part(rapidmoe_residual_state & st, const sidecar_part & part) {
    std::vector<std::pair<ggml_tensor *, size_t>> plain; // tensor, offset in the file
    const size_t data0 = gguf_get_data_offset(part.gg);
    for (int64_t i = 0; i < gguf_get_n_tensors(part.gg); ++i) {
        ggml_tensor * t = ggml_get_tensor(st.ctx, gguf_get_tensor_name(part.gg, i));
        if (t != nullptr) {
            plain.emplace_back(t, data0 + gguf_get_tensor_offset(part.gg, i));
        }
    }
    if (plain.empty()) {
        return "";
    }
    try {
        st.files.push_back(std::make_unique<llama_file>(part.path.c_str(), "rb"));
        st.maps.push_back(std::make_unique<llama_mmap>(st.files.back().get(), /*prefetch =*/ 0));
    } catch (const std::exception & e) {
        return std::string("cannot map ") + part.path + ": " + e.what();
    }
    const llama_mmap & map = *st.maps.back();
    auto * base = (uint8_t *) map.addr();
    ggml_backend_buffer_t buf = ggml_backend_cpu_buffer_from_ptr(base, map.size());
    if (buf == nullptr) {
        return "cannot make a CPU buffer over the mapping of " + part.path;
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    st.bufs_mapped.push_back(buf);
    for (const auto & [t, off] : plain) {
        if (off + ggml_nbytes(t) > map.size()) {
            return "sidecar " + part.path + " is truncated at tensor " + ggml_get_name(t);
        }
        if (ggml_backend_tensor_alloc(buf, t, base + off) != GGML_STATUS_SUCCESS) {
            return std::string("cannot place ") + ggml_get_name(t) + " in the mapping of " + part.path;
        }
        volatile uint8_t sink = 0; // fault the tensor's pages in: its memory is resident after attach, as a read's
        for (size_t at = 0; at < ggml_nbytes(t); at += 4096) {
            sink = sink + base[off + at];
        }
        (void) sink;
    }
    return "";
}

// the other tensors of one part: read into their (repacked, or with RAPIDMOE_SIDECAR_MMAP=0 plain) buffers
std::string read_part(rapidmoe_residual_state & st, const sidecar_part & part, std::vector<uint8_t> & staging) {
    FILE * fp = fopen(part.path.c_str(), "rb");
    if (fp == nullptr) {
        return "cannot open " + part.path;
    }
    std::string err;
    const size_t data0 = gguf_get_data_offset(part.gg);
    for (int64_t i = 0; i < gguf_get_n_tensors(part.gg) && err.empty(); ++i) {
        const char * name = gguf_get_tensor_name(part.gg, i);
        ggml_tensor * t = st.ctx != nullptr ? ggml_get_tensor(st.ctx, name) : nullptr;
        if (t != nullptr && t->buffer != nullptr && std::find(st.bufs_mapped.begin(), st.bufs_mapped.end(),
                                                              t->buffer) != st.bufs_mapped.end()) {
            continue; // in place
        }
        const bool repacked = t == nullptr;
        if (repacked) {
            t = ggml_get_tensor(st.ctx_repack, name);
            staging.resize(ggml_nbytes(t));
        }
        void * dst = repacked ? staging.data() : t->data;
        const size_t off = data0 + gguf_get_tensor_offset(part.gg, i);
        if (fseeko(fp, (off_t) off, SEEK_SET) != 0 || fread(dst, 1, ggml_nbytes(t), fp) != ggml_nbytes(t)) {
            err = "sidecar " + part.path + " is truncated at tensor " + ggml_get_name(t);
        } else if (repacked) {
            ggml_backend_tensor_set(t, staging.data(), 0, ggml_nbytes(t));
        }
    }
    fclose(fp);
    return err;
}

}  // namespace

std::string rapidmoe_residual_attach(const llama_model * model, const char * path) {
    std::vector<sidecar_part> parts;
    if (std::string err = open_parts(path, parts); !err.empty()) {
        return err;
    }
    rapidmoe_codec_id codec = RAPIDMOE_CODEC_RESIDUAL;
    if (std::string err = read_codec(parts[0].gg, codec); !err.empty()) {
        return err;
    }
    auto st = std::make_unique<rapidmoe_residual_state>();
    st->model = model;
    const auto & hp = model->hparams;
    st->n_expert_used = (int) hp.n_expert_used_max();
    st->layers.resize(model->layers.size());
    st->hooked = std::make_unique<std::atomic<bool>[]>(model->layers.size());
    int64_t n_t = 0;
    for (const auto & part : parts) {
        n_t += gguf_get_n_tensors(part.gg);
    }
    ggml_init_params ip = { (size_t) (n_t + 2) * ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
    st->ctx = ggml_init(ip);
    st->ctx_repack = ggml_init(ip);
    st->ctx_policy = ggml_init(ip);
    // the residual matmuls read these weights for every critical slot: like the model's own experts, they get
    // the CPU's repacked layout where the CPU has one for their type (its gemv kernels are the fast path)
    // RAPIDMOE_SIDECAR_REPACK=0: keep the plain layout (a diagnostic, for measuring what repacking buys)
    const char * env_repack = getenv("RAPIDMOE_SIDECAR_REPACK");
    ggml_backend_buffer_type_t repack = env_repack != nullptr && strcmp(env_repack, "0") == 0 ? nullptr : repack_buft();
    std::string err;
    for (size_t ip_ = 0; ip_ < parts.size() && err.empty(); ++ip_)
    for (int64_t i = 0; i < gguf_get_n_tensors(parts[ip_].gg) && err.empty(); ++i) {
        const char * name = gguf_get_tensor_name(parts[ip_].gg, i);
        int il = -1;
        std::string r, f;
        if (!parse_name(name, il, r, f) || il >= (int) model->layers.size()) {
            err = std::string("unexpected tensor ") + name + " in the sidecar";
            break;
        }
        const auto & L = model->layers[il];
        const ggml_tensor * base = nullptr;
        if (r == "up") base = L.ffn_up_exps;
        else if (r == "gate") base = L.ffn_gate_exps;
        else if (r == "down") base = L.ffn_down_exps;
        else if (r == "gate_up") base = L.ffn_gate_up_exps;
        const ggml_tensor * src = ggml_get_tensor(parts[ip_].meta, name);
        if (!codec_has_form(codec_of(codec), f)) {
            err = std::string("sidecar tensor ") + name + " is not one of " + codec_of(codec).title +
                  " (the tensors disagree with the sidecar's codec)";
            break;
        }
        const bool bit_plane = codec == RAPIDMOE_CODEC_REFINE;
        if (bit_plane && base != nullptr && src != nullptr) {
            if (err = refine_plane_error(base, src); !err.empty()) {
                break;
            }
        } else if (base == nullptr || src == nullptr || !same_shape(base, src)) {
            err = std::string("sidecar tensor ") + name + " does not match the model's expert tensor (shape)";
            break;
        }
        if (ggml_get_tensor(st->ctx, name) != nullptr || ggml_get_tensor(st->ctx_repack, name) != nullptr) {
            err = std::string("sidecar tensor ") + name + " appears twice";
            break;
        }
        // a bit plane is read by the refine op from the plain layout (it has no repacked one)
        const bool repacked = !bit_plane && repack != nullptr && !model_keeps_plain_layout(base) &&
                              cpu_runs_masked_from(repack, src, st->n_expert_used);
        ggml_tensor * t = ggml_dup_tensor(repacked ? st->ctx_repack : st->ctx, src);
        ggml_set_name(t, name);
        auto & lr = st->layers[il];
        lr.state = st.get();
        lr.il = il;
        lr.codec = codec;
        lr.base_up = L.ffn_up_exps;
        lr.base_gate = L.ffn_gate_exps;
        lr.base_down = L.ffn_down_exps;
        lr.base_gate_up = L.ffn_gate_up_exps;
        lr.scaled = L.ffn_up_exps_s != nullptr || L.ffn_gate_exps_s != nullptr || L.ffn_down_exps_s != nullptr;
        for (int phase = 0; phase < 2; ++phase) {
            lr.sites[phase]->il = il;
            lr.sites[phase]->phase = phase;
        }
        for (int stage = 0; stage < RAPIDMOE_OVERLAP_N_STAGES; ++stage) {
            lr.overlap[stage] = { &lr, stage, nullptr, &st->overlap_timing[stage] };
        }
        if (r == "up" && f == "wr") lr.up_wr = t;
        else if (r == "gate" && f == "wr") lr.gate_wr = t;
        else if (r == "gate_up" && f == "wr") lr.gate_up_wr = t;
        else if (r == "down" && (f == "wr" || f == "hi")) { lr.down_hi = t; lr.down_is_copy = f == "hi"; }
        else if (bit_plane && r == "up") lr.up_wr = t;
        else if (bit_plane && r == "gate") lr.gate_wr = t;
        else if (bit_plane && r == "down") { lr.down_hi = t; lr.down_is_copy = false; }
        else err = std::string("unexpected tensor ") + name + " in the sidecar";
    }
    for (size_t il = 0; il < st->layers.size() && err.empty(); ++il) {
        const auto & lr = st->layers[il];
        const bool any = lr.up_wr || lr.gate_wr || lr.gate_up_wr || lr.down_hi;
        const bool separate = lr.up_wr && lr.gate_wr && !lr.gate_up_wr, merged = lr.gate_up_wr && !lr.up_wr && !lr.gate_wr;
        if (any && !((separate || merged) && lr.down_hi)) {
            err = "layer " + std::to_string(il) + " of the sidecar lacks some of up/gate/down (or gate_up/down)";
        }
        int planes = 0;
        for (const ggml_tensor * t : { lr.up_wr, lr.gate_wr, lr.down_hi }) {
            planes += t != nullptr && t->type == GGML_TYPE_I8 ? 1 : 0;
        }
        if (err.empty() && planes != 0 && (planes != 3 || lr.gate_up_wr != nullptr)) {
            err = "layer " + std::to_string(il) + " of the sidecar mixes refinement bit planes (.rf) with other tensors";
        } else if (err.empty() && planes == 3 && lr.scaled) {
            err = "layer " + std::to_string(il) + " has per-expert scales, which the refine codec does not support";
        }
        if (!any && (model->layers[il].ffn_up_exps != nullptr || model->layers[il].ffn_gate_up_exps != nullptr)) {
            err = "the sidecar has no residual for MoE layer " + std::to_string(il);
        }
    }
    if (err.empty()) {
        st->policy = ggml_new_tensor_2d(st->ctx_policy, GGML_TYPE_F32, RAPIDMOE_UMIA_ROW,
                                        (int64_t) st->layers.size() + 1);
        ggml_set_name(st->policy, "rapidmoe_umia_policy");
        st->buf_policy = ggml_backend_alloc_ctx_tensors_from_buft(st->ctx_policy, ggml_backend_cpu_buffer_type());
        const bool in_place = mmap_in_place();
        for (size_t i = 0; i < parts.size() && in_place && err.empty(); ++i) {
            err = map_part(*st, parts[i]);
        }
        if (err.empty() && !in_place && ggml_get_first_tensor(st->ctx) != nullptr) {
            st->buf = ggml_backend_alloc_ctx_tensors_from_buft(st->ctx, ggml_backend_cpu_buffer_type());
            if (st->buf == nullptr) {
                err = "out of memory allocating the sidecar's tensors";
            }
        }
        if (err.empty() && ggml_get_first_tensor(st->ctx_repack) != nullptr) {
            st->buf_repack = ggml_backend_alloc_ctx_tensors_from_buft(st->ctx_repack, repack);
            if (st->buf_repack == nullptr) {
                err = "out of memory allocating the sidecar's tensors";
            }
        }
        if (err.empty() && st->buf_policy == nullptr) {
            err = "out of memory allocating the sidecar's tensors";
        }
        if (err.empty()) { // every slot critical until a policy is set: the graph computes exactly the full-precision model
            rapidmoe_umia_set_fixed(st->policy, st->n_expert_used);
            // idle until a graph overlaps (one sleeping thread); rapidmoe_llama_set_overlap sets its threads
            st->worker = std::make_unique<rapidmoe_residual_worker>(1);
            for (auto & lr : st->layers) {
                for (auto & site : lr.overlap) {
                    site.worker = st->worker.get();
                }
            }
        }
    }
    std::vector<uint8_t> staging; // a repacked tensor is written whole through the buffer (which repacks it)
    for (size_t i = 0; i < parts.size() && err.empty(); ++i) {
        err = read_part(*st, parts[i], staging);
    }
    parts.clear();
    if (!err.empty()) {
        return err;
    }
    std::lock_guard<std::mutex> lock(g_sidecars.mutex);
    if (g_sidecars.states.count(model) != 0) {
        return "a residual sidecar is already attached to this model";
    }
    g_sidecars.states[model] = std::move(st);
    rapidmoe_attach_generation_bump();
    return "";
}
