"""Shared nodes: a runtime dir another user prepared (a directory, or a symlink) is refused
and reads go on from the source, counted and logged once; what we create is ours alone; a
tier directory removed under a running daemon comes back private and caching resumes; the
private Ray cluster of `cachemw start` keeps its files to the user and stops whole."""
from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import uuid

import fsspec
import psutil
import pytest

from cachemw.protocol import REGISTRY, SOCKET, lookup
from conftest import daemon_stats, published, service_procs, wait_for

BS = 65536
SQUATTER = "cmwsquat"


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def other_user():
    """A second OS user, created for the test and removed after it, even on failure."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a second user (useradd) and act as it")
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed")
    name = f"{SQUATTER}{uuid.uuid4().hex[:6]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True, timeout=30)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=30)


def as_user(user, code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["/usr/bin/python3", "-c", code, *args], capture_output=True,
                          text=True, timeout=30, user=user.pw_uid, group=user.pw_gid, cwd="/")


@pytest.fixture
def shm_dir():
    """A fresh name in /dev/shm (world-writable, sticky: where a squatter gets in first)."""
    path = f"/dev/shm/cachemw-squat-test-{uuid.uuid4().hex[:8]}"
    yield path
    if os.path.islink(path):
        os.unlink(path)
    shutil.rmtree(path, ignore_errors=True)


def refused_reads(runtime_dir: str, files: dict, caplog) -> dict:
    caplog.set_level(logging.WARNING, logger="cachemw")
    fs = fsspec.filesystem("cachemw", target_protocol="file", block_size=BS,
                           runtime_dir=runtime_dir, skip_instance_cache=True)
    for _ in range(2):
        for p, data in files.items():
            assert fs.cat_file(p) == data
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("cachemw")
                and r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert runtime_dir in warnings[0]
    return fs.stats()


@pytest.mark.timeout(90)
def test_a_squatted_runtime_dir_is_refused_and_reads_go_on(other_user, shm_dir, dataset, caplog,
                                                            reap_daemons):
    reap_daemons(shm_dir)
    _, files = dataset
    nblocks = sum(max(1, -(-len(d) // BS)) for d in files.values())
    r = as_user(other_user, "import os, sys; os.mkdir(sys.argv[1], 0o777); "
                "os.chmod(sys.argv[1], 0o777)", shm_dir)
    assert r.returncode == 0, r.stderr
    stats = refused_reads(shm_dir, files, caplog)
    assert stats["fallbacks"] == 2 * nblocks and stats["hits"] == 0
    assert os.listdir(shm_dir) == []  # nothing of ours was put there
    assert os.stat(shm_dir).st_uid == other_user.pw_uid and mode(shm_dir) == 0o777  # untouched
    assert service_procs(shm_dir) == []


@pytest.mark.timeout(90)
def test_a_symlinked_runtime_dir_is_refused(other_user, shm_dir, dataset, caplog, tmp_path,
                                            reap_daemons):
    reap_daemons(shm_dir)
    _, files = dataset
    nblocks = sum(max(1, -(-len(d) // BS)) for d in files.values())
    target = f"{shm_dir}-target"
    os.mkdir(target, 0o700)  # even a link to a private directory of ours: whose link it is counts
    try:
        r = as_user(other_user, "import os, sys; os.symlink(sys.argv[2], sys.argv[1])",
                    shm_dir, target)
        assert r.returncode == 0, r.stderr
        stats = refused_reads(shm_dir, files, caplog)
        assert stats["fallbacks"] == 2 * nblocks and stats["hits"] == 0
        assert os.listdir(target) == []
        assert service_procs(shm_dir) == []
    finally:
        shutil.rmtree(target, ignore_errors=True)


@pytest.mark.timeout(90)
def test_another_user_cannot_read_tiers_registry_or_socket(other_user, shm_dir, dataset,
                                                           reap_daemons):
    reap_daemons(shm_dir)
    _, files = dataset
    fs = fsspec.filesystem("cachemw", target_protocol="file", block_size=BS,
                           runtime_dir=shm_dir, skip_instance_cache=True)
    for p, data in files.items():
        assert fs.cat_file(p) == data
    published(fs)
    address = lookup(shm_dir)
    assert address is not None and mode(shm_dir) == 0o700
    dram = address.tiers[0]["path"]
    block = next(os.path.join(dram, sub, name) for sub in sorted(os.listdir(dram))
                 if len(sub) == 2 for name in os.listdir(os.path.join(dram, sub)))
    probe = (
        "import socket, sys\n"
        "for path in sys.argv[1:4]:\n"
        "    try:\n"
        "        open(path, 'rb').read(1); print('read', path)\n"
        "    except PermissionError: print('denied')\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        "    s.connect(sys.argv[4]); print('connected')\n"
        "except PermissionError: print('denied')\n"
    )
    r = as_user(other_user, probe, os.path.join(shm_dir, REGISTRY), block,
                os.path.join(dram, "meta"), os.path.join(shm_dir, SOCKET))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["denied"] * 4, r.stdout


@pytest.mark.timeout(90)
def test_a_tier_dir_removed_under_the_daemon_comes_back_private(runtime_dir, spawn_daemon,
                                                                dataset):
    _, files = dataset
    paths = sorted(files)
    spawn_daemon(runtime_dir)
    fs = fsspec.filesystem("cachemw", target_protocol="file", block_size=BS, autostart=False,
                           runtime_dir=runtime_dir, skip_instance_cache=True)
    for p in paths[:5]:
        assert fs.cat_file(p) == files[p]
    published(fs)
    dram = daemon_stats(runtime_dir)["tiers"]["dram"]["path"]
    shutil.rmtree(dram)  # a cleaner of /dev/shm, a job epilogue, a user's rm -rf
    for p in paths:  # reads go on meanwhile (from the source where the blocks are gone)
        assert fs.cat_file(p) == files[p]

    def resumed():
        for p in paths:
            assert fs.cat_file(p) == files[p]
        published(fs)
        s = daemon_stats(runtime_dir)
        return s if s["tiers"]["dram"]["blocks"] == sum(
            max(1, -(-len(files[p]) // BS)) for p in paths) else None

    stats = wait_for(resumed, 30, interval=0.5, what="caching to resume in the new tier dir")
    assert stats["tiers"]["dram"]["admitting"]
    assert mode(dram) == 0o700
    for sub in os.listdir(dram):
        assert mode(os.path.join(dram, sub)) == 0o700, sub
    before = fs.stats()
    for p in paths:  # and reads are hits again
        assert fs.cat_file(p) == files[p]
    after = fs.stats()
    assert after["bytes_from_source"] == before["bytes_from_source"]


def _cluster_procs(temp_dir: str) -> list:
    """The processes of the Ray cluster whose temp dir is ``temp_dir``, and their children
    (Ray's agents rename themselves: ray::DashboardAgent, ray::RuntimeEnvAgent)."""
    roots = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in a for a in (p.info["cmdline"] or ())):
                roots.append(p)
        except psutil.NoSuchProcess:
            pass
    out = {p.pid: p for p in roots}
    for p in roots:
        try:
            out.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    return list(out.values())


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cachemw_start_is_private_strict_and_stops_whole(tmp_path):
    rt = tmp_path / "rt"
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=str(rt))
    env.pop("RAY_ADDRESS", None)

    def cli(*args, timeout=240, environ=None):
        return subprocess.run([sys.executable, "-m", "cachemw.cli", *args],
                              env=env if environ is None else environ,
                              capture_output=True, text=True, timeout=timeout, cwd="/")

    r = cli("start", "--dram-capacity", "0")  # not "25% of RAM": an error, before Ray starts
    assert r.returncode == 2 and "dram_capacity" in r.stderr, r.stderr
    assert not (rt / "ray.json").exists()

    r = cli("start", "--dram-dir", "/proc/cachemw-nowhere/dram")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "/proc/cachemw-nowhere" in r.stderr
    assert not (rt / "ray.json").exists()  # the Ray cluster started for it is gone too

    procs = []
    try:
        r = cli("start", "--dram-capacity", "64MiB")
        assert r.returncode == 0, r.stdout + r.stderr
        state = json.loads((rt / "ray.json").read_text())
        temp_dir = state["temp_dir"]
        # Ray's files (its sockets among them) are the user's alone
        assert mode(temp_dir) == 0o700 or mode(os.path.dirname(temp_dir)) == 0o700
        procs = _cluster_procs(temp_dir)
        names = " ".join(p.name() for p in procs)
        assert "raylet" in names and "gcs_server" in names

        r = cli("start", "--dram-capacity", "128MiB")  # not silently the old tiers
        assert r.returncode != 0
        assert "dram_capacity" in r.stderr and "64.0 MiB" in r.stderr and "128.0 MiB" in r.stderr
        assert "cachemw stop" in r.stderr and "Traceback" not in r.stderr
        r = cli("start", "--dram-capacity", "64MiB")  # the same options: fine
        assert r.returncode == 0, r.stderr
        # nothing asked (not even the session's CACHEMW_DRAM_CAPACITY, which start passes
        # on as asked): whatever runs
        r = cli("start", environ={k: v for k, v in env.items() if k != "CACHEMW_DRAM_CAPACITY"})
        assert r.returncode == 0, r.stderr
        r = cli("start", environ=dict(env, CACHEMW_DRAM_CAPACITY="128MiB"))  # asked: refused
        assert r.returncode == 2 and "(asked: 128.0 MiB)" in r.stderr, r.stderr
    finally:
        r = cli("stop")
    assert r.returncode == 0, r.stderr
    assert "stopped 1 daemon" in r.stdout
    alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:
        p.kill()
    assert alive == [], [(p.pid, p.name()) for p in alive]


