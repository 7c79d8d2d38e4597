#include "backends.h"

#include "ggml-backend.h"

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

}  // namespace rapidmoe
