// A per-model registry of attachments (the residual sidecars: rapidmoe-residual.cpp; the expert caches:
// rapidmoe-expert-cache.cpp): model -> its state, held by shared_ptr, so every user (a C API call, a ubatch guard)
// keeps what it took until it lets go. The owning file locks `mutex` around its own reads and writes of `states`.
#pragma once

#include "rapidmoe-generation.h"

#include <map>
#include <memory>
#include <mutex>
#include <utility>

struct llama_model;

template <typename State>
struct rapidmoe_registry {
    std::mutex mutex;
    std::map<const llama_model *, std::shared_ptr<State>> states;

    // the model's state, nullptr when none is registered (mutex held by the caller)
    State * at(const llama_model * model) const {
        auto it = states.find(model);
        return it == states.end() ? nullptr : it->second.get();
    }

    // the model's state, held by the caller; nullptr when none is registered
    std::shared_ptr<State> get(const llama_model * model) {
        std::lock_guard<std::mutex> lock(mutex);
        auto it = states.find(model);
        return it == states.end() ? nullptr : it->second;
    }

    // the first non-null find(state) over every model's state (a handful of models at most): a lookup by tensor,
    // valid until that state is removed
    template <typename Find> auto find_any(Find find) -> decltype(find(std::declval<const State &>())) {
        std::lock_guard<std::mutex> lock(mutex);
        for (const auto & entry : states) {
            if (auto found = find(*entry.second)) {
                return found;
            }
        }
        return nullptr;
    }

    // unregister the model's state (graphs built from now on do without it: the attachment generation is bumped);
    // it is freed when its last user lets go, after the lock. False when none was registered.
    bool remove(const llama_model * model) {
        std::shared_ptr<State> gone;
        {
            std::lock_guard<std::mutex> lock(mutex);
            auto it = states.find(model);
            if (it == states.end()) {
                return false;
            }
            gone = std::move(it->second);
            states.erase(it);
            rapidmoe_attach_generation_bump();
        }
        return true;
    }
};
