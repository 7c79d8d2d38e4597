// The statistics match tools/imatrix/imatrix.cpp (collect_imatrix): for MUL_MAT_ID each token's input row is
// added to the expert it was routed to; for MUL_MAT to the single matrix. Saved in llama.cpp's GGUF imatrix
// layout by Python (`<weight>.in_sum2` [n_mat, n_in] and `<weight>.counts` [n_mat]).
#include "imatrix.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include "ggml-backend.h"
#include "ggml.h"

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace rapidmoe {
namespace {

struct Stat {
    int64_t n_in = 0;
    std::vector<double>  sum2;    // [n_mat * n_in]
    std::vector<int64_t> counts;  // [n_mat]
};

struct ImatrixCollector {
    std::map<std::string, Stat> stats;
    std::mutex mutex;
    std::vector<char> host_src1;
    std::vector<char> host_ids;

    static std::string weight_name(const ggml_tensor * w) {
        std::string n = w->name;
        // llama.cpp names views "<weight> (view)" / "<weight> (reshaped)"; keep the weight's own name
        const auto pos = n.find(" (");
        return pos == std::string::npos ? n : n.substr(0, pos);
    }

    bool wants(const ggml_tensor * t) const {
        if (t->op != GGML_OP_MUL_MAT && t->op != GGML_OP_MUL_MAT_ID) {
            return false;
        }
        const ggml_tensor * src1 = t->src[1];
        return src1->type == GGML_TYPE_F32 && weight_name(t->src[0]).rfind("blk.", 0) == 0;
    }

    const char * host_data(const ggml_tensor * x, std::vector<char> & scratch) {
        if (x->buffer == nullptr || ggml_backend_buffer_is_host(x->buffer)) {
            return (const char *) x->data;
        }
        scratch.resize(ggml_nbytes(x));
        ggml_backend_tensor_get(x, scratch.data(), 0, ggml_nbytes(x));
        return scratch.data();
    }

    void collect(const ggml_tensor * t) {
        std::lock_guard<std::mutex> lock(mutex);
        const ggml_tensor * w = t->src[0];
        const ggml_tensor * src1 = t->src[1];
        const char * x = host_data(src1, host_src1);
        const int64_t n_in = src1->ne[0];
        const int64_t n_mat = t->op == GGML_OP_MUL_MAT_ID ? w->ne[2] : 1;
        Stat & s = stats[weight_name(w)];
        if (s.sum2.empty()) {
            s.n_in = n_in;
            s.sum2.assign((size_t) (n_in * n_mat), 0.0);
            s.counts.assign((size_t) n_mat, 0);
        }
        if (s.n_in != n_in || (int64_t) s.counts.size() != n_mat) {
            return;  // the same name with another shape: not a weight we can account for
        }
        auto add = [&](int64_t mat, const float * row) {
            double * acc = s.sum2.data() + mat * n_in;
            for (int64_t j = 0; j < n_in; ++j) {
                acc[j] += (double) row[j] * row[j];
            }
            s.counts[(size_t) mat]++;
        };
        if (t->op == GGML_OP_MUL_MAT_ID) {
            // ids: [n_expert_used, n_tokens] (maybe strided); src1: [n_in, n_expert_used or 1, n_tokens]
            const ggml_tensor * ids = t->src[2];
            const char * id = host_data(ids, host_ids);
            for (int64_t tok = 0; tok < ids->ne[1]; ++tok) {
                for (int64_t k = 0; k < ids->ne[0]; ++k) {
                    const int32_t e = *(const int32_t *) (id + tok * ids->nb[1] + k * ids->nb[0]);
                    if (e < 0 || e >= n_mat) {
                        continue;
                    }
                    const int64_t i11 = k % src1->ne[1];
                    add(e, (const float *) (x + i11 * src1->nb[1] + tok * src1->nb[2]));
                }
            }
        } else {
            for (int64_t i3 = 0; i3 < src1->ne[3]; ++i3) {
                for (int64_t i2 = 0; i2 < src1->ne[2]; ++i2) {
                    for (int64_t i1 = 0; i1 < src1->ne[1]; ++i1) {
                        add(0, (const float *) (x + i1 * src1->nb[1] + i2 * src1->nb[2] + i3 * src1->nb[3]));
                    }
                }
            }
        }
    }
};

// ggml_backend_sched_eval_callback: ask=true -> "do you want this node?", ask=false -> its data is ready
bool eval_callback(ggml_tensor * t, bool ask, void * user_data) {
    auto * c = static_cast<ImatrixCollector *>(user_data);
    if (ask) {
        return c->wants(t);
    }
    if (c->wants(t)) {
        c->collect(t);
    }
    return true;  // keep computing the graph
}

}  // namespace

void bind_imatrix(nb::module_ & m) {
    nb::class_<ImatrixCollector>(m, "ImatrixCollector",
        "Accumulates llama-imatrix statistics while a llama_context evaluates text. Pass callback_address\n"
        "and user_data as llama_context_params.cb_eval / cb_eval_user_data; keep this object alive meanwhile.")
        .def(nb::init<>())
        .def_prop_ro("callback_address", [](const ImatrixCollector &) { return (uintptr_t) &eval_callback; })
        .def_prop_ro("user_data", [](ImatrixCollector & c) { return (uintptr_t) &c; })
        .def("names", [](ImatrixCollector & c) {
            std::lock_guard<std::mutex> lock(c.mutex);
            nb::list out;
            for (const auto & kv : c.stats) {
                out.append(kv.first);
            }
            return out;
        }, "Weight names seen so far.")
        .def("get", [](ImatrixCollector & c, const std::string & name) {
            std::lock_guard<std::mutex> lock(c.mutex);
            auto it = c.stats.find(name);
            if (it == c.stats.end()) {
                throw nb::key_error(name.c_str());
            }
            const Stat & s = it->second;
            const size_t n_mat = s.counts.size(), n_in = (size_t) s.n_in;
            auto * sum2 = new float[n_mat * n_in];
            auto * cnt = new float[n_mat];
            for (size_t i = 0; i < n_mat * n_in; ++i) {
                sum2[i] = (float) s.sum2[i];
            }
            for (size_t i = 0; i < n_mat; ++i) {
                cnt[i] = (float) s.counts[i];
            }
            nb::capsule own_s(sum2, [](void * p) noexcept { delete[] (float *) p; });
            nb::capsule own_c(cnt, [](void * p) noexcept { delete[] (float *) p; });
            return nb::make_tuple(nb::ndarray<nb::numpy, float, nb::ndim<2>>(sum2, {n_mat, n_in}, own_s),
                                  nb::ndarray<nb::numpy, float, nb::ndim<1>>(cnt, {n_mat}, own_c));
        }, "name"_a, "(in_sum2 [n_mat, n_in], counts [n_mat]) for one weight, as float32 arrays.");
}

}  // namespace rapidmoe
