"""Shared fixtures. Test helpers live here, never inside the package."""
from __future__ import annotations

import os
import shutil
import tempfile
import threading

import pytest
from fsspec.implementations.local import LocalFileSystem

# Every test session gets its own runtime dir, so the daemon a test starts (autostarted or
# Ray) never meets a user's real daemon or another session's. A process the session spawns
# (a spawn DataLoader worker importing a test module) imports this file too: it inherits
# the session's dir and its environment as the test set it (a test's own runtime dir), and
# makes no dir of its own.
_SESSION_DIR = os.environ.get("TEST_CACHEMW_SESSION_DIR", "")
_MADE_SESSION_DIR = not os.path.isdir(_SESSION_DIR)  # this process made it: it removes it
if _MADE_SESSION_DIR:
    _SESSION_DIR = tempfile.mkdtemp(prefix="cachemw-test-")
    os.environ["TEST_CACHEMW_SESSION_DIR"] = _SESSION_DIR
    os.environ["CACHEMW_RUNTIME_DIR"] = os.path.join(_SESSION_DIR, "runtime")
    os.environ.setdefault("CACHEMW_DRAM_CAPACITY", "2GiB")


@pytest.fixture(scope="session", autouse=True)
def _session_runtime():
    """The session's daemon is stopped and its dir removed by the process that made the
    dir: a pytest run inside the session (a nested pytest, an xdist worker) inherits it
    and would otherwise stop the daemon and delete the dir under the outer session."""
    yield os.environ["CACHEMW_RUNTIME_DIR"]
    if not _MADE_SESSION_DIR:
        return
    from cachemw.launch import stop_local

    stop_local(os.environ["CACHEMW_RUNTIME_DIR"])
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    """A private runtime dir for one test (its own daemon, its own tiers)."""
    d = tmp_path / "runtime"
    monkeypatch.setenv("CACHEMW_RUNTIME_DIR", str(d))
    return str(d)


@pytest.fixture
def dataset(tmp_path):
    """A small source tree: 20 files of 3 KiB .. 200 KiB and one 3.5-block file."""
    import random

    rng = random.Random(1234)
    root = tmp_path / "source"
    root.mkdir()
    files = {}
    for i in range(20):
        data = rng.randbytes(rng.randint(3 * 1024, 200 * 1024))
        p = root / f"sample_{i:03d}.bin"
        p.write_bytes(data)
        files[str(p)] = data
    big = rng.randbytes(3 * 65536 + 1234)
    (root / "big.bin").write_bytes(big)
    files[str(root / "big.bin")] = big
    return root, files


@pytest.fixture
def make_tree(tmp_path):
    """Factory of random source trees: ``make_tree(sizes, name="src", seed=0,
    fmt="{i:04d}.bin")`` writes one file per entry of ``sizes`` (bytes from a RNG seeded
    with ``seed``) under ``tmp_path/name`` and returns ``{path: bytes}`` in file order."""
    import random

    def make(sizes, *, name: str = "src", seed: int = 0, fmt: str = "{i:04d}.bin") -> dict:
        rng = random.Random(seed)
        root = tmp_path / name
        root.mkdir(parents=True, exist_ok=True)
        out = {}
        for i, size in enumerate(sizes):
            data = rng.randbytes(size)
            path = root / fmt.format(i=i)
            path.write_bytes(data)
            out[str(path)] = data
        return out

    return make


# ---------------------------------------------------------------------------------------
# Helpers of the cache behaviour tests (tests/test_cache_*.py): a daemon in a separate
# process, a target filesystem that logs the calls it gets, and daemon stats over the socket.

