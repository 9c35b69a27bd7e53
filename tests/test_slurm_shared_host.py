"""Several Ray nodes on one host (ray.cluster_utils.Cluster; on Slurm, jobs side by side):
daemons that would share a directory fail before anything starts, with a message naming the
fix, and the per-job default runtime dir keeps two Slurm jobs of one user apart."""
from __future__ import annotations

import os

import pytest

from cachemw.config import DaemonConfig, default_runtime_dir, resolve_runtime_dir


def test_runtime_dir_default_is_per_slurm_job():
    uid = os.getuid()
    base = os.path.dirname(default_runtime_dir({}))
    assert default_runtime_dir({}) == os.path.join(base, f"cachemw-{uid}")
    one = resolve_runtime_dir(env={"SLURM_JOB_ID": "4242"})
    two = resolve_runtime_dir(env={"SLURM_JOB_ID": "4243"})
    assert one == os.path.join(base, f"cachemw-{uid}-job4242") and one != two
    # an explicit one still wins; a job id that is not a number is not put into a path
    assert resolve_runtime_dir(env={"SLURM_JOB_ID": "1", "CACHEMW_RUNTIME_DIR": "/x"}) == "/x"
    assert default_runtime_dir({"SLURM_JOB_ID": "../1"}) == default_runtime_dir({})
    config = DaemonConfig.build(env={"SLURM_JOB_ID": "4242"}, dram_capacity="1MiB")
    assert config.runtime_dir == one and config.tiers[0].path == os.path.join(one, "dram")


@pytest.fixture
def two_nodes():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        os.environ.pop(var, None)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="cachemw", log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.mark.ray
@pytest.mark.multinode
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nodes_sharing_a_host_need_node_ids_in_their_dirs(two_nodes, tmp_path, monkeypatch):
    from cachemw.cluster import actor as daemon

    shared = str(tmp_path / "rt")
    monkeypatch.setenv("CACHEMW_RUNTIME_DIR", shared)  # the default: no {node_id} in it
    with pytest.raises(ValueError) as info:
        daemon.start(two_nodes.address, dram_capacity="16MiB", timeout=60)
    message = str(info.value)
    assert "2 Ray nodes share host" in message and repr(shared) in message
    assert "{node_id" in message and "--runtime-dir" in message
    # nothing started: no daemon actor, nothing in the runtime dir
    assert daemon.status(two_nodes.address, runtime_dir=shared) == []
    assert not os.path.exists(shared) or os.listdir(shared) == []
    # an explicit tier dir shared by all nodes is named too, even with a per-node runtime dir
    with pytest.raises(ValueError, match="dram_dir"):
        daemon.start(two_nodes.address, runtime_dir=str(tmp_path / "{node_id:.16}"),
                     dram_dir=str(tmp_path / "dram"), dram_capacity="16MiB", timeout=60)
    assert daemon.status(two_nodes.address, runtime_dir=shared) == []
    # the fix the message names works: one daemon per node, each in its own directory
    try:
        out = daemon.start(two_nodes.address, runtime_dir=str(tmp_path / "{node_id:.16}"),
                           dram_capacity="16MiB", timeout=120)
        assert len(out) == 2 and len({a["socket"] for a in out}) == 2
    finally:
        daemon.stop(two_nodes.address, runtime_dir=shared, timeout=30)
