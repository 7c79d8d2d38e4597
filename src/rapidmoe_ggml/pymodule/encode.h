// RESplit's per-expert encoder, compiled: source rows -> WQ and sidecar bytes, plus the report's error sums.
#pragma once

#include <nanobind/nanobind.h>

namespace rapidmoe {

// Registers encode_experts and refine_encode on the module.
void bind_encode(nanobind::module_ & m);

}  // namespace rapidmoe
