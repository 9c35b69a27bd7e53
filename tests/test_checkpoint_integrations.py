"""Thin layers over the same machinery: torch.save-shaped save/load, Lightning CheckpointIO,
and a watcher in another process."""
from __future__ import annotations

import collections
import json
import os
import struct
import time
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from cachemw.checkpoint import ChecksumError, torch_like  # noqa: E402
from cachemw.checkpoint.lightning_io import LIGHTNING_AVAILABLE, CachemwCheckpointIO  # noqa: E402

pytestmark = pytest.mark.torch


def lightning_like_checkpoint():
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    return {"epoch": 3, "global_step": 120, "state_dict": model.state_dict(),
            "optimizer_states": [opt.state_dict()], "hyper_parameters": {"lr": 0.1, "layers": (16, 4)},
            "callbacks": collections.OrderedDict(ModelCheckpoint={"best": torch.tensor(0.25)})}


def assert_same_checkpoint(a, b):
    assert type(a["state_dict"]) is type(b["state_dict"])
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    assert a["optimizer_states"][0]["state"].keys() == b["optimizer_states"][0]["state"].keys()  # int keys kept
    assert a["hyper_parameters"] == b["hyper_parameters"] and a["epoch"] == b["epoch"]
    assert torch.equal(a["callbacks"]["ModelCheckpoint"]["best"], b["callbacks"]["ModelCheckpoint"]["best"])


@pytest.mark.parametrize("compression", [None, "lz4"])
def test_torch_like_save_load(tmp_path, compression):
    ckpt = lightning_like_checkpoint()
    torch_like.save(ckpt, tmp_path / "c", compression=compression)
    assert_same_checkpoint(ckpt, torch_like.load(tmp_path / "c"))
    torch_like.save({"x": torch.ones(2)}, tmp_path / "c")  # overwrite in place
    assert torch.equal(torch_like.load(tmp_path / "c")["x"], torch.ones(2))
    torch_like.save(torch.arange(4), tmp_path / "t")
    assert torch.equal(torch_like.load(tmp_path / "t"), torch.arange(4))


def test_torch_like_load_names_a_corrupted_chunk(tmp_path):
    torch_like.save({"x": torch.randn(1000)}, tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / "cachemw-manifest.json").read_text())
    item = next(v for k, v in manifest["items"].items() if k.startswith("tensors.s0"))
    path = tmp_path / "c" / item["relative_path"]
    data = bytearray(path.read_bytes())
    data[item["offset"] + item["data_offset"]] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="tensors.s0"):
        torch_like.load(tmp_path / "c")


def flip_a_byte_of_record(src, dst, record_suffix="/data/0"):
    """Copy the torch file ``src`` to ``dst`` with one byte of a tensor record's data flipped."""
    data = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as archive:
        record = next(r for r in archive.infolist() if r.filename.endswith(record_suffix))
    name_len, extra_len = struct.unpack("<HH", data[record.header_offset + 26:record.header_offset + 30])
    data[record.header_offset + 30 + name_len + extra_len + record.file_size // 2] ^= 0x10
    dst.write_bytes(bytes(data))
    return record.filename


def test_checkpoint_io_plugin_writes_a_torch_file_that_torch_load_reads(tmp_path):
    io = CachemwCheckpointIO()
    ckpt = lightning_like_checkpoint()
    io.save_checkpoint(ckpt, tmp_path / "sub" / "epoch=3.ckpt")
    path = tmp_path / "sub" / "epoch=3.ckpt"
    assert path.is_file() and os.listdir(tmp_path / "sub") == ["epoch=3.ckpt"]  # no temp file left
    assert_same_checkpoint(ckpt, torch.load(path, weights_only=False))
    assert_same_checkpoint(ckpt, io.load_checkpoint(path))
    assert io.load_checkpoint(path, map_location="cpu")["state_dict"]["weight"].device.type == "cpu"
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(ckpt, path, storage_options={"x": 1})
    io.remove_checkpoint(path)
    assert not path.exists()
    io.remove_checkpoint(path)  # already gone: nothing to do


def test_checkpoint_io_plugin_failed_overwrite_keeps_the_previous_checkpoint(tmp_path):
    """A save that fails midway leaves the committed file as it was and no partial one."""
    io = CachemwCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"w": torch.ones(1000)}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        io.save_checkpoint({"w": torch.zeros(1000), "z": Unpicklable()}, path)
    assert torch.equal(io.load_checkpoint(path)["w"], torch.ones(1000))
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_checkpoint_io_plugin_load_refuses_a_damaged_file_that_torch_load_takes(tmp_path):
    io = CachemwCheckpointIO()
    good, bad = tmp_path / "good.ckpt", tmp_path / "bad.ckpt"
    io.save_checkpoint({"w": torch.arange(1000.0)}, good)
    record = flip_a_byte_of_record(good, bad)
    assert not torch.equal(torch.load(bad)["w"], torch.arange(1000.0))  # torch.load does not check
    with pytest.raises(ChecksumError, match=record):
        io.load_checkpoint(bad)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(ChecksumError, match="not a whole"):
        io.load_checkpoint(truncated)


