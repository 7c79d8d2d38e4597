// Model loading: what becomes of the file's mapping once a weight has been copied out of it (patch 0022).
#pragma once

#include <cstddef>

struct llama_mmap;

// A weight whose bytes [offs, offs + n_size) of the mapping were just copied into a buffer of its own (repacked on
// the CPU, or on a device): drop the whole pages inside them from the process (madvise MADV_DONTNEED), so that they
// stop counting as its resident memory (the page cache keeps them while the kernel has room). The range stays mapped:
// nothing else can be placed there before the loader unmaps it. Not while `validating` (check_tensors reads the
// mapped bytes on other threads), nor with RAPIDMOE_KEEP_MAPPED=1 (upstream's behaviour, for comparison).
void rapidmoe_loader_release_copied(llama_mmap & mapping, size_t offs, size_t n_size, bool validating);
