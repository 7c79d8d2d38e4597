// RapidMoE's CPU flash attention over an F16 or Q8_0 KV cache, made for the decode step at any depth
// (ops/flash-attn/cpu/rapidmoe-fa-decode.cpp), called at the top of llama.cpp's CPU GGML_OP_FLASH_ATTN_EXT
// (patches/0011-cpu-fa-decode.patch). Compiled into ggml-cpu.
#pragma once

#include "ggml.h"

#include <cstdlib>
#include <cstring>

struct ggml_compute_params;

// Computes dst (every thread its share of work items: a decode step's set of heads on one KV head, or with the
// AVX-512 kernel on up to 16 / G adjacent ones, and over several chunks of 512 cells one chunk, folded after a
// barrier; a prompt batch's tile of up to 16 / G query rows on one KV head, claimed through the threadpool's chunk
// counter after one barrier) and returns true when the node reads an F16 or
// Q8_0 K/V cache (each either) with F32 Q (any number of query rows and streams), an F16 mask (one for all heads) or
// none, no sinks, no logit softcap, no ALiBi, DK = DV a multiple of 8 (Q8_0: 32) up to 256, a power of two query
// heads per KV head (taken by sets of up to 8) and at least one set per thread; otherwise returns false and computes
// nothing (llama.cpp's kernel runs). Every thread gets the same answer. Taking every batch, not only decode steps,
// keeps a token's attention the same computed alone or in a prompt, and a sequence's the same alone or batched with
// others in their own streams (llama.cpp's row, tiled and split-KV kernels each round differently): however the
// work is cut, each query row gets the same bits (tests/engine/test_fa_decode.py).
bool rapidmoe_flash_attn_decode(const struct ggml_compute_params * params, ggml_tensor * dst);

// Whether the op takes our kernel: yes, unless RAPIDMOE_FA_DECODE=0 is in the environment (read at each call, one a
// layer and token, so one process can time both kernels)
inline bool rapidmoe_fa_decode_enabled() {
    const char * env = std::getenv("RAPIDMOE_FA_DECODE");
    return env == nullptr || std::strcmp(env, "0") != 0;
}

// RAPIDMOE_FA_DECODE=avx2: our AVX2 loops (one KV head and one query row an item) where the build has the AVX-512
// kernel, to time one against the other in one process and to test the AVX2 code
inline bool rapidmoe_fa_decode_avx2_only() {
    const char * env = std::getenv("RAPIDMOE_FA_DECODE");
    return env != nullptr && std::strcmp(env, "avx2") == 0;
}