def test_checkpoint_io_plugin_load_refuses_central_directory_fields_crcs_do_not_cover(tmp_path):
    """A record's central-directory entry marked a directory (its MS-DOS attribute bit) made
    torch read uninitialised memory for the tensor, without an error; a compression method
    other than stored raised zlib.error."""
    io = CachemwCheckpointIO()
    path = tmp_path / "x.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.arange(6.0)}}, path)
    good = path.read_bytes()
    entries = [i for i in range(len(good)) if good.startswith(b"PK\x01\x02", i)]
    assert entries
    for entry in entries:
        for offset, bit in ((38, 0x10), (10, 0x01), (10, 0x08), (8, 0x01)):  # attr, method, flags
            damaged = bytearray(good)
            damaged[entry + offset] ^= bit
            path.write_bytes(bytes(damaged))
            try:
                got = io.load_checkpoint(path)
            except ChecksumError:
                continue
            assert torch.equal(got["state_dict"]["w"], torch.arange(6.0)), (entry, offset, bit)


def test_checkpoint_io_plugin_load_refuses_crafted_archives_and_reads_the_old_format(tmp_path):
    """A record name twice (the later bytes loaded), no record at all (a bare end record
    appended), bytes that merely start like a pickle: ChecksumError. A file in torch's
    pre-1.6 format still loads (unchecked, said in a warning)."""
    import io as io_module

    io = CachemwCheckpointIO()
    path = tmp_path / "x.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.arange(6.0)}}, path)
    good = path.read_bytes()
    with zipfile.ZipFile(io_module.BytesIO(good)) as archive:
        records = [(r, archive.read(r)) for r in archive.infolist()]
    twice = io_module.BytesIO()
    with zipfile.ZipFile(twice, "w", zipfile.ZIP_STORED) as out:
        for record, data in records:
            out.writestr(record, data)
        target = next(r for r, _ in records if r.filename.endswith("/data/0"))
        out.writestr(target, b"\0" * target.file_size)
    for damaged in (twice.getvalue(), good + b"PK\x05\x06" + b"\0" * 18,
                    b"\x80\x02" + os.urandom(200)):
        path.write_bytes(damaged)
        with pytest.raises(ChecksumError):
            io.load_checkpoint(path)
    torch.save({"epoch": 3}, path, _use_new_zipfile_serialization=False)
    assert io.load_checkpoint(path, weights_only=False)["epoch"] == 3


