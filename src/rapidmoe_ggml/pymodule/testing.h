// Test helpers: run one ggml op on the CPU backend from numpy, and capture named graph tensors while a
// llama_context computes. Used by the tests as the test-backend-ops-style check of our ggml additions.
#pragma once

#include <nanobind/nanobind.h>

namespace rapidmoe {

// Registers mul_mat_id and TensorCapture on the module.
void bind_testing(nanobind::module_ & m);

}  // namespace rapidmoe
