// Importance-matrix collection with our own build: a ggml eval callback that accumulates, per weight
// matrix and per expert, the sum of squared input activations (llama.cpp's llama-imatrix statistics).
#pragma once

#include <nanobind/nanobind.h>

namespace rapidmoe {

// Registers the ImatrixCollector class on the module.
void bind_imatrix(nanobind::module_ & m);

}  // namespace rapidmoe
