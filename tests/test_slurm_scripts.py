"""The slurm/ scripts without Slurm: they parse (bash -n, shellcheck when installed), and the
job script's per-job layout (runtime dir, Ray temp dir, Ray ports) is the job's own."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

SLURM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "slurm")
SCRIPTS = sorted(os.path.join(SLURM, f) for f in os.listdir(SLURM) if f.endswith(".sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_script_parses(script):
    subprocess.run(["bash", "-n", script], check=True)
    if shutil.which("shellcheck"):
        out = subprocess.run(["shellcheck", script], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout


def _layout(job: str, **env) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CACHEMW_")}
    out = subprocess.run(
        ["bash", "-c", 'source "$1" && cachemw_job_layout "$2" && '
         'echo "$CACHEMW_RUNTIME_DIR|$CACHEMW_RAY_TMP|$CACHEMW_RAY_PORT_BASE|'
         '$(cachemw_ray_ports)"', "bash", os.path.join(SLURM, "cachemw-job.sh"), job],
        env=dict(clean, **env), capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr}
    runtime, tmp, base, ports = out.stdout.strip().split("|")
    return {"runtime": runtime, "tmp": tmp, "base": int(base), "ports": ports.split()}


def test_job_layout_is_per_job():
    uid = os.getuid()
    one, two = _layout("4242"), _layout("4243")
    assert one["runtime"] == f"/dev/shm/cachemw-{uid}-job4242"  # = config's per-job default
    assert one["tmp"] != two["tmp"] and one["runtime"] != two["runtime"]
    ports = {int(p.split("=")[1]) for p in one["ports"]} | {one["base"]}
    others = {int(p.split("=")[1]) for p in two["ports"]} | {two["base"]}
    assert min(ports) >= 10000 and max(ports) < 32768  # below the ephemeral range
    assert max(ports) - min(ports) < 100 and not ports & others
    assert not set(range(one["base"], one["base"] + 100)) & set(
        range(two["base"], two["base"] + 100))
    # the user's runtime dir and Ray temp dir are bases the job's id is added to (an
    # exported one made two jobs side by side share a daemon's dir, and both fail); a job
    # submitted from a job drops that job's id; the port base is the user's; a job id that
    # is not a number is refused
    mine = _layout("7", CACHEMW_RUNTIME_DIR="/dev/shm/x", CACHEMW_RAY_TMP="/tmp/r")
    assert (mine["runtime"], mine["tmp"]) == ("/dev/shm/x-job7", "/tmp/r-job7")
    chained = _layout("8", CACHEMW_RUNTIME_DIR=mine["runtime"], CACHEMW_RAY_TMP=mine["tmp"])
    assert (chained["runtime"], chained["tmp"]) == ("/dev/shm/x-job8", "/tmp/r-job8")
    slashed = _layout("9", CACHEMW_RUNTIME_DIR="/dev/shm/x-job7/", CACHEMW_RAY_TMP="/tmp/r//")
    assert (slashed["runtime"], slashed["tmp"]) == ("/dev/shm/x-job9", "/tmp/r-job9")
    for bad in ("rel/dir", "/", ""):
        if bad:
            assert "absolute" in _layout("9", CACHEMW_RUNTIME_DIR=bad)["error"], bad
    assert _layout("7", CACHEMW_RAY_PORT_BASE="20000")["base"] == 20000
    assert "must be a number" in _layout("7; rm -rf /")["error"]
