"""The public surface of cachemw.checkpoint as the README writes it: the names importable from
the package (Lightning only when its plug-in is asked for), quiet single-process save/load, the
README's examples run as written, and Lightning's usual calls on checkpoints its plug-in wrote."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402

import torch.distributed.checkpoint as dcp  # noqa: E402

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl
    except ImportError:
        pl = None

pytestmark = pytest.mark.torch

LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")


def run_python(code: str, tmp_path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that shows every warning and every log record."""
    script = tmp_path / "snippet.py"
    script.write_text(textwrap.dedent(code))
    env = dict(os.environ, PYTHONWARNINGS="always")
    return subprocess.run([sys.executable, "-W", "always", str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
def test_public_names_import_from_the_package_and_lightning_only_on_demand(tmp_path):
    proc = run_python(f"""
        import sys
        from cachemw.checkpoint import Checkpointer, save, load
        from cachemw.checkpoint import torch_like
        assert save is torch_like.save and load is torch_like.load
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in {LIGHTNING_PACKAGES!r})
        assert not heavy, f"importing cachemw.checkpoint imported {{heavy[:5]}}"
        from cachemw.checkpoint import CachemwCheckpointIO
        from pytorch_lightning.plugins.io import CheckpointIO
        assert isinstance(CachemwCheckpointIO, type) and issubclass(CachemwCheckpointIO, CheckpointIO)
        import cachemw.checkpoint as ck
        assert "CachemwCheckpointIO" in dir(ck) and "CachemwCheckpointIO" in ck.__all__
        print("imports ok")
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "imports ok" in proc.stdout


def test_unknown_attribute_of_the_package_is_an_attribute_error():
    import cachemw.checkpoint as ck

    with pytest.raises(AttributeError, match="no_such_name"):
        ck.no_such_name  # noqa: B018


