// What llama.cpp's CPU backend repacks: the question its loader asks per weight, asked for the memory planner.
#pragma once

#include <nanobind/nanobind.h>

#include "ggml-backend.h"

namespace rapidmoe {

// The CPU backend's CPU_REPACK buffer type (llama.cpp's interleaved layouts), or nullptr where it has none.
ggml_backend_buffer_type_t cpu_repack_buft();

// Registers cpu_repacks on the module.
void bind_resident(nanobind::module_ & m);

}  // namespace rapidmoe