def test_checkpoint_io_plugin_load_says_checksum_error_for_any_damage(tmp_path):
    """Empty, cut to a few bytes, a flipped bit anywhere (the zip magic, a header, the
    central directory): a ChecksumError or the very checkpoint, never another error type
    (EOFError, a misleading weights_only UnpicklingError, NotImplementedError) nor other
    data."""
    io = CachemwCheckpointIO()
    good = tmp_path / "good.ckpt"
    state = {"state_dict": {"w": torch.randn(8)}, "epoch": 1}
    io.save_checkpoint(state, good)
    data = good.read_bytes()
    bad = tmp_path / "bad.ckpt"
    for damaged in (b"", data[:3]):
        bad.write_bytes(damaged)
        with pytest.raises(ChecksumError, match="not a whole"):
            io.load_checkpoint(bad)
    for at in range(0, len(data), 3):
        flipped = bytearray(data)
        flipped[at] ^= 1
        bad.write_bytes(bytes(flipped))
        try:
            got = io.load_checkpoint(bad)
        except ChecksumError:
            continue
        assert got["epoch"] == 1 and torch.equal(got["state_dict"]["w"], state["state_dict"]["w"]), at


def test_checkpoint_io_plugin_records_crc32s_even_when_torch_is_told_not_to(tmp_path):
    io = CachemwCheckpointIO()
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        io.save_checkpoint({"w": torch.arange(1000.0)}, tmp_path / "a.ckpt")
        assert torch.serialization.get_crc32_options() is False  # put back as it was
    finally:
        torch.serialization.set_crc32_options(previous)
    with zipfile.ZipFile(tmp_path / "a.ckpt") as archive:
        assert all(r.CRC != 0 for r in archive.infolist()) and archive.testzip() is None
    flip_a_byte_of_record(tmp_path / "a.ckpt", tmp_path / "b.ckpt")
    with pytest.raises(ChecksumError):
        io.load_checkpoint(tmp_path / "b.ckpt")


def test_checkpoint_io_plugin_reads_and_removes_directories_of_earlier_versions(tmp_path):
    ckpt = lightning_like_checkpoint()
    torch_like.save(ckpt, tmp_path / "epoch=1.ckpt")  # what the plug-in used to write
    io = CachemwCheckpointIO()
    assert_same_checkpoint(ckpt, io.load_checkpoint(tmp_path / "epoch=1.ckpt"))
    io.remove_checkpoint(tmp_path / "epoch=1.ckpt")
    assert not (tmp_path / "epoch=1.ckpt").exists()


@pytest.mark.parametrize("scheme", ["memory", "cachemw"])
def test_checkpoint_io_plugin_saves_over_an_earlier_directory_through_a_url(tmp_path, monkeypatch,
                                                                            scheme):
    """Through a filesystem that is not the local one but has directories (memory://,
    cachemw:: over a local path), the new file landed inside the old directory, whose
    manifest was gone: neither checkpoint loaded."""
    import fsspec

    if scheme == "memory":
        url = f"memory://run-{os.getpid()}-{tmp_path.name}/last.ckpt"
    else:
        monkeypatch.setenv("CACHEMW_AUTOSTART", "0")
        monkeypatch.setenv("CACHEMW_RUNTIME_DIR", str(tmp_path / "rt"))
        url = f"cachemw::file://{tmp_path}/last.ckpt"
    old, new = lightning_like_checkpoint(), lightning_like_checkpoint()
    new["epoch"] = 9
    torch_like.save(old, url)
    io = CachemwCheckpointIO()
    io.save_checkpoint(new, url)
    got = io.load_checkpoint(url)
    assert got["epoch"] == 9
    assert_same_checkpoint(new, got)
    fs, path = fsspec.core.url_to_fs(url)
    assert fs.isfile(path)
    assert [p for p in fs.ls(path.rpartition("/")[0], detail=False)
            if "cachemw-new" in p] == []


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "no-exchange"])
def test_checkpoint_io_plugin_saves_over_a_directory_of_an_earlier_version(tmp_path,
                                                                           monkeypatch, swap):
    """A save onto the name of an earlier version's checkpoint directory (a resumed run's
    last.ckpt) replaces it with the file, leaving nothing beside it; it failed with
    IsADirectoryError and left its full-size temp file."""
    import cachemw.checkpoint.lightning_io as lightning_io

    if not swap:  # a filesystem that cannot swap a file and a directory (NFS)
        monkeypatch.setattr(lightning_io, "exchange", lambda a, b: False)
    old, new = lightning_like_checkpoint(), lightning_like_checkpoint()
    new["epoch"] = 7
    torch_like.save(old, tmp_path / "last.ckpt")
    io = CachemwCheckpointIO()
    io.save_checkpoint(new, tmp_path / "last.ckpt")
    assert (tmp_path / "last.ckpt").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert_same_checkpoint(new, io.load_checkpoint(tmp_path / "last.ckpt"))
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["epoch"] == 7


