"""``cachemw bench``: a quick check of the node cache alone on local files (the main job,
a DLIO-style training on an emulated slow shared store, is ``cachemw job``, cachemw/job/).

Generates a synthetic dataset in a local directory standing for the PFS, then reads it for
several epochs through a torch DataLoader (default start method) twice: directly from the
source, and through ``cachemw::file://...``. Prints per-epoch time, samples/s and the
cache's hit ratio side by side. ``--pfs-latency-ms`` adds a per-request delay to the
source to stand in for a remote PFS or object store (0 = the raw local disk).

It runs in a private runtime dir with its own daemon (a process, as autostart makes it),
stopped and removed at the end, so it never disturbs (or is helped by) a daemon already
running on the node.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

from fsspec.implementations.local import LocalFileSystem

from .client.fs import CacheFileSystem
from .config_values import parse_size
from .launch import stop_local
from .report import format_stats


class SlowLocalFileSystem(LocalFileSystem):
    """A local filesystem with a fixed delay per data request: a stand-in for a PFS/S3."""

    protocol = "slowfile"

    def __init__(self, latency: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.latency = latency

    def cat_file(self, path, start=None, end=None, **kwargs):
        time.sleep(self.latency)
        return super().cat_file(path, start=start, end=end, **kwargs)


def add_arguments(p) -> None:
    p.add_argument("--files", type=int, default=2000, help="samples in the dataset")
    p.add_argument("--file-size", default="128KiB", help="bytes per sample")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="DataLoader num_workers")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--data-dir", default=None, help="where to generate the dataset "
                   "(default: a temporary directory, removed at the end)")
    p.add_argument("--pfs-latency-ms", type=float, default=0.0,
                   help="added delay per source request, to emulate a remote PFS")


def _dataset_cls():
    import numpy as np
    import torch.utils.data

    class FileDataset(torch.utils.data.Dataset):
        """Each sample is one file's bytes, read through the given fsspec filesystem."""

        def __init__(self, fs, paths):
            self.fs = fs
            self.paths = paths

        def __len__(self):
            return len(self.paths)

        def __getitem__(self, i):
            # a writable copy, as a decoder would make (torch warns on read-only arrays)
            return np.frombuffer(self.fs.cat_file(self.paths[i]), dtype=np.uint8).copy()

    return FileDataset


def _generate(data_dir: str, files: int, size: int) -> list[str]:
    os.makedirs(data_dir, exist_ok=True)
    paths = []
    for i in range(files):
        p = os.path.join(data_dir, f"sample_{i:06d}.bin")
        with open(p, "wb") as f:
            f.write(os.urandom(size))
        paths.append(p)
    return paths


def _epoch(loader) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for batch in loader:
        n += len(batch)
    return time.perf_counter() - t0, n


def main(args) -> int:
    import torch.utils.data

    size = parse_size(args.file_size, name="--file-size")
    work = tempfile.mkdtemp(prefix="cachemw-bench-")
    data_dir = args.data_dir or os.path.join(work, "pfs")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    runtime_dir = tempfile.mkdtemp(prefix="cachemw-bench-rt-", dir=shm)
    try:
        print(f"generating {args.files} files of {size} bytes in {data_dir} ...", flush=True)
        paths = _generate(data_dir, args.files, size)
        latency = args.pfs_latency_ms / 1000.0
        source = SlowLocalFileSystem(latency=latency)
        cached = CacheFileSystem(fs=source, runtime_dir=runtime_dir, validate="ttl",
                                 daemon_options={"dram_capacity": max(2 * size * args.files, 1 << 26)},
                                 skip_instance_cache=True)
        if not cached.client.connected():  # start the daemon before workers fork
            print("error: could not start the cache daemon", flush=True)
            return 1
        Dataset = _dataset_cls()

        def loader(fs):
            # each run lists the dataset first, as loaders do (DLIO: os.listdir): through
            # cachemw that listing is cached, and forked workers inherit it
            listed = sorted(fs.find(data_dir))
            if len(listed) != len(paths):
                raise RuntimeError(f"{data_dir}: listed {len(listed)} files, wrote {len(paths)}")
            return torch.utils.data.DataLoader(Dataset(fs, listed), batch_size=args.batch_size,
                                               shuffle=True, num_workers=args.workers)

        print(f"{args.epochs} epochs, DataLoader num_workers={args.workers}, batch "
              f"{args.batch_size}, source latency {args.pfs_latency_ms} ms/request\n", flush=True)
        print(f"{'epoch':>5} | {'direct s':>9} {'samples/s':>10} | {'cachemw s':>9} "
              f"{'samples/s':>10} {'hit ratio':>9} | {'speedup':>7}")
        totals = [0.0, 0.0]
        for epoch in range(1, args.epochs + 1):
            t_direct, n = _epoch(loader(source))
            before = cached.client.daemon_stats()["counters"]
            t_cache, n2 = _epoch(loader(cached))
            time.sleep(0.2)  # let the exiting workers' last access reports arrive
            after = cached.client.daemon_stats()["counters"]
            d = {k: after[k] - before[k] for k in ("hits", "misses", "fallbacks", "bypassed")}
            reads = sum(d.values())
            ratio = d["hits"] / reads if reads else 0.0
            totals[0] += t_direct
            totals[1] += t_cache
            print(f"{epoch:>5} | {t_direct:>9.2f} {n / t_direct:>10.0f} | {t_cache:>9.2f} "
                  f"{n2 / t_cache:>10.0f} {ratio:>9.1%} | {t_direct / t_cache:>6.2f}x", flush=True)
        print(f"{'all':>5} | {totals[0]:>9.2f} {'':>10} | {totals[1]:>9.2f} {'':>10} {'':>9} | "
              f"{totals[0] / totals[1]:>6.2f}x")
        stats = cached.client.daemon_stats()
        print("\n" + format_stats(stats))
        return 0
    finally:
        stop_local(runtime_dir)
        shutil.rmtree(runtime_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
