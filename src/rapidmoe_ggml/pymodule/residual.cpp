#include "residual.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "counter_table.h"
#include "model_handle.h"
#include "rapidmoe-llama.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace rapidmoe {

void bind_residual(nb::module_ & m) {
    m.def("attach_residual", [](uintptr_t model, const std::string & path) {
              char err[512] = {0};
              int32_t rc = 0;
              {
                  nb::gil_scoped_release release;
                  rc = rapidmoe_llama_attach_residual(as_model(model), path.c_str(), err, sizeof(err));
              }
              if (rc != 0) {
                  throw std::invalid_argument(err);
              }
          }, "model"_a, "path"_a,
          "Load a .wr.gguf sidecar into CPU memory and attach it to the llama_model at this address.");
    m.def("residual_unhooked", [](uintptr_t model) {
              const llama_model * mdl = as_model(model);
              const std::vector<int32_t> out = counter_rows<int32_t>(1, [&](int32_t * dst, int32_t n_max) {
                  return rapidmoe_llama_residual_unhooked(mdl, dst, n_max);
              });
              return std::vector<int>(out.begin(), out.end());
          }, "model"_a,
          "Layers of the attached sidecar that no graph build reached through llama.cpp's build_moe_ffn (check after "
          "creating a context): split routing cannot apply to them.");
    m.def("detach_residual", [](uintptr_t model) { return rapidmoe_llama_detach_residual(as_model(model)) != 0; },
          "model"_a, "Detach and free the model's sidecar; True if one was attached.");
    m.def("set_n_critical", [](uintptr_t model, int32_t r) {
              const int32_t got = rapidmoe_llama_set_n_critical(as_model(model), r);
              if (got < 0) {
                  throw std::invalid_argument("no residual sidecar is attached to this model");
              }
              return got;
          }, "model"_a, "n_critical"_a,
          "Fixed r (0..k, clamped): each token's r highest-weight experts run in high precision. Returns r.");
    m.def("moe_counters", [](uintptr_t model, bool reset) {
              const llama_model * mdl = as_model(model);
              return counter_table<int64_t, 2>({3}, [&](int64_t * out, int32_t n_max) {
                  return rapidmoe_llama_counters(mdl, out, n_max, reset);
              });
          }, "model"_a, "reset"_a = false,
          "Per layer [tokens, expert slots, critical slots] since the last reset, int64 [n_layer, 3].");
    m.def("set_policy", [](uintptr_t model, nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> p) {
              if (p.shape(1) != 4) {
                  throw std::invalid_argument("a UMIA policy array is float32 [n_layer + 1, 4]");
              }
              if (rapidmoe_llama_set_policy(as_model(model), p.data(), (int64_t) p.size()) != 0) {
                  const int64_t want = rapidmoe_llama_get_policy(as_model(model), nullptr, 0);
                  throw std::invalid_argument(want < 0 ? std::string("no residual sidecar is attached to this model")
                                                       : "policy array has " + std::to_string(p.size()) +
                                                             " values, this model needs " + std::to_string(want));
              }
          }, "model"_a, "params"_a,
          "Write the UMIA policy tensor (float32 [n_layer + 1, 4], layout in rapidmoe-llama.h); applies to the "
          "next graph computed.");
    m.def("get_policy", [](uintptr_t model) {
              const llama_model * mdl = as_model(model);
              const int64_t n = rapidmoe_llama_get_policy(mdl, nullptr, 0);
              std::vector<float> buf(n > 0 ? (size_t) n : 0);
              if (n < 0 || rapidmoe_llama_get_policy(mdl, buf.data(), n) != n) { // detached in between
                  throw std::invalid_argument("no residual sidecar is attached to this model");
              }
              auto [data, owner] = owned(std::move(buf));
              return nb::ndarray<nb::numpy, float, nb::ndim<2>>(data, {(size_t) n / 4, 4}, owner);
          }, "model"_a, "The UMIA policy tensor, float32 [n_layer + 1, 4].");
    m.def("set_skip_noncritical", [](uintptr_t model, bool skip) {
              if (rapidmoe_llama_set_skip_noncritical(as_model(model), skip) != 0) {
                  throw std::invalid_argument("no residual sidecar is attached to this model");
              }
          }, "model"_a, "skip"_a,
          "Drop baseline: non-critical slots are not computed at all. Read at graph build: set before the context.");
    m.def("set_overlap", [](uintptr_t model, int32_t mode, int32_t n_threads) {
              if (mode < 0 || mode > 2) {
                  throw std::invalid_argument("overlap mode is 0 (off), 1 (auto) or 2 (on), got " + std::to_string(mode));
              }
              if (n_threads < 1) {
                  throw std::invalid_argument("overlap threads must be >= 1, got " + std::to_string(n_threads));
              }
              if (rapidmoe_llama_set_overlap(as_model(model), mode, n_threads) != 0) {
                  throw std::invalid_argument("no residual sidecar is attached to this model");
              }
          }, "model"_a, "mode"_a, "n_threads"_a,
          "Overlap of the residual work with the device's WQ work: mode 0 off, 1 auto (WQ on a device), 2 on; the "
          "residual worker's threads. The mode is read at graph build: set it before the context.");
    m.def("overlap_stats", [](uintptr_t model, bool reset) {
              const llama_model * mdl = as_model(model); // before anything is allocated: a bad address leaks nothing
              // always both stages (zeros without a sidecar): the C function fills a fixed [2, 5]
              return counter_table<int64_t, 2>({5}, [&](int64_t * out, int32_t) {
                  if (out != nullptr) {
                      rapidmoe_llama_overlap_stats(mdl, out, reset);
                  }
                  return 2;
              });
          }, "model"_a, "reset"_a = false,
          "Overlap timing since the last reset, int64 [stage (0 gate/up, 1 down), 5]: begin/join pairs, then ns "
          "of the worker's matmuls, of the device's work (begin returned -> join started), join's wait, wall.");
    m.def("r_histogram", [](uintptr_t model, bool reset) {
              const llama_model * mdl = as_model(model);
              return counter_table<int64_t, 3>({2, RAPIDMOE_LLAMA_MAX_TOP_K + 1}, [&](int64_t * out, int32_t n_max) {
                  return rapidmoe_llama_r_histogram(mdl, out, n_max, reset);
              });
          }, "model"_a, "reset"_a = false,
          "Tokens per layer, phase (0 decode, 1 prefill) and r since the last reset, int64 [n_layer, 2, max_top_k + 1].");
    m.attr("max_top_k") = RAPIDMOE_LLAMA_MAX_TOP_K;
    m.def("take_worker_error", [](uintptr_t model) -> std::optional<std::string> {
              char err[512] = {0};
              if (rapidmoe_llama_take_worker_error(as_model(model), err, sizeof(err)) == 1) {
                  return std::string(err);
              }
              return std::nullopt;
          }, "model"_a,
          "The residual worker's first error since the last call (its join's outputs were NaN), or None.");
    m.def("worker_fail_next", []() { rapidmoe_llama_worker_fail_next(); },
          "Test entry: the next residual task any worker runs throws (its join carries the error).");
    m.def("worker_selftest", []() {
              char out[256] = {0};
              int32_t rc = 0;
              {
                  nb::gil_scoped_release release;
                  rc = rapidmoe_llama_worker_selftest(out, sizeof(out));
              }
              return std::make_pair(rc == 0, std::string(out));
          }, "Run the residual worker alone through its task life cycle and an exception: (passed, what failed).");
    m.def("umia_eval", [](nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> w,
                          nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> policy, int32_t il,
                          int32_t phase) {
              const int64_t T = (int64_t) w.shape(0);
              const int32_t k = (int32_t) w.shape(1);
              if (policy.shape(1) != 4 || policy.shape(0) < 2) {
                  throw std::invalid_argument("policy must be float32 [n_layer + 1, 4]");
              }
              const int32_t n_layer = (int32_t) policy.shape(0) - 1;
              auto * ids = new int32_t[(size_t) (T * k)];
              auto * hist = new int64_t[(size_t) k + 1];
              int32_t rc = 0;
              {
                  nb::gil_scoped_release release;
                  rc = rapidmoe_llama_umia_eval(w.data(), T, k, policy.data(), n_layer, il, phase, ids, hist);
              }
              nb::capsule own_ids(ids, [](void * q) noexcept { delete[] (int32_t *) q; });
              nb::capsule own_hist(hist, [](void * q) noexcept { delete[] (int64_t *) q; });
              if (rc != 0) {
                  throw std::invalid_argument("umia_eval: bad arguments (k in 1..64, 0 <= il < n_layer, phase 0/1)");
              }
              return std::make_pair(nb::ndarray<nb::numpy, int32_t, nb::ndim<2>>(ids, {(size_t) T, (size_t) k}, own_ids),
                                    nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>(hist, {(size_t) k + 1}, own_hist));
          }, "weights"_a, "policy"_a, "il"_a, "phase"_a,
          "Run UMIA's graph op on the CPU backend: weights float32 [T, k] (selected ids = slot numbers), one "
          "layer of a policy, phase 0 decode / 1 prefill. Returns (critical ids [T, k], -1 elsewhere; r histogram).");
}

}  // namespace rapidmoe
