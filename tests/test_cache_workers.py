"""Cold reader processes over a warm node cache (issue 17): a DataLoader worker that only
hits never connects to the daemon, yet its hits are counted; it still replaces a dead
daemon; what it reports reaches the daemon whichever way it goes."""
from __future__ import annotations

import json
import subprocess
import sys

import fsspec
import pytest

from conftest import daemon_stats, wait_for

torch = pytest.importorskip("torch")

BS = 65536


class LazyDataset(torch.utils.data.Dataset):
    """Makes its filesystem in each worker, as datasets usually do; each sample says
    whether the worker had a connection to the daemon when it returned."""

    def __init__(self, paths, runtime_dir):
        self.paths, self.runtime_dir = paths, runtime_dir
        self.fs = None

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        if self.fs is None:
            self.fs = fsspec.filesystem("cachemw", target_protocol="file", block_size=BS,
                                        runtime_dir=self.runtime_dir)
        data = self.fs.cat_file(self.paths[i])
        return i, data, self.fs.client.link() is not None


def _warm(make_cache_fs, files):
    fs = make_cache_fs(block_size=BS)
    for p, data in files.items():
        assert fs.cat_file(p) == data
    fs.client.flush()
    return fs


def _nblocks(files):
    return sum(max(1, -(-len(d) // BS)) for d in files.values())


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_worker_that_only_hits_never_connects_and_its_hits_are_counted(
        make_cache_fs, make_tree, runtime_dir):
    files = make_tree([4096, BS, BS + 1, 3 * BS - 7] * 6, name="train")
    fs = _warm(make_cache_fs, files)
    before = daemon_stats(runtime_dir)["counters"]
    paths = sorted(files)
    loader = torch.utils.data.DataLoader(LazyDataset(paths, runtime_dir), batch_size=None,
                                         shuffle=True, num_workers=2, timeout=60)
    seen = {}
    for i, data, connected in loader:  # default workers: forked, gone at the epoch's end
        seen[i] = data
        assert not connected, "a worker that only hit connected to the daemon"
    assert seen == {i: files[p] for i, p in enumerate(paths)}
    want = before["hits"] + _nblocks(files)
    after = wait_for(lambda: (c := daemon_stats(runtime_dir)["counters"])["hits"] >= want and c,
                     10, what="the workers' hits to be counted")
    assert after["hits"] == want  # each once: left in the runtime dir, taken once
    assert after["hit_bytes"] - before["hit_bytes"] == sum(len(d) for d in files.values())
    assert (after["misses"], after["fallbacks"]) == (before["misses"], before["fallbacks"])
    assert fs.stats()["fallbacks"] == 0


@pytest.mark.timeout(120)
def test_a_fresh_process_reads_hits_without_a_handshake_and_reports_them(
        make_cache_fs, make_tree, runtime_dir):
    """The same for any new process (no torch): the first read is a hit from the tier
    files named in the registry, and the report it leaves at exit is counted."""
    files = make_tree([BS // 2] * 8, name="train", seed=3)
    _warm(make_cache_fs, files)
    before = daemon_stats(runtime_dir)["counters"]["hits"]
    code = (
        "import fsspec, json, sys\n"
        f"fs = fsspec.filesystem('cachemw', target_protocol='file', block_size={BS},"
        f" runtime_dir={runtime_dir!r})\n"
        f"ok = all(fs.cat_file(p) == open(p, 'rb').read() for p in {sorted(files)!r})\n"
        "print(json.dumps([ok, fs.client.link() is None, fs.stats()['hits']]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [True, True, len(files)]
    wait_for(lambda: daemon_stats(runtime_dir)["counters"]["hits"] == before + len(files), 10,
             what="the exited process's hits to be counted")


def test_reports_left_in_the_runtime_dir_are_taken_once_and_junk_is_dropped(tmp_path):
    from cachemw import reports
    from cachemw.config import DaemonConfig
    from cachemw.node.cache import NodeCache

    rt = str(tmp_path / "rt")
    node = NodeCache(DaemonConfig.build(runtime_dir=rt, dram_dir=str(tmp_path / "dram"),
                                        dram_capacity="1MiB"))
    key = "ab" * 16
    assert reports.write(rt, {"hits": 2, "hit_bytes": 10, "tier_hit_bytes": {"dram": 10},
                              "hit_seconds": 0.25},  # the readers' seconds are floats
                         {"dram": [key, key]})
    for name, junk in (("1.0.json", b"{not json"), ("2.0.json", b'{"counters": 3}'),
                       ("3.0.json", b'{"counters": {"hits": -5, "misses": "x"}, "hits": {}}')):
        with open(tmp_path / "rt" / "reports" / name, "wb") as f:
            f.write(junk)
    stats = node.stats()
    assert (stats["counters"]["hits"], stats["counters"]["hit_bytes"]) == (2, 10)
    assert stats["counters"]["misses"] == 0
    assert stats["counters"]["hit_seconds"] == 0.25
    assert stats["tiers"]["dram"]["hits"] == 2 and stats["tiers"]["dram"]["hit_bytes"] == 10
    assert node.stats()["counters"]["hits"] == 2  # taken once
    assert list((tmp_path / "rt" / "reports").iterdir()) == []


_FREEZE_CHECK = r"""
import gc, json, sys
import torch.utils.data

class Probe(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        frozen_before = gc.get_freeze_count()
        import fsspec
        fsspec.get_filesystem_class("cachemw")  # what a worker's first cachemw:: URL does
        return frozen_before, gc.get_freeze_count()

if __name__ == "__main__":
    assert "cachemw" not in sys.modules
    loader = torch.utils.data.DataLoader(Probe(), batch_size=None, num_workers=1,
                                         multiprocessing_context=sys.argv[1])
    print(json.dumps([list(x) for x in loader]))
"""


@pytest.mark.torch
@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_importing_cachemw_freezes_what_it_inherited(tmp_path, method, monkeypatch):
    """A forked worker starts a young collection or two short of a full one; the import would
    set it off, walking (and copying) the trainer's whole heap. The worker freezes first,
    unless CACHEMW_GC_FREEZE=0; the main process never freezes."""
    script = tmp_path / "probe.py"
    script.write_text(_FREEZE_CHECK)
    for setting, frozen in (("", True), ("0", False)):
        monkeypatch.setenv("CACHEMW_GC_FREEZE", setting)
        out = subprocess.run([sys.executable, str(script), method], capture_output=True,
                             text=True, timeout=150)
        assert out.returncode == 0, out.stderr
        (before, after), _ = json.loads(out.stdout)
        assert before == 0
        assert (after > 0) == frozen, (setting, after)
