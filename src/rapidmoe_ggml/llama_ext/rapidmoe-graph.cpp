// The MoE FFN hook. Split expert routing will attach per-model residual state here and build the split
// graph; with no sidecar attached to any model the hook returns nullptr and llama.cpp builds its stock graph.
#include "rapidmoe-graph.h"

ggml_tensor * rapidmoe_build_moe_ffn(const llm_graph_context & g, const rapidmoe_moe_args & a) {
    (void) g;
    (void) a;
    return nullptr;  // no sidecar support in this build yet: always the stock MoE FFN
}
