"""DFTracer traces (cachemw.trace): a small DataLoader job run with CACHEMW_TRACE writes a
.pfw file per process (trainer, forked DataLoader workers, the daemon it starts), every
line well-formed, events nested per thread, covering misses, hits and a checkpoint save;
and the readers' time breakdown summed over the job's processes in the daemon's stats."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

JOB = r'''
import json, os, sys
import fsspec
import torch
import torch.utils.data


class Files(torch.utils.data.Dataset):
    def __init__(self, fs, paths):
        self.fs, self.paths = fs, paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return len(self.fs.cat_file(self.paths[i]))


if __name__ == "__main__":
    src, runtime_dir, root = sys.argv[1:4]
    fs = fsspec.filesystem("cachemw", runtime_dir=runtime_dir, skip_instance_cache=True,
                           daemon_options={"dram_capacity": "1MiB", "placement": "lru"})
    paths = sorted(os.path.join(src, p) for p in os.listdir(src))
    fs.client.daemon_stats()  # the daemon runs before the workers fork
    for order in (paths, paths[::-1]):  # epoch 2 backwards: what LRU kept is read first
        loader = torch.utils.data.DataLoader(Files(fs, order), batch_size=4, num_workers=2)
        assert sum(int(n) for batch in loader for n in batch) == 24 * 65536
    from cachemw.checkpoint import Checkpointer

    model = torch.nn.Linear(64, 64)
    with Checkpointer(root) as ck:
        ck.save(1, {"model": model}).wait()
    stats = fs.client.daemon_stats()
    print(json.dumps({"trainer": os.getpid(), "daemon": stats["pid"],
                      "counters": stats["counters"]}))
'''

REQUIRED = {"id": int, "name": str, "cat": str, "pid": int, "tid": int, "ts": int, "dur": int,
            "ph": str, "args": dict}


def _not_json(token: str):
    raise ValueError(f"{token} is not JSON")


def read_pfw(path: str) -> list[dict]:
    """The events of one trace file, every line checked: ``[`` first, ``]`` last (the
    process exited cleanly), one JSON object per line between."""
    with open(path) as f:
        lines = f.read().splitlines()
    assert lines[0] == "[", path
    assert lines[-1] == "]", path
    pid = int(path.rsplit("-", 1)[1].split(".")[0])
    events = []
    for line in lines[1:-1]:
        e = json.loads(line, parse_constant=_not_json)  # strict: no NaN or Infinity
        if e["ph"] == "M":  # metadata: the process's name
            assert e["name"] == "process_name" and e["pid"] == pid
            continue
        for key, kind in REQUIRED.items():
            assert isinstance(e.get(key), kind), (path, key, e)
        assert e["ph"] == "X" and e["pid"] == pid and e["dur"] >= 0
        assert e["ts"] > 1_600_000_000 * 10**6, e  # microseconds since the epoch
        assert e["cat"].startswith("cachemw."), e
        events.append(e)
    return events


def assert_nested(events: list[dict]) -> None:
    """On each thread, any two events are disjoint or one holds the other, and an event
    whose parent starts in the same microsecond comes after it in the file (what
    Perfetto's JSON importer needs)."""
    threads = defaultdict(list)
    for order, e in enumerate(events):
        threads[(e["pid"], e["tid"])].append((order, e))
    for key, evs in threads.items():
        evs.sort(key=lambda oe: (oe[1]["ts"], -oe[1]["dur"]))
        stack = []
        for order, e in evs:
            while stack and stack[-1][1]["ts"] + stack[-1][1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                top_order, top = stack[-1]
                assert e["ts"] + e["dur"] <= top["ts"] + top["dur"], (key, top, e)
                if e["ts"] == top["ts"]:
                    assert top_order < order, (key, top, e)
            stack.append((order, e))


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_dataloader_job_traces_every_process(tmp_path, make_tree):
    from cachemw.launch import stop_local

    files = make_tree([65536] * 24, name="src")
    script = tmp_path / "job.py"
    script.write_text(JOB)
    trace_dir = tmp_path / "trace"
    runtime_dir = str(tmp_path / "rt")
    env = dict(os.environ, CACHEMW_TRACE=str(trace_dir), CACHEMW_RUNTIME_DIR=runtime_dir)
    try:
        out = subprocess.run([sys.executable, str(script), str(tmp_path / "src"), runtime_dir,
                              str(tmp_path / "ckpt")], env=env, capture_output=True, text=True,
                             timeout=240)
        assert out.returncode == 0, out.stderr[-3000:]
    finally:
        stop_local(runtime_dir)  # the daemon ends (and closes its trace) before we read it
    result = json.loads(out.stdout.strip().splitlines()[-1])

    by_pid = {}
    for path in glob.glob(str(trace_dir / "*.pfw")):
        events = read_pfw(path)
        assert_nested(events)
        by_pid[events[0]["pid"] if events else None] = events
    trainer, daemon = by_pid.pop(result["trainer"]), by_pid.pop(result["daemon"])
    workers = [evs for pid, evs in by_pid.items() if pid is not None]
    assert len(workers) == 4, sorted(by_pid)  # two DataLoader workers (forked) per epoch
    names = lambda evs: {e["name"] for e in evs}  # noqa: E731
    read = set().union(*map(names, workers))
    # (no lease_wait: each block has one reader, whose lease comes after its fetch)
    assert {"miss", "source_fetch", "fill", "hit"} <= read, read
    assert {"save", "snapshot", "persist", "write", "commit"} <= names(trainer), names(trainer)
    assert "evict" in names(daemon), names(daemon)  # 1 MiB of DRAM for 1.5 MiB of files
    misses = [e for evs in workers for e in evs if e["name"] == "source_fetch"]
    assert {e["args"]["file"] for e in misses} == set(files)  # every file missed once at least

    # the readers' time, summed over the workers' reports in the daemon's stats
    c = result["counters"]
    assert c["source_reads"] == len(misses)
    assert c["hits"] == sum(1 for evs in workers for e in evs if e["name"] == "hit")
    assert c["hits"] > 0 and c["hit_seconds"] > 0
    # leases are asked by the workers' fill writers, behind the reads: no reader waited
    assert c["source_seconds"] > 0 and c["lease_requests"] > 0
    assert c["miss_seconds"] >= c["source_seconds"]


def test_spans_nest_and_a_parent_comes_first(tmp_path):
    """Events of one thread in one microsecond: the parent is written before its children
    whatever order they ended in; a killed-mid-write file would still parse line by line."""
    import threading
    import time

    from cachemw import trace

    assert not trace.ENABLED
    trace.start(str(tmp_path / "t"))
    try:
        def work():
            with trace.span("outer", trace.READ, n=1):
                t0 = time.perf_counter()
                with trace.span("inner", trace.READ):
                    trace.event("leaf", trace.READ, time.perf_counter())
                trace.event("late", trace.READ, t0)  # holds "inner", ends after it

        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        work()
    finally:
        trace.stop()
    assert not trace.ENABLED
    (path,) = glob.glob(str(tmp_path / "t" / "*.pfw"))
    events = read_pfw(path)
    assert len(events) == 16
    assert_nested(events)
    for tid in {e["tid"] for e in events}:
        mine = [e["name"] for e in events if e["tid"] == tid]
        assert mine[0] == "outer" and sorted(mine) == ["inner", "late", "leaf", "outer"]
        assert mine.index("inner") < mine.index("leaf")


def test_a_parent_comes_first_when_its_events_fall_in_one_microsecond(tmp_path, monkeypatch):
    """Spans and events whose floored start and end are all the same (a fast machine: a span
    and what it holds within one microsecond) are written enclosing ones first, so the file
    nests as recorded."""
    from cachemw import trace

    monkeypatch.setattr(trace, "_now", lambda: 1000.0)
    trace.start(str(tmp_path / "t"))
    try:
        with trace.span("outer", trace.READ):
            with trace.span("inner", trace.READ):
                trace.event("leaf", trace.READ, 1000.0)
            trace.event("late", trace.READ, 1000.0)  # holds "inner" (it began before it)
    finally:
        trace.stop()
    (path,) = glob.glob(str(tmp_path / "t" / "*.pfw"))
    events = read_pfw(path)
    assert_nested(events)
    assert [e["name"] for e in events] == ["outer", "late", "inner", "leaf"]


@pytest.fixture(params=["c", "python"])
def writer(request, monkeypatch):
    """Block events through the C writer (where it is built) and through the Python one."""
    from cachemw import trace

    if request.param == "python":
        monkeypatch.setattr(trace, "block_event", trace._block_event_py)
    elif trace._native is None:
        pytest.skip("cachemw._blocktrace is not built here")
    return request.param


def test_the_c_writer_is_built_where_there_is_a_compiler():
    """An install builds the hit path's writer (optional: a machine without a compiler
    writes from Python, slower); where a compiler and Python's headers are, a missing build
    is a bug."""
    import shutil
    import sysconfig

    from cachemw import trace

    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]  # the one setuptools uses
    if not shutil.which(compiler):
        pytest.skip(f"no C compiler ({compiler}) on this machine")
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip("no Python headers on this machine")
    assert trace._native is not None
    assert trace.block_event is trace._native.block_event


NAMES = ['/d/plain', '/d/a"b', "/d/back\\slash", "/d/\u00fcber/\u65e5\u672c", "/d/tab\there",
         "/d/ctl-" + "".join(map(chr, range(32))) + "\x7f", "/d/emoji-\U0001f600", ""]


def _lines(directory) -> list[bytes]:
    (path,) = glob.glob(str(directory / "*.pfw"))
    with open(path, "rb") as f:
        return [line for line in f.read().splitlines() if b'"ph":"X"' in line]


def test_the_c_writer_writes_msgspecs_line_byte_for_byte(tmp_path):
    """The same block event through C and through the Python writer (msgspec) is the same
    line but for its id: escapes of quotes, backslashes, every control character, non-ASCII
    and 4-byte characters, an empty name; negative and large integers."""
    import re

    from cachemw import trace

    if trace._native is None:
        pytest.skip("cachemw._blocktrace is not built here")
    cases = [(name, i, 4096) for i, name in enumerate(NAMES)] + [
        ("/d/x", -1, 2**62), ("/d/y", 0, 0), ("/d/z", -2**63, 2**63 - 1)]
    c_lines = []
    trace.start(str(tmp_path / "t"))
    try:
        trace._native.set_flush_at(float("inf"))  # no batch by time: C's lines stay with it
        for name, block, nbytes in cases:
            args = ("hit\u00e9\n", 1234.5678919, 1234.5679, "dram", name, block, nbytes)
            trace._native.block_event(*args)
            c_lines.append(trace._native.take())  # written by C, not handed to Python
            trace._block_event_py(*args)
            trace.flush()
    finally:
        trace.stop()
    py_lines = _lines(tmp_path / "t")
    assert len(py_lines) == len(c_lines) == len(cases)
    assert all(line.count(b"\n") == 1 for line in c_lines)
    ids = []
    for c_line, py_line in zip(c_lines, py_lines):
        ids += [json.loads(c_line)["id"], json.loads(py_line)["id"]]
        assert re.sub(rb'^\{"id":\d+,', b"{", c_line.rstrip(b"\n")) == \
            re.sub(rb'^\{"id":\d+,', b"{", py_line)
    assert ids == sorted(set(ids))  # one count for both writers


def test_odd_block_arguments_behave_as_in_the_python_writer(tmp_path):
    """What the C writer does not write itself goes to the Python writer, which raises or
    writes as it always did: times that are not numbers or not finite, integers past 64 bits,
    booleans (written as true/false)."""
    from cachemw import trace

    if trace._native is None:
        pytest.skip("cachemw._blocktrace is not built here")

    class Seconds:
        def __float__(self):
            return 2.0

    trace.start(str(tmp_path / "t"))
    try:
        for write in (trace._native.block_event, trace._block_event_py):
            with pytest.raises(TypeError):
                write("hit", "x", Seconds(), "dram", "/d/f", 0, 1)
            for bad in (float("inf"), float("nan")):
                with pytest.raises((OverflowError, ValueError)):
                    write("hit", 1.0, bad, "dram", "/d/f", 0, 1)
            write("hit", 1.0, 1e300, "dram", "/d/big", 2**64, 1)
            write("hit", 1.0, 2.0, "dram", "/d/f", True, False)
            trace.flush()
    finally:
        trace.stop()
    lines = _lines(tmp_path / "t")
    assert len(lines) == 4
    for line in lines:
        event = json.loads(line)
        if event["args"]["file"] == "/d/big":
            assert event["args"]["block"] == 2**64 and event["dur"] == int(1e300 * 1e6) - 1000000
        else:
            assert b'"block":true,"bytes":false' in line


def test_block_events_inside_a_span_are_sorted_with_it(tmp_path, writer):
    """A block event inside a span (a miss's source_fetch) waits for the span and comes
    after it in the file; outside any span, after the span closed, it is written directly."""
    import threading

    from cachemw import trace

    trace.start(str(tmp_path / "t"))
    try:
        def work():
            with trace.span("miss", trace.READ):
                now = trace._now()
                trace.block_event("source_fetch", now, trace._now(), "source", "/d/f", 0, 1)
                trace.flush()  # a batch now: an event not held for the span is written first
            now = trace._now()
            trace.block_event("hit", now, trace._now(), "dram", "/d/f", 0, 1)

        other = threading.Thread(target=work)
        other.start()
        other.join()
        work()
    finally:
        trace.stop()
    (path,) = glob.glob(str(tmp_path / "t" / "*.pfw"))
    events = read_pfw(path)
    assert_nested(events)
    for tid in {e["tid"] for e in events}:
        assert [e["name"] for e in events if e["tid"] == tid] == ["miss", "source_fetch", "hit"]


def test_block_events_name_any_file_exactly(tmp_path, writer):
    """A hit's file is written as JSON whatever its name holds (quotes, backslashes,
    non-ASCII, control characters, a byte that is not UTF-8, which Python holds as a lone
    surrogate and msgspec cannot encode): in a batch with such a name the other events
    are written as they are, none is lost."""
    import os
    import time

    from cachemw import trace

    undecodable = os.fsdecode(b"/d/latin1-\xff")
    names = ['/d/a"b', "/d/back\\slash", "/d/\u00fcber/\u65e5\u672c", "/d/tab\there",
             undecodable]
    trace.start(str(tmp_path / "t"))
    try:
        for rnd in range(2):
            for i, name in enumerate(names):
                now = time.perf_counter()
                trace.block_event("hit", now, now, "dram", name, i, 10 + rnd)
            trace.flush()
    finally:
        trace.stop()
    (path,) = glob.glob(str(tmp_path / "t" / "*.pfw"))
    hits = [e for e in read_pfw(path) if e["name"] == "hit"]
    assert [(e["args"]["file"], e["args"]["block"], e["args"]["bytes"]) for e in hits] == [
        (name, i, 10 + rnd) for rnd in range(2) for i, name in enumerate(names)]


def test_event_args_of_any_type_are_written(tmp_path):
    """A general event's args hold what callers put there: numbers (not finite ones too),
    strings, lists, None, other objects (written as their str), keys that are not strings;
    every line is strict JSON (a float that is not finite is null)."""
    import time

    from cachemw import trace

    class Thing:
        def __str__(self):
            return "thing!"

    trace.start(str(tmp_path / "t"))
    try:
        now = time.perf_counter()
        trace.event("a", trace.READ, now, now, {"n": 3, "x": 0.5, "s": "\u00e9", "l": [1, "b"],
                                                "none": None, "obj": Thing()})
        trace.event("b", trace.READ, now, now, {"inf": float("inf"), 7: "seven"})
        trace.event("c", trace.READ, now, now, {"bad": "x\udcff", (1, 2): "tuple key"})
        trace.event("d", trace.READ, now, now)
    finally:
        trace.stop()
    (path,) = glob.glob(str(tmp_path / "t" / "*.pfw"))
    events = {e["name"]: e for e in read_pfw(path) if e["ph"] == "X"}
    assert events["a"]["args"] == {"n": 3, "x": 0.5, "s": "\u00e9", "l": [1, "b"], "none": None,
                                   "obj": "thing!"}
    assert events["b"]["args"]["7"] == "seven" and events["b"]["args"]["inf"] is None
    assert events["c"]["args"] == {"bad": "x\udcff"}
    assert events["d"]["args"] == {}


def test_off_by_default_and_a_bad_directory_is_named(tmp_path):
    from cachemw.config import CacheOptions, trace_dir

    assert trace_dir({}) is None and trace_dir({"CACHEMW_TRACE": ""}) is None
    assert trace_dir({"CACHEMW_TRACE": "/x/y"}) == "/x/y"
    with pytest.raises(ValueError, match="CACHEMW_TRACE: must be an absolute directory"):
        trace_dir({"CACHEMW_TRACE": "relative/dir"})
    with pytest.raises(ValueError, match=r"CACHEMW_TRACE \(trace: must be an absolute"):
        CacheOptions.build(env={"CACHEMW_TRACE": "rel"}, runtime_dir=str(tmp_path))
    code = "import cachemw.trace as t, sys; sys.exit(0 if not t.ENABLED else 1)"
    env = {k: v for k, v in os.environ.items() if k != "CACHEMW_TRACE"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    env["CACHEMW_TRACE"] = "not/absolute"  # said, and not tracing: never a failed import
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "CACHEMW_TRACE: must be an absolute" in out.stderr


@pytest.mark.timeout(60)
def test_a_forked_child_writes_its_own_pid_thread_and_ids(tmp_path, writer):
    """The thread id is kept per thread (no system call per event) and event ids are counted
    per process: a forked child's events carry its own pid and thread id, not the ones its
    parent had kept, and each file's ids are distinct."""
    import multiprocessing
    import threading
    import time

    from cachemw import trace

    def child():
        now = time.perf_counter()
        trace.block_event("hit", now, now, "dram", "/d/child", 0, 1)
        trace.event("e", trace.READ, now, now)
        trace.stop()

    trace.start(str(tmp_path / "t"))
    try:
        now = time.perf_counter()
        trace.block_event("hit", now, now, "dram", "/d/parent", 0, 1)  # the parent's tid kept
        proc = multiprocessing.get_context("fork").Process(target=child)
        proc.start()
        proc.join(30)
        assert proc.exitcode == 0
        trace.event("e", trace.READ, now, now)
    finally:
        trace.stop()
    by_pid = {}
    for path in glob.glob(str(tmp_path / "t" / "*.pfw")):
        events = [e for e in read_pfw(path) if e["ph"] == "X"]
        by_pid[events[0]["pid"]] = events
    assert set(by_pid) == {os.getpid(), proc.pid}
    for pid, events in by_pid.items():
        assert len({e["id"] for e in events}) == len(events) == 2
        assert {e["pid"] for e in events} == {pid}
    assert {e["id"] for e in by_pid[proc.pid]} == {1, 2}  # counted from 1 in the child
    assert {e["tid"] for e in by_pid[proc.pid]} == {proc.pid}  # the child's main thread
    assert {e["tid"] for e in by_pid[os.getpid()]} == {threading.get_native_id()}


def test_a_second_start_writes_a_new_file(tmp_path):
    """start, stop, start again in one process: the second session's events go to a file of
    their own, and the first file keeps its events (it is never truncated)."""
    import time

    from cachemw import trace

    for name in ("first", "second"):
        trace.start(str(tmp_path / "t"))
        try:
            now = time.perf_counter()
            trace.event(name, trace.READ, now, now)
        finally:
            trace.stop()
    import socket

    stem = str(tmp_path / "t" / f"cachemw-{socket.gethostname()}-{os.getpid()}")
    files = [stem + ".pfw", stem + ".1.pfw"]
    assert sorted(glob.glob(str(tmp_path / "t" / "*.pfw"))) == sorted(files)
    names = [[e["name"] for e in read_pfw(f) if e["ph"] == "X"] for f in files]
    assert names == [["first"], ["second"]]


@pytest.mark.timeout(60)
def test_the_last_events_of_a_process_that_goes_idle_or_is_killed_are_written(tmp_path):
    """A batch was written only at an event: a reader whose last reads came within a second
    of the batch before, then idled (computing, hung) or was killed (scancel, a time limit,
    the OOM killer), left them unwritten, or no file at all (review ops5). A thread writes
    them within a second."""
    import signal
    import time

    code = r"""
import sys, time
import cachemw.trace as trace
trace.start(sys.argv[1])
for i in range(40):
    t = time.perf_counter()
    trace.event(f"read{i}", trace.READ, t)
print("made", flush=True)
time.sleep(60)
"""
    out = tmp_path / "t"
    child = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "made"
        deadline = time.monotonic() + 10
        names = set()
        while time.monotonic() < deadline and len(names) < 40:
            time.sleep(0.2)
            for path in glob.glob(str(out / "*.pfw")):
                with open(path) as f:
                    lines = [ln.rstrip(",\n") for ln in f if ln.startswith("{")]
                names = {json.loads(ln)["name"] for ln in lines} - {"process_name"}
        assert len(names) == 40, names  # written while it idles
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        child.stdout.close()
