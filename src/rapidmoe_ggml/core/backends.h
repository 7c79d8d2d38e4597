// Enumeration of ggml devices and their buffer types, for tensor buffer-type overrides.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace rapidmoe {

// (buffer type name, ggml_backend_buffer_type_t as an integer) for every device's default and host
// buffer types, in registry order; names are what llama.cpp's `-ot pattern=NAME` accepts.
std::vector<std::tuple<std::string, uintptr_t>> buffer_types();

}  // namespace rapidmoe
