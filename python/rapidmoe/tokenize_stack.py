"""Tokenize on a stack big enough for llama.cpp's std::regex pre-tokenizer, or refuse with a clear error.

Before BPE, llama.cpp splits text with its pre-tokenizer's regexes (unicode.cpp, unicode_regex_split). The types
without a hand-written splitter (deepseek-coder, deepseek-llm, deepseek-v3, falcon, gpt-neox, gpt-4o, ...; qwen2 and
llama3's have one) run libstdc++'s std::regex, whose
executor recurses once per character of the match it is trying: a few hundred bytes of stack per character
(measured per vocab in docs/fuzzing.md). A prompt of 30,000 letters or brackets in a row overflows an 8 MiB thread
stack, and the process dies with SIGSEGV and nothing printed: the server, `rapidmoe-cli run`, any caller.

Every pre-tokenizer regex llama.cpp ships matches within one line (`[^\\n]+` is one of them) followed by the
whitespace run after it (`[^\\s\\p{L}\\p{N}]+[\\r\\n]*`), or within one whitespace run (`\\s*[\\r\\n]+`), so
`STACK_PER_CHAR x (longest line + longest whitespace run)` bounds what a text needs. Short texts are tokenized on
the calling thread as before; longer ones on a helper thread with a stack of that size (address space: only the
pages the recursion touches become memory); texts that would need more than `MAX_STACK` are refused
(`TextTooLongError`: one error line in the CLI, HTTP 400 in the server).
"""
from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from typing import TypeVar

from .errors import RapidMoEError

T = TypeVar("T")

# Stack bytes per character of a regex match: the most any shipped vocab needed was ~330 (libstdc++ 12, -O2;
# docs/fuzzing.md), so this leaves a 3x margin; under AddressSanitizer (its redzones widen every frame) 4x more.
STACK_PER_CHAR = 1024
SANITIZER_FACTOR = 4
DIRECT_LIMIT = 1 << 20  # needs up to this run on the calling thread (any thread has at least 2 MiB)
HEADROOM = 8 << 20  # for the frames below and above the regex (Python, llama_tokenize, the BPE merges)
MAX_STACK = 4 << 30  # the most one tokenize call may reserve: a line of ~4 million characters

_LINE = re.compile(r"[^\n]+")
_SPACE = re.compile(r"\s+")  # Python's \s contains every character llama.cpp's \s does (unicode-data.cpp)
_stack_size_lock = threading.Lock()


class TextTooLongError(RapidMoEError, ValueError):
    """A text whose longest line is too long for llama.cpp's regex pre-tokenizer to split without overflowing."""


def _longest(pattern: re.Pattern[str], text: str) -> int:
    return max((m.end() - m.start() for m in pattern.finditer(text)), default=0)


def _per_char() -> int:
    sanitized = "libasan" in os.environ.get("LD_PRELOAD", "")
    return STACK_PER_CHAR * (SANITIZER_FACTOR if sanitized else 1)


def _runs(text: bytes) -> tuple[int, int]:
    """(longest line, longest whitespace run) of `text` in characters; each invalid UTF-8 byte counts as one
    (llama.cpp decodes it to one replacement code point)."""
    s = text.decode("utf-8", errors="surrogateescape")
    return _longest(_LINE, s), _longest(_SPACE, s)


def longest_match_bound(text: bytes) -> int:
    """Characters the longest pre-tokenizer regex match in `text` can cover: longest line + longest space run + 1."""
    line, space = _runs(text)
    return line + space + 1


def stack_needed(text: bytes) -> int:
    """Bytes of stack tokenizing `text` may need in llama.cpp's std::regex pre-tokenizer (an upper bound)."""
    return longest_match_bound(text) * _per_char()


def _too_long(text: bytes, why: str) -> TextTooLongError:
    line, space = _runs(text)
    return TextTooLongError(
        f"text has a line of {line} characters and a whitespace run of {space}: llama.cpp's regex pre-tokenizer "
        f"recurses once per character of them, and {why}; break the text into shorter lines")


def run_with_stack_for(text: bytes, fn: Callable[[], T]) -> T:
    """`fn()` (which tokenizes `text`) on this thread when the need is small, else on a thread with a stack that fits.

    Raises TextTooLongError when `text` would need more than MAX_STACK, or the system refuses a stack that big."""
    if len(text) * _per_char() <= DIRECT_LIMIT:  # the need is below this however the text is laid out
        return fn()
    need = stack_needed(text)
    if need <= DIRECT_LIMIT:
        return fn()
    size = need + HEADROOM
    size += -size % (1 << 16)  # a multiple of the page size on every platform Python supports
    if size > MAX_STACK:
        raise _too_long(text, f"the {size >> 20} MiB of stack that needs exceed the limit of {MAX_STACK >> 20} MiB")
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            error.append(e)

    with _stack_size_lock:  # threading.stack_size is process-wide: set it for this one thread only
        old = threading.stack_size(size)
        try:
            worker = threading.Thread(target=target, name="rapidmoe-tokenize", daemon=True)
            worker.start()
        except RuntimeError as e:  # the stack could not be mapped
            raise _too_long(text, f"the system refused the {size >> 20} MiB stack that needs ({e})") from e
        finally:
            threading.stack_size(old)
    worker.join()
    if error:
        raise error[0]
    return result[0]
