// Whether a prompt batch's work items are claimed by the threads as they go (the threadpool's chunk counter) rather
// than dealt out statically: our flash attention's query rows (rapidmoe-fa-decode.cpp) and the routed experts'
// column chunks of MUL_MAT_ID's gemm path (patches/0020-cpu-mmid-claimed.patch). Yes, unless RAPIDMOE_CLAIM=0 is in
// the environment (read at each op, to A/B in one process). The values do not depend on it.
#pragma once

#include <cstdlib>
#include <cstring>

inline bool rapidmoe_claim_enabled() {
    const char * env = std::getenv("RAPIDMOE_CLAIM");
    return env == nullptr || std::strcmp(env, "0") != 0;
}
