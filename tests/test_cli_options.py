"""The CLI's global options and environment reach every subcommand, and what it says (or
does not say) when something is off: a closed stdout, a refused runtime dir."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from cachemw.protocol import lock_holder

CLI = [sys.executable, "-m", "cachemw.cli"]


def _cli(*args, env=None, timeout=60):
    return subprocess.run(CLI + list(args), env=env, capture_output=True, text=True,
                          timeout=timeout, cwd="/")


@pytest.mark.timeout(120)
def test_warm_warms_the_runtime_dir_given_not_the_environment_s(tmp_path, make_tree):
    """`cachemw --runtime-dir B warm DIR` warmed (and started a daemon in) the runtime dir
    CACHEMW_RUNTIME_DIR named, and said nothing."""
    make_tree([5000, 7000], name="data")
    env_dir, given = str(tmp_path / "env-rt"), str(tmp_path / "given-rt")
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=env_dir, CACHEMW_DRAM_CAPACITY="64MiB")
    try:
        r = _cli("--runtime-dir", given, "warm", "--quiet", str(tmp_path / "data"), env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert lock_holder(given) is not None, "no daemon in the runtime dir given"
        assert lock_holder(env_dir) is None, "a daemon in the environment's runtime dir"
        r = _cli("--runtime-dir", given, "stats", "--json", env=env)
        assert r.returncode == 0 and '"blocks": 2' in r.stdout, r.stdout + r.stderr
    finally:
        for d in (given, env_dir):
            _cli("--runtime-dir", d, "stop", env=env)


@pytest.mark.parametrize("command", ["job", "bench"])
def test_job_and_bench_refuse_a_runtime_dir_they_would_not_use(command, capsys):
    """Both run a daemon of their own in a fresh runtime dir (and remove it): the global
    option was silently ignored. Refused before anything runs."""
    from cachemw import cli

    assert cli.main(["--runtime-dir", "/dev/shm/cachemw-elsewhere", command]) == 2
    err = capsys.readouterr().err
    assert "--runtime-dir" in err and "without --runtime-dir" in err, err


@pytest.fixture
def gcs_port():
    """A server where a Ray GCS would be that answers as a gRPC server does (an HTTP/2
    SETTINGS frame on a client's preface): RAY_ADDRESS is taken as answering."""
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                try:
                    conn.recv(64)
                    conn.sendall(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.shutdown(socket.SHUT_RDWR)
    listener.close()


def test_without_address_status_and_stop_reach_the_cluster_ray_address_names(
        tmp_path, monkeypatch, gcs_port):
    """connect() (status, top, stop) never read RAY_ADDRESS: with no cluster of `cachemw
    start`'s, it raised "no cachemw-managed Ray cluster runs" although one was named."""
    from cachemw.cluster import actor

    inits = []

    class Ray:  # ray.init only records where it was sent
        @staticmethod
        def is_initialized():
            return False

        @staticmethod
        def init(address, **_):
            inits.append(address)

    monkeypatch.delitem(sys.modules, "ray", raising=False)
    monkeypatch.setattr(actor, "_ray", lambda: Ray)
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{gcs_port}")
    state = actor.connect(None, str(tmp_path / "rt"))
    assert inits == [f"127.0.0.1:{gcs_port}"] and not state["started_by_cachemw"]
    # --address still wins over the variable
    actor.connect(f"localhost:{gcs_port}", str(tmp_path / "rt"))
    assert inits[-1] == f"localhost:{gcs_port}"
    # a stale variable is said at once (ray.init would retry for minutes), naming it
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(ConnectionError, match="RAY_ADDRESS=127.0.0.1:1"):
        actor.connect(None, str(tmp_path / "rt"))
    monkeypatch.setenv("RAY_ADDRESS", "")  # empty counts as unset
    with pytest.raises(ConnectionError, match="give --address"):
        actor.connect(None, str(tmp_path / "rt"))
    assert len(inits) == 2


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_status_top_and_stop_with_ray_address_set(tmp_path):
    """The reviewer's case: RAY_ADDRESS names a live cluster with daemons; status said no
    daemon runs, top showed no node, stop stopped none (exit 1)."""
    import json

    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from cachemw.cluster import actor

    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        os.environ.pop(var, None)
    rt = str(tmp_path / "rt")
    # the CLI's own runtime dir is another: its node-local fallback finds no daemon there
    env = dict(os.environ, RAY_ADDRESS="", CACHEMW_RUNTIME_DIR=str(tmp_path / "cli-rt"))
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        ray.init(address=c.address, namespace="cachemw", log_to_driver=False)
        assert len(actor.start(c.address, runtime_dir=rt, dram_capacity="64MiB")) == 1
        env["RAY_ADDRESS"] = c.address
        r = _cli("status", "--json", env=env)
        assert r.returncode == 0 and len(json.loads(r.stdout)["nodes"]) == 1, r.stdout + r.stderr
        r = _cli("top", "--json", "--interval", "0.2", env=env)
        assert r.returncode == 0 and len(json.loads(r.stdout)["nodes"]) == 1, r.stdout + r.stderr
        r = _cli("stop", env=env)
        assert r.returncode == 0 and "stopped 1 daemon" in r.stdout, r.stdout + r.stderr
    finally:
        try:
            actor.stop(c.address, runtime_dir=rt, timeout=10)
        finally:
            ray.shutdown()
            c.shutdown()


def _with_stdout_closed(*args, env):
    """Run the CLI with a stdout pipe whose reader has gone before it writes (`| head`)."""
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run(CLI + list(args), env=env, stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=60, cwd="/")
    finally:
        os.close(w)
    return proc


@pytest.mark.timeout(60)
def test_a_closed_stdout_ends_the_command_quietly(runtime_dir, spawn_daemon):
    """`cachemw stats --json | head -1` said "[Errno 32] Broken pipe" (exit 2)."""
    spawn_daemon(runtime_dir, dram_capacity="16MiB")
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=runtime_dir, RAY_ADDRESS="")
    for args in (["stats", "--json"], ["status", "--json"]):
        proc = _with_stdout_closed(*args, env=env)
        assert proc.returncode == 141 and proc.stderr == "", (args, proc.returncode, proc.stderr)


def test_a_refused_runtime_dir_is_said_alone(tmp_path):
    """status and stats said the refusal (as a reader's log line) and then "no cachemw
    daemon runs (start one ...)", which no start would fix."""
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=str(tmp_path / "link"), RAY_ADDRESS="")
    for args in (["status"], ["status", "--json"], ["stats"], ["top", "--json"]):
        r = _cli(*args, env=env)
        said = r.stderr.strip().splitlines()
        assert r.returncode == 2 and r.stdout == "" and len(said) == 1, (args, r.stdout, r.stderr)
        assert said[0].startswith(f"cachemw {args[0]}: {tmp_path / 'link'}: a symlink"), said
        assert "refusing to use it" in said[0] and "no cachemw daemon" not in said[0]
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)  # writable by other users: refused the same way
    r = _cli("stats", env=dict(env, CACHEMW_RUNTIME_DIR=str(tmp_path / "open")))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"cachemw stats: {tmp_path / 'open'}: writable by other users (mode 777); refusing to "
        f"use it (another user may have made it: remove it, or set another runtime_dir)"], r.stderr


@pytest.mark.timeout(60)
def test_start_with_a_trace_dir_that_cannot_take_files_fails_saying_so(tmp_path):
    """The daemons warned in their own logs and ran untraced; start exited 0 (review ops5)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=str(tmp_path / "rt"))
    r = _cli("start", "--trace", str(blocker / "traces"), env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "trace files cannot be written there" in r.stderr, r.stderr
    assert not (tmp_path / "rt" / "ray.json").exists()  # nothing was started
