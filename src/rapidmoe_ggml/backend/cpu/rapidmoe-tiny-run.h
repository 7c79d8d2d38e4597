// Runs of small graph nodes computed by one thread, with one barrier after the run instead of one after each node
// (backend/cpu/rapidmoe-tiny-run.cpp), asked by llama.cpp's CPU graph loop (patches/0013-cpu-tiny-run.patch; ggml-cpu.c
// is C). Compiled into ggml-cpu.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_cgraph;

// How many nodes from node_n on (node_n itself a node to compute) thread 0 should compute alone, one after another,
// before the threads meet again: at least 2 nodes that compute something, else 0 (the graph runs as upstream's).
// A node belongs to a run when its op is elementwise, row-wise or a copy that never meets the other threads inside
// (add, mul, div, scale, clamp, soft_max, argsort, get_rows, set_rows, sum_rows, rms_norm, norm, rope, glu, unary,
// cpy, cont, dup, and custom ops of one task such as split routing's choice of critical slots; not matmuls,
// attention or custom ops of several tasks) and its result has at most RAPIDMOE_TINY_RUN floats
// (default 4096; 0: no runs), as a decode step's norms, ropes, routing ops and expert sums do, where one barrier
// costs more than the node's work. Views and other no-op nodes inside a run come with it. A group that llama.cpp's
// fusion or ours computes as one node (RMS_NORM + MUL, build_moe_ffn's expert sum) joins a run whole or not at all.
// The value is per node and thread count only, so every thread reaches the same answer; each node's result is the
// one its own kernel computes (the same kernel with one thread: these ops' values do not depend on the thread
// count). The threshold is read from the environment when a graph's computation starts.
int rapidmoe_tiny_run_length(const struct ggml_cgraph * cgraph, int node_n, int ith, int nth);

// How many runs this process has computed (thread 0's count; exported from ggml-cpu for the tests)
__attribute__((visibility("default"))) long long rapidmoe_tiny_run_count(void);

#ifdef __cplusplus
}
#endif
