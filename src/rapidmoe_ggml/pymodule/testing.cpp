#include "testing.h"

#include "resident.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "rapidmoe-llama.h"

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <fstream>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace rapidmoe {
namespace {

using F32_3 = nb::ndarray<const float, nb::numpy, nb::ndim<3>, nb::c_contig, nb::device::cpu>;
using I32_2 = nb::ndarray<const int32_t, nb::numpy, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using U8_3  = nb::ndarray<const uint8_t, nb::numpy, nb::ndim<3>, nb::c_contig, nb::device::cpu>;

// dst[t, j, :] = as[ids[t, j]] @ b[t, j % n_b, :] (numpy order); masked: ids < 0 give zero rows
// A weight tensor's copy in a CPU_REPACK buffer (its bytes set through the buffer: repacked), for ops whose CPU
// kernels then read the interleaved layout; `claims(w)` builds the op on the copy (in a no-alloc context) and the
// CPU backend must accept it there (the extra buffer runs only the types, shapes and ops it has a layout for)
struct RepackedWeights {
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    ggml_tensor * w = nullptr;
    template <typename Claims>
    RepackedWeights(ggml_type type, int64_t n_in, int64_t n_out, int64_t n_as, const void * data, size_t nbytes,
                    Claims claims, const char * what) {
        ggml_backend_buffer_type_t buft = cpu_repack_buft();
        ggml_init_params wp = { 16 * ggml_tensor_overhead(), nullptr, true };
        ctx = ggml_init(wp);
        w = ggml_new_tensor_3d(ctx, type, n_in, n_out, n_as);
        buf = buft != nullptr ? ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft) : nullptr;
        if (buf == nullptr ||
            !ggml_backend_dev_supports_op(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU), claims(ctx, w))) {
            release();
            throw std::invalid_argument(std::string(what) + ": the CPU has no repacked layout for this type and shape");
        }
        ggml_backend_tensor_set(w, data, 0, nbytes);
    }
    void release() {
        if (buf != nullptr) {
            ggml_backend_buffer_free(buf);
        }
        ggml_free(ctx);
        buf = nullptr;
        ctx = nullptr;
    }
    ~RepackedWeights() { release(); }
    RepackedWeights(const RepackedWeights &) = delete;
    RepackedWeights & operator=(const RepackedWeights &) = delete;
};

nb::ndarray<nb::numpy, float, nb::ndim<3>> mul_mat_id(U8_3 as, int type_id, int64_t n_in, F32_3 b, I32_2 ids,
                                                      bool masked, int n_threads, bool repacked) {
    const auto type = (ggml_type) type_id;
    const int64_t n_as = as.shape(0), n_out = as.shape(1);
    const int64_t T = b.shape(0), n_b = b.shape(1), k = ids.shape(1);
    if ((int64_t) b.shape(2) != n_in || (int64_t) ids.shape(0) != T || as.shape(2) != ggml_row_size(type, n_in)) {
        throw std::invalid_argument("mul_mat_id: inconsistent shapes");
    }
    ggml_init_params ip = { 64 * ggml_tensor_overhead() + ggml_graph_overhead() +
                            as.nbytes() + b.nbytes() + ids.nbytes() + (size_t) (T * k * n_out) * 4 + (1 << 16),
                            nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * ta = ggml_new_tensor_3d(ctx, type, n_in, n_out, n_as);
    ggml_tensor * tb = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_in, n_b, T);
    ggml_tensor * ti = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, T);
    std::memcpy(ta->data, as.data(), as.nbytes());
    // repacked: the weights in a CPU_REPACK buffer (its kernels run the node: the extra buffer claims the op)
    std::unique_ptr<RepackedWeights> rw;
    if (repacked) {
        try {
            rw = std::make_unique<RepackedWeights>(
                type, n_in, n_out, n_as, as.data(), as.nbytes(),
                [&](ggml_context * c, ggml_tensor * w) {
                    ggml_tensor * db = ggml_new_tensor_3d(c, GGML_TYPE_F32, n_in, n_b, T);
                    ggml_tensor * di = ggml_new_tensor_2d(c, GGML_TYPE_I32, k, T);
                    return masked ? ggml_mul_mat_id_masked(c, w, db, di) : ggml_mul_mat_id(c, w, db, di);
                },
                "mul_mat_id");
        } catch (...) {
            ggml_free(ctx);
            throw;
        }
        ta = rw->w;
    }
    std::memcpy(tb->data, b.data(), b.nbytes());
    std::memcpy(ti->data, ids.data(), ids.nbytes());
    ggml_tensor * out = masked ? ggml_mul_mat_id_masked(ctx, ta, tb, ti) : ggml_mul_mat_id(ctx, ta, tb, ti);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    {
        nb::gil_scoped_release release;
        ggml_cpu_init();  // idempotent: fp16 tables etc. for the CPU kernels
        ggml_cplan plan = ggml_graph_plan(gf, n_threads, nullptr);
        std::vector<uint8_t> work(plan.work_size + 1);
        plan.work_data = work.data();
        ggml_graph_compute(gf, &plan);
    }
    auto * res = new float[(size_t) (T * k * n_out)];
    std::memcpy(res, out->data, ggml_nbytes(out));
    ggml_free(ctx);
    nb::capsule owner(res, [](void * p) noexcept { delete[] (float *) p; });
    return nb::ndarray<nb::numpy, float, nb::ndim<3>>(res, {(size_t) T, (size_t) k, (size_t) n_out}, owner);
}

