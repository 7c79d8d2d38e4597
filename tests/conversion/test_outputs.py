"""Outputs complete or absent (rapidmoe.atomic.outputs, under every file `convert` writes): renamed only when all are
written, removed on an exception, on a failed write (one OutputError naming them) and on any signal that ends the
process and can be handled, which still ends it, by that signal."""
from __future__ import annotations

import errno
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rapidmoe.atomic import OutputError, make_dir, outputs, write_text
from rapidmoe.errors import RapidMoEError


def test_renamed_when_complete(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.json"
    with outputs([a, b]) as (ta, tb):
        assert (ta.name, tb.name) == ("a.gguf.tmp", "b.json.tmp")
        ta.write_bytes(b"1")
        tb.write_text("2")
        assert not a.exists() and not b.exists()
    assert a.read_bytes() == b"1" and b.read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.json"]
    assert write_text(tmp_path / "c.txt", "3").read_text() == "3"


def test_removed_on_an_exception(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt), outputs([tmp_path / "a", tmp_path / "b"]) as (ta, _):
        ta.write_bytes(b"half")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_is_one_error_naming_the_outputs(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    with pytest.raises(OutputError, match=r"^cannot write .*a\.gguf, .*b\.gguf: No space left on device; nothing "
                                          r"was kept$") as e, outputs([a, b]) as (ta, _):
        ta.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert isinstance(e.value, RapidMoEError)
    with pytest.raises(OutputError, match=r"^cannot write .*b\.gguf: File too large"), outputs([a, b]) as (_, tb):
        raise OSError(errno.EFBIG, "File too large", str(tb))  # names its temporary: the output is named
    with pytest.raises(OutputError, match=r"the write was cut short \(9 requested and 4 written\)"), outputs([a]):
        raise OSError("9 requested and 4 written")  # numpy's tofile on a full disk: no errno
    assert list(tmp_path.iterdir()) == []


def test_an_error_about_another_file_passes_through(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError), outputs([tmp_path / "a"]):
        (tmp_path / "input.txt").read_text()  # not an output's problem: the caller's to word
    assert list(tmp_path.iterdir()) == []


def test_make_dir(tmp_path: Path) -> None:
    assert make_dir(tmp_path / "x" / "y").is_dir()
    (tmp_path / "f").write_text("")
    with pytest.raises(OutputError, match="exists and is not a folder"):
        make_dir(tmp_path / "f")
    with pytest.raises(OutputError, match=r"cannot make the output folder .*f/sub: Not a directory"):
        make_dir(tmp_path / "f" / "sub")


WRITER = """
import os, signal, sys, time
from pathlib import Path
from rapidmoe.atomic import outputs
# the defaults, whatever this process inherited (under nohup SIGHUP is ignored, in a shell's background job SIGINT,
# so Python installs no KeyboardInterrupt handler; an ignored signal is rightly left alone)
SIGS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGALRM)
for s in SIGS:
    signal.signal(s, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGS + (signal.SIGINT,))
out = Path(sys.argv[1])
with outputs([out / "a.gguf", out / "b.gguf"]) as (ta, tb):
    ta.write_bytes(b"half")
    tb.write_bytes(b"half")
    print("writing", flush=True)
    # short sleeps: Python runs a handler at the main thread's next bytecode; a signal the kernel hands to another
    # thread of the process would otherwise wait for one long sleep to end
    for _ in range(1200):
        time.sleep(0.05)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGALRM, signal.SIGINT])
def test_a_signal_leaves_no_file(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM (kill, a scheduler), SIGHUP (the terminal closed) and the rest end the process by the same signal, its
    temporaries gone; SIGINT ends it through KeyboardInterrupt, which removes them on its way out."""
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "writing\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.gguf.tmp", "b.gguf.tmp"]
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == -sig, err  # (an uncaught KeyboardInterrupt ends Python by SIGINT)
    assert list(tmp_path.iterdir()) == []
