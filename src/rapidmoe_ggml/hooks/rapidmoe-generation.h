// The attachment generation: bumped by every residual attach or detach and every expert cache change (of any
// model). The ubatch guard (rapidmoe-compute.h) reuses a graph only when it was built under the generation the
// guard's snapshot was taken at, so a graph built before a change is rebuilt. A leaf: the sidecar and cache
// registries bump it without depending on the guard, which depends on them.
#pragma once

#include <atomic>
#include <cstdint>

// one counter in libllama (an inline function's static is a single object across the library's translation units)
inline std::atomic<uint64_t> & rapidmoe_attach_generation_counter() {
    static std::atomic<uint64_t> generation{1};
    return generation;
}

inline uint64_t rapidmoe_attach_generation() {
    return rapidmoe_attach_generation_counter().load();
}

inline void rapidmoe_attach_generation_bump() {
    rapidmoe_attach_generation_counter().fetch_add(1);
}
