"""AnnouncingSampler: announces exactly the order it yields (every rank of a
DistributedSampler, windows with a lookahead, ranges, batches), forwards set_epoch and
len, pickles, works in a DataLoader with forked workers against a real daemon, and keeps
training going when no daemon answers or a path cannot be announced.
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time

import fsspec
import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler  # noqa: E402

from cachemw.torch import AnnouncingSampler  # noqa: E402
from conftest import daemon_stats, wait_for  # noqa: E402
from test_cache_torch import FsDataset  # noqa: E402  (index, bytes) per sample

pytestmark = pytest.mark.torch

PATHS = [f"/data/{i:04d}.bin" for i in range(50)]


class RecordingFs:
    """Stands for a cachemw filesystem: records what is announced and how far the
    consumer was when it was (picklable, module level)."""

    def __init__(self):
        self.announced: list = []
        self.calls: list[tuple[int, int]] = []  # (entries announced so far, len of this call)
        self.streams: list[dict] = []  # each call's rank, ranks, group, first (if any)

    def announce(self, entries, **stream):
        self.calls.append((len(self.announced), len(entries)))
        self.streams.append(stream)
        self.announced.extend(entries)
        return len(entries)


def path_range(i: int):
    """A record inside a big file (module level, so a sampler using it pickles)."""
    return ("/data/records.bin", i * 100, (i + 1) * 100)


def test_announces_exactly_the_order_it_yields_each_epoch():
    fs = RecordingFs()
    sampler = AnnouncingSampler(RandomSampler(range(50), generator=torch.Generator().manual_seed(3)),
                                PATHS, fs=fs)
    assert len(sampler) == 50
    orders = []
    for _ in range(3):
        fs.announced.clear()
        order = list(sampler)
        assert fs.announced == [PATHS[i] for i in order]
        orders.append(order)
    assert sorted(orders[0]) == list(range(50))
    assert orders[0] != orders[1]  # a fresh shuffle per epoch, announced afresh


@pytest.mark.parametrize("epoch", [0, 1, 4])
def test_every_rank_of_a_distributed_sampler_announces_what_it_yields(epoch):
    ranks = 3
    seen = []
    for rank in range(ranks):
        fs = RecordingFs()
        bare = DistributedSampler(range(50), num_replicas=ranks, rank=rank, shuffle=True, seed=7)
        wrapped = AnnouncingSampler(
            DistributedSampler(range(50), num_replicas=ranks, rank=rank, shuffle=True, seed=7),
            PATHS, fs=fs)
        bare.set_epoch(epoch)
        wrapped.set_epoch(epoch)  # forwarded: same shuffle as the bare sampler
        order = list(wrapped)
        assert order == list(bare)
        assert len(wrapped) == len(bare)
        assert fs.announced == [PATHS[i] for i in order]
        seen.extend(order)
    assert set(seen) == set(range(50))


def test_the_ranks_of_a_node_announce_each_epoch_as_one_group(monkeypatch):
    # two DDP ranks of one node, by torchrun's variables: each epoch's orders form one
    # group (the same name on both ranks, another each epoch), each window placed by the
    # number of entries its rank announced before it in the epoch
    import cachemw.torch

    monkeypatch.setattr(cachemw.torch, "_MADE", {})  # each rank's first sampler
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    samplers = []
    for rank in (0, 1):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        samplers.append(AnnouncingSampler(
            DistributedSampler(range(40), num_replicas=2, rank=rank, shuffle=False), PATHS,
            fs=RecordingFs(), lookahead=8))
    for epoch in range(2):
        for sampler in samplers:
            assert len(list(sampler)) == 20
    for rank, sampler in enumerate(samplers):
        assert (sampler.rank, sampler.ranks) == (rank, 2)
        streams, calls = sampler.fs.streams, sampler.fs.calls
        assert {s["group"] for s in streams} == {"run-7/2:20:0:0", "run-7/2:20:0:1"}
        for stream, (before, _) in zip(streams, calls):
            assert (stream["rank"], stream["ranks"]) == (rank, 2)
            epoch_start = 0 if stream["group"] == "run-7/2:20:0:0" else 20
            assert stream["first"] == before - epoch_start


def test_a_sampler_only_one_rank_makes_does_not_rename_the_others(monkeypatch):
    # rank 0 makes a validation sampler before its training sampler, rank 1 does not: the
    # training samplers still name the same owner (and so the same groups) on both
    import cachemw.torch

    names = []
    for rank, lengths in ((0, (6, 40)), (1, (40,))):
        monkeypatch.setattr(cachemw.torch, "_MADE", {})  # each rank its own process
        made = [AnnouncingSampler(DistributedSampler(range(n), num_replicas=2, rank=rank),
                                  PATHS, fs=RecordingFs(), rank=rank, ranks=2)
                for n in lengths]
        names.append(made[-1]._owner)
    assert names[0] == names[1]


def test_announce_checks_its_owner_and_names_one_for_every_order(runtime_dir):
    fs = fsspec.filesystem("cachemw", target_protocol="file", autostart=False,
                           runtime_dir=runtime_dir, skip_instance_cache=True)
    for bad in ({"owner": 3}, {"replace": 1}, {"ranks": 2, "rank": 0},
                {"ranks": 2, "rank": 0, "group": 7}, {"chunk": 0}, {"first": -1}):
        with pytest.raises(ValueError):
            fs.announce([], **bad)
    assert fs.announce([]) == 0  # no daemon: nothing announced, no error


def test_an_epoch_stopped_early_is_replaced_by_the_next(monkeypatch):
    # a loop that ends an epoch after some steps leaves the rest of its order announced:
    # the next epoch's first window replaces it; an epoch run to its end replaces nothing
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    fs = RecordingFs()
    sampler = AnnouncingSampler(range(10), PATHS, fs=fs, lookahead=4)

    def epoch(stop=None):
        calls = len(fs.streams)
        for i, _ in enumerate(sampler):
            if i == stop:
                break
        return [s.get("replace", False) for s in fs.streams[calls:]]

    assert not any(epoch())
    assert not any(epoch(stop=2))
    replaced = epoch()
    assert replaced[0] is True and len(replaced) > 1 and not any(replaced[1:])
    assert not any(epoch())


def test_one_rank_announces_as_before_and_a_rank_outside_the_node_is_an_error(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    sampler = AnnouncingSampler(range(5), PATHS, fs=RecordingFs())
    list(sampler)
    assert (sampler.rank, sampler.ranks) == (0, 1)
    assert [s["replace"] for s in sampler.fs.streams] == [False]
    owners = {s["owner"] for s in sampler.fs.streams}
    other = AnnouncingSampler(range(5), PATHS, fs=RecordingFs())  # a validation sampler, say
    list(other)
    assert owners.isdisjoint(s["owner"] for s in other.fs.streams)  # never withdraws ours
    for bad in ({"rank": 2, "ranks": 2}, {"rank": -1}, {"ranks": "2"}, {"rank": True}):
        with pytest.raises(ValueError):
            AnnouncingSampler(range(5), PATHS, fs=RecordingFs(), **bad)
    monkeypatch.setenv("LOCAL_RANK", "3")  # a launcher's LOCAL_RANK alone: one rank, no error
    assert AnnouncingSampler(range(5), PATHS, fs=RecordingFs()).ranks == 1
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(ValueError, match="rank"):  # ranks alone names no rank
        AnnouncingSampler(range(5), PATHS, fs=RecordingFs(), ranks=2)


def _shards_through_a_daemon(tmp_path, runtime_dir, spawn_daemon, monkeypatch,
                             old_daemon=False):
    """Two ranks (a filesystem, so a connection, each) announce their shards of 40 files
    to a daemon with room for 20: what each rank's first 10 reads find cached."""
    from cachemw.blockfile import stored_size
    from cachemw.config import TierConfig

    import cachemw.torch

    monkeypatch.setattr(cachemw.torch, "_MADE", {})  # each rank's first sampler
    size = 4096
    high = TierConfig("dram", "/unused", 1 << 30).high_watermark
    spawn_daemon(runtime_dir, dram_capacity=int(20 * stored_size(size) / high) + 1)
    root = tmp_path / "train"
    root.mkdir()
    paths = []
    for i in range(40):
        (root / f"{i:03d}.bin").write_bytes(os.urandom(size))
        paths.append(str(root / f"{i:03d}.bin"))
    systems, orders = [], []
    for rank in (0, 1):
        fs = fsspec.filesystem("cachemw", target_protocol="file", autostart=False,
                               runtime_dir=runtime_dir, skip_instance_cache=True)
        if old_daemon:  # as a daemon of the first release answers HELLO: no features
            assert fs.client._connect() is not None
            fs.client._features = frozenset()
        sampler = AnnouncingSampler(DistributedSampler(range(40), num_replicas=2, rank=rank),
                                    paths, fs=fs, rank=rank, ranks=2)
        orders.append(list(sampler))
        systems.append(fs)
    wait_for(lambda: daemon_stats(runtime_dir)["counters"].get("prefetched", 0) == 20, 30,
             what="the cache to be filled from the announced orders")
    time.sleep(0.5)  # no more prefetch: the cache is full of blocks needed soon
    assert daemon_stats(runtime_dir)["counters"]["prefetched"] == 20
    found = [0, 0]
    for rank in (1, 0):  # rank 1 first: reads free room, and prefetch may fill it
        for i in orders[rank][:10]:
            systems[rank].cat_file(paths[i])
        found[rank] = systems[rank].stats()["hits"]
    assert "failed" not in (tmp_path / "daemon-0.log").read_text()  # the daemon's stderr
    return found


