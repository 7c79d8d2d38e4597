// The refine codec's matmul (sidecar codec "q3k-refine1", docs/resplit.md): a critical expert's weights are its WQ
// Q3_K block values refined by one bit per weight that halves the base's step,
//     w = s_j * (L - 4) + s_j/4 * (2t - 1) = s_j/4 * (2f - 17),   f = 2L + t in 0..15,
// where L (0..7) and the sub-block scale s_j = d * (sc_j - 32) come from the WQ block itself and t from the sidecar's
// bit plane (no scales of its own: 1 bit per weight). The op reads WQ and the bits in one pass, so a critical slot
// costs 4.4375 bits per weight read, and the split's non-critical slots run llama.cpp's own Q3_K matmul (masked).
#pragma once

#include "rapidmoe-q3k-x8.h"
#include "ggml.h"

#include <cstddef>
#include <cstdint>
#include <string>

// bytes of one Q8_K block (d, qs[256], bsums[16]); a Q3_K block's layout (RAPIDMOE_Q3K_BLOCK bytes) is in
// rapidmoe-q3k-x8.h, with the repacked one the op also reads
constexpr size_t RAPIDMOE_Q8K_BLOCK = 292;

// dot(refined row, x) for one row of n weights (n % 256 == 0): wq = the row's Q3_K blocks, bits = its n/8 bytes
// (column i: byte i >> 3, bit i & 7), x = the activation quantized to Q8_K. The integer sums are exact and each block
// adds to the float sum in block order, so every kernel gives the reference's bits.
float rapidmoe_refine_dot_ref(int64_t n, const uint8_t * wq, const uint8_t * bits, const void * x);
float rapidmoe_refine_dot(int64_t n, const uint8_t * wq, const uint8_t * bits, const void * x); // SIMD where built
// the same row against nx <= RAPIDMOE_REFINE_MAX_X activations (a prompt batch's tokens routed to one expert): each
// weight block is unpacked once for all of them; out[i] has the bits rapidmoe_refine_dot gives for xs[i]
constexpr int RAPIDMOE_REFINE_MAX_X = 8;
void rapidmoe_refine_dot_multi(int64_t n, const uint8_t * wq, const uint8_t * bits, const void * const * xs, int nx,
                               float * out);

// What the op takes, the refine codec's checks in one place (the sidecar loader and the graph ask them too): WQ
// experts in Q3_K (rows of whole 256-weight super-blocks), and a bit plane I8 [n_in/8, n_out, n_expert] of them.
bool rapidmoe_refine_takes(const ggml_tensor * wq);
// "" where `plane` is a bit plane of `wq`'s experts that the op takes, else why not (naming the plane)
std::string rapidmoe_refine_plane_error(const ggml_tensor * wq, const ggml_tensor * plane);

// dst [n_out, k, T] f32 = refined(wq)[ids[j, t]] @ b[:, j % b->ne[1], t] for slots with ids >= 0, zero rows elsewhere.
// wq: Q3_K [n_in, n_out, n_expert] in CPU memory (plain, or repacked: patch 0021's 8-row layout, whose bytes the op
// reads back per row, the same bits); bits: I8 [n_in/8, n_out, n_expert]; b: f32
// [n_in, n_b, T]; ids: i32 [k, T]. A ggml custom op: the CPU computes it, on all its threads.
ggml_tensor * rapidmoe_refine_mul_mat_id(ggml_context * ctx, ggml_tensor * wq, ggml_tensor * bits, ggml_tensor * b,
                                         ggml_tensor * ids);
