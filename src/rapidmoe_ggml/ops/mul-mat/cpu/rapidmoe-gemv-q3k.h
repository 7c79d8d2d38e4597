// RapidMoE's Q3_K x Q8_K gemv and gemm over our repacked 8-row layout (rapidmoe_block_q3_Kx8, rapidmoe-q3k-x8.h),
// called from ggml_gemv_q3_K_8x8_q8_K / ggml_gemm_q3_K_8x8_q8_K (patches/0021-cpu-repack-q3-k.patch). Compiled into
// ggml-cpu. Upstream has no repacked Q3_K: every Q3_K matmul goes through the plain vec_dot one row at a time.
#pragma once

#include <cstddef>
#include <cstdint>

struct ggml_tensor;

// s[c] (c < nc, a multiple of 8) = the nc repacked Q3_K rows of vx times the one Q8_K row vy (nr = 1), n values a
// row. Per super-block: each row's exact integer dot product with the activation, times (row d x activation d),
// added by one fma in block order: the plain vec_dot's integers, accumulated in another order (tolerance-equal).
void rapidmoe_gemv_q3_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);

// s[r * bs + c] for the nr activation rows (a multiple of 4, block_q8_Kx4 as ggml_quantize_mat_q8_K_4x8 writes them)
// times the nc repacked rows of vx: each group of 4 rows de-interleaved, then the gemv's bits for each row
void rapidmoe_gemm_q3_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);

// repack: rows 8 i .. 8 i + 7 of the plain Q3_K tensor data (nrow rows of n / 256 blocks) become the i-th run of
// n / 256 x8 blocks at dst (nrow a multiple of 8)
void rapidmoe_repack_q3_K_x8(void * dst, const void * data, int64_t nrow, int64_t n);

// Whether Q3_K weights are repacked: where this build has the AVX-512 VNNI gemv (the one kernel fast enough to be
// worth it; elsewhere Q3_K stays plain), unless RAPIDMOE_Q3_K_REPACK=0 is in the environment (read at each weight
// load; then Q3_K stays plain, as upstream keeps it)
bool rapidmoe_q3_K_repack();

// Whether a ggml custom op reads the x8 layout of its repacked src[0] (its userdata is RAPIDMOE_Q3K_X8_READER): the
// CPU_REPACK buffer type then runs it (any other op on a repacked tensor would read the bytes as plain Q3_K)
bool rapidmoe_q3_K_x8_reader(const ggml_tensor * op);
