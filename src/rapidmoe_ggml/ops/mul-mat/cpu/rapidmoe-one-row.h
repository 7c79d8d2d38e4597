// A matmul of one activation row on the CPU_REPACK buffer (a decode step's attention, output head, and the MoE's
// gate and up with their sidecars) without the threads meeting inside the op (patches/0018-cpu-one-row.patch).
//
// Why: upstream's repacked MUL_MAT and MUL_MAT_ID quantize the activation on thread 0 (MUL_MAT_ID also builds its row
// map there) and then hold every thread at a barrier before the matmul, so a decode step meets 8 extra times a layer
// (attention's 4 matmuls, gate, up and split routing's 2 sidecar matmuls) while the other threads idle. Timed per
// graph node on the bench model (cpu-fast r = 1, 2 threads, Zen 5 VM) each such op cost 1-2 us beyond its weights'
// streaming. Here each thread quantizes the row itself (1-2 KiB of Q8_K: well under a barrier) and, for MUL_MAT_ID,
// reads the routing itself, then takes its part of the columns (upstream's split of an expert's columns, cut at
// multiples of the interleave). The activation is quantized by the same function, each column by the same gemv:
// the output is the same bits. RAPIDMOE_ONE_ROW=0 in the environment keeps upstream's code (read at each op).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

inline bool rapidmoe_one_row_enabled() {
    const char * env = std::getenv("RAPIDMOE_ONE_ROW");
    return env == nullptr || std::strcmp(env, "0") != 0;
}

// Thread ith's columns [*first, *end) of n, the ith of nth parts cut at multiples of cols (empty where n is small)
inline void rapidmoe_one_row_part(int64_t n, int64_t cols, int ith, int nth, int64_t * first, int64_t * end) {
    auto align = [cols, n](int64_t c) {
        c = c % cols ? c + cols - c % cols : c;
        return c < n ? c : n;
    };
    *first = align(ith * n / nth);
    *end = align((ith + 1) * n / nth);
}

// This thread's buffer for the quantized activation row (grown as needed, kept for the thread's next ops)
inline void * rapidmoe_one_row_buffer(size_t bytes) {
    static thread_local std::vector<char> buffer;
    if (buffer.size() < bytes) {
        buffer.resize(bytes);
    }
    return buffer.data();
}
