#include "residual.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include "rapidmoe-llama.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace rapidmoe {
namespace {

const llama_model * as_model(uintptr_t addr) {
    if (addr == 0) {
        throw std::invalid_argument("model address is null (model not loaded or already closed)");
    }
    return reinterpret_cast<const llama_model *>(addr);
}

}  // namespace

void bind_residual(nb::module_ & m) {
    m.def("attach_residual", [](uintptr_t model, const std::string & path) {
              char err[512] = {0};
              int32_t rc = 0;
              {
                  nb::gil_scoped_release release;
                  rc = rapidmoe_llama_attach_residual(as_model(model), path.c_str(), err, sizeof(err));
              }
              if (rc != 0) {
                  throw std::invalid_argument(err);
              }
          }, "model"_a, "path"_a,
          "Load a .wr.gguf sidecar into CPU memory and attach it to the llama_model at this address.");
    m.def("detach_residual", [](uintptr_t model) { return rapidmoe_llama_detach_residual(as_model(model)) != 0; },
          "model"_a, "Detach and free the model's sidecar; True if one was attached.");
    m.def("set_n_critical", [](uintptr_t model, int32_t r) {
              const int32_t got = rapidmoe_llama_set_n_critical(as_model(model), r);
              if (got < 0) {
                  throw std::invalid_argument("no residual sidecar is attached to this model");
              }
              return got;
          }, "model"_a, "n_critical"_a,
          "Fixed r (0..k, clamped): each token's r highest-weight experts run in high precision. Returns r.");
    m.def("moe_counters", [](uintptr_t model, bool reset) {
              std::vector<int64_t> buf(3 * 4096);
              const int32_t n = rapidmoe_llama_counters(as_model(model), buf.data(), 4096, reset);
              auto * out = new int64_t[3 * (size_t) n];
              std::copy(buf.begin(), buf.begin() + 3 * n, out);
              nb::capsule owner(out, [](void * p) noexcept { delete[] (int64_t *) p; });
              return nb::ndarray<nb::numpy, int64_t, nb::ndim<2>>(out, {(size_t) n, 3}, owner);
          }, "model"_a, "reset"_a = false,
          "Per layer [tokens, expert slots, critical slots] since the last reset, int64 [n_layer, 3].");
}

}  // namespace rapidmoe
