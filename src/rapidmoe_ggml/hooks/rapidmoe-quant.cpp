// rapidmoe_llama_quant_types: llama_model_quantize in dry-run mode (no output file, no tensor data read) with a
// thread-local listener that patch 0003's hook feeds.
#include "rapidmoe-quant.h"

#include "rapidmoe-llama.h"

#include <stdexcept>

namespace {

struct listener {
    rapidmoe_quant_type_cb cb;
    void * user_data;
};

thread_local listener * g_listener = nullptr;

}  // namespace

void rapidmoe_quant_target_type(const char * name, ggml_type type) {
    if (g_listener != nullptr) {
        g_listener->cb(g_listener->user_data, name, (int32_t) type);
    }
}

int32_t rapidmoe_llama_quant_types(const char * path, int32_t ftype, rapidmoe_quant_type_cb cb, void * user_data) {
    if (path == nullptr || cb == nullptr) {
        return -1;
    }
    llama_model_quantize_params params = llama_model_quantize_default_params();
    params.ftype = (llama_ftype) ftype;
    params.dry_run = true;
    params.nthread = 1;
    listener l = { cb, user_data };
    g_listener = &l;
    // the dry run logs a line per tensor: quiet while it runs (the log callback is process-wide)
    ggml_log_callback prev_cb = nullptr;
    void * prev_ud = nullptr;
    llama_log_get(&prev_cb, &prev_ud);
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    uint32_t rc = 1;
    try {
        rc = llama_model_quantize(path, "/dev/null", &params); // dry run: the output path is never opened
    } catch (const std::exception &) {
        rc = 1;
    }
    llama_log_set(prev_cb, prev_ud);
    g_listener = nullptr;
    return rc == 0 ? 0 : -1;
}
