// The ubatch guard (rapidmoe-compute.h): snapshots of the model's attachments held through a graph's build and
// compute, the attachment generation that decides graph reuse, the policy applied between computes, and which
// snapshot (or registry) a graph build's lookups search.
#include "rapidmoe-compute.h"

#include "rapidmoe-expert-cache.h"
#include "rapidmoe-residual.h"

#include <map>
#include <mutex>

namespace {

std::mutex g_built_mutex;
std::map<const void *, uint64_t> g_built; // graph slot -> generation its graph was built under (one per context)
thread_local const rapidmoe_ubatch_guard * t_current = nullptr;

}  // namespace

rapidmoe_ubatch_guard::rapidmoe_ubatch_guard(const llama_model & model, const void * graph_slot)
    : slot_(graph_slot), outer_(t_current) {
    generation_ = rapidmoe_attach_generation();
    residual_ = rapidmoe_residual_get(&model);
    cache_ = rapidmoe_expert_cache_get(&model);
    // an attach or detach in between: the snapshot may mix before and after; build from it, but never reuse
    consistent_ = rapidmoe_attach_generation() == generation_;
    if (residual_ != nullptr) {
        residual_->compute_enter();
    }
    t_current = this;
}

rapidmoe_ubatch_guard::~rapidmoe_ubatch_guard() {
    t_current = outer_;
    if (residual_ != nullptr) {
        residual_->compute_leave();
    }
}

bool rapidmoe_ubatch_guard::can_reuse() const {
    if (!consistent_) {
        return false;
    }
    std::lock_guard<std::mutex> lock(g_built_mutex);
    auto it = g_built.find(slot_);
    return it != g_built.end() && it->second == generation_;
}

void rapidmoe_ubatch_guard::built() {
    std::lock_guard<std::mutex> lock(g_built_mutex);
    g_built[slot_] = consistent_ ? generation_ : 0; // 0: never reused
}

const rapidmoe_layer_residual * rapidmoe_residual_find(const ggml_tensor * down_exps) {
    if (const rapidmoe_ubatch_guard * guard = t_current) {
        return guard->residual_ != nullptr ? rapidmoe_residual_layer_of(*guard->residual_, down_exps) : nullptr;
    }
    return rapidmoe_residual_find_attached(down_exps);
}

const rapidmoe_expert_cache_layer * rapidmoe_expert_cache_find(const ggml_tensor * up_exps) {
    if (const rapidmoe_ubatch_guard * guard = t_current) {
        return guard->cache_ != nullptr ? rapidmoe_expert_cache_layer_of(*guard->cache_, up_exps) : nullptr;
    }
    return rapidmoe_expert_cache_find_attached(up_exps);
}
