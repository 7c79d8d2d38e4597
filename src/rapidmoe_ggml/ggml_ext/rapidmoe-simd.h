// Small SIMD helpers shared by RapidMoE's CPU kernels (ggml_ext/*.cpp).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>

// 8 activation bytes broadcast to every 64-bit lane: a memcpy, not an int64 dereference (block_q8_K's qs sit at 4
// mod 8 after its float d: a misaligned int64 read is undefined behaviour, which UBSan reports); the same vpbroadcastq
inline __m256i broadcast_8_bytes(const int8_t * p) {
    int64_t v;
    std::memcpy(&v, p, sizeof(v));
    return _mm256_set1_epi64x(v);
}
#endif
