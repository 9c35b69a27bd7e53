"""``cachemw warm --nodes N`` against a daemon that is no cluster (autostarted, or site
mode's node-local one): a cache of one node, so N > 1 given is refused (exit 2), as for a
Ray cluster of another size; a Slurm step's default (its node count) warms everything on
each node, said as such.

It read everything, said "(its share, 2 nodes)" and exited 0 (review ops2, defect 6)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cachemw import warm
from cachemw.client.wire import DaemonUnavailable
from cachemw.config import WarmConfig


class NoCluster:
    """A daemon's client with no ring: an autostarted or node-local daemon."""

    def ring(self, *, strict=False):
        return None


class SlowToAnswer:
    """A clustered daemon's client (two nodes) whose first ``misses`` ring requests time out."""

    def __init__(self, misses):
        self.misses = misses

    def ring(self, *, strict=False):
        if self.misses:
            self.misses -= 1
            if strict:
                raise DaemonUnavailable("timed out")
            return None
        return {"self": "a", "members": ["a", "b"], "alive": 2, "vnodes": 64}


def test_a_daemon_slow_to_answer_is_asked_again_not_taken_for_a_node_alone():
    """It was taken for a daemon of no cluster: --nodes 2 refused (exit 2), and a Slurm
    step's default warmed every block on each node."""
    step = {"SLURM_STEP_NUM_NODES": "2", "SLURM_LOCALID": "0"}
    for config in (WarmConfig.build(nodes=2, ring_wait=30, env={}),
                   WarmConfig.build(ring_wait=30, env=step)):
        share = warm.node_share(SlowToAnswer(2), config, poll=0.01)
        assert share.ring is not None and share.nodes == 2 and share.node == "a"
    with pytest.raises(warm.WarmError, match="did not answer"):
        warm.node_share(SlowToAnswer(10**6), WarmConfig.build(nodes=2, ring_wait=0.2, env={}),
                        poll=0.01)
    # one node: it reads everything whatever the ring, at once
    assert warm.node_share(SlowToAnswer(10**6), WarmConfig.build(nodes=1, env={})).ring is None


def test_nodes_given_against_a_daemon_of_one_node_is_refused():
    with pytest.raises(warm.WarmError, match=r"runs on 2 nodes at once, but the cache "
                                             r"cluster this node's daemon sees has 1 node"):
        warm.node_share(NoCluster(), WarmConfig.build(nodes=2, ring_wait=0, env={}))
    step = {"SLURM_STEP_NUM_NODES": "3", "SLURM_LOCALID": "0"}
    with pytest.raises(warm.WarmError, match="--nodes 1"):  # given, in a step too
        warm.node_share(NoCluster(), WarmConfig.build(nodes=3, ring_wait=0, env=step))
    # a step's default: each node warms everything for itself (site mode), as one node
    for config in (WarmConfig.build(ring_wait=0, env=step), WarmConfig.build(nodes=1, env={})):
        share = warm.node_share(NoCluster(), config)
        assert share.ring is None and share.nodes == 1


def _cli(*args, env):
    return subprocess.run([sys.executable, "-m", "cachemw.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.timeout(180)
def test_warm_on_more_nodes_than_an_autostarted_daemon_exits_2(runtime_dir, spawn_daemon,
                                                               make_tree, tmp_path):
    spawn_daemon(runtime_dir)
    make_tree([5000 + i for i in range(6)], name="data")
    data = str(tmp_path / "data")
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=runtime_dir)
    for var in ("SLURM_STEP_NUM_NODES", "SLURM_LOCALID"):
        env.pop(var, None)
    r = _cli("warm", "--nodes", "2", "--ring-wait", "1", data, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "has 1 node(s)" in r.stderr and "--nodes 1" in r.stderr, r.stderr
    assert "warmed" not in r.stdout
    # a two-node Slurm step's default, each node's daemon its own: all of it, said as one
    r = _cli("warm", data, env=dict(env, SLURM_STEP_NUM_NODES="2", SLURM_LOCALID="0"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warmed" in r.stdout and "in 6 blocks of 6 files in" in r.stdout, r.stdout
    assert "share" not in r.stdout, r.stdout
