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


def test_single_process_save_and_load_emit_no_warning(tmp_path):
    from cachemw.checkpoint import load, save

    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        save({"w": torch.arange(6.0), "meta": {"epoch": 2}}, tmp_path / "c")
        back = load(tmp_path / "c")
        other = UserWarning("not DCP's: still shown")
        warnings.warn(other)
    assert [str(w.message) for w in seen] == [str(other)]  # only ours: the filter is scoped to the calls
    assert torch.equal(back["w"], torch.arange(6.0)) and back["meta"] == {"epoch": 2}
    assert warnings.filters == before


def test_dcp_warning_is_silenced_only_during_our_calls(tmp_path):
    from cachemw.checkpoint import save

    save({"w": torch.ones(2)}, tmp_path / "ours")
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)


def test_silencing_survives_catch_warnings_interleaved_from_another_thread():
    """The Checkpointer's worker thread silences DCP while the main thread may enter and leave
    ``catch_warnings`` (pytest does, around each test): the entry never outlives the call."""
    from cachemw.checkpoint.quiet import MESSAGE, single_process_dcp

    def ours(filters):
        return [f for f in filters if f[1] is not None and f[1].pattern == MESSAGE]

    before = list(warnings.filters)
    worker_call = single_process_dcp()
    worker_call.__enter__()                # worker: a DCP call starts
    main = warnings.catch_warnings()
    main.__enter__()                       # main thread: copies the filters, entry included
    assert ours(warnings.filters)
    worker_call.__exit__(None, None, None)  # worker: the call ends while main is inside
    assert not ours(warnings.filters)
    main.__exit__(None, None, None)        # main: restores the list it saved
    assert not ours(warnings.filters) and warnings.filters == before


@pytest.mark.timeout(120)
def test_single_process_save_load_and_checkpointer_print_nothing(tmp_path):
    """In a fresh process showing every warning and log record: stderr stays empty."""
    proc = run_python(f"""
        import logging
        import torch
        logging.basicConfig(level=logging.DEBUG)
        from cachemw.checkpoint import Checkpointer, load, save
        save({{"w": torch.ones(3)}}, "c")
        assert torch.equal(load("c")["w"], torch.ones(3))
        with Checkpointer("root", keep_last=1) as ck:
            ck.save(1, {{"w": torch.ones(3)}})
            ck.wait()
            state = {{"w": torch.zeros(3)}}
            assert ck.load(state) == 1 and torch.equal(state["w"], torch.ones(3))
        print("done")
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"
    assert proc.stderr == ""

