"""Thin layers over the same machinery: torch.save-shaped save/load, Lightning CheckpointIO,
and a watcher in another process."""
from __future__ import annotations

import collections
import json
import time

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from cachemw.checkpoint import ChecksumError, torch_like  # noqa: E402
from cachemw.checkpoint.lightning_io import LIGHTNING_AVAILABLE, CachemwCheckpointIO  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]


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
    item = next(v for k, v in manifest["items"].items() if k.startswith("tensors.t0"))
    path = tmp_path / "c" / item["relative_path"]
    data = bytearray(path.read_bytes())
    data[item["offset"] + item["data_offset"]] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="tensors.t0"):
        torch_like.load(tmp_path / "c")


def test_checkpoint_io_plugin_without_a_trainer(tmp_path):
    io = CachemwCheckpointIO(compression="lz4")
    ckpt = lightning_like_checkpoint()
    io.save_checkpoint(ckpt, tmp_path / "epoch=3.ckpt")
    assert_same_checkpoint(ckpt, io.load_checkpoint(tmp_path / "epoch=3.ckpt"))
    io.remove_checkpoint(tmp_path / "epoch=3.ckpt")
    assert not (tmp_path / "epoch=3.ckpt").exists()
    with pytest.raises(ValueError, match="compression"):
        CachemwCheckpointIO(compression="gzip")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not LIGHTNING_AVAILABLE, reason="Lightning is not installed")
def test_checkpoint_io_plugin_in_a_lightning_trainer(tmp_path):
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, _):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8)), batch_size=8)
    trainer = pl.Trainer(max_epochs=2, default_root_dir=tmp_path, plugins=[CachemwCheckpointIO()],
                         logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    model = Tiny()
    trainer.fit(model, data)
    ckpt_path = trainer.checkpoint_callback.best_model_path or trainer.checkpoint_callback.last_model_path
    assert ckpt_path and (tmp_path / ckpt_path).exists()
    trainer2 = pl.Trainer(max_epochs=3, default_root_dir=tmp_path, plugins=[CachemwCheckpointIO()], logger=False,
                          enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    model2 = Tiny()
    trainer2.fit(model2, data, ckpt_path=ckpt_path)
    assert trainer2.current_epoch == 3


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
