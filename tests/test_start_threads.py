"""Two threads of one process starting the local Ray cluster of one runtime dir at once:
one cluster comes of it, and a thread that reads the cluster's record while another
starts it waits for that start (cluster/local_ray.py ``_thread_guard``). The start lock is
an flock of the process, so threads went past it: each made a cluster of its own, and a
reader meanwhile found none. Ray itself is not started here: ``_start`` is a stand-in
that takes its time and writes the record as the real one does."""
from __future__ import annotations

import json
import threading
import time

import pytest

from cachemw.cluster import local_ray


@pytest.mark.timeout(60)
def test_threads_starting_at_once_make_one_cluster_and_a_reader_waits_for_it(
        tmp_path, monkeypatch):
    runtime_dir = str(tmp_path / "rt")
    started, entered = [], threading.Event()

    def slow_start(rd):
        started.append(threading.current_thread().name)
        entered.set()
        time.sleep(1.0)  # `ray start`
        state = {"address": f"127.0.0.1:{len(started)}", "started_by_cachemw": True}
        with open(local_ray.state_path(rd), "w") as f:
            json.dump(state, f)
        return state

    monkeypatch.setattr(local_ray, "_start", slow_start)
    monkeypatch.setattr(local_ray, "alive", lambda state: True)
    monkeypatch.setattr(local_ray, "_hold_start", local_ray._release_start_lock)
    got: dict[str, object] = {}

    def call(name, fn):
        try:
            got[name] = fn(runtime_dir)
        except Exception as exc:  # noqa: BLE001 - asserted below
            got[name] = exc

    first = threading.Thread(target=call, args=("first", local_ray.start), name="first")
    first.start()
    assert entered.wait(10)
    second = threading.Thread(target=call, args=("second", local_ray.start), name="second")
    reader = threading.Thread(target=call, args=("reader", local_ray.read_state), name="reader")
    second.start()
    reader.start()
    for t in (first, second, reader):
        t.join(30)
    assert started == ["first"]  # before: ["first", "second"], two clusters
    assert got["first"] == {"address": "127.0.0.1:1", "started_by_cachemw": True}
    assert isinstance(got["second"], RuntimeError) and "meanwhile" in str(got["second"])
    assert got["reader"] == got["first"]  # before: None, read while the start ran


@pytest.mark.timeout(60)
def test_a_child_forked_during_a_start_reads_the_record_at_once(tmp_path, monkeypatch):
    """A process forked while a thread of its parent starts the cluster: in the child no
    thread holds the parent's locks, and its read of the record waited START_WAIT s on one
    (review diffrev-5); it answers at once, as before the threads' lock."""
    import os

    runtime_dir = str(tmp_path / "rt")
    entered, done = threading.Event(), threading.Event()

    def slow_start(rd):
        entered.set()
        done.wait(30)
        return {"address": "127.0.0.1:1"}

    monkeypatch.setattr(local_ray, "_start", slow_start)
    monkeypatch.setattr(local_ray, "_hold_start", local_ray._release_start_lock)
    monkeypatch.setattr(local_ray, "START_WAIT", 20.0)
    starter = threading.Thread(target=local_ray.start, args=(runtime_dir,))
    starter.start()
    try:
        assert entered.wait(10)
        pid = os.fork()
        if pid == 0:  # the child: its answer within 5 s is its exit status
            code = 2
            try:
                began = time.monotonic()
                local_ray.read_state(runtime_dir)
                code = 0 if time.monotonic() - began < 5 else 1
            finally:
                os._exit(code)  # never back into pytest
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        done.set()
        starter.join(30)