@pytest.mark.timeout(60)
def test_a_runtime_dir_another_hosts_daemon_holds_is_said_to_be_shared(tmp_path):
    """A runtime dir on a filesystem the nodes share (CACHEMW_RUNTIME_DIR=/shared/x before a
    multi-node job): the daemon of the second node cannot start, and says that the directory
    is shared, not to stop the first node's daemon (which it cannot, nor would that help)."""
    import socket

    from cachemw.config import DaemonConfig
    from cachemw.node.service import DaemonAlreadyRunning, NodeService
    from cachemw.protocol import DaemonLock

    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    config = DaemonConfig.build(runtime_dir=str(rt), dram_dir=str(tmp_path / "dram"),
                                dram_capacity="16MiB")
    other = DaemonLock(str(rt))  # another node's daemon, as its lock file says
    assert other.acquire()
    try:
        other.describe(pid=4242, kind="ray", host="node-b-of-this-test")
        with pytest.raises(DaemonAlreadyRunning) as raised:
            NodeService(config)
        said = str(raised.value)
        assert "daemon of host node-b-of-this-test (pid 4242)" in said
        assert "on a filesystem the nodes share" in said and "{node_id}" in said
        assert "cachemw stop" not in said
        other.describe(pid=4242, kind="ray", host=socket.gethostname())  # this node's own
        with pytest.raises(DaemonAlreadyRunning, match=r"a cachemw ray daemon \(pid 4242\) "
                           r"already serves .*; stop it first \(`cachemw stop`\)"):
            NodeService(config)
    finally:
        other.release()


