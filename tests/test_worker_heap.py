"""A DataLoader worker reading through cachemw keeps its heap between batches
(cachemw/client/heap.py): freed sample bytes stay for the next batch instead of going back
to the kernel, to be faulted in again page by page."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cachemw.client import heap

pytest.importorskip("torch")

SCRIPT = r"""
import json, multiprocessing, os, sys
import fsspec
import torch.utils.data
from cachemw.client import heap

runtime_dir, path, where = sys.argv[1:4]

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def probe():
    fs = fsspec.filesystem("cachemw", runtime_dir=runtime_dir, autostart=False,
                           skip_instance_cache=True)
    fs.cat_file(path)
    samples = [b"\x01" * (112 * 1024) for _ in range(256)]  # 28 MiB, as a worker's batch
    before = rss()
    del samples
    # MiB given back to the kernel when the batch is freed
    return {"applied": heap.applied, "freed": (before - rss()) / 2**20}

class Probe(torch.utils.data.Dataset):
    def __len__(self):
        return 1
    def __getitem__(self, i):
        return json.dumps(probe())

def child(out):
    out.send(json.dumps(probe()))

if __name__ == "__main__":
    if where == "main":
        print(json.dumps(probe()))
    elif where == "process":  # a multiprocessing child that is no DataLoader worker
        ctx = multiprocessing.get_context("fork")
        here, there = ctx.Pipe()
        p = ctx.Process(target=child, args=(there,))
        p.start()
        print(here.recv())
        p.join(30)
    else:
        loader = torch.utils.data.DataLoader(Probe(), batch_size=None, num_workers=1,
                                             multiprocessing_context="fork", timeout=30)
        print(next(iter(loader)))
"""


@pytest.fixture
def probe(make_cache_fs, tmp_path):
    """What a read through cachemw did to the heap of a process (``where``: a DataLoader
    worker, the main process, a plain multiprocessing child)."""
    fs = make_cache_fs()
    path = str(tmp_path / "f.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(4096))
    assert fs.cat_file(path)
    script = tmp_path / "heap_probe.py"
    script.write_text(SCRIPT)

    def run(where, **env):
        r = subprocess.run([sys.executable, str(script), fs.options.runtime_dir, path, where],
                           capture_output=True, text=True, timeout=90,
                           env={**os.environ, **env})
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.splitlines()[-1])

    return run


@pytest.mark.timeout(180)
def test_a_worker_reading_through_cachemw_keeps_its_freed_heap(probe):
    got = probe("worker")
    assert got["applied"]
    assert got["freed"] < 4  # kept: the next batch faults nothing in
    # left alone where it is turned off, and outside DataLoader workers
    assert not probe("worker", CACHEMW_WORKER_HEAP="0")["applied"]
    assert not probe("main")["applied"]
    assert not probe("process")["applied"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("env", [{"MALLOC_TOP_PAD_": "131072"},
                                 {"MALLOC_TRIM_THRESHOLD_": "131072"},
                                 {"MALLOC_MMAP_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}])
def test_an_allocator_tuned_by_its_user_is_left_as_it_is(probe, env):
    assert not probe("worker", **env)["applied"]


@pytest.fixture
def in_a_worker(monkeypatch):
    """keep_in_worker as a DataLoader worker runs it, its mallopt calls recorded."""
    calls = []
    monkeypatch.setattr(heap, "_in_dataloader_worker", lambda: True)
    monkeypatch.setattr(heap, "_mallopt", lambda: lambda param, value: calls.append(
        (param, value)) or 1)
    monkeypatch.setattr(heap, "_done_pid", 0)
    monkeypatch.setattr(heap, "applied", False)
    for name in ("CACHEMW_WORKER_HEAP", "GLIBC_TUNABLES", *heap._USERS_OWN):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_the_thresholds_set_once_per_process(in_a_worker):
    heap.keep_in_worker()
    heap.keep_in_worker()
    assert in_a_worker == [(-3, 32 << 20), (-1, 64 << 20)]  # M_MMAP_THRESHOLD, M_TRIM
    assert heap.applied


def test_a_bad_setting_met_in_a_worker_is_said_and_the_read_goes_on(in_a_worker,
                                                                    monkeypatch, caplog):
    monkeypatch.setenv("CACHEMW_WORKER_HEAP", "maybe")
    heap.keep_in_worker()
    assert in_a_worker == [] and not heap.applied
    assert "CACHEMW_WORKER_HEAP" in caplog.text


def test_a_bad_worker_heap_setting_fails_when_the_filesystem_is_made(monkeypatch):
    import fsspec

    monkeypatch.setenv("CACHEMW_WORKER_HEAP", "maybe")
    with pytest.raises(ValueError, match="CACHEMW_WORKER_HEAP"):
        fsspec.filesystem("cachemw", autostart=False, skip_instance_cache=True)
