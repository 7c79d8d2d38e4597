// Bindings for attaching a residual sidecar to a model loaded by llama_cpp (passed as its address).
#pragma once

#include <nanobind/nanobind.h>

namespace rapidmoe {

// Registers attach_residual, detach_residual, set_n_critical and moe_counters on the module.
void bind_residual(nanobind::module_ & m);

}  // namespace rapidmoe
