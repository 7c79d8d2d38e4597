// The C API's counter protocol (rapidmoe-llama.h: a counter function called with out = NULL returns the row count,
// then fills that many rows) on the Python side: one helper turns a counter table into what Python gets, a numpy
// array [rows, row shape...] or a list.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "model_handle.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace rapidmoe {

// The table's values, `width` per row: rows(out, n_max) is the C call (out = nullptr: the row count). The table is
// sized by the first call and keeps the rows the second one wrote (none when the counters went away in between).
template <typename T, typename Rows>
std::vector<T> counter_rows(size_t width, Rows rows) {
    const int32_t n_alloc = std::max<int32_t>(0, (int32_t) rows(nullptr, 0));
    std::vector<T> buf((size_t) n_alloc * width);
    const int32_t n = (int32_t) rows(buf.data(), n_alloc);
    buf.resize((size_t) std::clamp<int32_t>(n, 0, n_alloc) * width);
    return buf;
}

// The table as a numpy array [rows, row_shape...] (a fresh one, owned by Python).
template <typename T, size_t NDim, typename Rows>
nanobind::ndarray<nanobind::numpy, T, nanobind::ndim<NDim>>
counter_table(const std::array<size_t, NDim - 1> & row_shape, Rows rows) {
    size_t width = 1;
    for (size_t d : row_shape) {
        width *= d;
    }
    std::vector<T> buf = counter_rows<T>(width, rows);
    std::array<size_t, NDim> shape{};
    shape[0] = buf.size() / width;
    std::copy(row_shape.begin(), row_shape.end(), shape.begin() + 1);
    auto [data, owner] = owned(std::move(buf));
    return nanobind::ndarray<nanobind::numpy, T, nanobind::ndim<NDim>>(data, NDim, shape.data(), owner);
}

}  // namespace rapidmoe
