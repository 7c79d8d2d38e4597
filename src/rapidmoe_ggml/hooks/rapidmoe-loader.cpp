// Model loading: pages of weights copied out of the file's mapping are released (patch 0022).
#include "rapidmoe-loader.h"

#include "llama-mmap.h"

#include <cstdlib>
#include <cstring>

void rapidmoe_loader_release_copied(llama_mmap & mapping, size_t offs, size_t n_size, bool validating) {
    const char * keep = getenv("RAPIDMOE_KEEP_MAPPED");
    if (validating || (keep != nullptr && strcmp(keep, "1") == 0)) {
        return;
    }
    mapping.unmap_fragment(offs, offs + n_size); // rounds inward to whole pages: a neighbour's bytes stay mapped
}
