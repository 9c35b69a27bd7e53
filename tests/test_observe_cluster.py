"""`cachemw top` and the metrics endpoints of a 3-node simulated Ray cluster
(ray.cluster_utils.Cluster), one daemon per node, each serving metrics on a port of its own."""
from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.slow]

BLOCK = 64 * 1024


@pytest.mark.timeout(600)
def test_top_json_and_status_list_three_nodes_with_their_endpoints(cluster, tmp_path, make_tree,
                                                                   capsys):
    import fsspec
    import ray

    from cachemw import cli
    from cachemw.cluster import actor as daemon

    template = str(tmp_path / "{node_id:.16}")
    with pytest.raises(ValueError, match="would all serve metrics on port 9400"):
        daemon.start(cluster[0].address, runtime_dir=template, dram_capacity="16MiB",
                     metrics_port=9400)
    daemon.start(cluster[0].address, runtime_dir=template, dram_capacity="16MiB",
                 metrics_port=0, metrics_host="127.0.0.1", peer_timeout=3.0,
                 refresh_interval=0.5, timeout=120)
    head = ray.get_runtime_context().get_node_id()
    fs = fsspec.filesystem("cachemw", runtime_dir=template.format(node_id=head),
                           autostart=False, block_size=BLOCK, skip_instance_cache=True,
                           validate="immutable")
    files = make_tree([BLOCK] * 48, name="src")
    got = fs.cat(sorted(files))
    assert all(got[p] == files[p] for p in files)
    fs.client.flush()

    assert cli.main(["top", "--json", "--address", cluster[0].address, "--interval", "0.5"]) == 0
    report = json.loads(capsys.readouterr().out)
    nodes = report["nodes"]
    assert len(nodes) == 3 and all("error" not in n for n in nodes), nodes
    assert {n["node_id"] for n in nodes} == {x["NodeID"] for x in ray.nodes() if x["Alive"]}
    for n in nodes:
        assert n["tiers"]["dram"]["capacity_bytes"] == 16 << 20
        assert set(n["mb_per_s"]) == {"tier", "remote", "source"}
        assert n["checkpoints_in_flight"] == []
    assert sum(n["tiers"]["dram"]["blocks"] for n in nodes) == len(files)  # spread by owner
    urls = [n["metrics"] for n in nodes]
    assert len(set(urls)) == 3 and all(u.startswith("http://127.0.0.1:") for u in urls)

    assert cli.main(["status", "--address", cluster[0].address]) == 0
    out = capsys.readouterr().out
    assert all(f"metrics {u}" in out for u in urls), out
    blocks = 0
    for url in urls:  # each node's endpoint: its own blocks, a ring of 3
        fams = {f.name: f for f in text_string_to_metric_families(
            urllib.request.urlopen(url, timeout=10).read().decode())}
        assert fams["cachemw_ring_nodes"].samples[0].value == 3
        blocks += fams["cachemw_tier_blocks"].samples[0].value
    assert blocks == len(files)
