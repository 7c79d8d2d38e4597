// RapidMoE code compiled into libllama: the C API additions declared in rapidmoe-llama.h.
// Graph hooks for split expert routing will live beside this file, called from our patches.
#include "rapidmoe-llama.h"

#include <atomic>

#ifndef RAPIDMOE_VERSION
#define RAPIDMOE_VERSION "dev"
#endif
#ifndef RAPIDMOE_LLAMA_COMMIT
#define RAPIDMOE_LLAMA_COMMIT "unknown"
#endif

static std::atomic<int64_t> g_probe{0};

const char * rapidmoe_llama_build_info(void) {
    return "rapidmoe " RAPIDMOE_VERSION " (llama.cpp " RAPIDMOE_LLAMA_COMMIT ")";
}

int64_t rapidmoe_llama_probe_add(int64_t delta) {
    return g_probe.fetch_add(delta) + delta;
}
