"""The Ray-managed daemon through the real CLI: start, status, stats, reads, stop."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CLI = [sys.executable, "-m", "cachemw.cli"]


def _cli(*args, env, timeout=240):
    return subprocess.run(CLI + list(args), env=env, capture_output=True, text=True,
                          timeout=timeout, cwd="/")


def _ray_procs(temp_dir_marker: str):
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir_marker in a for a in (p.info["cmdline"] or ())):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _gcs_clients(port: str):
    """Ray processes told to reach the GCS on ``port`` (the Ray client server names no temp
    dir and is no child of ours: it must go with the cluster all the same)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            args = p.info["cmdline"] or ()
            if any("ray" in a for a in args) and any(
                    a.startswith(("--address=", "--gcs-address=", "--gcs_address="))
                    and a.endswith(f":{port}") for a in args):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _local_ray_pids() -> set:
    """Every process of a local cluster cachemw started (any runtime dir), and Ray client
    servers."""
    pids = set()
    for p in psutil.process_iter(["cmdline"]):
        try:
            args = " ".join(p.info["cmdline"] or ())
            if "cachemw-ray-" in args or "ray.util.client.server" in args:
                pids.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


@pytest.mark.timeout(600)
def test_cli_start_status_read_stop(tmp_path, dataset):
    rt = tmp_path / "rt"
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=str(rt))
    env.pop("RAY_ADDRESS", None)
    root, files = dataset
    try:
        r = _cli("start", "--dram-capacity", "64MiB", "--nvme-dir", str(tmp_path / "nvme"),
                 "--nvme-capacity", "128MiB", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "daemon on node" in r.stdout
        # private runtime dir, socket and token
        assert (rt.stat().st_mode & 0o777) == 0o700
        assert ((rt / "daemon.sock").stat().st_mode & 0o777) == 0o600
        assert ((rt / "ray-token").stat().st_mode & 0o777) == 0o600
        state = json.loads((rt / "ray.json").read_text())
        assert state["started_by_cachemw"] and state["address"].startswith("127.0.0.1:")
        port = state["address"].rpartition(":")[2]
        # grpcio (a dev dependency, as in most ML environments) makes Ray start its client
        # server on the head: a process outside our temp dir that stop must end too
        servers = [p for p in _gcs_clients(port) if "ray.util.client.server" in p.cmdline()]
        assert [p.pid for p in servers] == [pid for pid, _ in state["strays"]]

        # idempotent: the same daemon, not a second one (nothing asked: not even the
        # session's CACHEMW_DRAM_CAPACITY, which start passes on as asked)
        r = _cli("start", env={k: v for k, v in env.items() if k != "CACHEMW_DRAM_CAPACITY"})
        assert r.returncode == 0, r.stderr
        r = _cli("status", "--json", env=env)
        assert r.returncode == 0, r.stderr
        nodes = json.loads(r.stdout)["nodes"]
        assert len(nodes) == 1
        tiers = nodes[0]["stats"]["tiers"]
        assert set(tiers) == {"dram", "nvme"} and tiers["dram"]["capacity_bytes"] == 64 << 20

        # a reader that is not a Ray process, with autostart off, uses the Ray daemon
        code = (
            "import fsspec, json, sys\n"
            "fs = fsspec.filesystem('cachemw', autostart=False)\n"
            f"files = json.loads({json.dumps(json.dumps(sorted(files)))})\n"
            "for _ in range(2):\n"
            "    for f in files: fs.cat_file(f)\n"
            "fs.client.flush()\n"
            "print(json.dumps(fs.stats()))\n"
        )
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        client = json.loads(r.stdout)
        assert client["misses"] == len(files) and client["hits"] == len(files)
        assert client["fallbacks"] == 0

        r = _cli("stats", "--json", env=env)
        assert r.returncode == 0, r.stderr
        stats = json.loads(r.stdout)
        assert stats["counters"]["misses"] == len(files)
        assert stats["counters"]["hits"] == len(files)
        assert stats["tiers"]["dram"]["blocks"] == len(files)
        r = _cli("stats", env=env)
        assert "hit ratio 50.0%" in r.stdout
        # top ended by SIGTERM (`timeout`, a job step's end) ends quietly: connected to Ray,
        # it wrote Ray's C++ stack dump to stderr (review ops5)
        top = subprocess.Popen(CLI + ["top", "--interval", "0.2"], env=env, cwd="/",
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert "1 node(s)" in top.stdout.readline()  # its first frame: Ray was looked into
            top.terminate()
            _, err = top.communicate(timeout=30)
        finally:
            top.kill()
            top.wait()
        assert top.returncode == 0 and "SIGTERM" not in err, err
        # a warm on 2 nodes at once while the cache cluster has 1: an error before any read
        # (a node warming only its share of a ring of 1 would leave half cold, or read all)
        r = _cli("warm", "--nodes", "2", "--ring-wait", "1", str(root), env=env)
        assert r.returncode == 2 and "has 1 node(s)" in r.stderr, r.stdout + r.stderr
    finally:
        r = _cli("stop", env=env)
    assert r.returncode == 0, r.stderr
    assert "stopped 1 daemon" in r.stdout
    assert not (rt / "daemon.json").exists() and not (rt / "ray-token").exists()
    assert _ray_procs(state["temp_dir"]) == []
    assert _gcs_clients(port) == []


@pytest.mark.timeout(300)
def test_a_start_that_fails_leaves_no_ray_behind(tmp_path):
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=str(tmp_path / "rt"))
    env.pop("RAY_ADDRESS", None)
    before = _local_ray_pids()
    r = _cli("start", "--dram-dir", "/proc/cachemw-cannot-be-here", env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    said = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(said) == 1 and "cannot start" in said[0] and "dram_dir" in said[0], r.stderr
    assert _local_ray_pids() <= before
    assert not (tmp_path / "rt" / "ray.json").exists() and not (tmp_path / "rt" / "ray-token").exists()


@pytest.mark.timeout(300)
def test_python_start_then_stop_in_one_process_stops_the_private_cluster_whole(tmp_path):
    """``cachemw.start()`` then ``cachemw.stop()`` in one process (README, Daemons): the
    stop found the process already in Ray, took that cluster for the driver's own, and
    left the private cluster's GCS, raylet and dashboard running, ray.json with them
    (review readme8)."""
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=str(tmp_path / "rt"))
    env.pop("RAY_ADDRESS", None)
    script = ("import json, os, cachemw\n"
              "cachemw.start(dram_capacity='64MiB')\n"
              "state = json.load(open(os.path.join(os.environ['CACHEMW_RUNTIME_DIR'], 'ray.json')))\n"
              "print(state['temp_dir'])\n"
              "print(cachemw.stop())\n")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=240, cwd="/")
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        temp_dir, stopped = r.stdout.split()[-2:]
        assert stopped == "1"
        assert not _ray_procs(temp_dir), [p.info["cmdline"] for p in _ray_procs(temp_dir)]
        assert not (tmp_path / "rt" / "ray.json").exists()
        assert not (tmp_path / "rt" / "ray-token").exists()
    finally:
        if (tmp_path / "rt" / "ray.json").exists():
            _cli("stop", env=env)


