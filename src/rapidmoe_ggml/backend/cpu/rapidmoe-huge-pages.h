// Transparent huge pages for the CPU backend's buffers (backend/cpu/rapidmoe-huge-pages.cpp), called from llama.cpp's
// CPU buffer allocation (patches/0015-cpu-buffer-huge-pages.patch; compiled into ggml-base).
#pragma once

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// Asks the kernel to back [base, base + size) with transparent huge pages (madvise MADV_HUGEPAGE over the whole
// 4 KiB pages inside it) when the buffer is at least 2 MiB; a no-op elsewhere (not Linux, a smaller buffer, the
// kernel without THP) and with RAPIDMOE_HUGE_PAGES=0 in the environment (read per buffer). Returns whether the advice
// was given. Changes no value: only the size of the pages the buffer's memory comes in.
int rapidmoe_advise_huge_pages(void * base, size_t size);

#ifdef __cplusplus
}
#endif