@pytest.mark.timeout(60)
def test_a_nodes_ranks_orders_are_prefetched_interleaved_by_a_real_daemon(
        tmp_path, runtime_dir, spawn_daemon, monkeypatch):
    # laid as the ranks read them: each rank's first 10 blocks fill the room for 20
    assert _shards_through_a_daemon(tmp_path, runtime_dir, spawn_daemon, monkeypatch) == [10, 10]


@pytest.mark.timeout(60)
def test_a_daemon_that_predates_ranks_is_sent_the_orders_alone(tmp_path, runtime_dir,
                                                               spawn_daemon, monkeypatch):
    # one after another, as that daemon understands them (said once), never rejected
    import cachemw.client.link as link

    warned = []  # (the suite's other tests may leave logging configured otherwise)
    monkeypatch.setattr(link.log, "warning", lambda msg, *args: warned.append(msg % args))
    found = _shards_through_a_daemon(tmp_path, runtime_dir, spawn_daemon, monkeypatch,
                                     old_daemon=True)
    assert found == [10, 0]
    assert sum("predates announcements by several ranks" in m for m in warned) == 2


def test_set_epoch_is_a_no_op_for_samplers_without_it():
    sampler = AnnouncingSampler(range(5), PATHS, fs=RecordingFs())
    sampler.set_epoch(3)
    assert list(sampler) == [0, 1, 2, 3, 4]


