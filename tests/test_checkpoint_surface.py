"""The public surface of cachemw.checkpoint as the README writes it: the names importable from
the package (Lightning only when its plug-in is asked for), quiet single-process save/load, the
README's examples run as written, and Lightning's usual calls on checkpoints its plug-in wrote."""
from __future__ import annotations

import io as io_module
import os
import re
import struct
import subprocess
import sys
import textwrap
import warnings
import zipfile
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
    proc = run_python("""
        import logging
        import torch
        logging.basicConfig(level=logging.DEBUG)
        from cachemw.checkpoint import Checkpointer, load, save
        save({"w": torch.ones(3)}, "c")
        assert torch.equal(load("c")["w"], torch.ones(3))
        with Checkpointer("root", keep_last=1) as ck:
            ck.save(1, {"w": torch.ones(3)})
            ck.wait()
            state = {"w": torch.zeros(3)}
            assert ck.load(state) == 1 and torch.equal(state["w"], torch.ones(3))
        print("done")
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"
    assert proc.stderr == ""


def _readme_training_state():
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def _train_step(model, opt):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _run_readme_checkpointer_example(url: str) -> None:
    from cachemw.checkpoint import Checkpointer

    model, opt = _readme_training_state()
    # -- as in the README ------------------------------------------------------------------
    ck = Checkpointer(url, keep_last=3)
    for epoch, step in enumerate(range(0, 50, 10)):
        _train_step(model, opt)
        handle = ck.save(step, {"model": model, "optim": opt, "epoch": epoch})  # returns after the snapshot
    ck.wait()                     # every pending save durable
    # -- a fresh process would rebuild its state and load -----------------------------------
    model2, opt2 = _readme_training_state()
    state = {"model": model2, "optim": opt2, "epoch": 0}
    step = ck.load(state)         # newest committed step, loaded in place
    assert handle.durable and step == 40 and state["epoch"] == 4
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert opt2.state_dict()["state"][0]["momentum_buffer"].equal(opt.state_dict()["state"][0]["momentum_buffer"])
    assert ck.steps() == [20, 30, 40]  # keep_last=3
    ck.close()


def test_readme_checkpointer_example_on_a_path_runs_quietly(tmp_path):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _run_readme_checkpointer_example(str(tmp_path / "run-1" / "ckpt"))
    assert [str(w.message) for w in seen] == []


def readme_checkpointing_blocks() -> list[str]:
    """The ```python blocks of the README's Checkpointing section, verbatim."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("\n## Checkpointing\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.fixture
def aws_env(s3_server, monkeypatch):
    """``s3://bucket/...`` reaches the S3 server on localhost (moto) through the standard AWS
    environment variables, as it would reach a real store: the README's URLs work unchanged."""
    s3fs = pytest.importorskip("s3fs")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server["endpoint"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = s3_server["boto3"]()
    try:
        client.create_bucket(Bucket="bucket")
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    s3fs.S3FileSystem.clear_instance_cache()
    yield client
    s3fs.S3FileSystem.clear_instance_cache()


if pl is not None:
    from test_checkpoint_integrations import Tiny  # noqa: E402

    class ReadmeModel(Tiny):
        """The integration tests' tiny module, with its data (the README's fit(model))."""

        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(torch.randn(32, 8))
            return torch.utils.data.DataLoader(data, batch_size=8)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_checkpointing_examples_run_as_written(aws_env, tmp_path, monkeypatch):
    """Each block of the README's Checkpointing section, executed verbatim (its s3:// URLs on
    the local S3 server), with the names it leaves to the reader defined beforehand."""
    monkeypatch.chdir(tmp_path)  # Lightning's default root dir
    checkpointer, save_load, lightning = readme_checkpointing_blocks()

    model, opt = _readme_training_state()
    _train_step(model, opt)
    fresh, fresh_opt = _readme_training_state()
    ns = {"model": model, "opt": opt, "epoch": 3, "step": 120,
          "state": {"model": fresh, "optim": fresh_opt, "epoch": 0}}
    exec(checkpointer, ns)
    assert ns["step"] == 120 and ns["state"]["epoch"] == 3 and ns["handle"].durable
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert "momentum_buffer" in fresh_opt.state_dict()["state"][0]

    ns = {"model": model, "step": 120}
    exec(save_load, ns)
    assert ns["obj"]["step"] == 120
    assert all(torch.equal(v, ns["obj"]["model"][k]) for k, v in model.state_dict().items())
    keys = [o["Key"] for o in aws_env.list_objects_v2(Bucket="bucket", Prefix="run-1/")["Contents"]]
    assert "run-1/final/cachemw-manifest.json" in keys
    assert any(k.startswith("run-1/ckpt/step_") and k.endswith("/cachemw-manifest.json") for k in keys)

    if pl is None:
        pytest.skip("Lightning is not installed")
    from cachemw.checkpoint import CachemwCheckpointIO

    first = pl.Trainer(max_epochs=1, plugins=[CachemwCheckpointIO()], enable_progress_bar=False, logger=False,
                       default_root_dir=tmp_path / "first")
    first.fit(ReadmeModel(hidden=3))
    ns = {"Trainer": pl.Trainer, "Model": ReadmeModel, "model": ReadmeModel(hidden=3), "torch": torch,
          "path": first.checkpoint_callback.best_model_path}
    exec(lightning, ns)
    assert ns["trainer"].current_epoch == 2 and ns["trainer"].global_step == 8


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_lightning_plugin_checkpoint_on_s3_reads_with_the_usual_calls(aws_env):
    if pl is None:
        pytest.skip("Lightning is not installed")
    import fsspec

    from cachemw.checkpoint import CachemwCheckpointIO, ChecksumError

    io, url = CachemwCheckpointIO(), "s3://bucket/run-2/checkpoints/epoch=0-step=4.ckpt"
    model = ReadmeModel(hidden=3)
    io.save_checkpoint({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams),
                        "pytorch-lightning_version": pl.__version__}, url)
    keys = [o["Key"] for o in aws_env.list_objects_v2(Bucket="bucket", Prefix="run-2/")["Contents"]]
    assert keys == ["run-2/checkpoints/epoch=0-step=4.ckpt"]  # no temp object left
    loaded = ReadmeModel.load_from_checkpoint(url)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    with fsspec.open(url, "rb") as f:
        assert torch.load(f)["hyper_parameters"]["hidden"] == 3
    assert torch.equal(io.load_checkpoint(url)["state_dict"]["layer.0.weight"], model.layer[0].weight)

    body = bytearray(aws_env.get_object(Bucket="bucket", Key=keys[0])["Body"].read())
    with zipfile.ZipFile(io_module.BytesIO(bytes(body))) as archive:
        record = next(r for r in archive.infolist() if r.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack("<HH", body[record.header_offset + 26:record.header_offset + 30])
    body[record.header_offset + 30 + name_len + extra_len] ^= 0x01  # the first byte of a tensor
    with fsspec.open("s3://bucket/run-2/checkpoints/bad.ckpt", "wb") as f:
        f.write(bytes(body))
    with pytest.raises(ChecksumError, match=record.filename):
        io.load_checkpoint("s3://bucket/run-2/checkpoints/bad.ckpt")
    io.remove_checkpoint(url)
    assert "Contents" not in aws_env.list_objects_v2(Bucket="bucket", Prefix="run-2/checkpoints/epoch")


def test_lightning_plugin_saves_over_an_earlier_version_s_directory_on_s3(aws_env):
    """On an object store the new .ckpt object is written, then the old directory's keys
    (its manifest first) are removed: the object itself stays."""
    from cachemw.checkpoint import CachemwCheckpointIO, save

    url = "s3://bucket/run-3/last.ckpt"
    save({"epoch": 1, "w": torch.ones(3)}, url)  # what the plug-in used to write
    io = CachemwCheckpointIO()
    assert io.load_checkpoint(url)["epoch"] == 1
    io.save_checkpoint({"epoch": 2, "w": torch.zeros(3)}, url)
    keys = [o["Key"] for o in aws_env.list_objects_v2(Bucket="bucket", Prefix="run-3/")["Contents"]]
    assert keys == ["run-3/last.ckpt"]
    got = io.load_checkpoint(url)
    assert got["epoch"] == 2 and torch.equal(got["w"], torch.zeros(3))


def test_torch_style_save_over_a_torch_save_object_on_s3_replaces_it(aws_env):
    """An S3 key can be an object and a "directory" at once: the old torch.save object was
    left beside the new checkpoint, and torch.load of the URL read the old weights."""
    import fsspec

    from cachemw.checkpoint import load, save

    url = "s3://bucket/run-4/model.pt"
    with fsspec.open(url, "wb") as f:
        torch.save({"w": torch.zeros(3)}, f)
    with pytest.raises(NotADirectoryError, match="torch.load"):
        load(url)
    save({"w": torch.ones(3)}, url)
    keys = [o["Key"] for o in aws_env.list_objects_v2(Bucket="bucket", Prefix="run-4/")["Contents"]]
    assert "run-4/model.pt" not in keys and "run-4/model.pt/cachemw-manifest.json" in keys
    assert torch.equal(load(url)["w"], torch.ones(3))


def test_lightning_plugin_replacing_a_directory_on_s3_is_never_left_without_a_checkpoint(
        aws_env, monkeypatch):
    """The process killed just after the old directory's manifest went: the new file is at
    its name already (it was only staged beside it, and nothing at the name loaded)."""
    from cachemw.checkpoint import CachemwCheckpointIO, save
    from cachemw.checkpoint.storage_io import Location

    url = "s3://bucket/run-5/last.ckpt"
    save({"epoch": 1}, url)
    removing = Location.remove_file

    def killed_after(self, rel):
        removing(self, rel)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(Location, "remove_file", killed_after)
    io = CachemwCheckpointIO()
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"epoch": 2}, url)
    monkeypatch.setattr(Location, "remove_file", removing)
    assert io.load_checkpoint(url)["epoch"] == 2


_OVERWRITE = textwrap.dedent("""
    import sys, torch
    from cachemw.checkpoint import save
    obj = {"w": torch.full((4_000_000,), float(sys.argv[2])), "v": int(sys.argv[2])}
    print("saving", flush=True)
    save(obj, sys.argv[1])
""")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_save_over_a_checkpoint_killed_midway_leaves_one_whole_version(tmp_path):
    """``save(obj, path)`` over an existing checkpoint, the process killed at any moment:
    ``load(path)`` gives the old object or the new one, whole, never an error."""
    import signal
    import time

    from cachemw.checkpoint import load, save
    path = str(tmp_path / "final")
    save({"w": torch.full((4_000_000,), 1.0), "v": 1}, path)
    for delay in (0.0, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, None):
        proc = subprocess.Popen([sys.executable, "-c", _OVERWRITE, path, "2"],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline() == "saving\n"
            if delay is not None:
                time.sleep(delay)
                proc.send_signal(signal.SIGKILL)
            proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        obj = load(path)
        assert obj["v"] in (1, 2), delay
        assert torch.equal(obj["w"], torch.full((4_000_000,), float(obj["v"]))), delay
        if delay is None:  # not killed: the new one
            assert obj["v"] == 2
        save({"w": torch.full((4_000_000,), 1.0), "v": 1}, path)  # back to the old one
        # what a killed save left beside the path is swept by the next save
        assert [p.name for p in tmp_path.iterdir()] == ["final"]


def test_a_save_into_a_directory_with_other_files_keeps_them(tmp_path):
    """Only a checkpoint directory that holds nothing else is replaced whole: a save into a
    run directory with other files writes in place, as before, and keeps them; a link is
    saved through; a regular file there (a torch.save file) is replaced, as torch.save
    replaces it."""
    from cachemw.checkpoint import load, save
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    save({"x": torch.arange(4)}, str(run))
    save({"x": torch.arange(5)}, str(run))
    assert (run / "config.json").read_text() == "{}"
    assert torch.equal(load(str(run))["x"], torch.arange(5))
    real = tmp_path / "real"
    save({"x": torch.arange(6)}, str(real))
    (tmp_path / "latest").symlink_to(real)
    save({"x": torch.arange(7)}, str(tmp_path / "latest"))
    assert (tmp_path / "latest").is_symlink()
    assert torch.equal(load(str(real))["x"], torch.arange(7))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "real", "run"]
    (tmp_path / "model.pt").write_bytes(b"a torch.save file")
    save({"x": torch.arange(8)}, str(tmp_path / "model.pt"))
    assert torch.equal(load(str(tmp_path / "model.pt"))["x"], torch.arange(8))


def test_where_directories_cannot_be_swapped_the_old_one_is_set_aside_and_put_back(
        tmp_path, monkeypatch):
    """Without RENAME_EXCHANGE (NFS) the old checkpoint is set aside for two renames; a
    save killed between them leaves it beside the path, and a load or the next save puts
    it back."""
    import socket as socket_module

    import cachemw.checkpoint.torch_like as torch_like
    from cachemw.checkpoint import load, save
    monkeypatch.setattr(torch_like, "exchange", lambda a, b: False)
    path = tmp_path / "final"
    save({"v": 1}, str(path))
    save({"v": 2}, str(path))
    assert load(str(path))["v"] == 2 and [p.name for p in tmp_path.iterdir()] == ["final"]
    proc = subprocess.Popen(["true"])
    proc.wait()  # a pid that is gone: the killed save's
    host = re.sub(r"[^A-Za-z0-9_]", "_", socket_module.gethostname())
    os.rename(path, tmp_path / f"final.cachemw-old-{host}-{proc.pid}-0123abcd")
    assert load(str(path))["v"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["final"]


def test_a_damaged_metadata_file_is_a_checksum_error_never_a_wrong_tensor(tmp_path):
    """DCP's .metadata holds every tensor's shape: the manifest records its checksum, so a
    flipped bit there (which once loaded a tensor of another shape, padded with whatever
    memory held) is a ChecksumError; in a checkpoint of an earlier release, whose
    manifest has no such record, a .metadata that does not load is one too."""
    import json

    from cachemw.checkpoint import ChecksumError, load, save
    from cachemw.checkpoint.writer import MANIFEST_NAME, parse_manifest, seal_manifest

    path = tmp_path / "ck"
    w = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
    save({"w": w}, str(path))
    good = (path / ".metadata").read_bytes()
    size_at = good.find(b"M" + (4000).to_bytes(2, "little"))  # torch.Size([4000]): w's bytes
    assert size_at >= 0
    damaged = bytearray(good)
    damaged[size_at + 1] ^= 1  # 4001 bytes: unpickles fine
    (path / ".metadata").write_bytes(bytes(damaged))
    with pytest.raises(ChecksumError, match=r"\.metadata"):
        load(str(path))
    # an earlier checkpoint: no record of the .metadata in its manifest
    manifest = parse_manifest((path / MANIFEST_NAME).read_bytes(), "m")
    del manifest["metadata"]
    (path / MANIFEST_NAME).write_bytes(seal_manifest(manifest))
    (path / ".metadata").write_bytes(good[:len(good) // 2])
    with pytest.raises(ChecksumError, match=r"\.metadata"):
        load(str(path))
    (path / ".metadata").write_bytes(good)
    assert torch.equal(load(str(path))["w"], w)
    assert json.loads((path / MANIFEST_NAME).read_bytes())["format"]
