"""Draining a checkpoint from the fast node-local tier to the root, file by file.

A save writes into the fast tier (e.g. /dev/shm) and each data file, once complete there, is
copied to the root while the rest is still being written, so committing at the root costs
little more than writing to it directly. Only data files are drained here; the coordinator
copies ``.metadata`` and then the manifest after every rank's files are durable at the root.
"""
from __future__ import annotations

import errno
import shutil
from concurrent.futures import Future, ThreadPoolExecutor

from cachemw import trace
from cachemw.files import fsync_path, make_private_dirs
from cachemw.node_daemon import node_daemon

from .background import run_at
from .layout import CheckpointDir
from .storage_io import Location
from .writer import MANIFEST_NAME, METADATA_NAME

COPY_BLOCK = 8 << 20


def copy_file(src: Location, dst: Location, rel: str) -> None:
    """Copy ``src/rel`` to ``dst/rel`` and make it durable at ``dst``."""
    if src.local and dst.local:
        # copyfile uses sendfile on Linux: no user-space buffers, no GIL-bound copying.
        shutil.copyfile(src.join(rel), dst.join(rel))
        fsync_path(dst.join(rel))
        return
    with src.open(rel, "rb") as fin:
        fout = dst.open(rel, "wb")
        try:
            shutil.copyfileobj(fin, fout, COPY_BLOCK)
        finally:
            dst.close_durably(fout)


def copy_file_whole(src: Location, dst: Location, rel: str) -> None:
    """``copy_file`` over a file that ``dst`` may hold already (a drain taken up again after
    its writer died, perhaps by two processes at once): readers of ``dst`` see the old bytes
    or the new, never a part. An object store replaces an object whole on its own."""
    if not dst.local:
        copy_file(src, dst, rel)
        return
    with src.open(rel, "rb") as fin, dst.open_atomic(rel) as fout:
        shutil.copyfileobj(fin, fout, COPY_BLOCK)


def drain_committed(fast: CheckpointDir, root: CheckpointDir, name: str) -> None:
    """Copy the step ``name``, committed in ``fast``, to ``root`` and commit it there (a
    drain taken up again after its writer died: Checkpointer._drain_left): its files,
    each replaced whole, checked at the root (another process's sweep of the directory,
    its first writer dead, may have raced the copy), then ``.metadata`` and, last, the
    manifest."""
    src, dst = fast.location.child(name), root.location.child(name)
    manifest = fast.manifest(name)
    if manifest is None:  # removed meanwhile (retention, `cachemw stop`)
        raise FileNotFoundError(f"checkpoint {name} is no longer in {fast.location.url}")
    root.begin(name)
    for rel in manifest["files"]:
        copy_file_whole(src, dst, rel)
    for rel, size in manifest["files"].items():
        got = dst.size(rel)
        if got != size:
            raise OSError(errno.EIO, f"{dst.url}/{rel}: {got} bytes at the root after the drain, "
                          f"{size} in memory; not committed")
    commit_copy(src, dst)


def commit_copy(src: Location, dst: Location) -> None:
    """Commit at ``dst`` the step whose data files were copied there from ``src``: its
    ``.metadata``, then, last, its manifest (the commit)."""
    dst.write_atomic(METADATA_NAME, src.read_bytes(METADATA_NAME))
    dst.write_atomic(MANIFEST_NAME, src.read_bytes(MANIFEST_NAME))


class Drainer:
    """Copies files of one save from ``src`` to ``dst`` in the background, as they complete."""

    def __init__(self, src: Location, dst: Location, threads: int = 2,
                 niceness: int | None = None) -> None:
        self.src, self.dst = src, dst
        # at the save's background priority whichever thread starts them (background.py)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="cachemw-drain",
                                        initializer=run_at, initargs=(niceness,))
        self._futures: list[Future] = []

    def submit(self, rel: str) -> None:
        self._futures.append(self._pool.submit(self._copy, rel))

    def _copy(self, rel: str) -> None:
        with trace.span("drain", trace.CHECKPOINT, file=rel):
            copy_file(self.src, self.dst, rel)

    def wait(self) -> None:
        """Block until every submitted copy is durable; raise the first failure."""
        try:
            for fut in self._futures:
                fut.result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def wait_quietly(self) -> None:
        """Wait for the copies already started, ignoring their failures (the save failed anyway)."""
        try:
            self.wait()
        except Exception:  # any copy failure: the save's own error is the one raised
            pass


def daemon_fast_root(root: str) -> str | None:
    """The fast tier a running cachemw daemon offers on this node, for checkpoints of ``root``.

    Saves land in the daemon's runtime dir (node DRAM, /dev/shm by default), one directory
    per root, and drain to ``root`` in the background. None when no daemon runs here. The
    daemon does not count these files against its tiers' capacities; ``fast_keep_last``
    bounds them.
    """
    daemon = node_daemon()
    if daemon is None:
        return None
    path = daemon.checkpoints_dir(root)
    make_private_dirs(path)  # in the runtime dir, private as all of it (0700)
    return path
