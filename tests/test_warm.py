"""``cachemw warm`` on one node and its share on several (tests/test_slurm_jobs.py runs it
on every node of a real Slurm job): which blocks a node warms, what a failure midway
leaves, and a daemon's NVMe tier kept warm for the next daemon (of this job or the next)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from cachemw import warm
from cachemw.client.metadata import FileMeta
from cachemw.config import WarmConfig
from cachemw.keys import block_count, block_key, version_token
from cachemw.launch import spawn_detached
from cachemw.ring import HashRing, ring_names
from conftest import daemon_stats

BS = 65536


def _metas(sizes: list[int]) -> list[FileMeta]:
    out = []
    for i, size in enumerate(sizes):
        info = {"size": size, "mtime": 1000.0 + i, "created": 1000.0 + i, "ino": i}
        out.append(FileMeta(f"/pfs/f{i}", f"file:///pfs/f{i}", size, version_token(info), info))
    return out


def test_nodes_warming_together_split_the_blocks_by_owner():
    metas = _metas([100, BS, 3 * BS + 5, 0, 10 * BS] + [5000 + i for i in range(200)])
    names = ["cmwn1", "cmwn2", "cmwn3"]
    ring = HashRing(names, 1024)
    shares = {n: warm.plan(metas, warm.Share(n, 3, ring, tuple(names)), BS) for n in names}
    every = [(m.path, i * BS) for m in metas if m.size for i in range(block_count(m.size, BS))]
    got = [(m.path, start) for share in shares.values() for m, start, _ in share]
    assert sorted(got) == sorted(every)  # each block once in all: no gap, no double
    for node, share in shares.items():
        assert share, node  # 200+ blocks: every node owns some
        for meta, start, end in share:
            assert ring.owner(block_key(meta.url, meta.version, start // BS, BS)) == node
            assert end - start == min(BS, meta.size - start)
    # alone (no cluster, or --nodes 1): everything
    alone = warm.plan(metas, warm.Share("cmwn1", 1), BS)
    assert sorted((m.path, s) for m, s, _ in alone) == sorted(every)


def test_ring_names_are_hostnames_unless_shared():
    assert ring_names({"a" * 56: "cmwn1", "b" * 56: "cmwn2"}) == {"a" * 56: "cmwn1",
                                                                "b" * 56: "cmwn2"}
    # several Ray nodes on one machine: their ids (their tiers are per node id anyway)
    assert ring_names({"a" * 56: "vm", "b" * 56: "vm", "c" * 56: "other"}) == {
        "a" * 56: "a" * 56, "b" * 56: "b" * 56, "c" * 56: "other"}
    assert ring_names({"a" * 56: ""}) == {"a" * 56: "a" * 56}


def test_warm_config_from_a_slurm_step():
    assert WarmConfig.build(env={}).nodes == 1
    step = {"SLURM_STEP_NUM_NODES": "3", "SLURM_LOCALID": "1"}
    assert (WarmConfig.build(env=step).nodes, WarmConfig.build(env=step).local_task) == (3, 1)
    assert WarmConfig.build(nodes=1, env=step).nodes == 1  # the option wins
    with pytest.raises(ValueError, match="SLURM_STEP_NUM_NODES"):
        WarmConfig.build(env={"SLURM_STEP_NUM_NODES": "three"})
    with pytest.raises(ValueError, match="nodes"):
        WarmConfig.build(nodes=0, env={})


def test_a_one_node_step_of_a_bigger_cluster_warms_alone_only_when_asked():
    """A one-node srun step in a 3-node job warmed everything alone (its default --nodes,
    the step's 1), where the README says a warm on fewer nodes than the cluster is refused:
    alone takes --nodes 1 given (found by a black-box check on an emulated Slurm)."""

    class Cluster:
        members = ["n1", "n2", "n3"]

        def ring(self, *, strict=False):
            return {"members": self.members, "alive": 3, "self": "n1", "vnodes": 64}

    step = {"SLURM_STEP_NUM_NODES": "1", "SLURM_LOCALID": "0"}
    with pytest.raises(warm.WarmError, match="--nodes 1"):
        warm.node_share(Cluster(), WarmConfig.build(ring_wait=0, env=step))
    forming = Cluster()
    forming.members = ["n1"]  # 3 alive, the ring still forming: not a cluster of one
    with pytest.raises(warm.WarmError, match="still forming"):
        warm.node_share(forming, WarmConfig.build(ring_wait=0, env=step))
    for config in (WarmConfig.build(nodes=1, ring_wait=0, env=step),  # asked for
                   WarmConfig.build(ring_wait=0, env={})):  # not a Slurm step
        share = warm.node_share(Cluster(), config)
        assert share.ring is None and share.node == "n1"  # all of it


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "cachemw.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.fixture
def stop_daemon(runtime_dir):
    yield
    _cli("--runtime-dir", runtime_dir, "stop")


@pytest.mark.timeout(120)
def test_warm_caches_everything_and_a_missing_path_is_an_error(runtime_dir, make_tree, tmp_path,
                                                               stop_daemon):
    files = make_tree([3000 + 997 * i for i in range(30)] + [5 * BS + 1], name="data")
    env = dict(os.environ, CACHEMW_BLOCK_SIZE=str(BS), CACHEMW_DRAM_CAPACITY="64MiB")
    data = str(tmp_path / "data")
    # no daemon runs: the warm starts one that outlives it (one it autostarted as a reader
    # would end with it, and free the DRAM tier just filled)
    r = _cli("warm", "--json", data, str(tmp_path / "nope"), env=env)
    assert r.returncode == 1, r.stderr
    report = json.loads(r.stdout)
    assert report["blocks"] == 30 + 6 and report["bytes"] == sum(map(len, files.values()))
    assert report["counters"]["misses"] == 36 and report["host"] == socket.gethostname()
    assert list(report["errors"]) == [str(tmp_path / "nope")]
    assert f"not warmed: {tmp_path / 'nope'}: FileNotFoundError" in r.stderr
    stats = daemon_stats(runtime_dir)
    assert stats["tiers"]["dram"]["blocks"] == 36
    # nothing that exists among the arguments: a bad argument (2), nothing read
    r = _cli("warm", str(tmp_path / "nope"), str(tmp_path / "nor-this"), env=env)
    assert r.returncode == 2 and "nothing to warm" in r.stderr and "nor-this" in r.stderr, r.stderr
    again = _cli("warm", data, env=env)  # all cached already
    assert again.returncode == 0, again.stderr
    assert "0 fetched from the source, 36 cached already" in again.stdout
    status = _cli("status", env=env)  # the daemon the warm left running, with its tiers
    assert status.returncode == 0 and "(not Ray-managed), dram " in status.stdout, status


@pytest.mark.timeout(120)
def test_a_store_that_refuses_the_listing_is_a_clear_error(runtime_dir, s3_server, stop_daemon):
    # no credentials at all for a real S3 server: botocore's own error (not an OSError)
    # before anything is read, said in one line, exit status 2, no traceback
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=s3_server["endpoint"], AWS_CONFIG_FILE="/nonexistent",
               AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_EC2_METADATA_DISABLED="true")
    r = _cli("warm", f"cachemw::s3://{s3_server['bucket']}/train/", env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    said = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(said) == 1 and "cannot list" in said[0] and "Credentials" in said[0], r.stderr


class _FailingDisk(LocalFileSystem):
    """Local files, one of which cannot be read (EIO), as a failing disk answers."""

    protocol = ("faildisk",)
    bad = ""

    def cat_file(self, path, start=None, end=None, **kwargs):
        if self._strip_protocol(path) == type(self).bad:
            raise OSError(5, f"Input/output error: {path}")
        return super().cat_file(path, start=start, end=end, **kwargs)


@pytest.mark.timeout(120)
def test_a_source_error_midway_fails_that_file_only_and_caches_no_wrong_bytes(
        runtime_dir, make_tree, tmp_path, monkeypatch, stop_daemon):
    fsspec.register_implementation("faildisk", _FailingDisk, clobber=True)
    files = make_tree([20_000 + i for i in range(150)] + [3 * BS], name="data")
    paths = sorted(files)
    _FailingDisk.bad = paths[100]
    monkeypatch.setenv("CACHEMW_BLOCK_SIZE", str(BS))
    monkeypatch.setenv("CACHEMW_DRAM_CAPACITY", "64MiB")
    report = warm.run([f"cachemw::faildisk://{tmp_path / 'data'}"], WarmConfig(threads=2))
    assert not report.ok and list(report.errors) == [paths[100]]
    assert "Input/output error" in report.errors[paths[100]]
    assert report.bytes == sum(len(d) for p, d in files.items() if p != paths[100])
    assert daemon_stats(runtime_dir)["tiers"]["dram"]["blocks"] == len(files) - 1 + 2
    # what the warm cached reads back right; the failed file is read from the source
    _FailingDisk.bad = ""
    fs = fsspec.filesystem("cachemw", target_protocol="faildisk", skip_instance_cache=True)
    assert all(fs.cat_file(p) == files[p] for p in paths)
    assert fs.stats()["misses"] == 1 and fs.stats()["hits"] == len(files) - 1 + 2


@pytest.mark.timeout(120)
def test_a_warm_that_does_not_fit_says_so(runtime_dir, make_tree, tmp_path, stop_daemon):
    files = make_tree([BS] * 40, name="data")
    env = dict(os.environ, CACHEMW_BLOCK_SIZE=str(BS), CACHEMW_DRAM_CAPACITY=str(10 * BS))
    r = _cli("warm", str(tmp_path / "data"), env=env)
    assert r.returncode == 1
    assert "read but not cached:" in r.stderr and "bypassed" in r.stderr, r.stderr
    assert "read (not all of it cached" in r.stdout and "warmed" not in r.stdout, r.stdout
    fs = fsspec.filesystem("cachemw", block_size=BS, skip_instance_cache=True)
    assert all(fs.cat_file(p) == d for p, d in files.items())


@pytest.mark.timeout(120)
def test_a_clean_stop_keeps_the_dram_blocks_on_nvme_for_the_next_daemon(runtime_dir, make_tree,
                                                                        tmp_path, stop_daemon):
    files = make_tree([BS // 2 + i for i in range(24)], name="data")
    options = dict(dram_capacity="64MiB", nvme_dir=str(tmp_path / "nvme"),
                   nvme_capacity="64MiB")
    spawn_detached(runtime_dir, options)
    fs = fsspec.filesystem("cachemw", block_size=BS, skip_instance_cache=True, autostart=False)
    assert all(fs.cat_file(p) == d for p, d in files.items())
    stats = daemon_stats(runtime_dir)
    assert stats["tiers"]["dram"]["blocks"] == 24 and stats["tiers"]["nvme"]["blocks"] == 0
    # a clean stop (SIGTERM: as Slurm ends a job, `cachemw stop`): the DRAM tier goes
    assert _cli("--runtime-dir", runtime_dir, "stop").returncode == 0
    assert not [f for _, _, fs in os.walk(stats["tiers"]["dram"]["path"]) for f in fs]
    # the next daemon finds every block on NVMe: nothing from the source
    spawn_detached(runtime_dir, options)
    stats = daemon_stats(runtime_dir)
    assert stats["counters"]["reindexed"] == 24 and stats["tiers"]["nvme"]["blocks"] == 24
    fresh = fsspec.filesystem("cachemw", block_size=BS, skip_instance_cache=True,
                              autostart=False)
    assert all(fresh.cat_file(p) == d for p, d in files.items())
    assert fresh.stats()["bytes_from_source"] == 0 and fresh.stats()["hits"] == 24


@pytest.mark.timeout(120)
def test_a_daemon_replacing_the_warm_s_own_outlives_the_warm(tmp_path, runtime_dir, reap_daemons):
    """The daemon a warm started is lost during the warm (OOM killer, kill -9): the read
    that follows starts another, which outlived the warm as the first would have. It was
    started as the warm process's own, ended with the warm and freed its DRAM tier, after
    the warm had reported every block cached (review ops6)."""
    from conftest import gone
    from cachemw.launch import stop_local
    from cachemw.protocol import lock_holder

    reap_daemons(runtime_dir)
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(1 << 20))
    script = f"""
import os, signal, time
import fsspec
from cachemw import warm
from cachemw.client import finding
from cachemw.protocol import lock_holder
rt = {runtime_dir!r}
fs = fsspec.filesystem("cachemw", runtime_dir=rt, skip_instance_cache=True)
with finding.daemons_outlive():  # as a warm runs (warm._warm)
    warm.ensure_daemon(fs)
    first = lock_holder(rt)["pid"]
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while lock_holder(rt) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fs.cat_file({str(src)!r}) == open({str(src)!r}, "rb").read()
assert finding._outliving == 0  # for the block only: the process's later daemons are its own
print(first, lock_holder(rt)["pid"], flush=True)
"""
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=90)
        assert out.returncode == 0, out.stderr
        first, second = map(int, out.stdout.split())
        assert second != first and gone(first)
        holder = None
        for _ in range(30):  # a daemon whose starter is gone notices it within a second
            time.sleep(0.1)
            holder = lock_holder(runtime_dir)
        assert holder is not None and holder["pid"] == second and not gone(second)
        with open(f"/proc/{second}/cmdline", "rb") as f:
            assert b"--parent-pid" not in f.read()
    finally:
        stop_local(runtime_dir)


@pytest.mark.timeout(120)
def test_a_warm_waits_for_ray_to_restart_the_daemon_it_placed(tmp_path, runtime_dir, reap_daemons):
    """In the second or so after a daemon `cachemw start` placed dies, before Ray has
    restarted it, a warm waits for the new one (it said "start one with `cachemw start`"
    and exited 2, review ops6). Here the dead daemon's address says "ray" and a daemon
    takes the runtime dir over a second later, as Ray's restart does."""
    import threading

    from cachemw.launch import stop_local
    from cachemw.protocol import DaemonAddress, ensure_private_dir, publish

    reap_daemons(runtime_dir)
    ensure_private_dir(runtime_dir)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout
    publish(runtime_dir, DaemonAddress(node_id="n", pid=int(dead), socket="/nonexistent",
                                       secret="00", tiers=(), meta_dir="/nonexistent", kind="ray"))
    fs = fsspec.filesystem("cachemw", runtime_dir=runtime_dir, skip_instance_cache=True)
    restart = threading.Timer(1.0, spawn_detached, (runtime_dir, fs.client.daemon_config))
    restart.start()
    try:
        warm.ensure_daemon(fs)  # no WarmError: the new daemon answers
        assert fs.client.connected()
    finally:
        restart.join()
        stop_local(runtime_dir)
