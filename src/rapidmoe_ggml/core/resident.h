// What llama.cpp's CPU backend repacks: the question its loader asks per weight, asked for the memory planner.
#pragma once

#include <nanobind/nanobind.h>

namespace rapidmoe {

// Registers cpu_repacks on the module.
void bind_resident(nanobind::module_ & m);

}  // namespace rapidmoe
