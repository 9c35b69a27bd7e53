"""The autostarted daemon's life: a daemon killed (SIGKILL) is replaced by the next process
that needs one, which takes over its leftovers; SIGTERM ends it as cleanly as a normal
exit; `cachemw stop` finds a daemon by its lock and pid (not its socket) and reclaims what a
dead one left; a hung (SIGSTOPped) daemon holds a reader up for ``daemon_timeout`` seconds,
not a minute. Real daemon processes (`python -m cachemw.node.service`), real signals, the real
CLI as a subprocess."""
from __future__ import annotations

import json
import logging
import os
import time
import shutil
import signal
import subprocess
import sys

import fsspec
import pytest

from cachemw.processes import process_state
from cachemw.protocol import REGISTRY, SOCKET, lookup
from conftest import daemon_stats, gone, published, service_procs, wait_for

BS = 65536
CLI = [sys.executable, "-m", "cachemw.cli"]


def nblocks(files, paths):
    return sum(max(1, -(-len(files[p]) // BS)) for p in paths)


def new_fs(runtime_dir, **options):
    return fsspec.filesystem("cachemw", target_protocol="file", block_size=BS,
                             runtime_dir=runtime_dir, skip_instance_cache=True, **options)


def cli(*args, runtime_dir, timeout=60):
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=runtime_dir)
    return subprocess.run(CLI + list(args), env=env, capture_output=True, text=True,
                          timeout=timeout, cwd="/")


def dram_blocks(dram: str) -> list[str]:
    """Block files (and leftovers of fills) in a DRAM tier directory, metadata aside."""
    out = []
    for sub in os.listdir(dram) if os.path.isdir(dram) else ():
        if len(sub) == 2 and os.path.isdir(os.path.join(dram, sub)):
            out += os.listdir(os.path.join(dram, sub))
    return out


def autostarted(runtime_dir, dataset, reap_daemons, n=8):
    """A daemon autostarted by this process, holding the blocks of ``n`` files in DRAM."""
    reap_daemons(runtime_dir)
    _, files = dataset
    paths = sorted(files)[:n]
    fs = new_fs(runtime_dir)
    for p in paths:
        assert fs.cat_file(p) == files[p]
    published(fs)
    address = lookup(runtime_dir)
    assert address is not None and address.kind == "autostarted"
    dram = address.tiers[0]["path"]
    assert len(dram_blocks(dram)) == nblocks(files, paths)
    return fs, address, dram


@pytest.mark.timeout(120)
def test_a_killed_daemon_is_replaced_by_the_next_reader(runtime_dir, dataset, reap_daemons,
                                                         caplog):
    caplog.set_level(logging.INFO, logger="cachemw")
    _, files = dataset
    paths = sorted(files)
    fs, first, dram = autostarted(runtime_dir, dataset, reap_daemons, n=10)
    os.kill(first.pid, signal.SIGKILL)
    wait_for(lambda: gone(first.pid), 10, what="the daemon to die")

    # the same process reads on: it starts a new daemon and goes on through the cache
    for p in paths:
        assert fs.cat_file(p) == files[p]
    # the misses' leases are asked behind the reads, by the fill writer, whose first one
    # starts the new daemon: the reads can end before it has registered (CI, a loaded
    # machine), so wait for the writer
    published(fs)
    second = lookup(runtime_dir)
    assert second is not None and second.pid != first.pid and not gone(second.pid)
    assert fs.stats()["fallbacks"] == 0
    stats = daemon_stats(runtime_dir)
    assert stats["pid"] == second.pid
    assert stats["counters"]["reindexed"] == nblocks(files, paths[:10])  # the dead one's blocks
    assert stats["tiers"]["dram"]["blocks"] == nblocks(files, paths)
    assert not [r for r in caplog.records if "unreachable" in r.getMessage()]
    r = cli("stats", "--json", runtime_dir=runtime_dir)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["pid"] == second.pid

    # killed again: four new processes at once; one of them starts the one replacement,
    # and all read through it (hits: the blocks stayed in DRAM)
    os.kill(second.pid, signal.SIGKILL)
    wait_for(lambda: gone(second.pid), 10, what="the daemon to die")
    code = (
        "import fsspec, json, sys\n"
        f"fs = fsspec.filesystem('cachemw', target_protocol='file', block_size={BS},"
        f" runtime_dir={runtime_dir!r})\n"
        f"for p in {paths!r}: fs.cat_file(p)\n"
        "print(json.dumps(fs.stats()), flush=True)\n"
        "sys.stdin.readline()\n"  # stay until all have read: the daemon ends with its starter
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    try:
        outs = [json.loads(p.stdout.readline()) for p in procs]
        daemons = service_procs(runtime_dir)
        assert len(daemons) == 1, daemons
        assert lookup(runtime_dir).pid == daemons[0].pid
    finally:
        errs = []
        for p in procs:
            _, err = p.communicate("done\n", timeout=60)
            errs.append(err)
    for out, err, p in zip(outs, errs, procs):
        assert p.returncode == 0, err
        assert out["fallbacks"] == 0 and out["bytes_from_source"] == 0, (out, err)
        assert out["hits"] == nblocks(files, paths)
        assert "unreachable" not in err and "refused" not in err, err


@pytest.mark.timeout(90)
def test_a_drain_after_the_daemon_died_starts_no_daemon(runtime_dir, dataset, reap_daemons,
                                                         tmp_path):
    """A drain (fs.stats(), a write, close, exit) waits for the daemon to have read the fill
    writer's notes with a round trip on the connection they went on; that daemon gone, the
    drain ends there: it must not start a new daemon just to be answered."""
    import errno

    fs, first, _ = autostarted(runtime_dir, dataset, reap_daemons, n=2)

    def refused(key):  # leases asked first: their fills are noted on this thread's connection
        raise OSError(errno.ENOSPC, "No space left on device")

    fs.reader.claims.take = refused
    fills = fs.stats()["fills"]
    fresh = []
    for i in range(3):
        path = tmp_path / f"fresh{i}.bin"
        path.write_bytes(os.urandom(2 * BS))
        fresh.append(str(path))
        assert fs.cat_file(str(path)) == path.read_bytes()
    wait_for(lambda: not fs.reader.fills.pending, 10, what="the fill writer's notes")
    os.kill(first.pid, signal.SIGKILL)
    wait_for(lambda: gone(first.pid), 10, what="the daemon to die")
    assert fs.stats()["fills"] - fills == 6  # noted, before the daemon died
    address = lookup(runtime_dir)  # (the registry still names the dead one)
    assert (address is None or address.pid == first.pid) and service_procs(runtime_dir) == []


@pytest.mark.timeout(90)
def test_cachemw_stop_reclaims_what_a_killed_daemon_left(runtime_dir, dataset, reap_daemons):
    fs, address, dram = autostarted(runtime_dir, dataset, reap_daemons)
    os.kill(address.pid, signal.SIGKILL)
    wait_for(lambda: gone(address.pid), 10, what="the daemon to die")
    assert os.path.exists(os.path.join(runtime_dir, SOCKET))  # what it left
    r = cli("stats", runtime_dir=runtime_dir)
    assert r.returncode == 1 and f"pid {address.pid}) died" in r.stderr, r.stderr
    r = cli("stop", runtime_dir=runtime_dir)
    assert r.returncode == 0, r.stderr
    assert "dead" in r.stdout, r.stdout
    assert not os.path.exists(os.path.join(runtime_dir, SOCKET))
    assert not os.path.exists(os.path.join(runtime_dir, REGISTRY))
    assert dram_blocks(dram) == []  # an autostarted daemon's DRAM tier is freed


@pytest.mark.timeout(90)
def test_sigterm_cleans_up_like_a_normal_exit(runtime_dir, dataset, reap_daemons):
    fs, address, dram = autostarted(runtime_dir, dataset, reap_daemons)
    os.kill(address.pid, signal.SIGTERM)  # as Slurm and Kubernetes stop things
    wait_for(lambda: gone(address.pid), 20, what="the daemon to exit")
    assert not os.path.exists(os.path.join(runtime_dir, SOCKET))
    assert not os.path.exists(os.path.join(runtime_dir, REGISTRY))
    assert dram_blocks(dram) == []


@pytest.mark.timeout(90)
def test_stop_frees_a_dram_tier_with_a_directory_in_a_blocks_place(runtime_dir, dataset,
                                                                  reap_daemons):
    """A directory where a block file was (a hand, a tool): the stop still frees the tier,
    the directory included, and says so without an error."""
    fs, address, dram = autostarted(runtime_dir, dataset, reap_daemons)
    sub = sorted(d for d in os.listdir(dram) if len(d) == 2 and os.listdir(os.path.join(dram, d)))[0]
    block = os.path.join(dram, sub, os.listdir(os.path.join(dram, sub))[0])
    os.unlink(block)
    os.mkdir(block)
    with open(os.path.join(block, "inside"), "wb") as f:
        f.write(b"x")
    r = cli("stop", runtime_dir=runtime_dir)
    assert r.returncode == 0, r.stderr
    assert "stopped 1 daemon" in r.stdout, r.stdout
    wait_for(lambda: gone(address.pid), 20, what="the daemon to exit")
    assert dram_blocks(dram) == []
    assert not os.path.exists(block)


@pytest.mark.timeout(90)
def test_a_daemon_whose_runtime_dir_is_removed_exits_and_leaves_the_next_one_alone(
        runtime_dir, dataset, reap_daemons):
    """``rm -rf`` of the runtime dir under a running daemon (a reset of the cache): no tool
    could find that daemon any more, so it exits (within a second or so), and it leaves the
    socket and tiers made since in its place alone: the next reader's daemon serves on."""
    fs, address, dram = autostarted(runtime_dir, dataset, reap_daemons)
    # as `rm -rf` does: entries the daemon removes meanwhile (its blocks' directories) are
    # no error (rmtree raised FileNotFoundError for them, in about one run of four)
    wait_for(lambda: shutil.rmtree(runtime_dir, ignore_errors=True) or not os.path.exists(runtime_dir),
             10, what="the runtime dir to be removed")
    wait_for(lambda: gone(address.pid), 10, what="the orphaned daemon to exit")
    # reaped by the process that started it (this one), not left a zombie under it
    wait_for(lambda: process_state(address.pid) is None, 5, what="the daemon to be reaped")
    _, files = dataset
    paths = sorted(files)
    late = new_fs(runtime_dir)
    for p in paths[:3]:
        assert late.cat_file(p) == files[p]
    second = lookup(runtime_dir)
    assert second is not None and second.pid != address.pid
    assert os.path.exists(os.path.join(runtime_dir, SOCKET))
    r = cli("stop", runtime_dir=runtime_dir)
    assert r.returncode == 0 and "stopped 1 daemon" in r.stdout, (r.stdout, r.stderr)
    wait_for(lambda: gone(second.pid), 20, what="the second daemon to exit")
    assert service_procs(runtime_dir) == []


@pytest.mark.timeout(90)
def test_stop_finds_a_daemon_whose_socket_was_deleted(runtime_dir, dataset, reap_daemons):
    fs, address, dram = autostarted(runtime_dir, dataset, reap_daemons)
    os.unlink(os.path.join(runtime_dir, SOCKET))
    r = cli("stop", runtime_dir=runtime_dir)
    assert r.returncode == 0, r.stderr
    assert "stopped 1 daemon" in r.stdout, r.stdout
    wait_for(lambda: gone(address.pid), 20, what="the daemon to exit")
    assert dram_blocks(dram) == []
    assert not os.path.exists(os.path.join(runtime_dir, REGISTRY))


@pytest.mark.timeout(90)
def test_stop_with_runtime_dir_stops_a_live_autostarted_daemon(runtime_dir, dataset,
                                                               reap_daemons, tmp_path):
    fs, address, dram = autostarted(runtime_dir, dataset, reap_daemons)
    r = cli("--runtime-dir", runtime_dir, "stop", runtime_dir=str(tmp_path / "elsewhere"))
    assert r.returncode == 0, r.stderr
    assert "stopped 1 daemon" in r.stdout, r.stdout
    wait_for(lambda: gone(address.pid), 20, what="the daemon to exit")
    assert dram_blocks(dram) == []
    assert service_procs(runtime_dir) == []


@pytest.mark.timeout(60)
def test_a_hung_daemon_holds_a_reader_for_daemon_timeout(runtime_dir, spawn_daemon, dataset,
                                                        caplog):
    caplog.set_level(logging.WARNING, logger="cachemw")
    _, files = dataset
    paths = sorted(files)
    daemon = spawn_daemon(runtime_dir)
    fs = new_fs(runtime_dir, autostart=False, daemon_timeout=1)
    assert fs.client.timeout == 1
    for p in paths[:5]:
        assert fs.cat_file(p) == files[p]
    published(fs)
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: process_state(daemon.pid) == "T", 10, what="the daemon to stop")
        # misses: the daemon does not answer within 1 s; read from the source, counted
        for p in paths[5:]:
            assert fs.cat_file(p) == files[p]
        assert fs.stats()["fallbacks"] == nblocks(files, paths[5:])
        # a process that starts now is not held up by the handshake either
        late = new_fs(runtime_dir, autostart=False, daemon_timeout=1)
        for p in paths[5:8]:
            assert late.cat_file(p) == files[p]
        assert late.stats()["fallbacks"] == nblocks(files, paths[5:8])
        # its fills' leases, asked behind its reads (claims.py), found the daemon silent:
        # that is said at its next miss
        assert late.cat_file(paths[8]) == files[paths[8]]
        # hits are still read from the tier files
        assert late.cat_file(paths[0]) == files[paths[0]]
        # the first client's reads were not held up either (their leases come behind them,
        # from its fill writer, which waited daemon_timeout): its next miss says so
        assert fs.cat_file(paths[5]) == files[paths[5]]
        # status names the silent daemon, and does not say that none runs
        r = cli("status", runtime_dir=runtime_dir)
        assert r.returncode == 1 and f"pid {daemon.pid}" in r.stdout, (r.stdout, r.stderr)
        assert "does not answer" in r.stdout and "no cachemw daemon runs" not in r.stdout
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]  # once per client
    # the daemon is back: reads go through it again
    wait_for(fs.client.connected, 30, interval=0.2, what="the client to reconnect")
    before = fs.stats()["fallbacks"]
    for p in paths[5:]:
        assert fs.cat_file(p) == files[p]
    assert fs.stats()["fallbacks"] == before


@pytest.mark.timeout(60)
def test_a_daemon_at_work_is_not_taken_for_a_hung_one(make_cache_fs, tmp_path, gate, caplog):
    """A lease that waits on another process's fill for longer than daemon_timeout is not
    a silence: the daemon says "busy" meanwhile, and the reader gets the block cached."""
    import threading

    caplog.set_level(logging.WARNING, logger="cachemw")
    a = make_cache_fs(block_size=BS, daemon_timeout=0.5)
    b = make_cache_fs(block_size=BS, daemon_timeout=0.5)
    path = str(tmp_path / "f.bin")
    data = os.urandom(BS)
    with open(path, "wb") as f:
        f.write(data)
    assert a.cat_file(path) == data  # A's fill is held at the gate: its lease stays open
    opener = threading.Timer(2.0, gate.set)  # four times B's daemon_timeout
    opener.start()
    try:
        assert b.cat_file(path) == data  # B's lease waits for A's fill
    finally:
        opener.cancel()
        gate.set()
    assert b.stats()["fallbacks"] == 0 and b.stats()["hits"] == 1, b.stats()
    assert not [r for r in caplog.records if "unreachable" in r.getMessage()]


def test_daemon_timeout_option_and_env():
    from cachemw.config import CacheOptions

    assert CacheOptions.build(env={}).daemon_timeout == 5.0
    assert CacheOptions.build(env={"CACHEMW_DAEMON_TIMEOUT": "2.5"}).daemon_timeout == 2.5
    assert CacheOptions.build(env={"CACHEMW_DAEMON_TIMEOUT": "2.5"},
                              daemon_timeout=7).daemon_timeout == 7
    for bad in (0, -1, float("nan"), float("inf"), "5", True):
        with pytest.raises(ValueError, match="daemon_timeout"):
            CacheOptions.build(env={}, daemon_timeout=bad)
    with pytest.raises(ValueError, match="CACHEMW_DAEMON_TIMEOUT"):
        CacheOptions.build(env={"CACHEMW_DAEMON_TIMEOUT": "soon"})


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_stop_removes_the_daemons_checkpoint_copies(runtime_dir, dataset, reap_daemons,
                                                    tmp_path):
    torch = pytest.importorskip("torch")
    from cachemw.checkpoint import Checkpointer

    fs, address, dram = autostarted(runtime_dir, dataset, reap_daemons)
    root = tmp_path / "ckpt"
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    with Checkpointer(str(root)) as ck:
        assert ck.fast is not None and ck.fast.location.url.startswith(runtime_dir)
        ck.save(1, state).wait(60)
    copies = os.path.join(runtime_dir, "checkpoints")
    assert os.listdir(copies)
    r = cli("stop", runtime_dir=runtime_dir)
    assert r.returncode == 0, r.stderr
    assert "stopped 1 daemon" in r.stdout, r.stdout
    assert not os.path.exists(copies)
    with Checkpointer(str(root), fast_root=None) as ck:  # the durable copy is untouched
        out = {"w": torch.zeros(4096)}
        assert ck.load(out) == 1 and torch.equal(out["w"], state["w"])


@pytest.mark.timeout(90)
def test_closing_a_client_after_the_daemon_died_starts_no_daemon(runtime_dir, dataset,
                                                                 reap_daemons, caplog):
    """close() sends the client's last report (hits not yet reported); with the daemon gone
    it is dropped, quietly: no daemon is started just to receive it. The client, used
    again, starts one as any reader does."""
    _, files = dataset
    fs, first, _ = autostarted(runtime_dir, dataset, reap_daemons, n=4)
    for p in sorted(files)[:4]:  # hits: counted, reported later
        assert fs.cat_file(p) == files[p]
    assert fs.client._unsent["hits"] > 0
    os.kill(first.pid, signal.SIGKILL)
    wait_for(lambda: gone(first.pid), 10, what="the daemon to die")
    caplog.set_level(logging.DEBUG, logger="cachemw")
    caplog.clear()
    fs.client.close()
    assert service_procs(runtime_dir) == []
    address = lookup(runtime_dir)
    assert address is None or address.pid == first.pid
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    path = sorted(files)[5]  # a miss afterwards: a new daemon, as for any reader
    assert fs.cat_file(path) == files[path]
    published(fs)
    assert lookup(runtime_dir).pid != first.pid


@pytest.mark.timeout(30)
def test_a_daemon_of_the_first_release_names_no_features_in_its_hello(tmp_path):
    # its HELLO reply is ('ok', node_id, pid): a client then sends only what it knows of
    import socket
    import threading
    from multiprocessing.connection import Connection, deliver_challenge

    from cachemw import ops
    from cachemw.client import wire
    from cachemw.protocol import DaemonAddress

    path, secret = str(tmp_path / "s"), os.urandom(16).hex()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def old_daemon(reply):
        sock, _ = server.accept()
        conn = Connection(sock.detach())
        deliver_challenge(conn, bytes.fromhex(secret))
        assert conn.recv()[0] == ops.HELLO
        conn.send(reply)
        conn.close()

    address = DaemonAddress("node", os.getpid(), path, secret, (), str(tmp_path))
    try:
        for reply, features in ((("ok", "node", 1), frozenset()),
                                (("ok", "node", 1, list(ops.FEATURES)), frozenset(ops.FEATURES))):
            t = threading.Thread(target=old_daemon, args=(reply,))
            t.start()
            conn, got = wire.dial(address, 5.0)
            conn.close()
            t.join(5)
            assert got == features
    finally:
        server.close()


@pytest.mark.timeout(90)
def test_a_daemon_killed_while_it_starts_is_said_so_and_not_remembered(runtime_dir, reap_daemons):
    """A daemon killed during its start (kill -9, the OOM killer) is no fault of its
    settings: the starter says it was killed (not an older line of the log), records no
    failure, and the next start goes ahead at once."""
    import threading
    import time

    from cachemw.launch import FAILED, DaemonStartError, spawn_detached

    reap_daemons(runtime_dir)
    os.makedirs(runtime_dir, mode=0o700, exist_ok=True)
    with open(os.path.join(runtime_dir, "daemon.log"), "w") as f:
        f.write("2026-01-01 00:00:00,000 INFO __main__: an older daemon's last line\n")
    os.chmod(os.path.join(runtime_dir, "daemon.log"), 0o600)

    def killer(done):
        while not done.is_set():
            for proc in service_procs(runtime_dir):
                os.kill(proc.pid, signal.SIGKILL)
                return
            time.sleep(0.002)

    for _ in range(5):  # the daemon is killed as soon as it appears: at the latest, the 5th time
        done = threading.Event()
        t = threading.Thread(target=killer, args=(done,), daemon=True)
        t.start()
        try:
            address = spawn_detached(runtime_dir, wait=20)
            assert address is not None, "the daemon neither started nor failed within 20 s"
        except DaemonStartError as exc:
            err = exc
            break
        finally:
            done.set()
            t.join(5)
        assert cli("stop", runtime_dir=runtime_dir).returncode == 0  # it started first: again
        wait_for(lambda: gone(address.pid), 20, what="the daemon to exit")
    else:
        pytest.fail("the daemon finished its start before it could be killed, 5 times")
    assert "killed" in str(err) and "SIGKILL" in str(err), err
    assert "older daemon" not in str(err)
    assert not os.path.exists(os.path.join(runtime_dir, FAILED))
    address = spawn_detached(runtime_dir, wait=20)  # at once: nothing remembered
    assert address is not None and not gone(address.pid)
    r = cli("stop", runtime_dir=runtime_dir)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: gone(address.pid), 20, what="the daemon to exit")


