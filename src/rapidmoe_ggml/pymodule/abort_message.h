// The message of a ggml abort (GGML_ASSERT, GGML_ABORT) on the stderr the process started with.
#pragma once

namespace rapidmoe {

// Install ggml's abort callback (once per process; later calls do nothing). ggml aborts end the process; its own
// handler prints the message on fd 2, which llama-cpp-python points at /dev/null while a model loads (verbose=False),
// so an assert reached by a damaged file's contents left only "Aborted". The callback writes one line,
// "$RAPIDMOE_PROG: error: llama.cpp aborted: FILE:LINE: MESSAGE" (RAPIDMOE_PROG: "rapidmoe" when unset), to a copy of
// fd 2 taken here, before any silencing; ggml then aborts as before.
void install_abort_message();

}  // namespace rapidmoe