// the refine codec's op: wq uint8 [n_as, n_out, n_in/256*110] (Q3_K), bits uint8 [n_as, n_out, n_in/8]
nb::ndarray<nb::numpy, float, nb::ndim<3>> refine_mul_mat_id(U8_3 wq, U8_3 bits, int64_t n_in, F32_3 b, I32_2 ids,
                                                             int n_threads, bool repacked) {
    const int64_t n_as = wq.shape(0), n_out = wq.shape(1);
    const int64_t T = b.shape(0), n_b = b.shape(1), k = ids.shape(1);
    if (n_in % 256 != 0 || (int64_t) b.shape(2) != n_in || (int64_t) ids.shape(0) != T ||
        wq.shape(2) != ggml_row_size(GGML_TYPE_Q3_K, n_in) || bits.shape(0) != wq.shape(0) ||
        bits.shape(1) != wq.shape(1) || (int64_t) bits.shape(2) * 8 != n_in) {
        throw std::invalid_argument("refine_mul_mat_id: inconsistent shapes");
    }
    ggml_init_params ip = { 64 * ggml_tensor_overhead() + ggml_graph_overhead() + wq.nbytes() + bits.nbytes() +
                            b.nbytes() + ids.nbytes() + (size_t) (T * k * n_out) * 4 + (1 << 16), nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * tw = ggml_new_tensor_3d(ctx, GGML_TYPE_Q3_K, n_in, n_out, n_as);
    ggml_tensor * tr = ggml_new_tensor_3d(ctx, GGML_TYPE_I8, n_in / 8, n_out, n_as);
    ggml_tensor * tb = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_in, n_b, T);
    ggml_tensor * ti = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, T);
    std::memcpy(tw->data, wq.data(), wq.nbytes());
    // repacked: wq in a CPU_REPACK buffer (our Q3_K layout, patch 0021), which the op reads row by row
    std::unique_ptr<RepackedWeights> rw;
    if (repacked) {
        try {
            rw = std::make_unique<RepackedWeights>(
                GGML_TYPE_Q3_K, n_in, n_out, n_as, wq.data(), wq.nbytes(),
                [&](ggml_context * c, ggml_tensor * w) {
                    ggml_tensor * dr = ggml_new_tensor_3d(c, GGML_TYPE_I8, n_in / 8, n_out, n_as);
                    ggml_tensor * db = ggml_new_tensor_3d(c, GGML_TYPE_F32, n_in, n_b, T);
                    ggml_tensor * di = ggml_new_tensor_2d(c, GGML_TYPE_I32, k, T);
                    return rapidmoe_llama_refine_mul_mat_id(c, w, dr, db, di);
                },
                "refine_mul_mat_id");
        } catch (...) {
            ggml_free(ctx);
            throw;
        }
        tw = rw->w;
    }
    std::memcpy(tr->data, bits.data(), bits.nbytes());
    std::memcpy(tb->data, b.data(), b.nbytes());
    std::memcpy(ti->data, ids.data(), ids.nbytes());
    ggml_tensor * out = rapidmoe_llama_refine_mul_mat_id(ctx, tw, tr, tb, ti);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    {
        nb::gil_scoped_release release;
        ggml_cpu_init();
        ggml_cplan plan = ggml_graph_plan(gf, n_threads, nullptr);
        std::vector<uint8_t> work(plan.work_size + 1);
        plan.work_data = work.data();
        ggml_graph_compute(gf, &plan);
    }
    auto * res = new float[(size_t) (T * k * n_out)];
    std::memcpy(res, out->data, ggml_nbytes(out));
    ggml_free(ctx);
    nb::capsule owner(res, [](void * p) noexcept { delete[] (float *) p; });
    return nb::ndarray<nb::numpy, float, nb::ndim<3>>(res, {(size_t) T, (size_t) k, (size_t) n_out}, owner);
}

