// RapidMoE's flash attention for one decode token (ggml_ext/rapidmoe-fa-decode.cpp), called at the top of
// llama.cpp's CPU GGML_OP_FLASH_ATTN_EXT (patches/0011-cpu-fa-decode.patch). Compiled into ggml-cpu.
#pragma once

#include "ggml.h"

#include <cstdlib>
#include <cstring>

// Computes dst (every thread its share: a query row's set of heads on one KV head at a time) and returns true when
// the node has fewer than max_rows query rows (the caller passes its tile: below it llama.cpp runs its row-at-a-time
// kernel, which this replaces for decode steps and short batches alike, so a token's attention is the same computed
// alone or in a short batch) over an F16 K/V cache with F32 Q, an F16 mask (one for all heads) or none, no sinks,
// no logit softcap, no ALiBi, DK = DV a multiple of 8 up to 256, a power of two query heads per KV head (taken by
// sets of up to 8) and at least one set per thread; otherwise returns false and computes nothing (llama.cpp's
// kernel runs). Every thread gets the same answer.
bool rapidmoe_flash_attn_decode(int ith, int nth, ggml_tensor * dst, int64_t max_rows);

// Whether the op takes our kernel: yes, unless RAPIDMOE_FA_DECODE=0 is in the environment (read at each call, one a
// layer and token, so one process can time both kernels)
inline bool rapidmoe_fa_decode_enabled() {
    const char * env = std::getenv("RAPIDMOE_FA_DECODE");
    return env == nullptr || std::strcmp(env, "0") != 0;
}
