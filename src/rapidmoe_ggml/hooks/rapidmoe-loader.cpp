// Model loading: pages of weights copied out of the file's mapping are released (patch 0022).
#include "rapidmoe-loader.h"

#include "llama-mmap.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if !defined(_WIN32)
#include <unistd.h>  // _POSIX_MAPPED_FILES
#endif
#if defined(_POSIX_MAPPED_FILES)
#include <sys/mman.h>
#endif

void rapidmoe_loader_release_copied(llama_mmap & mapping, size_t offs, size_t n_size, bool validating) {
    const char * keep = getenv("RAPIDMOE_KEEP_MAPPED");
    if (validating || (keep != nullptr && strcmp(keep, "1") == 0)) {
        return;
    }
#if defined(_POSIX_MAPPED_FILES)
    // The pages are dropped, not unmapped: the address range stays the mapping's. An unmapped hole could be handed
    // to another mapping (a new thread's stack) before the loader's final unmap_fragment(0, size), which unmaps the
    // whole range again, holes included, when every weight was copied out (a model offloaded whole).
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    const size_t first = (offs + page - 1) / page * page;  // inward to whole pages: a neighbour's bytes stay
    const size_t last = (offs + n_size) / page * page;
    if (last > first) {
        madvise(static_cast<uint8_t *>(mapping.addr()) + first, last - first, MADV_DONTNEED);
    }
#else
    (void) mapping;
    (void) offs;
    (void) n_size;
#endif
}
