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


def _prolog(tmp_path, nvme_base, user: str = "nobody",
            template: str = "cachemw-%u") -> tuple[subprocess.CompletedProcess, str]:
    """Run the site-mode Prolog as Slurm does (as root, for ``user``'s job 4242), with a
    stand-in for cachemw that records its arguments; (the run, those arguments)."""
    said = tmp_path / "said"
    said.mkdir(mode=0o1777)
    said.chmod(0o1777)
    fake = tmp_path / "fake-cachemw"
    fake.write_text(f'#!/bin/sh\necho "$@" > {said}/args\n')
    fake.chmod(0o755)
    site = tmp_path / "site.env"
    site.write_text(f"CACHEMW_BIN={fake}\nCACHEMW_NVME_DIR={nvme_base}/{template}\n"
                    f"CACHEMW_NVME_CAPACITY=1GiB\n")
    env = {"PATH": os.environ["PATH"], "CACHEMW_SITE_ENV": str(site),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_USER": user, "SLURM_JOB_PARTITION": "p"}
    run = subprocess.run(["bash", os.path.join(SLURM, "prolog.sh")], env=env,
                         capture_output=True, text=True, timeout=60)
    args = (said / "args").read_text() if (said / "args").exists() else ""
    return run, args


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("runuser") or subprocess.run(
        ["id", "-u", "nobody"], capture_output=True).returncode != 0,
    reason="the Prolog runs as root and starts the daemon as the job's user (nobody here)")


@pytest.fixture
def open_dir():
    """A directory the job's user can reach (pytest's own is private to root)."""
    import tempfile
    from pathlib import Path

    path = tempfile.mkdtemp(prefix="cachemw-test-prolog-", dir="/tmp")
    os.chmod(path, 0o755)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def _planted(where, name: str):
    """A sticky scratch dir (``nvme``, 1777) where user nobody has put a symlink ``name``
    to a root directory (``victim``, 0755): (the scratch dir, the victim)."""
    base = where / "nvme"
    base.mkdir()
    base.chmod(0o1777)
    victim = where / "victim"
    victim.mkdir()
    victim.chmod(0o755)
    subprocess.run(["runuser", "-u", "nobody", "--", "ln", "-s", str(victim), str(base / name)],
                   check=True)
    return base, victim


@needs_root
@pytest.mark.timeout(120)
def test_the_prolog_never_follows_a_link_the_job_s_user_planted(open_dir):
    """As root it ran ``install -d -o USER`` on the NVMe path: where users can write the
    directory holding it (node-local scratch, 1777), a symlink at that name made its
    target (/etc, say) the user's (review ops5). Now root makes the directory only where
    nothing has the name; anything else there must be the user's own directory."""
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    tmp_path = open_dir
    base, victim = _planted(open_dir, "cachemw-nobody")
    run, args = _prolog(tmp_path, base)
    assert run.returncode == 0, run.stderr
    st = victim.stat()
    assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o755)  # untouched
    assert "--nvme-dir" not in args and "start" in args  # the job runs, without NVMe
    assert "not a directory of nobody's" in run.stderr

    (base / "cachemw-nobody").unlink()  # nothing at the name: made, the user's, 0700
    again = tmp_path / "again"
    again.mkdir()
    run, args = _prolog(again, base)
    made = base / "cachemw-nobody"
    st = os.lstat(made)
    assert os.path.isdir(made) and not os.path.islink(made)
    assert (st.st_uid, st.st_mode & 0o777) == (nobody, 0o700)
    assert f"--nvme-dir {made} --nvme-capacity 1GiB" in args, args


@needs_root
@pytest.mark.timeout(120)
def test_the_prolog_never_acts_through_a_parent_the_user_made(open_dir):
    """``/base/%u/cachemw`` (as the job script's example has it): a symlink the user put
    at ``/base/USER`` made root create a directory of the user's wherever it pointed; a
    trailing slash made ``chown -h`` follow a link swapped in for root's new directory
    (diffrev-7). Where the user can write, the user makes the directory."""
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    base, victim = _planted(open_dir, "nobody")
    run, args = _prolog(open_dir, base, template="%u/cachemw/")
    assert run.returncode == 0, run.stderr
    assert not (victim / "cachemw").exists() or (victim / "cachemw").stat().st_uid == nobody
    assert os.stat(victim).st_uid == 0
    # a plain per-user dir in a sticky scratch dir: made by the user, with a trailing slash too
    (base / "nobody").unlink()
    again = open_dir / "again"
    again.mkdir()
    run, args = _prolog(again, base, template="cachemw-%u/")
    made = base / "cachemw-nobody"
    assert os.lstat(made).st_uid == nobody and not os.path.islink(made)
    assert f"--nvme-dir {made} " in args, args
