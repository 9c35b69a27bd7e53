"""``cachemw top`` into a pipe (``| head``, ``| tee``): a frame per refresh, flushed, plain.

rich's live display redraws only on a terminal: into a pipe top wrote nothing until it was
killed, and ``cachemw top | head -3`` hung (review ops2, defect 3)."""
from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import pytest

CLI = [sys.executable, "-m", "cachemw.cli"]


def _read_frames(proc, frames: int, timeout: float) -> bytes:
    """What ``proc`` wrote to its stdout until ``frames`` frame titles or ``timeout`` s."""
    got = b""
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    while got.count(b"cachemw  ") < frames and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            got += chunk
    return got


@pytest.mark.timeout(120)
def test_top_into_a_pipe_writes_each_frame_as_it_is_made(runtime_dir, spawn_daemon):
    spawn_daemon(runtime_dir)
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=runtime_dir)
    env.pop("PYTHONUNBUFFERED", None)  # stdout block-buffered, as into any pipe
    proc = subprocess.Popen(CLI + ["top", "--interval", "0.2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out = _read_frames(proc, 2, 60)  # a frame of a few hundred bytes, per refresh
        assert out.count(b"cachemw  ") >= 2, out  # each frame's title
        assert b"\x1b" not in out  # no cursor moves, no colours: plain frames
        assert proc.poll() is None  # still refreshing
        proc.stdout.close()  # the reader gone, as `| head` goes after its lines
        assert proc.wait(timeout=30) == 141  # as a tool SIGPIPE ended
        assert b"Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stderr.close()


def test_a_frame_into_a_latin_1_pipe_is_drawn_in_ascii(monkeypatch):
    """A pipe or file in latin-1 (a locale, PYTHONIOENCODING) cannot hold rich's box
    characters: the frame's write failed before any frame appeared."""
    import io
    import sys

    from rich.table import Table

    from cachemw import top

    table = Table(title="t")
    table.add_column("tier")
    table.add_row("dram")
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="latin-1"))
    text = top._plain(table)
    text.encode("latin-1")
    assert "dram" in text and "+" in text
