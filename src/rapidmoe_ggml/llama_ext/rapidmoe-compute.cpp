// The ubatch guard (rapidmoe-compute.h): snapshots of the model's attachments held through a graph's build and
// compute, the attachment generation that decides graph reuse, and the policy applied between computes.
#include "rapidmoe-compute.h"

#include "rapidmoe-expert-cache.h"
#include "rapidmoe-residual.h"

#include <atomic>
#include <map>
#include <mutex>

namespace {

std::atomic<uint64_t> g_generation{1};
std::mutex g_built_mutex;
std::map<const void *, uint64_t> g_built; // graph slot -> generation its graph was built under (one per context)
thread_local const rapidmoe_ubatch_guard * t_current = nullptr;

}  // namespace

uint64_t rapidmoe_attach_generation() {
    return g_generation.load();
}

void rapidmoe_attach_generation_bump() {
    g_generation.fetch_add(1);
}

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

const rapidmoe_ubatch_guard * rapidmoe_ubatch_guard::current() {
    return t_current;
}

const rapidmoe_layer_residual * rapidmoe_ubatch_guard::find_residual(const ggml_tensor * down_exps) const {
    if (residual_ == nullptr) {
        return nullptr;
    }
    for (const auto & lr : residual_->layers) {
        if (lr.down_hi != nullptr && lr.base_down == down_exps) {
            return &lr;
        }
    }
    return nullptr;
}

const rapidmoe_expert_cache_layer * rapidmoe_ubatch_guard::find_cache(const ggml_tensor * up_exps) const {
    if (cache_ == nullptr) {
        return nullptr;
    }
    for (const auto & c : *cache_) {
        if (c != nullptr && c->base_up == up_exps) {
            return c.get();
        }
    }
    return nullptr;
}