@pytest.mark.timeout(60)
def test_stop_never_signals_a_pid_another_hosts_lock_names(tmp_path):
    """`cachemw stop` on a node whose runtime dir is shared with another node: the pid in the
    lock file is the other node's daemon, here some other process (with the same start
    time, as unlikely as that is): it is left alone."""
    import socket
    import subprocess
    import sys

    from cachemw.launch import stop_local
    from cachemw.processes import process_start
    from cachemw.protocol import DaemonLock

    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    other = DaemonLock(str(rt))
    assert other.acquire()
    try:
        other.describe(pid=bystander.pid, start=process_start(bystander.pid), kind="autostarted",
                       host="node-b-of-this-test")
        assert stop_local(str(rt), timeout=2) is False
        assert bystander.poll() is None  # not signalled
        # nor is anything of it removed by `cachemw stop`: the node-DRAM checkpoint copies
        # there are the other node's trainers' (some still draining); and it says why
        copy = rt / "checkpoints" / "0123" / "step_000000000001-abcdef01" / "__0_0.distcp"
        copy.parent.mkdir(parents=True)
        copy.write_bytes(b"x")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        r = subprocess.run([sys.executable, "-m", "cachemw.cli", "stop"], capture_output=True,
                           text=True, timeout=120, env={**env, "CACHEMW_RUNTIME_DIR": str(rt)})
        assert r.returncode == 0 and "stopped 0 daemon(s)" in r.stdout, r.stdout + r.stderr
        assert ("daemon of host node-b-of-this-test" in r.stderr and "filesystem the nodes "
                "share" in r.stderr and "nothing in it was stopped or removed" in r.stderr), r.stderr
        assert copy.exists() and bystander.poll() is None
        other.describe(pid=bystander.pid, start=process_start(bystander.pid), kind="autostarted",
                       host=socket.gethostname())  # this host's: the process stop stops
        assert stop_local(str(rt), timeout=1) is True
        assert bystander.wait(timeout=10) == -15
    finally:
        other.release()
        bystander.kill()
        bystander.wait()
