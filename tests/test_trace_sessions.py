"""A process given a second trace directory (a filesystem made with another ``trace=``)
finishes the file it was writing: every file it leaves is ``[``, its lines, ``]``.

The earlier file was closed without its ``]`` (review ops2, defect 4)."""
from __future__ import annotations

import json
import os
import socket
import time

from cachemw import trace


def _events(path: str) -> list[str]:
    """The names of a trace file's X events, the file checked whole: ``[`` first, then
    the process_name metadata line, then X events, ``]`` last."""
    with open(path) as f:
        lines = f.read().splitlines()
    assert lines[0] == "[" and lines[-1] == "]", (path, lines[-1:])
    meta = json.loads(lines[1])
    assert meta["ph"] == "M" and meta["name"] == "process_name", meta
    names = []
    for line in lines[2:-1]:
        event = json.loads(line)
        assert event["ph"] == "X" and {"ts", "dur", "pid", "tid", "cat", "args"} <= set(event)
        names.append(event["args"]["file"] if event["name"] == "hit" else event["name"])
    return sorted(names)


def test_a_start_into_another_directory_finishes_the_file_before(tmp_path):
    first, second = str(tmp_path / "d1"), str(tmp_path / "d2")
    try:
        for directory, name in ((first, "one"), (second, "two"), (first, "three")):
            trace.start(directory)
            now = time.perf_counter()
            trace.event(name, trace.READ, now, now)
            trace.block_event("hit", now, now, "dram", name, 0, 10)  # the C writer's, if built
    finally:
        trace.stop()
    stem = f"cachemw-{socket.gethostname()}-{os.getpid()}"
    # each event (a hit's: named by its file here) in the file of its session
    assert _events(os.path.join(first, f"{stem}.pfw")) == ["one", "one"]
    assert _events(os.path.join(second, f"{stem}.pfw")) == ["two", "two"]
    assert _events(os.path.join(first, f"{stem}.1.pfw")) == ["three", "three"]
    assert sorted(os.listdir(first)) == [f"{stem}.1.pfw", f"{stem}.pfw"]
