"""Bad daemon settings fail fast, with the real message, once: a setting the calling process
can check is a ValueError naming it before anything is spawned; one only the daemon can find
(an unusable tier directory) reaches the reader from the daemon within its start, is logged
once per process, and is remembered so later processes do not respawn a doomed daemon.
Real processes: readers and the autostarted daemon they spawn."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import fsspec
import pytest

from cachemw.config import CacheOptions, DaemonConfig
from conftest import service_procs

CLI = [sys.executable, "-m", "cachemw.cli"]


def reader_code(path: str, **options) -> str:
    return (
        "import fsspec, json, logging\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        f"fs = fsspec.filesystem('cachemw', target_protocol='file', **{options!r})\n"
        f"for _ in range(3): data = fs.cat_file({path!r})\n"
        "print(json.dumps(dict(fs.stats(), n=len(data))), flush=True)\n"
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env_name,value,option", [
    ("CACHEMW_DRAM_CAPACITY", "abc", "dram_capacity"),
    ("CACHEMW_PLACEMENT", "bogus", "placement"),
    ("CACHEMW_NVME_CAPACITY", "1GiB", "nvme_dir"),
])
def test_a_bad_daemon_setting_in_the_environment_fails_at_once(runtime_dir, tmp_path, env_name,
                                                                value, option):
    (tmp_path / "f").write_bytes(b"x" * 1000)
    env = dict(os.environ, **{env_name: value})
    r = subprocess.run([sys.executable, "-c", reader_code(str(tmp_path / "f"))], env=env,
                       capture_output=True, text=True, timeout=15)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError") and option in last and (value in last or
                                                                  env_name in last), r.stderr
    assert "no daemon runs" not in r.stderr
    assert not os.path.exists(os.path.join(runtime_dir, "daemon.log"))  # nothing was spawned


@pytest.mark.parametrize("kwargs,match", [
    ({"dram_capacity": 0}, "dram_capacity"),
    ({"dram_capacity": "0"}, "dram_capacity"),
    ({"nvme_dir": "/tmp/x", "nvme_capacity": 0}, "nvme_capacity"),
    ({"runtime_dir": ""}, "runtime_dir"),
    ({"runtime_dir": "relative/dir"}, "runtime_dir"),
    ({"runtime_dir": "/tmp/" + "d" * 120}, "108"),
    ({"placement": "bogus"}, "placement"),
])
def test_daemon_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match) as exc:
        DaemonConfig.build(env={}, **kwargs)
    assert "25%" not in str(exc.value) or match == "dram_capacity"


def test_env_values_are_checked_like_keywords():
    with pytest.raises(ValueError, match="CACHEMW_DRAM_CAPACITY"):
        DaemonConfig.build(env={"CACHEMW_DRAM_CAPACITY": "0"})
    assert DaemonConfig.build(env={"CACHEMW_DRAM_CAPACITY": ""}).tiers[0].capacity > 0  # unset


@pytest.mark.parametrize("kwargs,match", [
    ({"ttl": math.nan}, "ttl"), ({"ttl": math.inf}, "ttl"), ({"ttl": -1}, "ttl"),
    ({"runtime_dir": ""}, "runtime_dir"), ({"runtime_dir": "rel"}, "runtime_dir"),
    ({"runtime_dir": "/tmp/" + "d" * 120}, "108"),
])
def test_cache_options_reject(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheOptions.build(env={}, **kwargs)
    with pytest.raises(ValueError, match=match):
        fsspec.filesystem("cachemw", skip_instance_cache=True, **kwargs)


@pytest.mark.parametrize("autostart", [False, True])
def test_a_reader_s_runtime_dir_template_is_an_error_naming_the_fix(tmp_path, monkeypatch,
                                                                   autostart):
    """`{node_id}` is filled in by the daemons `cachemw start` places, never by a reader:
    a reader given the template read everything from the source (autostart off) or
    started a daemon in a directory literally named `{node_id:.16}`."""
    template = str(tmp_path / "{node_id:.16}")
    with pytest.raises(ValueError, match=r"runtime_dir: .*\{node_id\}.*\.format\(node_id="):
        fsspec.filesystem("cachemw", runtime_dir=template, autostart=autostart,
                          skip_instance_cache=True)
    monkeypatch.setenv("CACHEMW_RUNTIME_DIR", template)  # `cachemw start`'s, as its error says
    with pytest.raises(ValueError, match="CACHEMW_RUNTIME_DIR"):
        fsspec.filesystem("cachemw", autostart=autostart, skip_instance_cache=True)
    assert os.listdir(tmp_path) == []  # no daemon, no directory named by the template
    resolved = template.format(node_id="0123456789abcdef0123")  # what a reader passes
    assert CacheOptions.build(env={}, runtime_dir=resolved).runtime_dir.endswith("0123456789abcdef")


def test_ttl_nan_from_the_environment_is_rejected():
    with pytest.raises(ValueError, match="CACHEMW_TTL"):
        CacheOptions.build(env={"CACHEMW_TTL": "nan"})


@pytest.mark.timeout(90)
def test_an_unusable_dram_dir_fails_fast_once_and_is_remembered(runtime_dir, tmp_path,
                                                                reap_daemons):
    reap_daemons(runtime_dir)
    f = tmp_path / "f"
    f.write_bytes(os.urandom(5000))
    options = {"daemon_options": {"dram_dir": "/proc/cachemw-nowhere/dram"}}
    outs = []
    for i in range(3):  # three processes one after the other (workers of a job)
        r = subprocess.run([sys.executable, "-c", reader_code(str(f), **options)],
                           capture_output=True, text=True, timeout=15)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["n"] == 5000 and out["fallbacks"] == 3 and out["hits"] == 0
        # the daemon's own message, once per process
        lines = [ln for ln in r.stderr.splitlines() if "/proc/cachemw-nowhere" in ln]
        assert len(lines) == 1, r.stderr
        assert "dram" in lines[0] and "no daemon runs" not in r.stderr
        outs.append(r.stderr)
    assert service_procs(runtime_dir) == []
    # the first process spawned the daemon that failed; the others were told by the record
    with open(os.path.join(runtime_dir, "daemon.log")) as log:
        starts = [ln for ln in log if "cannot start" in ln]
    assert len(starts) == 1, starts


_SMALL_TMPFS = """
import json, os, fsspec
from cachemw.config import DaemonConfig
from cachemw.launch import stop_local
from cachemw.client.fills import drain_all
from cachemw.client.link import DaemonClient
rt = os.path.join({mnt!r}, "rt")
out = {{"default": DaemonConfig.build(runtime_dir=rt).tiers[0].capacity}}
fs = fsspec.filesystem("cachemw", runtime_dir=rt, skip_instance_cache=True, block_size="1MiB")
src = {src!r}
names = sorted(os.listdir(src))
try:
    for _ in range(3):
        for name in names:
            with open(os.path.join(src, name), "rb") as f:
                assert fs.cat_file(os.path.join(src, name)) == f.read()
    drain_all(timeout=30)
    dram = DaemonClient(rt, autostart=False, timeout=10.0).daemon_stats()["tiers"]["dram"]
    out.update(admitting=dram["admitting"], used=dram["used_bytes"], hits=fs.stats()["hits"])
