// Transparent huge pages for the CPU backend's buffers: the weights llama.cpp repacks at load (CPU_REPACK), the
// weights it loads without mmap, our residual sidecars, the KV cache.
//
// Why: a decode step streams every weight it uses once, hundreds of MB a token, and with 4 KiB pages that is a TLB
// miss and a page walk every 4 KiB; in a virtual machine each walk is two-dimensional (guest and host tables). Linux
// distributions ship THP as "madvise" (only regions that ask get 2 MiB pages), and ggml's buffers come from
// posix_memalign, which never asks. Measured on the bench model's cpu-fast r=1 decode (AMD EPYC Zen 5 VM, 2 threads,
// bench/bench_ik_speed.py --ab RAPIDMOE_HUGE_PAGES): see docs/split-routing.md, CPU performance.
//
// The advice goes to the pages wholly inside the buffer; the buffer is untouched here (posix_memalign of this size
// maps fresh memory), so the kernel backs its 2 MiB-aligned parts with huge pages as they are first written.
#include "rapidmoe-huge-pages.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace {

constexpr size_t MIN_BYTES = size_t(2) << 20; // a smaller buffer cannot hold an aligned 2 MiB page

bool switched_off() {
    const char * env = std::getenv("RAPIDMOE_HUGE_PAGES");
    return env != nullptr && std::strcmp(env, "0") == 0;
}

}  // namespace

int rapidmoe_advise_huge_pages(void * base, size_t size) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (base == nullptr || size < MIN_BYTES || switched_off()) {
        return 0;
    }
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t begin = ((uintptr_t) base + page - 1) & ~(page - 1);
    const uintptr_t end = ((uintptr_t) base + size) & ~(page - 1);
    if (end <= begin) {
        return 0;
    }
    // EINVAL: a kernel built without THP; the buffer then keeps its small pages, as without us
    return madvise((void *) begin, end - begin, MADV_HUGEPAGE) == 0 ? 1 : 0;
#else
    (void) base;
    (void) size;
    return 0;
#endif
}