if LIGHTNING_AVAILABLE:
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl

    class Tiny(pl.LightningModule):
        def __init__(self, hidden: int = 4):
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Linear(hidden, 1))

        def training_step(self, batch, _):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)


def tiny_trainer(root, max_epochs):
    return pl.Trainer(max_epochs=max_epochs, default_root_dir=root, plugins=[CachemwCheckpointIO()], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not LIGHTNING_AVAILABLE, reason="Lightning is not installed")
def test_lightning_usual_calls_read_what_the_plugin_saved(tmp_path):
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8)), batch_size=8)
    trainer = tiny_trainer(tmp_path, max_epochs=1)
    model = Tiny(hidden=3)
    trainer.fit(model, data)
    path = trainer.checkpoint_callback.best_model_path
    assert path.endswith(".ckpt") and os.path.isfile(path)

    loaded = Tiny.load_from_checkpoint(path)  # Lightning's own loader: a plain torch.load
    assert loaded.hparams.hidden == 3
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    raw = torch.load(path)
    assert raw["epoch"] == 0 and raw["global_step"] == 4 and raw["hyper_parameters"]["hidden"] == 3

    resumed = tiny_trainer(tmp_path, max_epochs=2)
    resumed.fit(Tiny(hidden=3), data, ckpt_path=path)  # through the plug-in's CRC-checked load
    assert resumed.current_epoch == 2 and resumed.global_step == 8
    ckpt_dir = os.path.dirname(resumed.checkpoint_callback.best_model_path)
    assert all(name.endswith(".ckpt") for name in os.listdir(ckpt_dir))  # no temp files left behind

    bad = tmp_path / "bad.ckpt"
    record = flip_a_byte_of_record(Path(path), bad)
    with pytest.raises(ChecksumError, match=record):
        tiny_trainer(tmp_path, max_epochs=2).fit(Tiny(hidden=3), data, ckpt_path=str(bad))


def _watch_consumer(root, fast_root, out):
    from cachemw.checkpoint import Checkpointer

    state = {"t": torch.zeros(100)}
    ck = Checkpointer(root, fast_root=fast_root)
    with open(out, "a") as f:
        f.write(json.dumps({"ready": True}) + "\n")
        f.flush()
        for step in ck.watch(state, poll_interval=60, timeout=60):
            f.write(json.dumps({"step": step, "value": state["t"][0].item(), "at": time.time()}) + "\n")
            f.flush()
            if step >= 2:
                return


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_watch_from_another_process_is_notified_through_the_fast_tier(tmp_path):
    from cachemw.checkpoint import Checkpointer

    root, fast, out = tmp_path / "root", tmp_path / "fast", tmp_path / "seen.jsonl"
    producer = Checkpointer(str(root), fast_root=str(fast))
    proc = mp.get_context("spawn").Process(target=_watch_consumer, args=(str(root), str(fast), str(out)))
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        committed = {}
        for step in (1, 2):
            handle = producer.save(step, {"t": torch.full((100,), float(step))})
            handle.wait_in_memory(60)
            committed[step] = time.time()
            handle.wait(60)
            time.sleep(0.5)
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        producer.close()
    seen = [json.loads(line) for line in out.read_text().splitlines()][1:]
    assert [(s["step"], s["value"]) for s in seen] == [(1, 1.0), (2, 2.0)]
    assert all(s["at"] - committed[s["step"]] < 10 for s in seen)  # not the 60 s fallback poll
