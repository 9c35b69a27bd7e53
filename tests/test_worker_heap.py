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

SCRIPT = r"""
import json, multiprocessing, os, sys
import fsspec

runtime_dir, path, read_in = sys.argv[1:4]

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

def child(read, out):
    out.send(batch_freed(read))

if __name__ == "__main__":
    if read_in == "main":
        print(json.dumps(batch_freed(True)))
    else:
        ctx = multiprocessing.get_context("fork")
        here, there = ctx.Pipe()
        p = ctx.Process(target=child, args=(read_in == "worker", there))
        p.start()
        print(json.dumps(here.recv()))
        p.join(30)
"""


def _freed(tmp_path, runtime_dir, path, read_in, **env):
    script = tmp_path / "heap_probe.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script), runtime_dir, path, read_in],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.timeout(120)
def test_a_worker_reading_through_cachemw_keeps_its_freed_heap(make_cache_fs, tmp_path):
    fs = make_cache_fs()
    path = str(tmp_path / "f.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(4096))
    assert fs.cat_file(path)
    rt = fs.options.runtime_dir
    assert _freed(tmp_path, rt, path, "worker") < 4  # kept: the next batch faults nothing
    # given back where cachemw is not read, turned off, or in the main process
    assert _freed(tmp_path, rt, path, "worker-without-reads") > 20
    assert _freed(tmp_path, rt, path, "worker", CACHEMW_WORKER_HEAP="0") > 20
    assert _freed(tmp_path, rt, path, "main") > 20
    # the user's own allocator settings are theirs
    assert _freed(tmp_path, rt, path, "worker", MALLOC_TOP_PAD_="131072") > 20


def test_a_bad_worker_heap_setting_fails_when_the_filesystem_is_made(monkeypatch):
    import fsspec

    monkeypatch.setenv("CACHEMW_WORKER_HEAP", "maybe")
    with pytest.raises(ValueError, match="CACHEMW_WORKER_HEAP"):
        fsspec.filesystem("cachemw", autostart=False, skip_instance_cache=True)
