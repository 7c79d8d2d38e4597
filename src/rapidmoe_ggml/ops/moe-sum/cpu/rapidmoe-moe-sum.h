// The MoE layer's expert sum in one node on the CPU (ops/moe-sum/cpu/rapidmoe-moe-sum.cpp), offered each graph node by
// llama.cpp's CPU fusion hook (patches/0012-cpu-moe-sum.patch; ggml-cpu.c is C). Compiled into ggml-cpu.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_cgraph;
struct ggml_compute_params;

// When the nodes from node_n on are build_moe_ffn's tail, computes this thread's share of its result and returns how
// many of the nodes after node_n it covered (the caller skips them); otherwise returns 0 and computes nothing. The
// tail is
//   [ADD (split routing's WQ down + the critical slots' part, its only use the MUL)] MUL (down results x routing
//   weights), k VIEWs of the MUL (one per expert slot), k - 1 ADDs summing them in slot order,
//   [ADD (the sum + the layer's residual stream, the sum's only use)],
// all F32, every intermediate used only inside the tail (ggml_can_fuse_subgraph). Each output element is the same
// float operations in the same order as the separate nodes compute it (no contraction into FMA: the file is compiled
// with -ffp-contract=off), so the result is bit-identical; one node instead of 2k to 2k + 2, each of which ended in
// a barrier of every thread, and a decode token's single row split across the threads (ggml's ADD gives a row to one
// thread). Every thread reaches the same answer. Where ggml's allocator placed the output over memory a source held
// (free once the separate nodes had read it), the threads compute aside and write after a barrier.
// RAPIDMOE_MOE_SUM=0 in the environment (read when a tail matches) leaves the nodes to llama.cpp.
int rapidmoe_moe_sum_try_fuse(const struct ggml_cgraph * cgraph, int node_n, const struct ggml_compute_params * params);

// How many nodes the tail that starts at node_n has (0: none), fused or not (RAPIDMOE_MOE_SUM is not read)
int rapidmoe_moe_sum_tail_length(const struct ggml_cgraph * cgraph, int node_n);

// How many tails this process has computed fused (exported from ggml-cpu: the tests read it to see that a model's
// graph takes the fused node)
__attribute__((visibility("default"))) long long rapidmoe_moe_sum_count(void);

#ifdef __cplusplus
}
#endif
