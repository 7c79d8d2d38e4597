// Per-node times of the CPU graph loop: each thread's compute time per node and its wait at the barrier after it,
// summed per kind of node (op, tensor name without its layer suffix, weight type), written to a file at exit.
// llama.cpp's CPU graph loop calls these (patches/0019-cpu-node-times.patch; ggml-cpu.c is C) when the environment
// has RAPIDMOE_NODE_TIMES=FILE; tools/profile_nodes.py runs a decode or prompt under it and prints the table.
// Compiled into ggml-cpu.
//
// Why: perf's samples say which functions take the time, not which graph node a thread was waiting after, nor how
// fast each matmul streamed its weights; a decode step's cost beyond streaming (threads idle while one computes a
// small node, barriers, small matmuls that never reach the bandwidth) shows up only per node.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_tensor;

// Whether RAPIDMOE_NODE_TIMES names a file (read once per process)
int rapidmoe_node_times_on(void);

// A monotonic clock in microseconds
double rapidmoe_node_times_now(void);

// A graph's computation starts (thread 0 counts graphs)
void rapidmoe_node_times_graph(int ith);

// Thread ith spent compute_us computing node (or a run or fusion starting at it) and wait_us at the barrier after
void rapidmoe_node_times_add(const struct ggml_tensor * node, int ith, double compute_us, double wait_us);

// Forget what was summed so far (between graph computations: after a warm-up), exported from ggml-cpu for
// tools/profile_nodes.py
__attribute__((visibility("default"))) void rapidmoe_node_times_reset(void);

#ifdef __cplusplus
}
#endif
