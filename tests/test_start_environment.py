"""``cachemw start`` (and ``cachemw.start``) gives the daemons the CACHEMW_* settings of the
environment it runs in: a Ray actor's own environment is its raylet's, so with
``--address`` a ``CACHEMW_PLACEMENT=lru`` or ``CACHEMW_DRAM_CAPACITY=48MiB`` was checked by
the command and then dropped (the default placement, 25% of RAM), and a start again with
another ``CACHEMW_PLACEMENT`` returned 0 instead of naming the difference (review nodes3,
defect 2). Options given still win over the variables; ``--placement`` is an option too."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cachemw import cli
from cachemw.cluster import actor
from cachemw.config import daemon_environment


class _Handle:
    """A daemon actor as start() sees it: its address and settings, through ``.remote()``."""

    def __init__(self, node_id, options, running=None):
        self.node_id, self.options, self.running = node_id, options, running

    def _call(self, value):
        return type("Method", (), {"remote": staticmethod(lambda: value)})()

    @property
    def address(self):
        return self._call({"node_id": self.node_id, "tiers": []})

    @property
    def settings(self):
        return self._call(dict(self.running or {}, node_id=self.node_id))


class _Ray:
    """Ray as start() uses it: the nodes, and ray.get of what a fake handle returned."""

    def __init__(self, hosts):
        self.hosts = hosts

    def nodes(self):
        return [{"NodeID": n, "Alive": True, "NodeManagerAddress": h} for n, h in self.hosts.items()]

    @staticmethod
    def get(value, timeout=None):
        return value

    @staticmethod
    def kill(handle, no_restart=True):
        pass


@pytest.fixture
def placed(monkeypatch):
    """start() against a fake cluster of one node per host; returns the options each daemon
    was placed with (``placed.running``: the settings of daemons that already run)."""
    out = {}

    def place(node_id, options):
        out[node_id] = options
        return _Handle(node_id, options, out.get("running"))

    monkeypatch.setattr(actor, "connect", lambda *a, **k: {"address": "fake"})
    monkeypatch.setattr(actor, "_ray", lambda: _Ray(out.get("hosts") or {"n1": "h1"}))
    monkeypatch.setattr(actor, "place", place)
    monkeypatch.setattr(actor, "_daemon_handles",
                        lambda: {"n1": None} if out.get("running") else {})
    monkeypatch.setattr(actor, "lock_holder", lambda _: None)
    for var in ("CACHEMW_PLACEMENT", "CACHEMW_DRAM_CAPACITY", "CACHEMW_DRAM_DIR",
                "CACHEMW_NVME_DIR", "CACHEMW_NVME_CAPACITY", "CACHEMW_METRICS_PORT",
                "CACHEMW_METRICS_HOST", "CACHEMW_TRACE"):
        monkeypatch.delenv(var, raising=False)
    return out


def test_the_callers_variables_reach_every_daemon(placed, monkeypatch, tmp_path):
    monkeypatch.setenv("CACHEMW_PLACEMENT", "lru")
    monkeypatch.setenv("CACHEMW_DRAM_CAPACITY", "48MiB")
    monkeypatch.setenv("CACHEMW_METRICS_PORT", "0")
    monkeypatch.setenv("CACHEMW_METRICS_HOST", "")  # empty: unset
    actor.start("fake:1", runtime_dir=str(tmp_path / "rt"))
    options = placed["n1"]
    assert (options["placement"], options["dram_capacity"], options["metrics_port"]) == (
        "lru", "48MiB", 0)
    assert "metrics_host" not in options and "nvme_dir" not in options
    # an option given wins over the variable
    actor.start("fake:1", runtime_dir=str(tmp_path / "rt"), dram_capacity="64MiB",
                placement="pin")
    assert (placed["n1"]["placement"], placed["n1"]["dram_capacity"]) == ("pin", "64MiB")


def test_a_start_again_with_another_variable_names_the_difference(placed, monkeypatch, tmp_path):
    placed["running"] = {"placement": "lru", "dram_capacity": 48 << 20, "metrics_port": None}
    monkeypatch.setenv("CACHEMW_DRAM_CAPACITY", "48MiB")
    monkeypatch.setenv("CACHEMW_PLACEMENT", "lru")
    actor.start("fake:1", runtime_dir=str(tmp_path / "rt"))  # the same: a no-op
    monkeypatch.setenv("CACHEMW_PLACEMENT", "pin")
    with pytest.raises(RuntimeError, match=r"placement 'lru' \(asked: 'pin'\)"):
        actor.start("fake:1", runtime_dir=str(tmp_path / "rt"))
    monkeypatch.delenv("CACHEMW_PLACEMENT")
    monkeypatch.setenv("CACHEMW_DRAM_CAPACITY", "64MiB")
    with pytest.raises(RuntimeError, match=r"dram_capacity 48.0 MiB \(asked: 64.0 MiB\)"):
        actor.start("fake:1", runtime_dir=str(tmp_path / "rt"))


def test_a_shared_dir_from_the_environment_is_refused_naming_the_cli_s_options(
        placed, monkeypatch, tmp_path):
    """Nodes sharing a host: a CACHEMW_DRAM_DIR without {node_id} is one directory for all
    (it reached no daemon before, so it was not checked either); the fix named is the
    CLI's real spelling: --runtime-dir is a global option, not one of `start`'s."""
    placed["hosts"] = {"n1": "h", "n2": "h"}
    monkeypatch.setenv("CACHEMW_DRAM_DIR", "/dev/shm/cachemw-shared-dram")
    with pytest.raises(ValueError) as info:
        actor.start("fake:1", runtime_dir=str(tmp_path / "{node_id:.16}"))
    message = str(info.value)
    assert "dram_dir '/dev/shm/cachemw-shared-dram'" in message, message
    assert "`cachemw --runtime-dir DIR start --dram-dir DIR" in message, message
    assert "n1" not in placed and "n2" not in placed  # refused before any daemon is placed
    parsed = cli.build_parser().parse_args(["--runtime-dir", "/dev/shm/x", "start",
                                            "--dram-dir", "/d", "--nvme-dir", "/n"])
    assert (parsed.runtime_dir, parsed.dram_dir, parsed.nvme_dir) == ("/dev/shm/x", "/d", "/n")


def test_placement_is_an_option_of_the_cli(monkeypatch, capsys):
    asked = {}
    monkeypatch.setattr(cli.daemon, "start", lambda address, **kw: asked.update(kw) or [])
    assert cli.main(["--runtime-dir", "/dev/shm/cachemw-x", "start", "--address", "a:1",
                     "--placement", "lru"]) == 0
    assert asked["placement"] == "lru"
    with pytest.raises(SystemExit):
        cli.main(["start", "--placement", "bogus"])
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


def test_a_bad_variable_is_still_named(placed, monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="CACHEMW_METRICS_PORT"):
        daemon_environment({"CACHEMW_METRICS_PORT": "x"})
    monkeypatch.setenv("CACHEMW_PLACEMENT", "bogus")
    with pytest.raises(ValueError, match=r"CACHEMW_PLACEMENT \(placement\): must be one of"):
        actor.start("fake:1", runtime_dir=str(tmp_path / "rt"))
    assert "n1" not in placed


def _cli(*args, env, timeout=240):
    return subprocess.run([sys.executable, "-m", "cachemw.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd="/")


@pytest.mark.ray
@pytest.mark.multinode
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_start_on_a_cluster_runs_the_daemons_with_its_variables(cluster, tmp_path):
    import ray

    c, _ = cluster
    template = str(tmp_path / "{node_id:.16}")
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=template, CACHEMW_PLACEMENT="lru",
               CACHEMW_DRAM_CAPACITY="48MiB", PYTHONPATH=os.pathsep.join(sys.path))
    r = _cli("start", "--address", c.address, "--peer-timeout", "3", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        settings = [ray.get(ray.get_actor(actor.actor_name(n["NodeID"]),
                                          namespace=actor.NAMESPACE).settings.remote(),
                            timeout=60)
                    for n in ray.nodes() if n["Alive"]]
        assert len(settings) == 3
        assert all((s["placement"], s["dram_capacity"]) == ("lru", 48 << 20)
                   for s in settings), settings
        r = _cli("start", "--address", c.address, env=dict(env, CACHEMW_PLACEMENT="pin"))
        assert r.returncode == 2 and "placement 'lru' (asked: 'pin')" in r.stderr, r.stderr
        r = _cli("start", "--address", c.address, env=env)  # the same again: a no-op
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        _cli("stop", "--address", c.address, env=env, timeout=120)
