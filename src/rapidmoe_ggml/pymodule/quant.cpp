// Quantize/dequantize through ggml_quantize_chunk and the type traits' to_float: exactly the values the
// kernels will see. Inputs are zero-copy views of numpy arrays; outputs are new numpy arrays owned by a
// capsule. Rows are split across threads with the GIL released.
#include "quant.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "ggml.h"
#include "rapidmoe-llama.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace rapidmoe {
namespace {

using F32Rows   = nb::ndarray<const float, nb::numpy, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using F32Vec    = nb::ndarray<const float, nb::numpy, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using BytesRows = nb::ndarray<const uint8_t, nb::numpy, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

ggml_type checked_type(int type) {
    if (type < 0 || type >= GGML_TYPE_COUNT) {
        throw std::invalid_argument("unknown ggml type id " + std::to_string(type));
    }
    const auto * tr = ggml_get_type_traits((ggml_type) type);
    if (tr->blck_size == 0 || tr->type_size == 0) {
        throw std::invalid_argument(std::string("ggml type ") + std::to_string(type) + " has been removed");
    }
    return (ggml_type) type;
}

void check_row(ggml_type type, int64_t n_per_row) {
    const int64_t blck = ggml_blck_size(type);
    if (n_per_row <= 0 || n_per_row % blck != 0) {
        throw std::invalid_argument(std::string(ggml_type_name(type)) + " needs rows that are a multiple of " +
                                    std::to_string(blck) + " values; got " + std::to_string(n_per_row));
    }
}

// run fn(row_begin, row_end) over [0, nrows) on n_threads threads
template <typename Fn>
void parallel_rows(int64_t nrows, int n_threads, Fn fn) {
    n_threads = (int) std::max<int64_t>(1, std::min<int64_t>(n_threads, nrows));
    if (n_threads == 1) {
        fn(0, nrows);
        return;
    }
    std::vector<std::thread> pool;
    const int64_t per = (nrows + n_threads - 1) / n_threads;
    for (int t = 0; t < n_threads; ++t) {
        const int64_t r0 = t * per, r1 = std::min(nrows, r0 + per);
        if (r0 < r1) {
            pool.emplace_back(fn, r0, r1);
        }
    }
    for (auto & th : pool) {
        th.join();
    }
}

template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<2>> owned_2d(size_t rows, size_t cols, T ** data) {
    T * buf = new T[rows * cols];
    *data = buf;
    nb::capsule owner(buf, [](void * p) noexcept { delete[] (T *) p; });
    return nb::ndarray<nb::numpy, T, nb::ndim<2>>(buf, {rows, cols}, owner);
}

int default_threads() {
    return (int) std::max(1u, std::thread::hardware_concurrency());
}

nb::ndarray<nb::numpy, uint8_t, nb::ndim<2>> quantize(F32Rows src, int type_id, std::optional<F32Vec> imatrix,
                                                      int n_threads) {
    const ggml_type type = checked_type(type_id);
    const int64_t nrows = (int64_t) src.shape(0), n_per_row = (int64_t) src.shape(1);
    check_row(type, n_per_row);
    const float * imat = nullptr;
    if (imatrix.has_value()) {
        if ((int64_t) imatrix->shape(0) != n_per_row) {
            throw std::invalid_argument("imatrix has " + std::to_string(imatrix->shape(0)) +
                                        " entries, rows have " + std::to_string(n_per_row));
        }
        imat = imatrix->data();
    } else if (ggml_quantize_requires_imatrix(type)) {
        throw std::invalid_argument(std::string(ggml_type_name(type)) + " requires an importance matrix");
    }
    const size_t row_size = ggml_row_size(type, n_per_row);
    uint8_t * dst = nullptr;
    auto out = owned_2d<uint8_t>((size_t) nrows, row_size, &dst);
    const float * x = src.data();
    ggml_quantize_init(type);  // not thread-safe to race on first use; chunks below then only read tables
    {
        nb::gil_scoped_release release;
        parallel_rows(nrows, n_threads > 0 ? n_threads : default_threads(), [&](int64_t r0, int64_t r1) {
            ggml_quantize_chunk(type, x + r0 * n_per_row, dst + r0 * row_size, 0, r1 - r0, n_per_row, imat);
        });
    }
    return out;
}

nb::ndarray<nb::numpy, float, nb::ndim<2>> dequantize(BytesRows src, int type_id, int64_t n_per_row, int n_threads) {
    const ggml_type type = checked_type(type_id);
    check_row(type, n_per_row);
    const size_t row_size = ggml_row_size(type, n_per_row);
    if (src.shape(1) != row_size) {
        throw std::invalid_argument(std::string(ggml_type_name(type)) + " rows of " + std::to_string(n_per_row) +
                                    " values take " + std::to_string(row_size) + " bytes, got " +
                                    std::to_string(src.shape(1)));
    }
    const auto * tr = ggml_get_type_traits(type);
    if (tr->to_float == nullptr) {
        throw std::invalid_argument(std::string("ggml has no dequantization for ") + ggml_type_name(type));
    }
    const int64_t nrows = (int64_t) src.shape(0);
    float * dst = nullptr;
    auto out = owned_2d<float>((size_t) nrows, (size_t) n_per_row, &dst);
    const uint8_t * q = src.data();
    {
        nb::gil_scoped_release release;
        parallel_rows(nrows, n_threads > 0 ? n_threads : default_threads(), [&](int64_t r0, int64_t r1) {
            for (int64_t r = r0; r < r1; ++r) {
                tr->to_float(q + r * row_size, dst + r * n_per_row, n_per_row);
            }
        });
    }
    return out;
}

}  // namespace

