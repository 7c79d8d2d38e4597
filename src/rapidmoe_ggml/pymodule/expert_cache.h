#pragma once

#include <nanobind/nanobind.h>

namespace rapidmoe {

// per-expert WQ cache on a device: set, clear, hit counters
void bind_expert_cache(nanobind::module_ & m);

}  // namespace rapidmoe
