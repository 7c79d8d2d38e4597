// RapidMoE's flash attention for one decode token (ggml_ext/rapidmoe-fa-decode.cpp), called at the top of
// llama.cpp's CPU GGML_OP_FLASH_ATTN_EXT (patches/0011-cpu-fa-decode.patch). Compiled into ggml-cpu.
#pragma once

#include "ggml.h"

#include <cstdlib>
#include <cstring>

// Computes dst (every thread its share, by KV head) and returns true when the node is one query row per head
// (neq1 = neq3 = 1) over an F16 K/V cache with F32 Q, an F16 mask or none, no sinks, no logit softcap, no ALiBi,
// DK = DV a multiple of 8 up to 256, at most 8 query heads per KV head and at least as many KV heads as threads;
// otherwise returns false and computes nothing (llama.cpp's kernel runs). Every thread gets the same answer.
bool rapidmoe_flash_attn_decode(int ith, int nth, ggml_tensor * dst);

// Whether the op takes our kernel: yes, unless RAPIDMOE_FA_DECODE=0 is in the environment (read at each call, one a
// layer and token, so one process can time both kernels)
inline bool rapidmoe_fa_decode_enabled() {
    const char * env = std::getenv("RAPIDMOE_FA_DECODE");
    return env == nullptr || std::strcmp(env, "0") != 0;
}
