#include "expert_cache.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "counter_table.h"
#include "model_handle.h"
#include "rapidmoe-llama.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace rapidmoe {

void bind_expert_cache(nb::module_ & m) {
    m.def("expert_cache_set", [](uintptr_t model, int32_t il, const std::vector<int32_t> & ids,
                                 const std::string & device) {
              char err[512] = {0};
              int32_t rc = 0;
              {
                  nb::gil_scoped_release release; // copies the experts' slices to the device
                  rc = rapidmoe_llama_expert_cache_set(as_model(model), il, ids.data(), (int32_t) ids.size(),
                                                       device.c_str(), err, sizeof(err));
              }
              if (rc != 0) {
                  throw std::invalid_argument(err);
              }
          }, "model"_a, "il"_a, "ids"_a, "device"_a,
          "Copy the WQ gate/up/down slices of experts `ids` of layer il to the device (or buffer type) named "
          "`device`; the layer's graphs then compute those experts there and the others on the CPU.");
    m.def("expert_cache_replace", [](uintptr_t model, int32_t il, int32_t out_expert, int32_t in_expert) {
              char err[512] = {0};
              int32_t rc = 0;
              {
                  nb::gil_scoped_release release; // copies one expert's slices to the device
                  rc = rapidmoe_llama_expert_cache_replace(as_model(model), il, out_expert, in_expert, err,
                                                           sizeof(err));
              }
              if (rc != 0) {
                  throw std::invalid_argument(err);
              }
          }, "model"_a, "il"_a, "out_expert"_a, "in_expert"_a,
          "Put expert in_expert of layer il into the cache slot of out_expert (between decodes only).");
    m.def("expert_cache_set_lru", [](uintptr_t model, int32_t il, bool lru) {
              char err[512] = {0};
              if (rapidmoe_llama_expert_cache_set_lru(as_model(model), il, lru, err, sizeof(err)) != 0) {
                  throw std::invalid_argument(err);
              }
          }, "model"_a, "il"_a, "lru"_a,
          "Layer il's cache loads the experts each ubatch needs into its least recently used slots (lru) or stays "
          "as set (static).");
    m.def("expert_cache_set_moepic", [](uintptr_t model, int32_t il, int64_t n_top, int32_t capacity) {
              char err[512] = {0};
              if (rapidmoe_llama_expert_cache_set_moepic(as_model(model), il, n_top, capacity, err, sizeof(err)) != 0) {
                  throw std::invalid_argument(err);
              }
          }, "model"_a, "il"_a, "n_top"_a, "capacity"_a,
          "Layer il's cache becomes MoEpic's: top segments of n_top intermediate rows, up to `capacity` resident, "
          "its slots a work area assembled per ubatch, the next layer's predicted experts assembled ahead.");
    m.def("expert_cache_set_async", [](uintptr_t model, bool enabled) {
              if (rapidmoe_llama_expert_cache_set_async(as_model(model), enabled) != 0) {
                  throw std::invalid_argument("the model has no expert cache");
              }
          }, "model"_a, "enabled"_a,
          "Cache copies overlap compute (each layer waits for its own right before its device work) or not.");
    m.def("expert_cache_bytes", [](uintptr_t model, bool reset) {
              const llama_model * mdl = as_model(model);
              return counter_table<int64_t, 2>({3}, [&](int64_t * out, int32_t n_max) {
                  return rapidmoe_llama_expert_cache_bytes(mdl, out, n_max, reset);
              });
          }, "model"_a, "reset"_a = false,
          "Per layer, host -> device bytes copied on demand and ahead (prefetch), and microseconds the computing "
          "thread waited for the copies, since the last reset (int64 [n_layer, 3]).");
    m.def("expert_cache_copies", [](uintptr_t model, bool reset) {
              const llama_model * mdl = as_model(model);
              return counter_table<int64_t, 1>({}, [&](int64_t * out, int32_t n_max) {
                  return rapidmoe_llama_expert_cache_copies(mdl, out, n_max, reset);
              });
          }, "model"_a, "reset"_a = false,
          "Per layer, experts the lru policy copied host -> device since the last reset (int64 [n_layer]).");
    m.def("expert_cache_expert_counts", [](uintptr_t model, int32_t il, bool reset) {
              const llama_model * mdl = as_model(model);
              return counter_table<int64_t, 1>({}, [&](int64_t * out, int32_t n_max) {
                  return rapidmoe_llama_expert_cache_expert_counts(mdl, il, out, n_max, reset);
              });
          }, "model"_a, "il"_a, "reset"_a = false,
          "Per expert of cached layer il, the expert slots routed to it since the last reset (int64 [n_expert]; "
          "empty when the layer has no cache).");
    m.def("expert_cache_clear", [](uintptr_t model) { return rapidmoe_llama_expert_cache_clear(as_model(model)) != 0; },
          "model"_a, "Free the model's expert caches; True if there were any.");
    m.def("expert_cache_stats", [](uintptr_t model, bool reset) {
              const llama_model * mdl = as_model(model);
              return counter_table<int64_t, 2>({3}, [&](int64_t * out, int32_t n_max) {
                  return rapidmoe_llama_expert_cache_stats(mdl, out, n_max, reset);
              });
          }, "model"_a, "reset"_a = false,
          "Per layer [cached experts (-1: no cache), slots served from the cache, all slots] since the last reset, "
          "int64 [n_layer, 3] (0 rows without a cache).");
}

}  // namespace rapidmoe
