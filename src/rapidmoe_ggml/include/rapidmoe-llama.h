// RapidMoE's additions to libllama's C API. They are compiled into libllama itself (see
// llama_ext/), so the ctypes layer and rapidmoe._core reach them in one library instance.
// Additions only: no existing llama.h signature or struct changes (llama-cpp-python mirrors those).
#pragma once

#include "llama.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// "rapidmoe <version> (llama.cpp <commit>)": present only in our build of libllama.
LLAMA_API const char * rapidmoe_llama_build_info(void);

// A process-wide counter living in libllama: adds delta and returns the new value.
// Two callers that see each other's additions share one copy of the library.
LLAMA_API int64_t rapidmoe_llama_probe_add(int64_t delta);

// Attach a residual sidecar (.wr.gguf) to a loaded model: its tensors are read into CPU memory and every
// later graph of this model runs split expert routing. Returns 0, or -1 with the reason in err.
LLAMA_API int32_t rapidmoe_llama_attach_residual(const struct llama_model * model, const char * path,
                                                 char * err, size_t err_size);
// Detach (and free) the sidecar; returns 1 if one was attached. Call before llama_model_free.
LLAMA_API int32_t rapidmoe_llama_detach_residual(const struct llama_model * model);
// Fixed r: the number of highest-weight experts of each token's top-k computed in high precision (0..k;
// clamped). Read when a graph is computed, so it applies to the next decode without rebuilding anything.
LLAMA_API int32_t rapidmoe_llama_set_n_critical(const struct llama_model * model, int32_t n_critical);
// Per layer i: out[3*i + 0] tokens, [3*i + 1] expert slots, [3*i + 2] critical slots, since the last reset.
// Returns the number of layers written (0 without a sidecar).
LLAMA_API int32_t rapidmoe_llama_counters(const struct llama_model * model, int64_t * out, int32_t n_layer_max,
                                          bool reset);

#ifdef __cplusplus
}
#endif