def test_lookahead_announces_in_windows_always_ahead_of_the_reader():
    fs = RecordingFs()
    sampler = AnnouncingSampler(RandomSampler(range(50), generator=torch.Generator().manual_seed(1)),
                                PATHS, fs=fs, lookahead=8)
    order = []
    for i, index in enumerate(sampler):
        assert len(fs.announced) > i  # announced before it is yielded
        assert len(fs.announced) <= i + 8  # and no further than the window
        order.append(index)
    assert fs.announced == [PATHS[i] for i in order]
    assert len(fs.calls) > 5


def test_ranges_and_batches_announce_each_index():
    fs = RecordingFs()
    batches = AnnouncingSampler(BatchSampler(range(10), batch_size=4, drop_last=False), path_range,
                                fs=fs)
    out = list(batches)
    assert out == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert fs.announced == [path_range(i) for i in range(10)]


def test_bad_arguments_are_value_errors_naming_them():
    with pytest.raises(ValueError, match="lookahead"):
        AnnouncingSampler(range(3), PATHS, fs=RecordingFs(), lookahead=0)
    with pytest.raises(ValueError, match="paths"):
        AnnouncingSampler(range(3), 42, fs=RecordingFs())
    with pytest.raises(ValueError, match="sampler"):
        AnnouncingSampler(42, PATHS, fs=RecordingFs())


def test_pickles_with_its_filesystem_or_with_the_default():
    sampler = AnnouncingSampler(RandomSampler(range(50)), path_range, fs=RecordingFs(),
                                lookahead=16)
    copy = pickle.loads(pickle.dumps(sampler))
    assert len(copy) == 50 and copy.lookahead == 16
    assert sorted(copy) == list(range(50))
    assert copy.fs.announced  # its own filesystem came along
    default = AnnouncingSampler(range(4), PATHS)
    assert pickle.loads(pickle.dumps(default)).fs is None


