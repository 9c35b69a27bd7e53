"""The placement engine as the node daemon drives it, with an announced order.

* Placer (no processes): prefetch never displaces a block whose next read is announced
  (that would cost a second source read), and never plans a block the reader has already
  missed (the engine hears of hits late, of misses at once).
* A real daemon: an announced order is prefetched (counter "prefetched") before the reader
  gets there; with a cache of half the dataset, the epoch 2+ hit ratio beats LRU's and the
  source reads match the clairvoyant simulator's on the same trace.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import fsspec
import pytest

from cachemw.blockfile import stored_size
from cachemw.config import TierConfig
from cachemw.placement import Evict, simulate
from cachemw.node.placer import Placer
from conftest import daemon_stats, wait_for


def placer_of(tmp_path, blocks: int, size: int = 100) -> Placer:
    tier = TierConfig("dram", str(tmp_path / "dram"), blocks * size, high_watermark=1.0,
                      low_watermark=1.0)
    return Placer((tier,))


def _a_process() -> subprocess.Popen:
    """A process that announces (a trainer), alive until the test kills it."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def kinds(moves) -> list[tuple[str, str]]:
    return [(type(m).__name__, m.key) for m in moves]


def test_prefetch_never_displaces_a_block_with_an_announced_read(tmp_path):
    placer = placer_of(tmp_path, 4)
    placer.announce([(k, 100) for k in "abcdea"])
    assert kinds(placer.prefetch(1 << 20)) == [("Prefetch", k) for k in "abcd"]
    placer.hit("a")  # a is read again at position 5: the engine alone would evict it for e
    assert placer.prefetch(1 << 20) == []
    placer.hit("b")  # b is done: its room goes to e
    assert kinds(placer.prefetch(1 << 20)) == [("Evict", "b"), ("Prefetch", "e")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first_exits", [True, False])
def test_the_order_of_a_trainer_that_exited_gives_way_to_the_next_trainer_s(tmp_path, first_exits):
    """A trainer killed mid-epoch leaves its order's unread rest ahead; the next trainer (a
    new process: another owner, so it cannot replace that order) had its order laid after
    it, further from the reads than they ever caught up, and prefetch served the dead
    order: no hits for 14 epochs (review announce2). The order of an owner whose
    announcing processes have all exited is withdrawn when another order comes; a live
    one's stays where it is."""
    first = _a_process()
    try:
        placer = placer_of(tmp_path, 4)
        placer.announce([(f"old{i}", 100) for i in range(5000)],
                        (None, 0, 1, 0, False, "pid-1:sampler"), pid=first.pid)
        for i in range(100):  # the first trainer read a little of its order
            placer.hit(f"old{i}") if i < 4 else placer.miss(f"old{i}", 100)
        if first_exits:
            first.kill()
            first.wait()
        placer.announce([(f"new{i}", 100) for i in range(8)],
                        (None, 0, 1, 0, False, "pid-2:sampler"), pid=os.getpid())
        policy = placer._engine.policy
        if first_exits:  # laid where the reads are: prefetched first
            assert policy.next_use("new0") == policy.cursor
            fetched = [k for kind, k in kinds(placer.prefetch(1 << 20)) if kind == "Prefetch"]
            assert fetched == [f"new{i}" for i in range(4)]
        else:
            assert policy.next_use("new0") == 5000
    finally:
        first.kill()
        first.wait()


def test_prefetch_skips_a_block_the_reader_already_missed(tmp_path):
    placer = placer_of(tmp_path, 4)
    placer.announce([(k, 100) for k in "abcdef"])
    assert len(placer.prefetch(1 << 20)) == 4
    tier, _ = placer.miss("e", 100)  # the reader is at e; its hits of a..d arrive later
    assert tier is None  # full of blocks needed sooner: bypassed
    for key in "abcd":
        placer.hit(key)
    moves = placer.prefetch(1 << 20)
    assert ("Prefetch", "e") not in kinds(moves)
    assert ("Prefetch", "f") in kinds(moves)
    assert sum(isinstance(m, Evict) for m in moves) == 1


def test_reads_outside_an_announced_order_leave_its_first_blocks_to_prefetch(tmp_path):
    # another process's reads, or a lease written behind a read made before the order,
    # reach the daemon just after the order and before its first prefetch pass
    placer = placer_of(tmp_path, 8)
    placer.announce([(k, 100) for k in "abcd"])
    placer.miss("x", 100)
    placer.hit("x")
    assert kinds(placer.prefetch(1 << 20)) == [("Prefetch", k) for k in "abcd"]


def test_a_nodes_ranks_orders_are_prefetched_as_they_will_be_read(tmp_path):
    # room for half of two ranks' orders: prefetch takes each rank's first blocks, where
    # the orders one after another would give it all to the first rank's
    placer = placer_of(tmp_path, 4)
    placer.announce([(k, 100) for k in "abcd"], ("epoch-0", 0, 2, 0))
    placer.announce([(k, 100) for k in "wxyz"], ("epoch-0", 1, 2, 0))
    assert kinds(placer.prefetch(1 << 20)) == [("Prefetch", k) for k in "awbx"]


def test_prefetch_waits_for_every_rank_of_a_group_to_announce(tmp_path, monkeypatch, caplog):
    # the second epoch: rank 0's order is in, rank 1's not yet; rank 1's cached blocks look
    # dead meanwhile, and prefetch for rank 0 would evict them only to fetch them again
    placer = placer_of(tmp_path, 4)
    placer.announce([(k, 100) for k in "ab"], ("epoch-0", 0, 2, 0))
    placer.announce([(k, 100) for k in "wx"], ("epoch-0", 1, 2, 0))
    assert len(placer.prefetch(1 << 20)) == 4
    for key in "awbx":
        placer.hit(key)
    placer.announce([(k, 100) for k in "cd"], ("epoch-1", 0, 2, 0))
    assert placer.prefetch(1 << 20) == []  # w and x are dead until rank 1 says otherwise
    placer.announce([(k, 100) for k in "wx"], ("epoch-1", 1, 2, 0))
    moves = kinds(placer.prefetch(1 << 20))
    assert ("Evict", "w") not in moves and ("Evict", "x") not in moves
    assert ("Prefetch", "c") in moves and ("Prefetch", "d") in moves
    # an announcement the engine rejects holds nothing
    with pytest.raises(ValueError):
        placer.announce([(k, 100) for k in "q"], ("epoch-9", 5, 2, 0))
    assert "epoch-9" not in placer._holds
    # a rank that never announces holds prefetch back for Placer.HOLD seconds, once: its
    # group's later windows do not hold it again
    monkeypatch.setattr(Placer, "HOLD", 0.2)
    for key in "cwdx":
        placer.hit(key)
    placer.announce([(k, 100) for k in "e"], ("epoch-2", 0, 2, 0))
    assert placer.prefetch(1 << 20) == []
    time.sleep(0.3)
    assert ("Prefetch", "e") in kinds(placer.prefetch(1 << 20))
    assert "only ranks [0] announced" in caplog.text  # said when it gives up
    placer.announce([(k, 100) for k in "f"], ("epoch-2", 0, 2, 1))
    assert ("Prefetch", "f") in kinds(placer.prefetch(1 << 20))


FILE = 16 << 10
STORED = stored_size(FILE)


def cache_fs(runtime_dir: str):
    return fsspec.filesystem("cachemw", target_protocol="file", runtime_dir=runtime_dir,
                             autostart=False, validate="immutable", skip_instance_cache=True)


def read_epochs(fs, paths, orders, announce: bool, compute: float) -> list[dict]:
    """Read each epoch (announcing it first if asked); per-epoch reader and daemon counts."""
    out = []
    for order in orders:
        before = dict(fs.client.counters)
        before_prefetched = fs.client.daemon_stats()["counters"].get("prefetched", 0)
        if announce:
            fs.announce([paths[i] for i in order])
        for j, i in enumerate(order):
            fs.cat_file(paths[i])
            if j % 16 == 15:
                time.sleep(compute)
        time.sleep(0.6)  # the last access report lands
        prefetched = fs.client.daemon_stats()["counters"].get("prefetched", 0) - before_prefetched
        out.append({k: fs.client.counters[k] - before[k]
                    for k in ("hits", "misses", "bypassed", "fallbacks")} | {"prefetched": prefetched})
    return out


@pytest.mark.timeout(60)
def test_an_announced_order_is_prefetched_ahead_of_the_reader(make_tree, runtime_dir, spawn_daemon):
    spawn_daemon(runtime_dir, dram_capacity="16MiB")
    paths = sorted(make_tree([FILE] * 40))
    fs = cache_fs(runtime_dir)
    assert fs.announce(paths[::-1]) == 40
    wait_for(lambda: daemon_stats(runtime_dir)["counters"].get("prefetched", 0) == 40, 20,
             what="the 40 announced files to be prefetched")
    for p in paths[::-1]:
        with open(p, "rb") as f:
            assert fs.cat_file(p) == f.read()
    assert fs.stats()["hits"] == 40 and fs.stats()["misses"] == 0
    assert fs.stats()["bypassed"] == 0 and fs.stats()["fallbacks"] == 0


@pytest.mark.timeout(60)
def test_files_missing_from_an_order_take_no_place_and_the_rest_is_prefetched(
        make_tree, runtime_dir, spawn_daemon, caplog):
    """One file of the order gone from the store (its reads will fail) cost the whole
    order: fs.announce raised, and AnnouncingSampler went without an order every epoch."""
    import logging
    import os
    import pathlib
    caplog.set_level(logging.WARNING, logger="cachemw")
    spawn_daemon(runtime_dir, dram_capacity="16MiB")
    paths = sorted(make_tree([FILE] * 30))
    for gone in paths[3:5]:
        os.unlink(gone)
    fs = cache_fs(runtime_dir)
    order = [pathlib.Path(p) for p in paths[:10]] + paths[10:]  # os.PathLike too
    assert fs.announce(order) == 28
    wait_for(lambda: daemon_stats(runtime_dir)["counters"].get("prefetched", 0) == 28, 20,
             what="the 28 files still at the store to be prefetched")
    said = [r.getMessage() for r in caplog.records if "not at the store" in r.getMessage()]
    assert len(said) == 1 and "2 of the 30" in said[0] and paths[3] in said[0]
    fs.announce(paths)
    assert len([r for r in caplog.records if "not at the store" in r.getMessage()]) == 1
    for bad in (paths[0], [b"/x"], [("a", 1)], [3]):  # one path for the list, odd entries
        with pytest.raises(ValueError, match="announce"):
            fs.announce(bad)


@pytest.mark.timeout(60)
def test_an_order_announced_after_a_read_is_prefetched(make_tree, runtime_dir, spawn_daemon):
    """A read before the first announcement (the daemon then switches to clairvoyant with
    that block in place) must not shift the announced order: all of it is prefetched."""
    spawn_daemon(runtime_dir, dram_capacity="16MiB")
    paths = sorted(make_tree([FILE] * 41))
    fs = cache_fs(runtime_dir)
    fs.cat_file(paths[0])
    assert fs.announce(paths[1:]) == 40
    wait_for(lambda: daemon_stats(runtime_dir)["counters"].get("prefetched", 0) == 40, 30,
             what="the 40 files announced after a read to be prefetched")


@pytest.mark.timeout(60)
def test_reads_before_an_announcement_reach_the_daemon_before_it(make_tree, runtime_dir,
                                                                  spawn_daemon, monkeypatch):
    """A read's lease counts as a read of the node's access stream; one written behind the
    read (the fill writer lingering) that reached the daemon after the order came would
    count there, after the order (a block the order names would take its place early). An
    announcement drains this process's fills first: the lease is in before it returns."""
    from cachemw.client.fills import FillWriter

    monkeypatch.setattr(FillWriter, "LINGER", 30.0)  # written behind until something drains
    spawn_daemon(runtime_dir, dram_capacity="16MiB")
    paths = sorted(make_tree([FILE] * 41))
    fs = cache_fs(runtime_dir)
    fs.cat_file(paths[0])
    assert fs.reader.fills.pending  # its lease not asked for yet
    assert fs.announce(paths[1:]) == 40
    assert daemon_stats(runtime_dir, drain=False)["counters"]["leases"] == 1
    wait_for(lambda: daemon_stats(runtime_dir)["counters"].get("prefetched", 0) == 40, 30,
             what="the 40 files announced to be prefetched")


@pytest.mark.timeout(60)
def test_an_order_replacing_one_stopped_early_is_prefetched_at_once(make_tree, runtime_dir,
                                                                   spawn_daemon):
    """An epoch ended after 3 of its 20 reads, then the next announced replacing it: the
    cache's room (10 blocks) goes to the new order's first blocks, where appended after
    the 17 unread ones they would not be prefetched before the reader came to them."""
    high = TierConfig("dram", "/unused", 1 << 30).high_watermark
    spawn_daemon(runtime_dir, dram_capacity=int(10 * STORED / high) + 1)
    paths = sorted(make_tree([FILE] * 40))
    fs = cache_fs(runtime_dir)
    assert fs.announce(paths[:20]) == 20
    wait_for(lambda: daemon_stats(runtime_dir)["counters"].get("prefetched", 0) == 10, 30,
             what="the first order's first 10 blocks to be prefetched")
    for p in paths[:3]:
        fs.cat_file(p)
    fs.client.daemon_stats()  # the 3 hits reported: the daemon saw the reader there
    wait_for(lambda: daemon_stats(runtime_dir)["counters"]["prefetched"] == 13, 30,
             what="the room of the 3 read refilled from the first order (blocks 10-12)")
    assert fs.announce(paths[20:], replace=True) == 20
    wait_for(lambda: daemon_stats(runtime_dir)["counters"]["prefetched"] == 23, 30,
             what="the replacing order's first 10 blocks to be prefetched")
    hits = fs.stats()["hits"]
    for p in paths[20:30]:
        fs.cat_file(p)
    assert fs.stats()["hits"] - hits == 10


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(180)
def test_epoch2_hit_ratio_with_half_the_dataset_beats_lru_and_matches_the_simulator(
        tmp_path, make_tree, runtime_dir, spawn_daemon):
    pytest.importorskip("torch")  # the trace comes from torch's RandomSampler
    from cachemw.placement import workloads

    n, epochs = 160, 3
    paths = sorted(make_tree([FILE] * n))
    # the engine fills a tier to its high watermark (95%): size it so that is half the data
    dram = int(n * STORED * 0.5 / 0.95) + 1
    capacity = TierConfig("dram", "/unused", dram).high_bytes
    orders = [e[0] for e in workloads.epoch_orders(n, epochs, seed=2)]
    results = {}
    for label, placement, announce in (("announced", None, True), ("lru", "lru", False)):
        rt = str(tmp_path / f"rt-{label}")
        spawn_daemon(rt, dram_capacity=dram, **({"placement": placement} if placement else {}))
        results[label] = read_epochs(cache_fs(rt), paths, orders, announce, compute=0.05)

    def ratios(per_epoch):
        later = per_epoch[1:]
        reads = sum(e["hits"] + e["misses"] + e["bypassed"] + e["fallbacks"] for e in later)
        fetched = sum(e["misses"] + e["bypassed"] + e["fallbacks"] + e["prefetched"] for e in later)
        return sum(e["hits"] for e in later) / reads, 1 - fetched / reads

    announced_hits, announced_saved = ratios(results["announced"])
    lru_hits, _ = ratios(results["lru"])
    trace = [(i, STORED) for order in orders for i in order]
    sim = simulate(trace, "clairvoyant", capacity, announced=True, horizon=n)
    sim_epoch2 = sim.hits / (sim.accesses - n)
    assert sum(e["prefetched"] for e in results["announced"]) > 0
    # with half the data cached, the clairvoyant optimum hits half the reads of epochs 2+
    # and LRU about a quarter: the announced order gets near the optimum and well above
    # LRU, in hits and in source reads saved (kept across epochs, prefetches not counted).
    # Near, not within 5 % (benchmarks/placement_daemon.py holds that target): the engine
    # hears of hits up to a report interval late and a read can reach a block before its
    # prefetch has landed; on a loaded machine (CI) that cost 0.447 saved of 0.5
    assert announced_hits >= 0.9 * sim_epoch2, (announced_hits, sim_epoch2)
    assert announced_hits > 1.5 * lru_hits, (announced_hits, lru_hits)
    assert announced_saved >= 0.85 * sim_epoch2, (announced_saved, sim_epoch2)


def test_failing_prefetches_are_said_once_a_minute_with_a_count(monkeypatch, caplog):
    """A store the daemon cannot read (no credentials) failed every block of an announced
    order alike, each with a warning of its own (found by a black-box check)."""
    import logging

    from cachemw.node import prefetch

    monkeypatch.setattr(prefetch, "_said", {})
    caplog.set_level(logging.WARNING, logger="cachemw")
    for i in range(5):
        prefetch._say_failed("s3://b/k", i, PermissionError("Unable to locate credentials"), 1000.0 + i)
    prefetch._say_failed("s3://b/k", 9, TimeoutError("slow"), 1005.0)  # another kind: said at once
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "block 0 failed" in said[0] and "slow" in said[1]
    prefetch._say_failed("s3://b/k", 7, PermissionError("Unable to locate credentials"), 1061.0)
    assert "4 more prefetches failed" in caplog.records[-1].getMessage()


@pytest.mark.timeout(60)
def test_a_ddp_job_run_again_under_its_name_is_not_laid_after_its_dead_run_s_order(tmp_path):
    """A DDP job killed and run again keeps its name (torchrun's default rendezvous
    address, a requeued Slurm job) in new processes: its dead run's unread places were
    kept, the owner being the one announcing, and the new order laid after them
    (diffrev-12). They are withdrawn, and their cached blocks go first."""
    owner = "127.0.0.1:29500/0:5000:0"
    placer = placer_of(tmp_path, 4)
    old = [_a_process() for _ in range(2)]
    try:
        for rank in range(2):
            placer.announce([(f"old{rank}-{i}", 100) for i in range(2500)],
                            (f"{owner}:0", rank, 2, 0, False, owner), pid=old[rank].pid)
        for i in range(50):
            placer.miss(f"old{i % 2}-{i // 2}", 100)
    finally:
        for p in old:
            p.kill()
            p.wait()
    for rank in range(2):  # run again: the same names, new processes
        placer.announce([(f"new{rank}-{i}", 100) for i in range(8)],
                        (f"{owner}:0", rank, 2, 0, False, owner), pid=os.getpid())
    policy = placer._engine.policy
    assert policy.next_use("new0-0") == policy.cursor
    fetched = [k for kind, k in kinds(placer.prefetch(1 << 20)) if kind == "Prefetch"]
    assert fetched == ["new0-0", "new1-0", "new0-1", "new1-1"]  # the ranks interleaved


def test_an_order_announced_and_never_read_gives_the_tier_back_once_its_places_run_out(tmp_path):
    """Another process announced an order and never read it (a sampler iterated and left,
    an evaluation loop broken out of): its blocks, prefetched, pushed out the working set
    of a trainer that announces nothing. Once the order's places ran out (abandoned after
    ``slack`` reads outside it, then passed), its blocks and the trainer's were all "never
    read again", and the rule that keeps a block against a newcomer needed no sooner kept
    the unread blocks for good: 0 hits in 1,800 reads of a working set of 150 blocks
    (review announce2). Blocks whose announced read never came go first."""
    placer = placer_of(tmp_path, 4)
    hot = [f"hot{i}" for i in range(4)]
    for key in hot:
        assert placer.miss(key, 100)[0] == "dram"
    placer.announce([(f"junk{i}", 100) for i in range(10)], pid=os.getpid())
    fetched = [k for kind, k in kinds(placer.prefetch(1 << 20)) if kind == "Prefetch"]
    assert fetched == [f"junk{i}" for i in range(4)]  # in the order's name, as announced
    slack = placer._engine.policy.slack
    hits = []
    for n in range(3 * slack + 400):  # the trainer reads its 4 blocks, round after round
        key = hot[n % 4]
        if key in placer._engine.placement():
            placer.hit(key)
            hits.append(n)
        else:
            placer.miss(key, 100)
        if n % 16 == 0:
            placer.prefetch(1 << 20)  # the daemon's prefetch pass, which drops old places
    assert hits and hits[-1] == 3 * slack + 399  # cached again, and kept
    assert not any(k.startswith("junk") for k in placer._engine.placement())


@pytest.mark.timeout(60)
def test_the_daemon_knows_which_process_is_at_the_other_end_of_a_connection(tmp_path):
    """An announcement is remembered with the pid of the process that sent it, as the
    daemon sees it (SO_PEERCRED: 0, not known, for another pid namespace's), so that its
    order can be withdrawn once that process is gone."""
    from multiprocessing.connection import Listener

    from cachemw.node.server import peer_pid

    address = str(tmp_path / "s.sock")
    with Listener(address, family="AF_UNIX") as listener:
        child = subprocess.Popen([sys.executable, "-c", (
            "import sys, time\n"
            "from multiprocessing.connection import Client\n"
            f"c = Client({address!r}, family='AF_UNIX')\n"
            "c.send('hi'); c.recv()\n")])
        try:
            with listener.accept() as conn:
                assert conn.recv() == "hi"
                assert peer_pid(conn) == child.pid
                conn.send("bye")
        finally:
            child.wait(30)
