// Per-node times of the CPU graph loop (rapidmoe-node-times.h).
#include "rapidmoe-node-times.h"

#include "ggml.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace {

constexpr int MAX_THREADS = 256;

struct Sums {
    double compute_us = 0.0;
    double wait_us = 0.0;
    long long count = 0;       // nodes of this kind computed by this thread
    double weight_bytes = 0.0; // bytes of weights the nodes read (thread 0's count): matmuls only
};

struct Table {
    std::string path;
    long long graphs = 0;
    std::map<std::string, Sums> per_thread[MAX_THREADS];  // each touched by its own thread only while computing
};

Table & table() {
    static Table t;
    return t;
}

// The kind of a node: op, name with a trailing "-<layer>" removed, and its weight's type for matmuls
std::string kind_of(const ggml_tensor * node) {
    std::string name = node->name;
    const size_t dash = name.rfind('-');
    if (dash != std::string::npos && dash + 1 < name.size() &&
        name.find_first_not_of("0123456789", dash + 1) == std::string::npos) {
        name.resize(dash);
    }
    if (name.rfind("node_", 0) == 0) {
        name = "-";
    }
    std::string kind = std::string(ggml_op_desc(node)) + "\t" + name;
    const bool matmul = node->op == GGML_OP_MUL_MAT || node->op == GGML_OP_MUL_MAT_ID ||
                        node->op == GGML_OP_MUL_MAT_ID_MASKED;
    kind += "\t";
    kind += matmul && node->src[0] != nullptr ? ggml_type_name(node->src[0]->type) : "-";
    return kind;
}

// Bytes of weights a matmul node reads: all of src0 for MUL_MAT, the routed experts' matrices for MUL_MAT_ID (each
// distinct id once; a masked op's skipped slots, id < 0, read nothing)
double weight_bytes(const ggml_tensor * node) {
    const ggml_tensor * w = node->src[0];
    if (node->op == GGML_OP_MUL_MAT) {
        return (double) ggml_nbytes(w);
    }
    if (node->op != GGML_OP_MUL_MAT_ID && node->op != GGML_OP_MUL_MAT_ID_MASKED) {
        return 0.0;
    }
    const ggml_tensor * ids = node->src[2];
    std::set<int32_t> distinct;
    for (int64_t t = 0; t < ids->ne[1]; t++) {
        for (int64_t s = 0; s < ids->ne[0]; s++) {
            const int32_t e = *(const int32_t *) ((const char *) ids->data + t * ids->nb[1] + s * ids->nb[0]);
            if (e >= 0) {
                distinct.insert(e);
            }
        }
    }
    return (double) distinct.size() * (double) w->nb[2];
}

void write_table() {
    Table & t = table();
    FILE * f = std::fopen(t.path.c_str(), "w");
    if (f == nullptr) {
        std::fprintf(stderr, "rapidmoe: RAPIDMOE_NODE_TIMES: cannot write %s\n", t.path.c_str());
        return;
    }
    std::fprintf(f, "# graphs\t%lld\n", t.graphs);
    std::fprintf(f, "op\tname\tweight_type\tthread\tcount\tcompute_us\twait_us\tweight_bytes\n");
    for (int ith = 0; ith < MAX_THREADS; ith++) {
        for (const auto & [kind, s] : t.per_thread[ith]) {
            std::fprintf(f, "%s\t%d\t%lld\t%.3f\t%.3f\t%.0f\n", kind.c_str(), ith, s.count, s.compute_us, s.wait_us,
                         s.weight_bytes);
        }
    }
    std::fclose(f);
}

}  // namespace

int rapidmoe_node_times_on(void) {
    static const int on = [] {
        const char * path = std::getenv("RAPIDMOE_NODE_TIMES");
        if (path == nullptr || path[0] == '\0') {
            return 0;
        }
        table().path = path;
        std::atexit(write_table);
        return 1;
    }();
    return on;
}

double rapidmoe_node_times_now(void) {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void rapidmoe_node_times_graph(int ith) {
    if (ith == 0) {
        table().graphs++;
    }
}

void rapidmoe_node_times_add(const struct ggml_tensor * node, int ith, double compute_us, double wait_us) {
    if (ith < 0 || ith >= MAX_THREADS) {
        return;
    }
    Sums & s = table().per_thread[ith][kind_of(node)];
    s.compute_us += compute_us;
    s.wait_us += wait_us;
    s.count++;
    if (ith == 0) {
        s.weight_bytes += weight_bytes(node);
    }
}

void rapidmoe_node_times_reset(void) {
    Table & t = table();
    t.graphs = 0;
    for (auto & m : t.per_thread) {
        m.clear();
    }
}