using U8_1 = nb::ndarray<const uint8_t, nb::numpy, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using F32_1 = nb::ndarray<const float, nb::numpy, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

float refine_dot(U8_1 wq, U8_1 bits, F32_1 x, bool reference) {
    const int64_t n = (int64_t) x.shape(0);
    if (n % 256 != 0 || wq.shape(0) != ggml_row_size(GGML_TYPE_Q3_K, n) || (int64_t) bits.shape(0) * 8 != n) {
        throw std::invalid_argument("refine_dot: inconsistent shapes");
    }
    return rapidmoe_llama_refine_dot(n, wq.data(), bits.data(), x.data(), reference);
}

// A name "NODE#src1" captures the second source of the graph node NODE (e.g. "ffn_moe_logits-3#src1": the input the
// router of layer 3 multiplies, whatever the architecture named it), read when NODE has been computed
constexpr std::string_view SRC1_SUFFIX = "#src1";

struct TensorCapture {
    std::vector<std::string> names;  // exact graph tensor names, e.g. "ffn_moe_out-0", or "NODE#src1"
    std::map<std::string, std::vector<std::vector<float>>> data;  // name -> one entry per computation
    std::map<std::string, std::vector<std::vector<int64_t>>> shapes;  // one per computation (batches differ)
    std::mutex mutex;

    static bool readable(const ggml_tensor * t) {
        return t != nullptr && (t->type == GGML_TYPE_F32 || t->type == GGML_TYPE_I32);
    }

    // the tensors to copy when node t has been computed, each with the name it is kept under
    std::vector<std::pair<std::string, const ggml_tensor *>> wanted(const ggml_tensor * t) const {
        std::vector<std::pair<std::string, const ggml_tensor *>> out;
        for (const auto & n : names) {
            const std::string_view name(n);
            const size_t node_len = name.size() - SRC1_SUFFIX.size();  // meaningful only with the suffix
            const bool of_src1 = name.size() > SRC1_SUFFIX.size() && name.substr(node_len) == SRC1_SUFFIX;
            if (!of_src1 && name == t->name && readable(t)) {
                out.emplace_back(n, t);
            } else if (of_src1 && name.substr(0, node_len) == t->name && readable(t->src[1])) {
                out.emplace_back(n, t->src[1]);
            }
        }
        return out;
    }
};

