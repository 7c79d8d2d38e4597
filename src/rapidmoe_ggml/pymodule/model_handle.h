// The llama_model behind the integer address Python passes (llama_cpp's model pointer), checked for null.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <stdexcept>
#include <utility>
#include <vector>

struct llama_model;

namespace rapidmoe {

inline const llama_model * as_model(uintptr_t addr) {
    if (addr == 0) {
        throw std::invalid_argument("model address is null (model not loaded or already closed)");
    }
    return reinterpret_cast<const llama_model *>(addr);
}

// A vector moved to the heap with the capsule that frees it: the data and owner of a numpy array returned to
// Python. Take it last, once nothing can throw any more (a bad model address has been refused by then).
template <typename T>
std::pair<T *, nanobind::capsule> owned(std::vector<T> && v) {
    auto * heap = new std::vector<T>(std::move(v));
    return { heap->data(), nanobind::capsule(heap, [](void * p) noexcept { delete (std::vector<T> *) p; }) };
}

}  // namespace rapidmoe
