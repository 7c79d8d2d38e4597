// The per-model prefill streaming threshold (design in rapidmoe-stream.h).
#include "rapidmoe-stream.h"

#include "rapidmoe-expert-cache.h"
#include "rapidmoe-llama.h"

#include <mutex>
#include <unordered_map>

namespace {

std::mutex g_mutex;
std::unordered_map<const llama_model *, int32_t> g_min_batch; // models with a threshold > 0

}  // namespace

void rapidmoe_stream_set_min_batch(const llama_model * model, int32_t n_tokens) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (n_tokens > 0) {
        g_min_batch[model] = n_tokens;
    } else {
        g_min_batch.erase(model);
    }
}

int32_t rapidmoe_stream_get_min_batch(const llama_model * model) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_min_batch.find(model);
    return it == g_min_batch.end() ? 0 : it->second;
}

int32_t rapidmoe_stream_min_batch_of(const ggml_tensor * up_exps) {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const auto & [model, n] : g_min_batch) { // a handful of models at most
        auto layers = rapidmoe_expert_cache_get(model);
        if (layers != nullptr && rapidmoe_expert_cache_layer_of(*layers, up_exps) != nullptr) {
            return n;
        }
    }
    return 0;
}

// ---- C API (include/rapidmoe-llama.h) ---------------------------------------------------------------------------

int32_t rapidmoe_llama_set_stream_min_batch(const llama_model * model, int32_t n_tokens) {
    rapidmoe_stream_set_min_batch(model, n_tokens);
    return rapidmoe_stream_get_min_batch(model);
}
