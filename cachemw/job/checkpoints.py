"""The checkpoint methods the job compares, each saving the same model-sized state to the
same store from the training loop:

- ``torch.save``: into a file on the store, synchronously (what most training scripts do):
  the training waits for every byte to be written and durable;
- ``dcp.async_save``: torch.distributed.checkpoint's asynchronous save (thread mode, no
  process group): training waits for the staging copy, the write runs in the background;
  a save first waits for the one before it, as DCP requires;
- ``Checkpointer``: cachemw's; it snapshots the state and returns, writes in the
  background, and where a cachemw daemon runs (here: the warm cache's) lands the save in
  the node's DRAM first and drains it to the store. Before the loop it is told the state's
  shape (``Checkpointer.reserve``), as the README shows, so that its first save's stall is a
  copy like the others (not planning and the first touch of the snapshot's memory).

For each save: the training stall (the time the loop was blocked by it, waiting for an
earlier save included) and the time to durable (from the call until the checkpoint is
committed on the store). Durable times are taken by a thread per save waiting on the save's
future or handle, so measuring never blocks the loop. A save that fails, at the call or
later, has its error recorded (the table shows it FAILED) and the training goes on: DCP's
``CheckpointException`` is a ``BaseException``, caught as such, and a save's wait for the
one before it does not raise that one's failure again.

fsspec URLs are written with DCP's ``FsspecWriter(sync_files=False)``: the store's close is
durable already, and DCP's fallback for a stream without a descriptor is ``os.sync()``, a
sync of every filesystem of the machine.
"""
from __future__ import annotations

import os
import threading
import time

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

from ..checkpoint import Checkpointer
from ..node_daemon import node_daemon
from .settings import METHODS
TENSOR_BYTES = 16 << 20  # the state is cut into tensors of this size (layers of a model)
FAILURES = (Exception, CheckpointException)  # a save's failure (DCP's is a BaseException)


def failure_of(exc: BaseException) -> str:
    """A save's failure in one line: DCP's CheckpointException carries each rank's
    exception and traceback; the first rank's exception says what went wrong."""
    if isinstance(exc, CheckpointException):
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                exc = inner
                break
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def model_state(nbytes: int, seed: int = 0) -> dict:
    """A model-sized state: float32 tensors totalling ``nbytes`` (rounded to 4 bytes),
    plus a step counter, as a state dict holds."""
    g = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // 4)
    per = TENSOR_BYTES // 4
    tensors = {}
    i = 0
    while n > 0:
        k = min(per, n)
        tensors[f"layer{i}.weight"] = torch.rand(k, generator=g)
        n -= k
        i += 1
    return {"model": tensors, "step": 0}


def touch(state: dict, step: int) -> None:
    """The "optimizer step": every tensor changes a little, so every save has new bytes."""
    state["step"] = step
    for t in state["model"].values():
        t[step % t.numel()] += 1.0


class Method:
    key = ""
    synchronous = False

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/")
        self.records: list[dict] = []
        self._lock = threading.Lock()
        self._watchers: list[threading.Thread] = []

    def prepare(self, state: dict) -> None:
        """What the method's own API offers to do before the training loop (untimed)."""

    def save(self, step: int, state: dict) -> None:
        t0 = time.perf_counter()
        record = {"step": step, "stall_s": None, "durable_s": None, "error": None}
        with self._lock:
            self.records.append(record)
        try:
            self._save(step, state, record, t0)
        except FAILURES as exc:  # recorded (shown FAILED); the training goes on
            record["error"] = failure_of(exc)
        record["stall_s"] = time.perf_counter() - t0
        if self.synchronous and record["error"] is None:  # durable when it returns
            record["durable_s"] = record["stall_s"]

    def _watch(self, record: dict, t0: float, wait) -> None:
        def run() -> None:
            try:
                wait()
            except FAILURES as exc:  # a failed save: recorded, shown in the results
                record["error"] = failure_of(exc)
            else:
                record["durable_s"] = time.perf_counter() - t0

        t = threading.Thread(target=run, name=f"job-{self.key}-durable", daemon=True)
        t.start()
        self._watchers.append(t)

    def finish(self) -> float:
        """Wait until every save is durable; returns the seconds waited."""
        t0 = time.perf_counter()
        for t in self._watchers:
            t.join()
        return time.perf_counter() - t0

    def close(self) -> None:
        pass

    def _save(self, step: int, state: dict, record: dict, t0: float) -> None:
        raise NotImplementedError


class TorchSave(Method):
    key = "torch.save"
    synchronous = True

    def _save(self, step, state, record, t0):
        fs, path = fsspec.core.url_to_fs(self.root)
        local = isinstance(fs, LocalFileSystem)
        target = f"{path}/torch-save/step_{step:08d}.pt"
        fs.makedirs(f"{path}/torch-save", exist_ok=True)
        with fs.open(target, "wb") as f:
            torch.save(state, f)
            if local:  # durable as a PFS file is: flushed and fsynced
                f.flush()
                os.fsync(f.fileno())


class DcpAsyncSave(Method):
    key = "dcp.async_save"

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self._pending = None

    def _save(self, step, state, record, t0):
        if self._pending is not None:  # DCP: one async save in flight at a time
            try:
                self._pending.result()
            except FAILURES:
                pass  # that save's failure: recorded by its own watcher, not this save's
        path = f"{self.root}/dcp/step_{step:08d}"
        if "://" in path:
            writer = FsspecWriter(path, sync_files=False)
        else:
            writer = FileSystemWriter(path, sync_files=True)
        future = dcp.async_save(state, storage_writer=writer, no_dist=True)
        self._pending = future
        self._watch(record, t0, future.result)


class CachemwCheckpointer(Method):
    key = "Checkpointer"

    def __init__(self, root: str, runtime_dir: str | None = None) -> None:
        super().__init__(root)
        daemon = node_daemon(runtime_dir) if runtime_dir else None
        self.fast_root = None if daemon is None else daemon.checkpoints_dir(self.root)
        self.ck = Checkpointer(f"{self.root}/checkpointer", keep_last=2, fast_root=self.fast_root)

    def prepare(self, state):
        self.ck.reserve(state)  # plan and allocate before the loop, as the README says

    def _save(self, step, state, record, t0):
        handle = self.ck.save(step, state)
        self._watch(record, t0, handle.wait)

    def close(self) -> None:
        self.ck.close()


def build(key: str, root: str, runtime_dir: str | None = None) -> Method:
    if key == "torch.save":
        return TorchSave(root)
    if key == "dcp.async_save":
        return DcpAsyncSave(root)
    if key == "Checkpointer":
        return CachemwCheckpointer(root, runtime_dir)
    raise ValueError(f"unknown checkpoint method {key!r}: expected one of {', '.join(METHODS)}")
