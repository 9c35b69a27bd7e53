"""A torch DataLoader (2 workers) started by fork, forkserver and spawn reads a dataset
through ``cachemw::file://...`` and gets the exact bytes; the second epoch is all hits.

The daemon this (main) process autostarts serves the workers, as it would a user's
training script; when the main process never touched cachemw (a dataset of plain URLs),
the first worker starts one that outlives it and exits once idle.
"""
from __future__ import annotations

import pickle
import random

import fsspec
import pytest

torch = pytest.importorskip("torch")

BS = 65536


class FsDataset(torch.utils.data.Dataset):
    """Holds the filesystem object itself (it must pickle for spawn/forkserver)."""

    def __init__(self, fs, paths):
        self.fs, self.paths = fs, paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return i, self.fs.cat_file(self.paths[i])


class UrlDataset(torch.utils.data.Dataset):
    """Holds only URLs: each worker builds its filesystem through fsspec's registry."""

    def __init__(self, urls):
        self.urls = urls

    def __len__(self):
        return len(self.urls)

    def __getitem__(self, i):
        with fsspec.open(self.urls[i], "rb", cachemw={"block_size": BS}) as f:
            head = f.read(10)
            return i, head + f.read()


@pytest.fixture
def files(make_tree):
    rng = random.Random(5)
    sizes = [rng.choice([0, 1, 4096, BS, BS + 1, 3 * BS - 7]) for _ in range(24)]
    return make_tree(sizes, name="train", seed=5, fmt="{i:03d}.bin")


def _epochs(dataset, method, n=2):
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=True, num_workers=2,
                                         multiprocessing_context=method, timeout=120,
                                         persistent_workers=True)
    for _ in range(n):
        yield {i: data for i, data in loader}


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("holder", ["fs", "url"])
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_dataloader_workers_read_exact_bytes(files, method, holder):
    from conftest import wait_for  # here: spawned workers import this module, not conftest

    paths = sorted(files)
    fs = fsspec.filesystem("cachemw", target_protocol="file", block_size=BS)
    assert fs.client.connected()  # the main process starts (or finds) the daemon
    assert pickle.loads(pickle.dumps(fs)).options == fs.options
    if holder == "fs":
        dataset = FsDataset(fs, paths)
    else:
        dataset = UrlDataset([f"cachemw::file://{p}" for p in paths])
    nblocks = sum(max(1, -(-len(files[p]) // BS)) for p in paths if files[p])

    before = fs.client.daemon_stats()["counters"]
    for epoch, got in enumerate(_epochs(dataset, method)):
        assert sorted(got) == list(range(len(paths)))
        for i, p in enumerate(paths):
            assert got[i] == files[p], (epoch, p)
        # epoch 1 filled every block once; epoch 2 all hits (a fill's lease is asked behind
        # its read, by the worker's fill writer: it may come just after the epoch)
        leases = lambda: fs.client.daemon_stats()["counters"]["leases"] - before["leases"]
        wait_for(lambda: leases() >= nblocks, 10, what="the workers' fills")
        assert leases() == nblocks, epoch
    after = fs.client.daemon_stats()["counters"]
    assert after["fallbacks"] == before["fallbacks"]
    assert after["bypassed"] == before["bypassed"]


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_url_only_dataset_is_cached_without_touching_cachemw_in_the_main_process(
        runtime_dir, files):
    """The issue's promise: point an existing loader at cachemw::<url>, no other change, and
    epochs after the first are served from the cache."""
    import os
    import signal

    from cachemw.protocol import lookup
    from conftest import daemon_stats, wait_for

    paths = sorted(files)
    dataset = UrlDataset([f"cachemw::file://{p}" for p in paths])
    nblocks = sum(max(1, -(-len(files[p]) // BS)) for p in paths if files[p])
    try:
        leases = []
        for got in _epochs(dataset, "fork"):
            assert [got[i] for i in range(len(paths))] == [files[p] for p in paths]
            assert lookup(runtime_dir) is not None, "no daemon serves the workers"
            wait_for(lambda: daemon_stats(runtime_dir)["counters"]["leases"] >= nblocks, 10,
                     what="the workers' fills")  # leased behind the reads (claims.py)
            leases.append(daemon_stats(runtime_dir)["counters"]["leases"])
        assert leases == [nblocks, nblocks]
    finally:
        address = lookup(runtime_dir)
        if address is not None and address.pid != os.getpid():
            try:
                os.kill(address.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
