#include "backends.h"

#include "ggml-backend.h"

#include <stdexcept>

namespace rapidmoe {

std::vector<std::tuple<std::string, uintptr_t>> buffer_types() {
    std::vector<std::tuple<std::string, uintptr_t>> out;
    auto add = [&](ggml_backend_buffer_type_t buft) {
        if (buft == nullptr) {
            return;
        }
        for (const auto & seen : out) {
            if (std::get<1>(seen) == reinterpret_cast<uintptr_t>(buft)) {
                return;
            }
        }
        out.emplace_back(ggml_backend_buft_name(buft), reinterpret_cast<uintptr_t>(buft));
    };
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        add(ggml_backend_dev_buffer_type(dev));
        add(ggml_backend_dev_host_buffer_type(dev));
    }
    return out;
}

std::vector<std::tuple<std::string, std::string, std::string, std::string, uintptr_t>> devices() {
    std::vector<std::tuple<std::string, std::string, std::string, std::string, uintptr_t>> out;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        const char * type = "cpu";
        switch (ggml_backend_dev_type(dev)) {
            case GGML_BACKEND_DEVICE_TYPE_CPU: type = "cpu"; break;
            case GGML_BACKEND_DEVICE_TYPE_GPU: type = "gpu"; break;
            case GGML_BACKEND_DEVICE_TYPE_IGPU: type = "igpu"; break;
            case GGML_BACKEND_DEVICE_TYPE_ACCEL: type = "accel"; break;
            default: type = "meta"; break;
        }
        out.emplace_back(ggml_backend_dev_name(dev), ggml_backend_dev_description(dev), type,
                         ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev)), reinterpret_cast<uintptr_t>(dev));
    }
    return out;
}

std::vector<std::tuple<std::string, std::string>> rpc_add_server(const std::string & endpoint) {
    // llama.cpp common/arg.cpp add_rpc_devices(): the RPC registry's "ggml_backend_rpc_add_server" entry point
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    if (rpc == nullptr) {
        throw std::runtime_error("this build has no RPC backend (build with -DGGML_RPC=ON)");
    }
    using add_server_t = ggml_backend_reg_t (*)(const char * endpoint);
    auto add_server = reinterpret_cast<add_server_t>(ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server"));
    if (add_server == nullptr) {
        throw std::runtime_error("the RPC backend has no ggml_backend_rpc_add_server entry point");
    }
    ggml_backend_reg_t reg = add_server(endpoint.c_str()); // one registry per endpoint, cached by ggml
    if (reg == nullptr) {
        throw std::runtime_error("the rpc-server at " + endpoint + " reports no device");
    }
    bool registered = false;
    for (size_t i = 0; i < ggml_backend_reg_count(); ++i) {
        registered = registered || ggml_backend_reg_get(i) == reg;
    }
    if (!registered) {
        ggml_backend_register(reg);
    }
    std::vector<std::tuple<std::string, std::string>> out;
    for (size_t i = 0; i < ggml_backend_reg_dev_count(reg); ++i) {
        ggml_backend_dev_t dev = ggml_backend_reg_dev_get(reg, i);
        out.emplace_back(ggml_backend_dev_name(dev), ggml_backend_buft_name(ggml_backend_dev_buffer_type(dev)));
    }
    return out;
}

}  // namespace rapidmoe
