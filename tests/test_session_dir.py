"""The test session's dir (conftest.py): a pytest run inside the session inherits it
(TEST_CACHEMW_SESSION_DIR) and leaves its daemon and its removal to the process that
made it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def test_a_nested_pytest_leaves_the_session_dir_to_the_process_that_made_it(tmp_path):
    """A nested pytest (or an xdist worker) ran the session fixture's teardown too: it
    stopped the session's daemon and removed the dir under the session that made it."""
    session = os.environ["TEST_CACHEMW_SESSION_DIR"]
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text("def test_inner():\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                           "-p", "no:cacheprovider", str(tmp_path / "test_inner.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout
    assert os.path.isdir(session)
