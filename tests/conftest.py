"""Shared fixtures. Test helpers live here, never inside the package."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# Every test session gets its own runtime dir, so the daemon a test starts (embedded or
# Ray) never meets a user's real daemon or another session's.
_SESSION_DIR = tempfile.mkdtemp(prefix="cachemw-test-")
os.environ["CACHEMW_RUNTIME_DIR"] = os.path.join(_SESSION_DIR, "runtime")
os.environ.setdefault("CACHEMW_DRAM_CAPACITY", "2GiB")


@pytest.fixture(scope="session", autouse=True)
def _session_runtime():
    yield os.environ["CACHEMW_RUNTIME_DIR"]
    from cachemw.embedded import stop_embedded_daemon

    stop_embedded_daemon()
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    """A private runtime dir for one test (its own daemon, its own tiers)."""
    d = tmp_path / "runtime"
    monkeypatch.setenv("CACHEMW_RUNTIME_DIR", str(d))
    return str(d)


@pytest.fixture
def dataset(tmp_path):
    """A small source tree: 20 files of 3 KiB .. 200 KiB and one 3.5-block file."""
    import random

    rng = random.Random(1234)
    root = tmp_path / "source"
    root.mkdir()
    files = {}
    for i in range(20):
        data = rng.randbytes(rng.randint(3 * 1024, 200 * 1024))
        p = root / f"sample_{i:03d}.bin"
        p.write_bytes(data)
        files[str(p)] = data
    big = rng.randbytes(3 * 65536 + 1234)
    (root / "big.bin").write_bytes(big)
    files[str(root / "big.bin")] = big
    return root, files
