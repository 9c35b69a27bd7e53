"""Two `cachemw start` at once on one runtime dir: one Ray cluster and one daemon come of
them, and `cachemw stop` stops it whole (cluster/local_ray.py serializes starts).

Before: each start made a private Ray cluster of its own; the one whose daemon lost the
runtime dir's lock failed (exit 2) and, cleaning up, deleted the winner's ray.json and
token, so that `cachemw stop` could reach neither the daemon nor its cluster, which ran on.
Real `cachemw start` processes; whatever they started is stopped in the end."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import psutil
import pytest

from cachemw.cluster import local_ray

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CLI = [sys.executable, "-m", "cachemw.cli"]


def _ray_dirs(runtime_dir: str) -> set[str]:
    """The temp dirs of the running local clusters started for ``runtime_dir`` (their
    processes have it in their environment: other clusters on the machine are not ours)."""
    out = set()
    for d in glob.glob(f"/tmp/cachemw-ray-{os.getuid()}-*"):
        for p in _procs_of(d):
            try:
                if p.environ().get("CACHEMW_RUNTIME_DIR") == runtime_dir:
                    out.add(d)
                    break
            except psutil.Error:
                continue
    return out


def _procs_of(temp_dir: str) -> list:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in a for a in (p.info["cmdline"] or ())):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.timeout(600)
def test_two_starts_at_once_make_one_cluster_that_stop_stops(tmp_path):
    rt = tmp_path / "rt"
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=str(rt))
    env.pop("RAY_ADDRESS", None)
    starts = []
    try:
        starts = [subprocess.Popen(CLI + ["start", "--dram-capacity", "64MiB"], env=env, cwd="/",
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                  for _ in range(2)]
        said = [p.communicate(timeout=300) for p in starts]
        codes = [p.returncode for p in starts]
        # the second finds the first's cluster (a no-op); or, asked in the moment before
        # the first took the start lock, it says so and touches nothing
        assert 0 in codes, said
        for code, (out, err) in zip(codes, said):
            assert code == 0 or "another `cachemw start`" in err, (code, out, err)
        assert (rt / "ray.json").exists() and (rt / "ray-token").exists()  # before: deleted
        made = _ray_dirs(str(rt))
        assert len(made) == 1, made  # one cluster
        r = subprocess.run(CLI + ["stop"], env=env, cwd="/", capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and "stopped 1 daemon" in r.stdout, r.stdout + r.stderr
        for d in made:
            assert _procs_of(d) == []
    finally:
        for p in starts:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        subprocess.run(CLI + ["stop"], env=env, cwd="/", capture_output=True, timeout=120)
        for d in _ray_dirs(str(rt)):  # whatever stop could not reach: by its temp dir
            local_ray.stop(os.path.join(d, "ray"))