finally:
    stop_local(rt)
print(json.dumps(out))
"""


@pytest.mark.timeout(180)
def test_the_default_dram_tier_fits_a_small_dev_shm(tmp_path):
    """A container's /dev/shm is often far smaller than the machine's memory (Docker's and
    Kubernetes' 64 MiB): the default DRAM tier is at most half of its filesystem, and so
    keeps admitting. Sized at 25% of memory, it filled the tmpfs, ran out of space with
    nothing to evict (its used bytes under its capacity), and admitted nothing from then on
    (review ops6: a 10% hit ratio over three passes of a dataset twice the tier)."""
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounting a tmpfs in a mount namespace needs root and unshare")
    mnt, src = tmp_path / "shm", tmp_path / "src"
    mnt.mkdir()
    src.mkdir()
    for i in range(24):  # 48 MiB: more than the tier (16 MiB), less than the tmpfs
        (src / f"{i:02d}.bin").write_bytes(os.urandom(2 << 20))
    script = _SMALL_TMPFS.format(mnt=str(mnt), src=str(src))
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs -o size=32m tmpfs "{mnt}" && exec "{sys.executable}" -c "$0"', script],
        capture_output=True, text=True, timeout=150,
        env={k: v for k, v in os.environ.items() if k not in ("CACHEMW_RUNTIME_DIR",
                                                             "CACHEMW_DRAM_CAPACITY")})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["default"] == 16 << 20
    assert got["admitting"] and got["used"] <= 16 << 20 and "No space left" not in out.stderr
    assert got["hits"] >= 12  # what the tier holds (12-15 blocks) hit again