@pytest.mark.timeout(90)
def test_a_hung_daemon_does_not_hold_a_large_announcement(runtime_dir, spawn_daemon, tmp_path):
    """An order too large for the socket's buffer, sent to a stopped daemon, fails after
    daemon_timeout with nothing taken (it was blocked for as long as the daemon was), and
    the AnnouncingSampler built on it yields its first index as soon."""
    src = tmp_path / "many"
    src.mkdir()
    paths = []
    for i in range(3000):
        p = src / f"f{i:04d}"
        p.write_bytes(b"x")
        paths.append(str(p))
    daemon = spawn_daemon(runtime_dir)
    fs = new_fs(runtime_dir, autostart=False, daemon_timeout=1)
    assert fs.cat_file(paths[0]) == b"x"
    assert fs.client.connected()
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: process_state(daemon.pid) == "T", 10, what="the daemon to stop")
        started = time.monotonic()
        assert fs.announce(paths) == 0
        # the send's timeout (daemon_timeout, once over the message's writes), not the stop
        assert time.monotonic() - started < 6
        from cachemw.torch import AnnouncingSampler
        started = time.monotonic()
        sampler = AnnouncingSampler(list(range(len(paths))), paths, fs=fs)
        assert next(iter(sampler)) == 0
        assert time.monotonic() - started < 4  # backing off: not asked again at once
        assert fs.cat_file(paths[1]) == b"x"  # read from the source meanwhile
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    wait_for(fs.client.connected, 30, interval=0.2, what="the client to reconnect")
    assert fs.cat_file(paths[2]) == b"x"


@pytest.mark.timeout(60)
def test_a_daemon_stopped_for_less_than_daemon_timeout_costs_no_fallback(runtime_dir, spawn_daemon,
                                                                        dataset, caplog):
    """A stop shorter than daemon_timeout is a silence it allows: a process whose first
    connection comes during the stop waits for it (a stopped daemon was unreachable at
    once, and the process read the source for the back-off)."""
    import threading

    caplog.set_level(logging.WARNING, logger="cachemw")
    _, files = dataset
    paths = sorted(files)
    daemon = spawn_daemon(runtime_dir)
    os.kill(daemon.pid, signal.SIGSTOP)
    resume = threading.Timer(0.8, os.kill, (daemon.pid, signal.SIGCONT))
    resume.start()
    try:
        wait_for(lambda: process_state(daemon.pid) == "T", 10, what="the daemon to stop")
        fs = new_fs(runtime_dir, autostart=False, daemon_timeout=4)
        for p in paths:
            assert fs.cat_file(p) == files[p]
        assert fs.stats()["fallbacks"] == 0
    finally:
        resume.join()
        os.kill(daemon.pid, signal.SIGCONT)
    assert not [r for r in caplog.records if "unreachable" in r.getMessage()]
