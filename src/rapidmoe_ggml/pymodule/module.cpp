// rapidmoe._core: the nanobind extension module. Thin bindings only; Python owns the policy.
// Linked against the same libllama/libggml files that llama_cpp's ctypes layer loads.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "llama.h"
#include "rapidmoe-llama.h"

#include "abort_message.h"
#include "backends.h"
#include "encode.h"
#include "expert_cache.h"
#include "imatrix.h"
#include "quant.h"
#include "residual.h"
#include "resident.h"
#include "testing.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_core, m) {
    m.doc() = "RapidMoE native core (bindings to our build of llama.cpp/ggml)";
    rapidmoe::install_abort_message();  // a ggml abort's message reaches the user even while a load silences fd 2

    m.def("build_info", &rapidmoe_llama_build_info,
          "Build string of our libllama; only our build exports it.");
    m.def("probe_add", &rapidmoe_llama_probe_add, "delta"_a,
          "Add delta to a counter inside libllama and return the new value (library-identity probe).");
    m.def("system_info", []() { return std::string(llama_print_system_info()); },
          "llama.cpp's system info line (backends and CPU features compiled in).");
    m.def("buffer_types", &rapidmoe::buffer_types,
          "Buffer types of every ggml device: list of (name, address) usable as tensor_buft_overrides.");
    m.def("devices", &rapidmoe::devices,
          "Every ggml device: list of (name, description, type, backend registry name, address).");
    m.def("rpc_add_server", &rapidmoe::rpc_add_server, "endpoint"_a,
          "Register the devices of the rpc-server at endpoint (host:port), once per process; returns "
          "(device name, buffer type name) per device. The endpoint must answer: ggml aborts otherwise.");
    m.def("tensor_buffer", [](uintptr_t model, const std::string & name) -> std::string {
              if (model == 0) {
                  throw std::invalid_argument("model address is null (model not loaded or already closed)");
              }
              const char * buf = rapidmoe_llama_tensor_buffer(reinterpret_cast<const llama_model *>(model), name.c_str());
              return buf != nullptr ? std::string(buf) : std::string();
          }, "model"_a, "name"_a,
          "Name of the backend buffer holding the model's (or its sidecar's) tensor `name`; '' if none.");
    rapidmoe::bind_quant(m);
    rapidmoe::bind_encode(m);
    rapidmoe::bind_resident(m);
    rapidmoe::bind_imatrix(m);
    rapidmoe::bind_residual(m);
    rapidmoe::bind_expert_cache(m);
    rapidmoe::bind_testing(m);
}