// t's elements as floats, in ggml order; I32 values are converted (exact below 2^24, e.g. expert ids). Views whose
// rows are contiguous (e.g. ffn_moe_topk, the first k columns of the argsort) are read row by row. False: the
// layout is not one of these.
bool read_as_float(const ggml_tensor * t, std::vector<float> & v) {
    const size_t es = ggml_type_size(t->type);
    if (t->nb[0] != es) {
        return false;
    }
    const int64_t n0 = t->ne[0], n_rows = ggml_nrows(t);
    std::vector<uint8_t> raw((size_t) (n0 * n_rows) * es);
    if (ggml_is_contiguous(t)) {
        ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    } else {
        for (int64_t i3 = 0, r = 0; i3 < t->ne[3]; i3++) {
            for (int64_t i2 = 0; i2 < t->ne[2]; i2++) {
                for (int64_t i1 = 0; i1 < t->ne[1]; i1++, r++) {
                    ggml_backend_tensor_get(t, raw.data() + (size_t) r * n0 * es,
                                            i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3], (size_t) n0 * es);
                }
            }
        }
    }
    v.resize((size_t) (n0 * n_rows));
    if (t->type == GGML_TYPE_F32) {
        std::memcpy(v.data(), raw.data(), raw.size());
    } else {
        const auto * src = reinterpret_cast<const int32_t *>(raw.data());
        for (size_t i = 0; i < v.size(); i++) {
            v[i] = (float) src[i];
        }
    }
    return true;
}

bool capture_callback(ggml_tensor * t, bool ask, void * user_data) {
    auto * c = static_cast<TensorCapture *>(user_data);
    const auto wanted = c->wanted(t);
    if (ask) {
        return !wanted.empty();
    }
    std::lock_guard<std::mutex> lock(c->mutex);
    for (const auto & [name, x] : wanted) {
        std::vector<float> v;
        if (!read_as_float(x, v)) {
            continue;  // only tensors with contiguous rows are captured
        }
        c->data[name].push_back(std::move(v));
        c->shapes[name].push_back({ x->ne[3], x->ne[2], x->ne[1], x->ne[0] });
    }
    return true;
}


// The VmFlags of the /proc/self/smaps mapping that holds addr ("" when none is found, or not on Linux)
std::string vm_flags_at(uintptr_t addr) {
    std::ifstream smaps("/proc/self/smaps");
    std::string line;
    bool inside = false;
    while (std::getline(smaps, line)) {
        unsigned long long lo = 0, hi = 0;
        if (std::sscanf(line.c_str(), "%llx-%llx ", &lo, &hi) == 2 && line.find(':') > line.find('-')) {
            inside = addr >= lo && addr < hi;
        } else if (inside && line.rfind("VmFlags:", 0) == 0) {
            return line.substr(8);
        }
    }
    return "";
}

// Allocates a CPU (or CPU_REPACK) buffer of nbytes as llama.cpp does for weights and caches, and returns the VmFlags
// of the memory it got: "hg" among them is madvise(MADV_HUGEPAGE) (patch 0015)
std::string cpu_buffer_vm_flags(size_t nbytes, bool repack) {
    ggml_backend_buffer_type_t buft = repack ? cpu_repack_buft() : ggml_backend_cpu_buffer_type();
    if (buft == nullptr) {
        throw std::invalid_argument("cpu_buffer_vm_flags: this CPU backend has no CPU_REPACK buffer type");
    }
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, nbytes);
    if (buf == nullptr) {
        throw std::runtime_error("cpu_buffer_vm_flags: the allocation failed");
    }
    const auto base = (uintptr_t) ggml_backend_buffer_get_base(buf);
    std::string flags = vm_flags_at(base + ggml_backend_buffer_get_size(buf) / 2);
    ggml_backend_buffer_free(buf);
    return flags;
}
}  // namespace

