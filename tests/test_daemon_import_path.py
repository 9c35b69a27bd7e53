"""An autostarted daemon runs the cachemw of the process that starts it. ``python -m`` puts
the working directory first on the path: a reader started where a directory named cachemw
lies (a checkout of another version) had its daemon import that one, which failed, and
every read went to the source."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import cachemw

READER = r"""
import json, sys
import fsspec
fs = fsspec.filesystem("cachemw", target_protocol="file")
path = sys.argv[1]
ok = fs.cat_file(path) == open(path, "rb").read()
stats = fs.stats()
print(json.dumps({"ok": ok, "fallbacks": stats.get("fallbacks", 0), "misses": stats.get("misses", 0)}))
"""


@pytest.mark.timeout(120)
def test_a_reader_in_a_directory_holding_another_cachemw_gets_its_own_daemon(
        tmp_path, runtime_dir, reap_daemons):
    reap_daemons(runtime_dir)
    workdir = tmp_path / "work"
    (workdir / "cachemw" / "node").mkdir(parents=True)
    for init in (workdir / "cachemw" / "__init__.py", workdir / "cachemw" / "node" / "__init__.py"):
        init.write_text('raise SystemExit("the cachemw of the working directory was imported")\n')
    data = tmp_path / "sample.bin"
    data.write_bytes(os.urandom(100_000))
    parent = os.path.dirname(os.path.dirname(os.path.abspath(cachemw.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([parent, os.environ.get("PYTHONPATH", "")]))
    # the reader itself imports ours (-I would drop PYTHONPATH: the path is set explicitly)
    code = f"import sys; sys.path[:0] = [{parent!r}]\n" + READER
    r = subprocess.run([sys.executable, "-c", code, str(data)], cwd=workdir, env=env,
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"], out
    assert out["misses"] == 1 and out["fallbacks"] == 0, (out, r.stderr)
