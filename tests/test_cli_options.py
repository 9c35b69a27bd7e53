"""The CLI's global options and environment reach every subcommand, and what it says (or
does not say) when something is off: a closed stdout, a refused runtime dir."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cachemw.protocol import lock_holder

CLI = [sys.executable, "-m", "cachemw.cli"]


def _cli(*args, env=None, timeout=60):
    return subprocess.run(CLI + list(args), env=env, capture_output=True, text=True,
                          timeout=timeout, cwd="/")


@pytest.mark.timeout(120)
def test_warm_warms_the_runtime_dir_given_not_the_environment_s(tmp_path, make_tree):
    """`cachemw --runtime-dir B warm DIR` warmed (and started a daemon in) the runtime dir
    CACHEMW_RUNTIME_DIR named, and said nothing."""
    make_tree([5000, 7000], name="data")
    env_dir, given = str(tmp_path / "env-rt"), str(tmp_path / "given-rt")
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=env_dir, CACHEMW_DRAM_CAPACITY="64MiB")
    try:
        r = _cli("--runtime-dir", given, "warm", "--quiet", str(tmp_path / "data"), env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert lock_holder(given) is not None, "no daemon in the runtime dir given"
        assert lock_holder(env_dir) is None, "a daemon in the environment's runtime dir"
        r = _cli("--runtime-dir", given, "stats", "--json", env=env)
        assert r.returncode == 0 and '"blocks": 2' in r.stdout, r.stdout + r.stderr
    finally:
        for d in (given, env_dir):
            _cli("--runtime-dir", d, "stop", env=env)


@pytest.mark.parametrize("command", ["job", "bench"])
def test_job_and_bench_refuse_a_runtime_dir_they_would_not_use(command, capsys):
    """Both run a daemon of their own in a fresh runtime dir (and remove it): the global
    option was silently ignored. Refused before anything runs."""
    from cachemw import cli

    assert cli.main(["--runtime-dir", "/dev/shm/cachemw-elsewhere", command]) == 2
    err = capsys.readouterr().err
    assert "--runtime-dir" in err and "without --runtime-dir" in err, err