_DAEMON_SCRIPT = r"""
import json, sys, time
from cachemw.config import DaemonConfig
from cachemw.node.service import NodeService
service = NodeService(DaemonConfig.build(**json.loads(sys.argv[1])))
print("ready", flush=True)
while True:
    time.sleep(3600)
"""


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout``."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def daemon_stats(runtime_dir: str, drain: bool = True) -> dict:
    """The stats of the daemon serving ``runtime_dir``, asked over its socket by a fresh client,
    once this process's fills written behind its reads have landed."""
    from cachemw.client.link import DaemonClient
    from cachemw.client.fills import drain_all

    if drain:
        drain_all(timeout=30)
    client = DaemonClient(runtime_dir, autostart=False, timeout=10.0)
    try:
        stats = client.daemon_stats()
    finally:
        client.close()
    assert stats is not None, f"no daemon answers for {runtime_dir}"
    return stats


@pytest.fixture
def gate(monkeypatch):
    """Hold every fill this process stages (its fill writer's) until ``gate.set()``."""
    from cachemw.tiers.directory import DirectoryTier

    held = threading.Event()
    real_stage = DirectoryTier.stage

    def stage(self, key, data, lease, tag=b""):
        if not held.wait(60):
            raise TimeoutError("test gate never opened")
        return real_stage(self, key, data, lease, tag=tag)

    monkeypatch.setattr(DirectoryTier, "stage", stage)
    yield held
    held.set()


def staged_files(tier, key: str) -> list[str]:
    """The fills of ``key`` staged in ``tier`` (whatever their lease), not yet published."""
    import glob

    return glob.glob(f"{glob.escape(tier.block_path(key))}.*.staged")


def published(fs) -> None:
    """Wait until the blocks this thread's reads through ``fs`` filled are published under
    their keys: its fill writer has sent every note, and a round trip over the same
    connection (the daemon reads each connection in order) has gone past them."""
    assert fs.reader.fills.drain(30)
    assert fs.client.ping()


@pytest.fixture
def spawn_daemon(tmp_path):
    """Start a real node daemon (cachemw.node.service.NodeService) in its own process.

    ``spawn_daemon(runtime_dir, **DaemonConfig.build kwargs)`` returns the Popen once the
    daemon has published its address. Every daemon still alive at teardown is SIGKILLed.
    """
    import json
    import subprocess
    import sys

    from cachemw.protocol import lookup

    procs = []

    def start(runtime_dir: str, **config):
        log = open(tmp_path / f"daemon-{len(procs)}.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-c", _DAEMON_SCRIPT, json.dumps(dict(runtime_dir=runtime_dir, **config))],
            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        log.close()
        procs.append(proc)

        def ready():
            if proc.poll() is not None:
                pytest.fail(f"daemon exited with {proc.returncode}: "
                            f"{(tmp_path / f'daemon-{len(procs) - 1}.log').read_text()}")
            address = lookup(runtime_dir)
            return address is not None and address.pid == proc.pid

        wait_for(ready, 30, what="the daemon to publish its address")
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


_call_depth = threading.local()


def _counted(name):
    base = getattr(LocalFileSystem, name)

    def method(self, *args, **kwargs):
        depth = getattr(_call_depth, "n", 0)
        if depth == 0:  # count what the caller asks, not the target's own inner calls
            with open(self.log_path, "a") as f:
                f.write(f"{name} {args[0] if args else ''}\n")
        _call_depth.n = depth + 1
        try:
            return base(self, *args, **kwargs)
        finally:
            _call_depth.n = depth

    method.__name__ = name
    return method


class CountingLocalFileSystem(LocalFileSystem):
    """A local filesystem that appends one line per outermost ``info``/``ls``/``cat_file``/
    ``_open`` call to a log file, so calls made from any process (forked or spawned
    workers) can be counted. Picklable: the log path is its storage option."""

    cachable = False

    def __init__(self, log_path: str, **kwargs):
        super().__init__(**kwargs)
        self.log_path = log_path

    info = _counted("info")
    ls = _counted("ls")
    cat_file = _counted("cat_file")
    _open = _counted("_open")

    def calls(self, name: str | None = None) -> list[str]:
        """The logged calls (``"op path"`` lines), of one op if given."""
        try:
            with open(self.log_path) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return []
        return [line for line in lines if name is None or line.split(" ", 1)[0] == name]

    def reset(self) -> None:
        open(self.log_path, "w").close()