@pytest.mark.timeout(60)
def test_cli_errors(tmp_path):
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=str(tmp_path / "none"))
    r = _cli("stats", env=env)
    assert r.returncode == 1 and "no cachemw daemon answers" in r.stderr
    r = _cli("start", "--dram-capacity", "lots", env=env)
    assert r.returncode == 2 and "cannot parse size" in r.stderr
    r = _cli("start", "--nvme-dir", str(tmp_path), env=env)
    assert r.returncode == 2 and "nvme_capacity" in r.stderr
    r = _cli("start", "--peer-timeout", "-1", env=env)
    assert r.returncode == 2 and "peer_timeout" in r.stderr


def test_bad_peer_timeout_fails_before_anything_starts(tmp_path):
    from cachemw.cluster import actor as daemon

    for bad in (0, -1.0, "10", True, float("nan")):
        with pytest.raises(ValueError, match="peer_timeout"):
            daemon.start(runtime_dir=str(tmp_path / "rt"), peer_timeout=bad)


def test_a_library_s_own_error_is_one_line_and_an_interrupt_is_said(monkeypatch, capsys):
    """botocore's NoCredentialsError from `cachemw job --source s3://...` came out as three
    chained tracebacks; an error with no text printed an empty message."""
    import asyncio

    from cachemw import cli

    class NoCredentialsError(Exception):  # a library's own (not builtins, not cachemw's)
        pass

    for raised, said, code in ((NoCredentialsError("Unable to locate credentials"),
                                "cachemw bench: NoCredentialsError: Unable to locate credentials", 2),
                               (asyncio.TimeoutError(), "cachemw bench: TimeoutError", 2),
                               (KeyboardInterrupt(), "cachemw bench: interrupted", 130)):
        def fail(args, raised=raised):
            raise raised
        monkeypatch.setattr(cli, "cmd_bench", fail)
        assert cli.main(["bench"]) == code
        assert capsys.readouterr().err.strip() == said
