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

// Every registered ggml device: (name, description, type "cpu"|"gpu"|"igpu"|"accel"|"meta", name of its backend
// registry ("CPU", "CUDA", "RPC", ...), ggml_backend_dev_t as an integer), in registry order.
std::vector<std::tuple<std::string, std::string, std::string, std::string, uintptr_t>> devices();

// Connect to a running rpc-server at endpoint ("host:port") and register its devices with ggml (once per
// endpoint and process, as llama.cpp's --rpc does). Returns the (device name, buffer type name) of each.
// Throws std::runtime_error when this build has no RPC backend or the server reports no device.
// The caller must check that the endpoint answers first: ggml's RPC client aborts the process otherwise.
std::vector<std::tuple<std::string, std::string>> rpc_add_server(const std::string & endpoint);

}  // namespace rapidmoe
