// Runs of small graph nodes on one thread.
//
// Why: ggml's CPU graph loop ends every node with a barrier of all threads. A decode step's norms, ropes, cache
// writes, routing ops and expert sums are each a few thousand floats of work, less than the barrier costs, and an op
// with a single row (a decode token's) gives it to one thread while the others wait anyway. Thread 0 computes such a
// run of consecutive nodes alone and the threads meet once after it (patches/0013-cpu-tiny-run.patch runs it).
// Matmuls, attention and custom ops of several tasks stay shared (and they may meet the other threads inside, which a
// run must not); a custom op of one task (split routing's choice of critical slots) is thread 0's anyway.
#include "rapidmoe-tiny-run.h"

#include "rapidmoe-moe-sum.h"

#include "ggml-impl.h" // ggml_cgraph, ggml_op_is_empty

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

std::atomic<long long> runs{ 0 };

constexpr int64_t DEFAULT_LIMIT = 4096; // floats a node's result may have

// the threshold, read when a thread starts a graph (its node indices go back to the start)
int64_t limit_for(int node_n) {
    thread_local int last = -1;
    thread_local int64_t limit = DEFAULT_LIMIT;
    if (node_n <= last || last < 0) {
        const char * env = std::getenv("RAPIDMOE_TINY_RUN");
        limit = env != nullptr && *env != '\0' ? std::strtoll(env, nullptr, 10) : DEFAULT_LIMIT;
    }
    last = node_n;
    return limit;
}

// ops whose CPU kernels split rows or elements between threads and never wait for the others inside
bool single_thread_safe(ggml_op op) {
    switch (op) {
        case GGML_OP_ADD:
        case GGML_OP_MUL:
        case GGML_OP_DIV:
        case GGML_OP_SCALE:
        case GGML_OP_CLAMP:
        case GGML_OP_SOFT_MAX:
        case GGML_OP_ARGSORT:
        case GGML_OP_TOP_K:
        case GGML_OP_GET_ROWS:
        case GGML_OP_SET_ROWS:
        case GGML_OP_SUM_ROWS:
        case GGML_OP_RMS_NORM:
        case GGML_OP_NORM:
        case GGML_OP_ROPE:
        case GGML_OP_GLU:
        case GGML_OP_UNARY:
        case GGML_OP_CPY:
        case GGML_OP_CONT:
        case GGML_OP_DUP:
            return true;
        default:
            return false;
    }
}

bool skipped(const ggml_tensor * t) { // the graph loop passes over it
    return ggml_op_is_empty(t->op) || (t->flags & GGML_TENSOR_FLAG_COMPUTE) == 0;
}

// a custom op that asked for one task: thread 0 computes all of it in any case (the others return at once)
bool single_task_custom(const ggml_tensor * t) {
    if (t->op != GGML_OP_CUSTOM) {
        return false;
    }
    ggml_custom_op_params p;
    std::memcpy(&p, t->op_params, sizeof(p));
    return p.n_tasks == 1;
}

bool tiny(const ggml_tensor * t, int64_t limit) {
    return skipped(t) ||
           ((single_thread_safe(t->op) || single_task_custom(t)) && ggml_nelements(t) <= limit);
}

// nodes in the unit that starts at i: a group llama.cpp or we compute as one node, else 1
int unit_length(const ggml_cgraph * g, int i) {
    const int tail = rapidmoe_moe_sum_tail_length(g, i);
    if (tail > 0) {
        return tail;
    }
    if (g->nodes[i]->op == GGML_OP_RMS_NORM && i + 1 < g->n_nodes && g->nodes[i + 1]->op == GGML_OP_MUL) {
        return 2; // ggml_cpu_try_fuse_ops may take both (conservative: a run holds the pair whole or not at all)
    }
    return 1;
}

}  // namespace

int rapidmoe_tiny_run_length(const ggml_cgraph * cgraph, int node_n, int ith, int nth) {
    const int64_t limit = limit_for(node_n);
    if (nth < 2 || limit <= 0) {
        return 0;
    }
    int i = node_n;
    int units = 0; // nodes (or fused groups) of the run that compute something
    while (i < cgraph->n_nodes) {
        if (skipped(cgraph->nodes[i])) {
            ++i;
            continue;
        }
        const int n = unit_length(cgraph, i);
        if (i + n > cgraph->n_nodes) {
            break;
        }
        bool all = true;
        for (int j = i; j < i + n && all; ++j) {
            all = tiny(cgraph->nodes[j], limit);
        }
        if (!all) {
            break;
        }
        ++units;
        i += n;
    }
    // a run ends at a node to compute or the graph's end: the no-op nodes after it stay the loop's to pass over
    while (i > node_n && skipped(cgraph->nodes[i - 1])) {
        --i;
    }
    if (units < 2) {
        return 0;
    }
    if (ith == 0) {
        runs.fetch_add(1, std::memory_order_relaxed);
    }
    return i - node_n;
}

long long rapidmoe_tiny_run_count(void) {
    return runs.load(std::memory_order_relaxed);
}
