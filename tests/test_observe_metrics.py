"""Prometheus metrics of a live daemon, scraped over HTTP and parsed with prometheus_client's
own parser; the README's table and the Grafana dashboard checked against what is served."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachemw.metrics import METRICS, exposed_names

from conftest import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "cachemw.json")


def _scrape(url: str) -> dict:
    """{family name: family} of one scrape (the daemon advertises its hostname; the test
    reaches it on loopback, where it listens too)."""
    host = url.split("//", 1)[1].split(":", 1)[0]
    text = urllib.request.urlopen(url.replace(host, "127.0.0.1", 1), timeout=10).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams: dict, name: str, **labels) -> float:
    """The sample ``name`` (as exposed) with exactly these labels."""
    for fam in fams.values():
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    raise KeyError(f"{name}{labels} not scraped")


@pytest.fixture
def metrics_fs(runtime_dir):
    import fsspec

    fs = fsspec.filesystem("cachemw", runtime_dir=runtime_dir, skip_instance_cache=True,
                           daemon_options={"metrics_port": 0, "dram_capacity": "64MiB"})
    yield fs
    from cachemw.launch import stop_local

    fs.client.close()
    stop_local(runtime_dir)


@pytest.mark.timeout(120)
def test_every_documented_metric_is_served_with_its_labels_and_moves_with_reads(
        metrics_fs, dataset):
    fs = metrics_fs
    _, files = dataset
    paths = sorted(files)
    for p in paths:  # epoch 1: misses
        assert fs.cat_file(p) == files[p]
    url = fs.client.daemon_stats()["metrics"]
    assert url and url.startswith("http://") and url.endswith("/metrics")
    first = _scrape(url)

    for m in METRICS:
        assert m.name in first, f"{m.name} not served"
        fam = first[m.name]
        assert fam.type == m.type, (m.name, fam.type)
        assert fam.samples, f"{m.name} has no sample"
        for s in fam.samples:
            assert s.name in exposed_names(m), (m.name, s.name)
            keys = set(s.labels) - ({"le"} if s.name.endswith("_bucket") else set())
            assert keys == set(m.labels), (s.name, s.labels, m.labels)
    assert set(first) == {m.name for m in METRICS}  # nothing undocumented
    blocks = len(files)  # each smaller than a block (8 MiB)
    assert _value(first, "cachemw_misses_total", via="fill") == blocks
    assert _value(first, "cachemw_source_reads_total") == blocks
    assert _value(first, "cachemw_miss_latency_seconds_count") == blocks
    assert _value(first, "cachemw_read_seconds_total", kind="source") > 0
    assert _value(first, "cachemw_read_bytes_total", origin="source") == sum(map(len, files.values()))
    assert _value(first, "cachemw_tier_used_bytes", tier="dram") > 0
    assert _value(first, "cachemw_tier_capacity_bytes", tier="dram") == 64 << 20

    for p in paths:  # epoch 2: hits
        assert fs.cat_file(p) == files[p]
    fs.client.daemon_stats()  # flushes this process's counters to the daemon
    second = _scrape(url)
    assert _value(second, "cachemw_hits_total") == _value(first, "cachemw_hits_total") + len(paths)
    assert _value(second, "cachemw_tier_hits_total", tier="dram") > _value(
        first, "cachemw_tier_hits_total", tier="dram")
    assert _value(second, "cachemw_read_seconds_total", kind="hit") > _value(
        first, "cachemw_read_seconds_total", kind="hit")
    assert _value(second, "cachemw_read_bytes_total", origin="tier") == _value(
        first, "cachemw_read_bytes_total", origin="tier") + sum(map(len, files.values()))
    assert _value(second, "cachemw_misses_total", via="fill") == blocks  # no new miss

    # a miss of a block another client is filling waits on the daemon's lease: lease_wait
    import threading
    import time

    from cachemw.client.link import DaemonClient
    from cachemw.keys import block_key

    extra = os.path.join(os.path.dirname(paths[0]), "extra.bin")
    with open(extra, "wb") as f:
        f.write(b"x" * 1000)
    meta = fs.meta.file(extra)
    key = block_key(meta.url, meta.version, 0, fs.options.block_size)
    other = DaemonClient(fs.options.runtime_dir, autostart=False)
    assert other.lease_many([(key, 1000, meta.url, None)])[0][0] == "fill"
    threading.Timer(0.3, other.abort, (key, "error")).start()  # it gives up: ours to fill
    started = time.monotonic()
    assert fs.cat_file(extra) == b"x" * 1000
    assert time.monotonic() - started >= 0.25
    fs.client.daemon_stats()
    third = _scrape(url)
    assert _value(third, "cachemw_read_seconds_total", kind="lease_wait") >= 0.25
    other.close()


@pytest.mark.timeout(60)
def test_status_advertises_the_endpoint(metrics_fs, runtime_dir):
    url = metrics_fs.client.daemon_stats()["metrics"]
    out = subprocess.run([sys.executable, "-m", "cachemw.cli", "--runtime-dir", runtime_dir,
                          "status"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"metrics {url}" in out.stdout


@pytest.mark.timeout(60)
def test_a_taken_port_fails_the_daemon_start_naming_it(tmp_path):
    import socket

    from cachemw.config import DaemonConfig
    from cachemw.node.service import NodeService

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        config = DaemonConfig.build(runtime_dir=str(tmp_path / "rt"), dram_capacity="16MiB",
                                    metrics_port=port, metrics_host="127.0.0.1")
        with pytest.raises(OSError, match=f"metrics_port: cannot listen on 127.0.0.1:{port}"):
            NodeService(config)
    service = NodeService(config)  # the lock was let go: the port free now, it starts
    service.close()
    # a host that is no address here is said as the host's fault, not the port's (review ops5)
    for host in ("999.1.1.1", "203.0.113.7"):
        config = DaemonConfig.build(runtime_dir=str(tmp_path / "rt"), dram_capacity="16MiB",
                                    metrics_port=0, metrics_host=host)
        with pytest.raises(OSError, match=f"metrics_host: '{host}' is no address of this"):
            NodeService(config)


def test_bad_metrics_options_are_named():
    from cachemw.config import DaemonConfig

    with pytest.raises(ValueError, match="metrics_port: must be a port number"):
        DaemonConfig.build(runtime_dir="/tmp/x", metrics_port=70000)
    with pytest.raises(ValueError, match=r"CACHEMW_METRICS_PORT \(metrics_port\): expected a port"):
        DaemonConfig.build(runtime_dir="/tmp/x", env={"CACHEMW_METRICS_PORT": "nine"})
    assert DaemonConfig.build(runtime_dir="/tmp/x", env={"CACHEMW_METRICS_PORT": "9400"}
                              ).metrics_port == 9400


def test_readme_documents_every_metric():
    """The README's metrics table is METRICS: name, type, labels, row for row."""
    text = open(os.path.join(ROOT, "README.md")).read()
    rows = re.findall(r"^\| `(cachemw_[a-z_]+)` \| (\w+) \| ([^|]*) \|", text, re.M)
    documented = {name: (kind, tuple(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}
    served = {}
    for m in METRICS:
        shown = m.name + ("_total" if m.type == "counter" else "")
        served[shown] = (m.type, m.labels)
    assert documented == served


def test_grafana_dashboard_uses_only_served_metrics(metrics_fs, dataset):
    _, files = dataset
    for p in sorted(files)[:3]:
        metrics_fs.cat_file(p)
    fams = _scrape(metrics_fs.client.daemon_stats()["metrics"])
    served = {s.name for f in fams.values() for s in f.samples}
    with open(DASHBOARD) as f:
        board = json.load(f)
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(board)
    assert len(exprs) >= 10
    used = {name for e in exprs for name in re.findall(r"\bcachemw_[a-z_]+", e)}
    assert used and used <= served, sorted(used - served)
    # every metric family appears on the board
    assert {m.name for m in METRICS} <= {n for u in used for m in METRICS
                                        for n in [m.name] if u in exposed_names(m)}


@pytest.mark.timeout(60)
def test_checkpoint_notes_reach_the_daemon_and_a_dead_trainers_save_leaves(metrics_fs,
                                                                           runtime_dir):
    from cachemw.node_daemon import note_checkpoint
    from cachemw.processes import process_start

    url = metrics_fs.client.daemon_stats()["metrics"]  # the daemon runs (autostarted)
    me = {"pid": os.getpid(), "start": process_start(os.getpid())}
    assert note_checkpoint(dict(me, event="begin", step=7, stall=0.02, root="/r"), runtime_dir)
    # a trainer that dies mid-save: its save is not in flight for ever
    code = ("import os, sys; from cachemw.node_daemon import note_checkpoint; "
            "from cachemw.processes import process_start; "
            "sys.exit(0 if note_checkpoint({'event': 'begin', 'pid': os.getpid(), "
            "'start': process_start(os.getpid()), 'step': 8, 'stall': 0.5}, sys.argv[1]) else 1)")
    subprocess.run([sys.executable, "-c", code, runtime_dir], check=True, timeout=60)
    ck = wait_for(lambda: (lambda s: s if s["stall_seconds"]["count"] == 2 else None)(
        metrics_fs.client.daemon_stats()["checkpoints"]), 10, what="both begin notes")
    assert [x["step"] for x in ck["in_flight"]] == [7]
    fams = _scrape(url)
    assert _value(fams, "cachemw_checkpoints_in_flight") == 1
    assert _value(fams, "cachemw_checkpoint_stall_seconds_count") == 2
    assert note_checkpoint(dict(me, event="end", step=7, ok=True, bytes=1000, durable=1.5),
                           runtime_dir)
    wait_for(lambda: metrics_fs.client.daemon_stats()["checkpoints"]["last_step"] == 7, 10,
             what="the end note")
    fams = _scrape(url)
    assert _value(fams, "cachemw_checkpoint_saves_total", result="ok") == 1
    assert _value(fams, "cachemw_checkpoint_bytes_total") == 1000
    assert _value(fams, "cachemw_checkpoint_durable_seconds_bucket", le="2.5") == 1
    assert _value(fams, "cachemw_checkpoint_durable_seconds_bucket", le="1.0") == 0
    assert _value(fams, "cachemw_checkpoint_last_step") == 7
    assert _value(fams, "cachemw_checkpoints_in_flight") == 0
    # no daemon: a note is not sent, and says so without raising
    assert not note_checkpoint(dict(me, event="begin", step=9), runtime_dir + "-none")


@pytest.mark.timeout(60)
def test_what_a_process_counted_reaches_the_daemon_while_it_is_idle(make_cache_fs, runtime_dir, make_tree):
    """Counts are reported twice a second, not only when the process reads again or exits:
    a trainer between epochs, or a reader that only missed, shows in stats and metrics."""
    from conftest import daemon_stats

    files = make_tree([20_000] * 6, seed=7)
    fs = make_cache_fs()
    for path, data in files.items():
        assert fs.cat_file(path) == data  # misses only: no hit to report them with
    path, data = next(iter(files.items()))
    with fs.open(path) as f:  # hits an open file counts on its own (mapped blocks)
        for at in (0, 4096, 8192):
            f.seek(at)
            assert f.read(100) == data[at:at + 100]
    # this thread now idles: nothing here flushes
    stats = wait_for(lambda: (s := daemon_stats(runtime_dir, drain=False)["counters"])["misses"]
                     == len(files) and s["hits"] >= 1 and s, 5,
                     what="the idle process's counts to be reported")
    assert stats["bytes_from_source"] == sum(len(d) for d in files.values())
