// Whether the CPU backend keeps a weight in its repacked layout (the CPU_REPACK extra buffer type, anonymous memory
// that the loader copies into) or uses it in place from the mapped file: llama.cpp's loader decides per weight by
// asking the device whether it runs the weight's op (a matmul, or MUL_MAT_ID for routed experts) with the weight in
// that buffer type (weight_buft_supported, llama-model-loader.cpp); this asks the same question with the same dummy
// operands, so the planner's resident-memory figures follow this build and this CPU (python/rapidmoe/placement).
#include "resident.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "ggml-backend.h"
#include "ggml.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace rapidmoe {

ggml_backend_buffer_type_t cpu_repack_buft() {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    auto get_extra = cpu == nullptr ? nullptr : (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(cpu), "ggml_backend_dev_get_extra_bufts");
    for (ggml_backend_buffer_type_t * b = get_extra ? get_extra(cpu) : nullptr; b != nullptr && *b != nullptr; ++b) {
        if (std::strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) {
            return *b;
        }
    }
    return nullptr;
}

namespace {

bool cpu_repacks(int type, std::vector<int64_t> ne, const std::string & op, int n_expert_used) {
    if (type < 0 || type >= GGML_TYPE_COUNT || ne.empty() || ne.size() > 4) {
        throw std::invalid_argument("cpu_repacks needs a ggml type id and 1 to 4 dimensions (ggml order)");
    }
    if (op != "mul_mat" && op != "mul_mat_id") {
        throw std::invalid_argument("op must be mul_mat or mul_mat_id, not " + op);
    }
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_buffer_type_t buft = cpu != nullptr ? cpu_repack_buft() : nullptr;
    if (buft == nullptr) {
        return false;
    }
    ne.resize(4, 1);
    ggml_init_params ip = { 8 * ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * w = ggml_new_tensor_4d(ctx, (ggml_type) type, ne[0], ne[1], ne[2], ne[3]);
    ggml_tensor * node = nullptr;
    if (op == "mul_mat") {
        node = ggml_mul_mat(ctx, w, ggml_new_tensor_4d(ctx, GGML_TYPE_F32, ne[0], 512, ne[2], ne[3]));
    } else {
        const int k = n_expert_used > 0 ? n_expert_used : 1;
        node = ggml_mul_mat_id(ctx, w, ggml_new_tensor_3d(ctx, GGML_TYPE_F32, ne[0], k, 512),
                               ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, 512));
    }
    ggml_backend_buffer_t dummy = ggml_backend_buft_alloc_buffer(buft, 0);
    w->buffer = dummy;
    const bool ok = dummy != nullptr && ggml_backend_dev_supports_op(cpu, node);
    if (dummy != nullptr) {
        ggml_backend_buffer_free(dummy);
    }
    ggml_free(ctx);
    return ok;
}

}  // namespace

void bind_resident(nb::module_ & m) {
    m.def("cpu_repacks", &cpu_repacks, "type"_a, "ne"_a, "op"_a, "n_expert_used"_a = 8,
          "Whether llama.cpp's CPU backend keeps a weight of ggml type `type` and shape `ne` (ggml order) in its\n"
          "repacked layout (anonymous memory) when `op` (mul_mat, or mul_mat_id for routed experts) uses it, as its\n"
          "loader decides; False where it uses the weight in place from the mapped file.");
}

}  // namespace rapidmoe