@pytest.fixture
def counting_target(tmp_path):
    """A local target filesystem that counts the calls it gets (across processes)."""
    return CountingLocalFileSystem(str(tmp_path / "target-calls.log"))


@pytest.fixture
def make_cache_fs(runtime_dir, spawn_daemon):
    """A private daemon (own process, own runtime dir, default tiers) and a factory of
    ``cachemw`` filesystems bound to it: ``make_cache_fs(validate=..., fs=target, ...)``."""
    import fsspec

    started = []

    def make(**options):
        if not started:
            started.append(spawn_daemon(runtime_dir))
        if "fs" not in options:
            options.setdefault("target_protocol", "file")
        return fsspec.filesystem("cachemw", autostart=False, runtime_dir=runtime_dir,
                                 skip_instance_cache=True, **options)

    return make


@pytest.fixture(autouse=True)
def _checkpoints_without_a_daemon(request, tmp_path_factory, monkeypatch):
    """Checkpointer(fast_root="auto") lands saves in a running daemon's DRAM; the checkpoint
    tests pin the no-daemon case (an empty runtime dir) unless they are about the daemon."""
    name = request.node.module.__name__
    if name.startswith("test_checkpoint_") and name != "test_checkpoint_daemon_tier":
        monkeypatch.setenv("CACHEMW_RUNTIME_DIR", str(tmp_path_factory.mktemp("no-daemon")))


# ---------------------------------------------------------------------------------------
# A real S3 server on localhost (moto's, over HTTP), for tests against an object store.

S3_BUCKET = "cachemw-test"


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1 with one empty bucket; yields its endpoint and keys.

    ``s3_server["target_options"]`` are s3fs options that reach it; ``s3_server["boto3"]()``
    a boto3 client for writing behind the cache's back."""
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    creds = dict(aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1")

    def client():
        return boto3.client("s3", endpoint_url=endpoint, **creds)

    client().create_bucket(Bucket=S3_BUCKET)
    try:
        yield {
            "endpoint": endpoint,
            "bucket": S3_BUCKET,
            "boto3": client,
            "target_options": {"key": "testing", "secret": "testing",
                               "client_kwargs": {"endpoint_url": endpoint,
                                                 "region_name": "us-east-1"}},
        }
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------
# Daemon lifecycle helpers: autostarted daemons (`python -m cachemw.node.service`) found by their
# command line, so a test that kills, stops or hangs one leaves none behind.

def service_procs(runtime_dir: str) -> list:
    """The live (not zombie) daemon processes serving ``runtime_dir``."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = p.info["cmdline"] or ()
            if (p.info["status"] != psutil.STATUS_ZOMBIE and "cachemw.node.service" in cmd
                    and runtime_dir in cmd):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def gone(pid: int) -> bool:
    """Has process ``pid`` exited (a zombie not yet reaped by its parent counts as gone)?"""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def reap_daemons():
    """``reap_daemons(runtime_dir)`` registers a runtime dir; at teardown every daemon
    process still serving it is continued (if stopped) and killed."""
    import signal

    dirs = []
    yield dirs.append
    for d in dirs:
        for p in service_procs(d):
            try:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait(10)
            except Exception:
                pass


@pytest.fixture
def cluster(tmp_path):
    """A simulated 3-node Ray cluster on this machine (ray.cluster_utils.Cluster): the head
    and two added nodes, one CPU each; yields (cluster, the two added nodes). Daemons the
    test started on it are stopped before Ray is."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        os.environ.pop(var, None)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = [c.add_node(num_cpus=1) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="cachemw", log_to_driver=False)
    try:
        yield c, nodes
    finally:
        from cachemw.cluster import actor as daemon

        try:
            daemon.stop(c.address, runtime_dir=str(tmp_path / "unused"), timeout=10)
        except Exception:
            pass
        ray.shutdown()
        c.shutdown()