void bind_testing(nb::module_ & m) {
    m.def("mul_mat_id", &mul_mat_id, "as_"_a, "type"_a, "n_in"_a, "b"_a, "ids"_a, "masked"_a = false,
          "n_threads"_a = 2, "repacked"_a = false,
          "Run ggml_mul_mat_id (or ggml_mul_mat_id_masked) on the CPU backend: as_ uint8 [n_as, n_out, row_bytes]\n"
          "of ggml type `type`, b float32 [T, n_b, n_in], ids int32 [T, k]; returns float32 [T, k, n_out].\n"
          "repacked: the weights in the CPU_REPACK buffer (its kernels); ValueError where it has no layout.");
    m.def("refine_mul_mat_id", &refine_mul_mat_id, "wq"_a, "bits"_a, "n_in"_a, "b"_a, "ids"_a, "n_threads"_a = 2,
          "repacked"_a = false,
          "Run the refine codec's op on the CPU: wq uint8 [n_as, n_out, row_bytes] (Q3_K), bits uint8 [n_as, n_out,\n"
          "n_in/8], b float32 [T, n_b, n_in], ids int32 [T, k] (-1: a zero row); returns float32 [T, k, n_out].\n"
          "repacked: wq in the CPU_REPACK buffer (our Q3_K layout; ValueError where the CPU has none).");
    m.def("refine_dot", &refine_dot, "wq"_a, "bits"_a, "x"_a, "reference"_a = false,
          "One refined row (Q3_K bytes, bit plane) dot x (quantized to Q8_K): the SIMD kernel or the scalar\n"
          "reference.");
    m.def("refine_x8_enabled", &rapidmoe_llama_refine_x8_enabled,
          "Whether the refine op runs its 8-row kernel on repacked WQ (AVX-512 VNNI and BITALG in this build,\n"
          "RAPIDMOE_REFINE_X8 not \"0\"); else it reads repacked rows one at a time (the same bits).");
    m.def("cpu_buffer_vm_flags", &cpu_buffer_vm_flags, "nbytes"_a, "repack"_a = false,
          "Allocate a CPU (repack: CPU_REPACK) backend buffer of nbytes and return the VmFlags of /proc/self/smaps'\n"
          "mapping that holds its middle (\"\" if none): \"hg\" = huge pages advised. Frees the buffer.");
    nb::class_<TensorCapture>(m, "TensorCapture",
        "Copies the named F32 or I32 graph tensors (I32 as exact floats; views with contiguous rows too) each time\n"
        "a llama_context computes them (eval callback); a name \"NODE#src1\" copies node NODE's second source.")
        .def("__init__", [](TensorCapture * c, std::vector<std::string> names) {
            new (c) TensorCapture();
            c->names = std::move(names);
        }, "names"_a)
        .def_prop_ro("callback_address", [](const TensorCapture &) { return (uintptr_t) &capture_callback; })
        .def_prop_ro("user_data", [](TensorCapture & c) { return (uintptr_t) &c; })
        .def("get", [](TensorCapture & c, const std::string & name) {
            std::lock_guard<std::mutex> lock(c.mutex);
            nb::list out;
            auto it = c.data.find(name);
            if (it == c.data.end()) {
                return out;
            }
            const auto & shapes = c.shapes[name];
            for (size_t i = 0; i < it->second.size(); i++) {
                const auto & v = it->second[i];
                const auto & sh = shapes[i];
                auto * buf = new float[v.size()];
                std::memcpy(buf, v.data(), v.size() * sizeof(float));
                nb::capsule owner(buf, [](void * p) noexcept { delete[] (float *) p; });
                out.append(nb::ndarray<nb::numpy, float, nb::ndim<4>>(
                    buf, {(size_t) sh[0], (size_t) sh[1], (size_t) sh[2], (size_t) sh[3]}, owner));
            }
            return out;
        }, "name"_a, "Every captured copy of `name`, in numpy order [ne3, ne2, ne1, ne0].")
        .def("clear", [](TensorCapture & c) {
            std::lock_guard<std::mutex> lock(c.mutex);
            c.data.clear();
            c.shapes.clear();
        });
}

}  // namespace rapidmoe
