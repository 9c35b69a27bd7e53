"""A DataLoader worker reading through cachemw keeps its heap between batches
(cachemw/client/heap.py): freed sample bytes stay for the next batch instead of going back
to the kernel, to be faulted in again page by page. Observed the way it matters: the
process's resident memory after a batch's worth of samples is freed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

SCRIPT = r"""
import json, multiprocessing, os, sys
import fsspec
import torch.utils.data

runtime_dir, path, where = sys.argv[1:4]

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def batch_freed(read):  # MiB given back to the kernel when a batch of samples is freed
    if read:
        fs = fsspec.filesystem("cachemw", runtime_dir=runtime_dir, autostart=False,
                               skip_instance_cache=True)
        fs.cat_file(path)
    samples = [b"\x01" * (112 * 1024) for _ in range(256)]  # 28 MiB, as a worker's batch
    before = rss()
    del samples
    return (before - rss()) / 2**20

class Probe(torch.utils.data.Dataset):
    def __len__(self):
        return 1
    def __getitem__(self, i):
        return batch_freed(True)

def child(out):
    out.send(batch_freed(True))

if __name__ == "__main__":
    if where == "main":
        print(json.dumps(batch_freed(True)))
    elif where == "process":  # a multiprocessing child that is no DataLoader worker
        ctx = multiprocessing.get_context("fork")
        here, there = ctx.Pipe()
        p = ctx.Process(target=child, args=(there,))
        p.start()
        print(json.dumps(here.recv()))
        p.join(30)
    else:
        loader = torch.utils.data.DataLoader(Probe(), batch_size=None, num_workers=1,
                                             multiprocessing_context="fork", timeout=30)
        print(json.dumps(next(iter(loader))))
"""


@pytest.fixture
def freed(make_cache_fs, tmp_path):
    """MiB a process gives back when it frees 28 MiB of samples, after a read through
    cachemw (in ``where``: a DataLoader worker, the main process, ...)."""
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
def test_a_worker_reading_through_cachemw_keeps_its_freed_heap(freed):
    assert freed("worker") < 4  # kept: the next batch faults nothing in
    # given back where it is turned off, and outside DataLoader workers
    assert freed("worker", CACHEMW_WORKER_HEAP="0") > 20
    assert freed("main") > 20
    assert freed("process") > 20


@pytest.mark.timeout(180)
@pytest.mark.parametrize("env", [{"MALLOC_TOP_PAD_": "131072"},
                                 {"MALLOC_TRIM_THRESHOLD_": "131072"},
                                 {"MALLOC_MMAP_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}])
def test_an_allocator_tuned_by_its_user_is_left_as_it_is(freed, env):
    assert freed("worker", **env) > 20


def test_a_bad_worker_heap_setting_fails_when_the_filesystem_is_made(monkeypatch):
    import fsspec

    monkeypatch.setenv("CACHEMW_WORKER_HEAP", "maybe")
    with pytest.raises(ValueError, match="CACHEMW_WORKER_HEAP"):
        fsspec.filesystem("cachemw", autostart=False, skip_instance_cache=True)