def test_no_daemon_logs_once_and_yields_everything(tmp_path, caplog):
    fs = fsspec.filesystem("cachemw", target_protocol="file", autostart=False,
                           runtime_dir=str(tmp_path / "nobody"), skip_instance_cache=True)
    for i in range(4):
        (tmp_path / f"{i}.bin").write_bytes(b"x" * 10)
    paths = [str(tmp_path / f"{i}.bin") for i in range(4)]
    sampler = AnnouncingSampler(RandomSampler(range(4)), paths, fs=fs, lookahead=2)
    with caplog.at_level(logging.WARNING, logger="cachemw.torch"):
        for _ in range(2):
            assert sorted(sampler) == [0, 1, 2, 3]
    warnings = [r for r in caplog.records if r.name == "cachemw.torch"]
    assert len(warnings) == 1 and "no cachemw daemon" in warnings[0].getMessage()


def test_a_path_that_cannot_be_announced_never_stops_the_epoch(tmp_path, caplog):
    fs = fsspec.filesystem("cachemw", target_protocol="file", autostart=False,
                           runtime_dir=str(tmp_path / "nobody"), skip_instance_cache=True)
    sampler = AnnouncingSampler(range(3), [str(tmp_path / "missing")] * 3, fs=fs)
    with caplog.at_level(logging.WARNING, logger="cachemw.torch"):
        assert list(sampler) == [0, 1, 2]
        assert list(sampler) == [0, 1, 2]
    assert len([r for r in caplog.records if r.name == "cachemw.torch"]) == 1


def test_importing_cachemw_never_imports_torch():
    code = ("import sys, cachemw, cachemw.client.fs, cachemw.placement, cachemw.tiers.gpu; "
            "sys.exit('torch' in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class SlowFsDataset(FsDataset):
    """Each sample takes a little compute, so the daemon's prefetch (started by the
    announcement the sampler makes in the main process) gets ahead of the workers."""

    def __getitem__(self, i):
        time.sleep(0.01)
        return super().__getitem__(i)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dataloader_with_forked_workers_prefetches_the_announced_order(tmp_path, runtime_dir,
                                                                      spawn_daemon):
    spawn_daemon(runtime_dir, dram_capacity="64MiB")
    root = tmp_path / "train"
    root.mkdir()
    files = {}
    for i in range(64):
        data = os.urandom(16384 + i)
        (root / f"{i:03d}.bin").write_bytes(data)
        files[str(root / f"{i:03d}.bin")] = data
    paths = sorted(files)
    fs = fsspec.filesystem("cachemw", target_protocol="file", autostart=False,
                           runtime_dir=runtime_dir, skip_instance_cache=True)
    inner = RandomSampler(range(len(paths)), generator=torch.Generator().manual_seed(0))
    sampler = AnnouncingSampler(inner, paths, fs=fs)
    loader = DataLoader(SlowFsDataset(fs, paths), batch_size=8, sampler=sampler, num_workers=2,
                        multiprocessing_context="fork", collate_fn=lambda batch: batch)
    for _ in range(2):
        got = [item for batch in loader for item in batch]
        assert sorted(i for i, _ in got) == list(range(len(paths)))
        for i, data in got:
            assert data == files[paths[i]]
    stats = wait_for(lambda: (s := daemon_stats(runtime_dir))["counters"].get("prefetched") and s,
                     20, what="the daemon to prefetch the announced order")
    assert stats["counters"]["prefetched"] > 0


def test_the_ranks_of_an_mpi_job_are_named_by_its_pmix_namespace(monkeypatch):
    """Ranks started by mpirun (Open MPI, as DLIO is run) without torchrun's, a
    rendezvous' or Slurm's variables were all "local": two such jobs on a node made one
    group (review announce2). Open MPI gives each job's ranks its PMIx namespace."""
    from cachemw.torch import _job

    for var in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID",
                "PMIX_NAMESPACE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    assert _job() == "local/0"
    monkeypatch.setenv("PMIX_NAMESPACE", "prterun-host-1234@1")
    assert _job() == "pmix-prterun-host-1234@1/0"
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # a Slurm step (srun --mpi=pmix sets both)
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert _job() == "slurm-77.0/0"
