"""The read paths the job compares, each the same training over the same source:

- ``direct``: fsspec straight to the store (what a loader does with no cache);
- ``simplecache``: fsspec's ``simplecache::`` (what users reach for today): whole files
  copied to a local directory on first read, read from there after; put on /dev/shm (the
  medium cachemw's DRAM tier uses), so the comparison is of software, not of disks;
- ``cachemw``: ``cachemw::`` with its own fresh daemon: epoch 1 cold, epochs 2+ warm;
- ``cachemw+announce``: the same with ``cachemw.torch.AnnouncingSampler``, which tells the
  daemon each epoch's order so it prefetches ahead of the reader.

Both caches treat the dataset as immutable (simplecache never revalidates; cachemw runs
with ``validate="immutable"``), as training data is. Each cachemw system gets a private
runtime dir, so it starts cold and never meets (or is helped by) a daemon already
running on the node.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import stat
import tempfile

from ..launch import stop_local
from ..torch import AnnouncingSampler
from .owners import OWNER, gone, mark
from .settings import SYSTEMS
from .source import Source
from .training import Opener
from .workload import Workload

LABELS = {"direct": "direct reads", "simplecache": "fsspec simplecache::",
          "cachemw": "cachemw:: (epoch 1 cold)", "cachemw+announce": "cachemw:: + AnnouncingSampler"}


def _scratch_base() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def scratch_dir(prefix: str) -> str:
    """A private directory in node memory (/dev/shm) where there is one, else in /tmp,
    marked with the job that made it (``sweep_scratch``)."""
    path = tempfile.mkdtemp(prefix=prefix, dir=_scratch_base())
    with open(os.path.join(path, OWNER), "w") as f:
        f.write(mark())
    return path


def sweep_scratch() -> list[str]:
    """Remove the scratch dirs of this user's jobs that are gone without their cleanup (a
    SIGKILL, an out-of-memory kill): their dataset copies hold node memory in /dev/shm."""
    removed = []
    for base in {_scratch_base() or tempfile.gettempdir(), tempfile.gettempdir()}:
        for path in glob.glob(os.path.join(base, "cachemw-job-*")):
            try:
                st = os.lstat(path)
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                    continue
                with open(os.path.join(path, OWNER)) as f:
                    dead = gone(f.read())  # (another node's, in a shared /tmp: never)
            except (OSError, ValueError):
                continue  # no mark (another tool's, or being made): not ours to judge
            if dead:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


@dataclasses.dataclass
class System:
    key: str
    opener: Opener
    announce: bool = False
    runtime_dir: str | None = None  # cachemw's
    scratch: str | None = None  # a directory to remove at the end

    @property
    def label(self) -> str:
        return LABELS[self.key]

    @property
    def cachemw(self) -> bool:
        return self.runtime_dir is not None

    def start(self) -> None:
        """Before the loader forks its workers: start cachemw's daemon from the trainer, as
        its first read would, so workers find it running."""
        if self.cachemw and not self.opener.fs().client.connected():
            raise RuntimeError(f"{self.key}: could not start the cachemw daemon in "
                               f"{self.runtime_dir} (see its daemon.log)")

    def list_dataset(self, train_dir: str) -> list[str]:
        """The dataset's files as this system's filesystem lists them (loaders list first)."""
        names = self.opener.fs().ls(train_dir, detail=False)
        return sorted(n for n in names if n.endswith(".bin"))

    def sampler(self, base, entries: list):
        if not self.announce:
            return base
        paths = [p if s is None else (p, s, e) for p, s, e in entries]
        return AnnouncingSampler(base, paths, fs=self.opener.fs())

    def daemon_counters(self) -> dict | None:
        if not self.cachemw:
            return None
        stats = self.opener.fs().client.daemon_stats()
        return None if stats is None else dict(stats["counters"])

    def stop(self) -> None:
        if self.runtime_dir is not None:
            stop_local(self.runtime_dir)
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def build(key: str, source: Source, workload: Workload) -> System:
    if key == "direct":
        return System(key, Opener(source.protocol, source.options))
    if key == "simplecache":
        storage = scratch_dir("cachemw-job-simplecache-")
        return System(key, Opener("simplecache", {
            "target_protocol": source.protocol, "target_options": source.options,
            "cache_storage": storage, "check_files": False}),
            scratch=storage)
    if key in ("cachemw", "cachemw+announce"):
        runtime_dir = scratch_dir("cachemw-job-rt-")
        capacity = max(2 * workload.dataset_bytes, 64 << 20)
        return System(key, Opener("cachemw", {
            "target_protocol": source.protocol, "target_options": source.options,
            "runtime_dir": runtime_dir, "validate": "immutable",
            "daemon_options": {"dram_capacity": capacity}}),
            announce=key == "cachemw+announce", runtime_dir=runtime_dir)
    raise ValueError(f"unknown system {key!r}: expected one of {', '.join(SYSTEMS)}")
