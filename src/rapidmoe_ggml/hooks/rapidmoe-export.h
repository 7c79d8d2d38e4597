// Conventions the C API additions (include/rapidmoe-llama.h) share: an error message copied into the caller's
// buffer, and the counter protocol of the per-layer and per-expert counters.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

// 0 for no error; else the message copied (truncated, NUL-terminated) into err and -1
inline int32_t rapidmoe_report(const std::string & msg, char * err, size_t err_size) {
    if (msg.empty()) {
        return 0;
    }
    if (err != nullptr && err_size > 0) {
        const size_t n = std::min(msg.size(), err_size - 1);
        std::memcpy(err, msg.data(), n);
        err[n] = '\0';
    }
    return -1;
}

// a counter's value since the last reset; reset: zeroed in the same step
inline int64_t rapidmoe_take(std::atomic<int64_t> & counter, bool reset) {
    return reset ? counter.exchange(0) : counter.load();
}

// The counter protocol: a table of n_rows rows of `width` int64 values. out = NULL: returns n_rows, writing and
// resetting nothing (what to allocate); else row(i, out + i * width) writes (and, asked to, resets) row i of the
// first min(n_max, n_rows) rows, and their count is returned.
template <typename Row>
int32_t rapidmoe_export_rows(int64_t * out, int32_t n_max, int32_t n_rows, int32_t width, Row row) {
    if (out == nullptr) {
        return n_rows;
    }
    const int32_t n = std::min(n_max, n_rows);
    for (int32_t i = 0; i < n; ++i) {
        row(i, out + (size_t) i * (size_t) width);
    }
    return n;
}
