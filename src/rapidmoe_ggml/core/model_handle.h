// The llama_model behind the integer address Python passes (llama_cpp's model pointer), checked for null.
#pragma once

#include <cstdint>
#include <stdexcept>

struct llama_model;

namespace rapidmoe {

inline const llama_model * as_model(uintptr_t addr) {
    if (addr == 0) {
        throw std::invalid_argument("model address is null (model not loaded or already closed)");
    }
    return reinterpret_cast<const llama_model *>(addr);
}

}  // namespace rapidmoe
