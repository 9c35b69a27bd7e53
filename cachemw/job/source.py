"""Where the job's dataset and checkpoints live: the emulated store, a directory, or any
fsspec URL (``--source``), and the dataset generated there, DLIO-style.

The dataset is ``num_files_train`` files named as DLIO names them
(``{file_prefix}_{i}_of_{n}.bin``), each ``num_samples_per_file`` records of that file's
record length (DLIO's ``dataset.record_length``, drawn around it with
``record_length_stdev``), random bytes from the workload's seed: the same files on
every run, so a dataset left in a ``--source`` directory is found complete and reused.

Checkpoints on a ``--source`` go to a directory of the run's own under
``<source>/cachemw-job/checkpoints/`` (``with_run_dir``), removed after the run: two jobs on
one store (two nodes, two users) never write or delete each other's. Each is marked with
its job (owners.py), and a job removes the directories of this host's jobs that are gone
without their cleanup (``sweep_runs``).
"""
from __future__ import annotations

import dataclasses
import os
import posixpath
import secrets
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem
import numpy as np

from . import owners
from .workload import Workload

JOB_DIR = "cachemw-job"  # under a --source: the job's datasets and (while it runs) checkpoints


@dataclasses.dataclass(frozen=True)
class Source:
    """A store as the job reads and writes it."""

    protocol: str  # the target filesystem's protocol ("http", "file", "s3", ...)
    options: dict  # its storage options
    train_dir: str  # the dataset's directory, as a path of that filesystem
    checkpoint_root: str  # a URL (or local path) checkpoints are written under
    description: str

    def fs(self):
        return fsspec.filesystem(self.protocol, **self.options)


def file_sizes(workload: Workload) -> dict[str, int]:
    """Every dataset file's name and size, from the workload alone (deterministic)."""
    n = workload.num_files_train
    rng = np.random.default_rng(workload.seed)
    width = len(str(n - 1))
    out = {}
    for i in range(n):
        rec = workload.record_length_bytes
        if workload.record_length_bytes_stdev:
            rec = int(rng.normal(rec, workload.record_length_bytes_stdev))
            rec = min(max(1, rec), 4 * workload.record_length_bytes)
        out[f"{workload.file_prefix}_{i:0{width}d}_of_{n}.bin"] = rec * workload.num_samples_per_file
    return out


def generate(fs, train_dir: str, workload: Workload, on_file=None) -> int:
    """Write the dataset under ``train_dir`` of ``fs`` unless it is there complete (names
    and sizes); returns the number of files written."""
    sizes = file_sizes(workload)
    try:
        found = {posixpath.basename(e["name"].rstrip("/")): e.get("size")
                 for e in fs.ls(train_dir, detail=True)}
    except FileNotFoundError:
        found = {}
    missing = [n for n, size in sizes.items() if found.get(n) != size]
    if not missing:
        return 0
    fs.makedirs(train_dir, exist_ok=True)
    rng = np.random.default_rng(workload.seed + 1)
    for name in missing:
        path = posixpath.join(train_dir, name) if "://" not in train_dir else f"{train_dir}/{name}"
        fs.pipe_file(path, rng.bytes(sizes[name]))
        if on_file is not None:
            on_file()
    return len(missing)


def entries(names: list[str], workload: Workload) -> list[tuple]:
    """The samples of the listed files, in file order: ``(path, None, None)`` per whole
    file, or ``(path, start, end)`` per record when a file holds several."""
    sizes = file_sizes(workload)
    by_base = {posixpath.basename(n.rstrip("/")): n for n in names}
    absent = sorted(set(sizes) - set(by_base))
    if absent:
        raise FileNotFoundError(f"the dataset misses {len(absent)} file(s), e.g. {absent[0]}")
    out = []
    k = workload.num_samples_per_file
    for base in sorted(sizes):
        path = by_base[base]
        if k == 1:
            out.append((path, None, None))
            continue
        rec = sizes[base] // k
        out.extend((path, r * rec, (r + 1) * rec) for r in range(k))
    return out


def local_source(directory: str, workload: Workload) -> Source:
    base = os.path.join(os.path.abspath(directory), JOB_DIR)
    return Source("file", {}, os.path.join(base, workload.name, "train"),
                  os.path.join(base, "checkpoints"), f"the directory {directory}")


def url_source(url: str, options: dict, workload: Workload) -> Source:
    fs, path = fsspec.core.url_to_fs(url, **options)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if isinstance(fs, LocalFileSystem) and not fs.isdir(path):  # as a plain path is: a typo
        raise ValueError(f"--source {url}: not a directory")  # must not write a dataset
    if protocol in ("http", "https"):
        base = f"{url.rstrip('/')}/{JOB_DIR}"
        return Source(protocol, options, f"{base}/{workload.name}/train", "", url)
    base = f"{path.rstrip('/')}/{JOB_DIR}"
    return Source(protocol, options, f"{base}/{workload.name}/train",
                  f"{protocol}://{base}/checkpoints", url)


def emulated_source(store_url: str, workload: Workload, jobstore_protocol: str) -> Source:
    hostport = store_url.split("://", 1)[1]
    return Source("http", {}, f"{store_url}/{workload.name}/train",
                  f"{jobstore_protocol}://{hostport}/checkpoints", "the emulated store")


def _path(src: Source, url: str) -> tuple:
    fs = src.fs()
    return fs, fs._strip_protocol(url)


def with_run_dir(src: Source) -> Source:
    """``src`` with its checkpoints in a new directory of this run's own under its
    checkpoint root, marked with this job (made now, so that no other job's sweep takes
    it for a dead job's: a directory without its mark is never swept)."""
    name = f"run-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{secrets.token_hex(4)}"
    root = f"{src.checkpoint_root.rstrip('/')}/{name}"
    fs, path = _path(src, root)
    fs.makedirs(path, exist_ok=True)
    fs.pipe_file(f"{path}/{owners.OWNER}", owners.mark().encode())
    return dataclasses.replace(src, checkpoint_root=root)


def sweep_runs(src: Source) -> list[str]:
    """Remove the run directories under ``src``'s checkpoint root whose job ran on this
    host and is gone without its cleanup; returns them. Unmarked directories (a run's
    being made, another tool's) and other hosts' runs are left alone."""
    fs, base = _path(src, src.checkpoint_root)
    try:
        names = fs.ls(base, detail=False, refresh=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for path in names:
        if not posixpath.basename(path.rstrip("/")).startswith("run-"):
            continue
        try:
            dead = owners.gone(fs.cat_file(f"{path.rstrip('/')}/{owners.OWNER}").decode())
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if dead:
            fs.rm(path, recursive=True)
            removed.append(path)
    return removed
