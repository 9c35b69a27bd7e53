"""Train through the node cache and checkpoint with the Checkpointer: the RayJob example.

Each sample is one file under ``--data`` (a ``cachemw::`` URL, e.g.
``cachemw::s3://bucket/train/``): 17 float32 values, 16 features and a target. Every Ray
Train worker reads its share through its own node's daemon (found by CACHEMW_RUNTIME_DIR,
no Ray on the read path) and the model is checkpointed to ``--checkpoints`` each epoch,
resumed from the newest committed step if one exists. ``--workers 0`` trains in this process
(no Ray), which is how a laptop checks it.
"""
from __future__ import annotations

import argparse

import fsspec
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from cachemw.checkpoint import CheckpointNotFoundError, Checkpointer

FEATURES = 16


class FileSamples(Dataset):
    """One sample per file, read through the filesystem of a ``cachemw::`` URL."""

    def __init__(self, url: str) -> None:
        self.fs, root = fsspec.core.url_to_fs(url)
        self.paths = sorted(p for p in self.fs.find(root) if not p.endswith("/"))
        if not self.paths:
            raise FileNotFoundError(f"no sample files under {url}")

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        row = np.frombuffer(self.fs.cat_file(self.paths[i]), dtype=np.float32)
        return torch.from_numpy(row[:FEATURES].copy()), torch.from_numpy(row[FEATURES:].copy())


def train_loop(config: dict) -> None:
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    data = FileSamples(config["data"])
    sampler = DistributedSampler(data) if dist else None
    loader = DataLoader(data, batch_size=config["batch_size"], sampler=sampler,
                        shuffle=sampler is None, num_workers=config["loader_workers"])
    model = torch.nn.Linear(FEATURES, 1)
    if dist:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    ck = Checkpointer(config["checkpoints"], keep_last=3)
    state = {"model": model, "optim": optim}
    try:
        start = ck.load(state) + 1
    except CheckpointNotFoundError:
        start = 0
    for epoch in range(start, config["epochs"]):
        if sampler is not None:
            sampler.set_epoch(epoch)
        total = 0.0
        for x, y in loader:
            optim.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optim.step()
            total += loss.item() * len(x)
        ck.save(epoch, state)  # returns after the snapshot; writes go on in the background
        print(f"epoch {epoch}: loss {total / len(data):.4f}", flush=True)
    ck.wait()
    ck.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True, help="cachemw::s3://bucket/train/")
    p.add_argument("--checkpoints", required=True, help="s3://bucket/runs/NAME/ckpt")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--loader-workers", type=int, default=2)
    p.add_argument("--workers", type=int, default=2, help="Ray Train workers (0: this process)")
    a = p.parse_args(argv)
    config = {"data": a.data, "checkpoints": a.checkpoints, "epochs": a.epochs,
              "batch_size": a.batch_size, "loader_workers": a.loader_workers}
    if a.workers == 0:
        train_loop(config)
        return
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(train_loop, train_loop_config=config,
                 scaling_config=ScalingConfig(num_workers=a.workers)).fit()


if __name__ == "__main__":
    main()
