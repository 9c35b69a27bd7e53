"""Where a cachemw daemon runs, a Checkpointer's saves land first in the node's DRAM (the
daemon's runtime dir) and drain to root; with no daemon, they go straight to root."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402

from cachemw.checkpoint import Checkpointer  # noqa: E402
from cachemw.checkpoint.writer import MANIFEST_NAME  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]


def _committed(d):
    return sorted(p.name for p in d.iterdir() if (p / MANIFEST_NAME).exists()) if d.exists() else []


@pytest.mark.timeout(120)
def test_default_fast_root_is_the_daemons_dram(runtime_dir, spawn_daemon, tmp_path):
    spawn_daemon(runtime_dir)
    root = tmp_path / "root"
    state = {"w": torch.randn(256, 64), "step": 3}
    with Checkpointer(str(root)) as ck:
        assert ck.fast is not None
        fast_dir = ck.fast.location.url
        assert fast_dir.startswith(runtime_dir)
        handle = ck.save(3, state)
        handle.wait(60)
        assert handle.in_memory and handle.durable
        out = {"w": torch.zeros(256, 64), "step": 0}
        assert ck.load(out) == 3 and torch.equal(out["w"], state["w"]) and out["step"] == 3
    from pathlib import Path

    assert _committed(root) == _committed(Path(fast_dir)) != []
    for d in (Path(fast_dir), Path(fast_dir).parent):  # in the runtime dir: private as all of it
        assert d.stat().st_mode & 0o777 == 0o700, d


@pytest.mark.timeout(60)
def test_no_daemon_no_fast_tier(runtime_dir, tmp_path):
    with Checkpointer(str(tmp_path / "root")) as ck:
        assert ck.fast is None
        ck.save(1, {"x": torch.ones(4)}).wait(30)
    assert _committed(tmp_path / "root")
