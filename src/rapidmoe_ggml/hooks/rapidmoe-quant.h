// llama-quantize's per-tensor type choice, recorded: patch 0003 reports every tensor's target type from
// llama_model_quantize's planning loop, so a RESplit WQ file can give its non-expert tensors exactly the types a
// stock quantization (Q4_K_M, Q5_K_M, ...) gives them.
#pragma once

#include "ggml.h"

// called by llama-quant.cpp (patch 0003) for each tensor once its target type is decided; records it when a
// rapidmoe_llama_quant_types call on this thread is listening, else does nothing
void rapidmoe_quant_target_type(const char * name, ggml_type type);
