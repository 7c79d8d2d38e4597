// RapidMoE's additions to libllama's C API. They are compiled into libllama itself (see
// llama_ext/), so the ctypes layer and rapidmoe._core reach them in one library instance.
// Additions only: no existing llama.h signature or struct changes (llama-cpp-python mirrors those).
#pragma once

#include "llama.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// "rapidmoe <version> (llama.cpp <commit>)": present only in our build of libllama.
LLAMA_API const char * rapidmoe_llama_build_info(void);

// A process-wide counter living in libllama: adds delta and returns the new value.
// Two callers that see each other's additions share one copy of the library.
LLAMA_API int64_t rapidmoe_llama_probe_add(int64_t delta);

#ifdef __cplusplus
}
#endif
