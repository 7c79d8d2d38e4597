// The refine codec's kernel for 8 rows at once on the repacked Q3_K layout (rapidmoe-q3k-x8.h, patch 0021): a
// critical slot's dot products computed the way our Q3_K gemv computes a plain one, with the refinement bit added to
// each value in the same registers (rapidmoe-refine-x8.cpp). The bits of rapidmoe_refine_dot_ref for every row.
#pragma once

#include "rapidmoe-q3k-x8.h"

#include <cstddef>
#include <cstdint>

// whether this build has the kernel (AVX-512 VNNI and BITALG) and RAPIDMOE_REFINE_X8 does not switch it off ("0":
// the op reads each repacked row back one at a time instead, the same bits)
bool rapidmoe_refine_x8_enabled();

// rows c = 0..7 of one group of the repacked layout: group = its n/256 blocks, bits = row 0's bit plane (n/8 bytes,
// the next rows bits_stride bytes apart), xs = nx Q8_K activations. out[8 i + c] = refined row c . xs[i], bit for bit
// rapidmoe_refine_dot_ref's. Only where rapidmoe_refine_x8_enabled().
void rapidmoe_refine_dot_x8(int64_t n, const rapidmoe_block_q3_Kx8 * group, const uint8_t * bits, size_t bits_stride,
                            const void * const * xs, int nx, float * out);