void bind_quant(nb::module_ & m) {
    m.def("quantize", &quantize, "src"_a, "type"_a, "imatrix"_a = nb::none(), "n_threads"_a = 0,
          "Quantize float32 rows [n_rows, n_per_row] to ggml type `type` (id) with ggml_quantize_chunk.\n"
          "imatrix: per-column importance [n_per_row], required by the IQ types. Returns uint8 [n_rows, row_size].");
    m.def("dequantize", &dequantize, "src"_a, "type"_a, "n_per_row"_a, "n_threads"_a = 0,
          "Dequantize uint8 rows [n_rows, row_size] of ggml type `type` back to float32 [n_rows, n_per_row].");
    m.def("type_info", [](int type_id) {
              const ggml_type t = checked_type(type_id);
              return nb::make_tuple(std::string(ggml_type_name(t)), (int64_t) ggml_blck_size(t),
                                    (int64_t) ggml_type_size(t), ggml_is_quantized(t),
                                    ggml_quantize_requires_imatrix(t));
          }, "type"_a, "(name, block size, bytes per block, is quantized, requires imatrix) of a ggml type id.");
    m.def("row_size", [](int type_id, int64_t n) { return ggml_row_size(checked_type(type_id), n); },
          "type"_a, "n_per_row"_a, "Bytes of one row of n_per_row values in this type.");
    m.def("quant_types", [](const std::string & path, int ftype) {
              std::vector<std::pair<std::string, int>> out;
              auto cb = [](void * ud, const char * name, int32_t type) {
                  static_cast<std::vector<std::pair<std::string, int>> *>(ud)->emplace_back(name, (int) type);
              };
              int32_t rc;
              {
                  nb::gil_scoped_release release;
                  rc = rapidmoe_llama_quant_types(path.c_str(), ftype, cb, &out);
              }
              if (rc != 0) {
                  throw std::invalid_argument("llama.cpp cannot plan a quantization of " + path + " to ftype " +
                                              std::to_string(ftype));
              }
              return out;
          }, "path"_a, "ftype"_a,
          "llama-quantize's target ggml type id for every tensor of the GGUF at path under llama_ftype `ftype`\n"
          "(a dry run: nothing is quantized or written). Returns [(tensor name, type id)] in file order.");
}

}  // namespace rapidmoe
