// ggml abort messages that survive llama-cpp-python's silenced stderr (see abort_message.h).
#include "abort_message.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "ggml.h"

namespace rapidmoe {
namespace {

std::atomic<int> g_stderr_copy{-1};

void write_all(int fd, const char * s) {
    size_t n = std::strlen(s);
    while (n > 0) {
        const ssize_t w = ::write(fd, s, n);
        if (w <= 0) {
            return;  // nothing more can be said: the process aborts next anyway
        }
        s += w;
        n -= static_cast<size_t>(w);
    }
}

// Runs inside ggml_abort, right before abort(): only async-signal-safe calls (write) and getenv.
void on_ggml_abort(const char * message) {
    const int fd = g_stderr_copy.load();
    if (fd < 0) {
        return;
    }
    const char * prog = std::getenv("RAPIDMOE_PROG");
    write_all(fd, prog != nullptr && *prog != '\0' ? prog : "rapidmoe");
    write_all(fd, ": error: llama.cpp aborted: ");
    write_all(fd, message);
    write_all(fd, "\n");
}

}  // namespace

void install_abort_message() {
    int expected = -1;
    const int fd = ::fcntl(2, F_DUPFD_CLOEXEC, 3);
    if (fd < 0) {
        return;  // no stderr to copy: ggml's own handler stays
    }
    if (!g_stderr_copy.compare_exchange_strong(expected, fd)) {
        ::close(fd);  // installed already
        return;
    }
    ggml_set_abort_callback(on_ggml_abort);
}

}  // namespace rapidmoe
