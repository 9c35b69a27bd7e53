"""The emulated training: a torch DataLoader reads samples, each step "computes" by
sleeping (as DLIO emulates the accelerator), and checkpoints fall where the workload says.

Shaped as dlio_benchmark's torch loader shapes it (``data_loader/torch_data_loader.py``):
``read_threads`` workers, persistent across epochs, ``prefetch_factor`` =
ceil(``prefetch_size`` / ``read_threads``), the last partial batch dropped; the sampler
reshuffles every epoch from the workload's seed, so every system reads the same order.

The loop measures, per step, the time blocked in ``next(iterator)`` (I/O wait as the
trainer sees it), the compute, and a checkpoint's stall (timeline.Step).
"""
from __future__ import annotations

import itertools
import os
import time
from typing import Callable, Sequence

import fsspec
import numpy as np
import torch
import torch.utils.data

from .timeline import Epoch, Step
from .workload import Workload

Entry = tuple  # (path, start, end); start is None for a whole file


class Opener:
    """Builds an fsspec filesystem in whichever process uses it (the trainer, each
    DataLoader worker: an fsspec instance holding an event loop or a daemon link does not
    cross a fork), from a protocol and its options. Picklable."""

    def __init__(self, protocol: str, options: dict | None = None) -> None:
        self.protocol = protocol
        self.options = dict(options or {})
        self._fs = None
        self._pid = None

    def __getstate__(self) -> dict:
        return {"protocol": self.protocol, "options": self.options, "_fs": None, "_pid": None}

    def fs(self):
        if self._fs is None or self._pid != os.getpid():
            self._fs = fsspec.filesystem(self.protocol, **self.options)
            self._pid = os.getpid()
        return self._fs


class SampleDataset(torch.utils.data.Dataset):
    """Sample ``i`` is the bytes of ``entries[i]``: a whole file, or a record's range in it."""

    def __init__(self, opener: Opener, entries: Sequence[Entry]) -> None:
        self.opener = opener
        self.entries = list(entries)
        self.flusher = None  # an iowait.WorkerFlush, for cachemw's per-epoch counts

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> bytes:
        path, start, end = self.entries[i]
        fs = self.opener.fs()
        if start is None:
            return fs.cat_file(path)
        return fs.cat_file(path, start=start, end=end)


class MemorySamples:
    """The samples already in the process's memory, as an Opener's filesystem serves them
    (``fs().cat_file``): the DataLoader's own floor, the same loader with no reader at all
    (collate, the workers' hand-over to the trainer in shared memory, its own bookkeeping),
    measured in the same run as the caches it bounds. Workers inherit the bytes by fork
    (spawn pickles them)."""

    def __init__(self, samples: dict) -> None:
        self.samples = samples  # (path, start, end) -> bytes

    def fs(self) -> "MemorySamples":
        return self

    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.samples[(path, start, end)]


def collate(batch: list) -> tuple:
    """A batch as one flat uint8 tensor and the samples' lengths (samples may differ in
    size, as with DLIO's ``dataset.record_length_stdev``): one copy per sample. In a worker
    the batch is built in shared memory, as torch's default_collate builds its batches:
    a batch in private memory is copied once more into shared memory on its way to the
    trainer."""
    lengths = [len(b) for b in batch]
    flat = _batch_tensor(sum(lengths))
    view = flat.numpy()
    offset = 0
    for b in batch:
        view[offset:offset + len(b)] = np.frombuffer(b, dtype=np.uint8)
        offset += len(b)
    return flat, torch.tensor(lengths)


def _batch_tensor(n: int) -> torch.Tensor:
    """``n`` uninitialised bytes, in shared memory in a DataLoader worker (with the call
    default_collate makes; plain memory where this torch lacks it)."""
    if torch.utils.data.get_worker_info() is not None:
        empty = torch.empty(0, dtype=torch.uint8)
        try:
            return empty.new(empty._typed_storage()._new_shared(n, device=empty.device))
        except (AttributeError, TypeError):
            pass
    return torch.empty(n, dtype=torch.uint8)


class EpochSteps(torch.utils.data.Sampler):
    """The first ``steps`` batches of ``sampler``'s order each epoch (all of it while
    ``steps`` is None; ``train_epoch`` sets it): an epoch stopped early
    (``train.total_training_steps``, the checkpoint phase's last epoch at its last save)
    reads no sample it does not train on. Handed the whole order, the DataLoader's workers
    would read on past the last step, and those reads would be counted in the next epoch."""

    def __init__(self, sampler, batch_size: int, steps: int | None = None) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.steps = steps

    def __len__(self) -> int:
        n = len(self.sampler)
        return n if self.steps is None else min(n, self.steps * self.batch_size)

    def __iter__(self):
        if self.steps is None:
            yield from self.sampler
        else:
            yield from itertools.islice(self.sampler, self.steps * self.batch_size)


def base_sampler(workload: Workload, n: int) -> EpochSteps:
    """DLIO's ``sample_shuffle``: off (in order), seed (a fixed seed: every run and every
    system reads the same orders, a new one each epoch) or random; each epoch
    ``workload.epoch_steps`` batches of it (``EpochSteps``)."""
    if workload.sample_shuffle == "off":
        order = torch.utils.data.SequentialSampler(range(n))
    else:
        g = torch.Generator()
        g.manual_seed(workload.seed if workload.sample_shuffle == "seed" else
                      int.from_bytes(os.urandom(8), "little") >> 1)
        order = torch.utils.data.RandomSampler(range(n), generator=g)
    return EpochSteps(order, workload.batch_size, workload.epoch_steps)


def _epoch_steps_of(loader) -> EpochSteps | None:
    """The loader's EpochSteps, under whatever wraps it (an AnnouncingSampler)."""
    sampler = loader.sampler
    while sampler is not None and not isinstance(sampler, EpochSteps):
        sampler = getattr(sampler, "sampler", None)
    return sampler


def worker_init(worker_id: int) -> None:
    """The loader's worker_init_fn: start the dataset's flush thread (iowait.WorkerFlush)."""
    info = torch.utils.data.get_worker_info()
    flusher = getattr(info.dataset, "flusher", None)
    if flusher is not None:
        flusher.start_in_worker(worker_id, info.dataset.opener.fs)


def make_loader(dataset, workload: Workload, sampler) -> torch.utils.data.DataLoader:
    workers = workload.read_threads
    extra = {}
    if workers > 0:
        extra = {"persistent_workers": True, "prefetch_factor": workload.prefetch_factor,
                 "multiprocessing_context": workload.multiprocessing_context,
                 "worker_init_fn": worker_init}
    return torch.utils.data.DataLoader(dataset, batch_size=workload.batch_size, sampler=sampler,
                                       num_workers=workers, collate_fn=collate,
                                       drop_last=True, pin_memory=False, **extra)


class Compute:
    """The accelerator: ``computation_time`` seconds per step, drawn as DLIO draws them
    (abs(normal(mean, stdev))), from the workload's seed: every system gets the same."""

    def __init__(self, workload: Workload, *, flat_out: bool = False) -> None:
        # flat_out: no compute at all, the loader flat out (the job's flat-out epochs)
        self.mean = 0.0 if flat_out else workload.computation_time
        self.stdev = 0.0 if flat_out else workload.computation_time_stdev
        self.rng = np.random.default_rng(workload.seed)

    def __call__(self) -> None:
        t = abs(self.rng.normal(self.mean, self.stdev)) if self.stdev else self.mean
        if t > 0:
            time.sleep(t)


def train_epoch(loader, workload: Workload, epoch: int, step: int, compute: Compute,
                checkpoint: Callable[[int], None] | None = None,
                on_step: Callable[[], None] | None = None,
                steps: int | None = None) -> tuple[Epoch, int]:
    """One epoch of ``steps`` steps (``workload.epoch_steps`` if None); ``step`` is the
    global step count before it. Returns the epoch's timeline and the global step count
    after it. ``checkpoint(step)`` runs where the workload puts a checkpoint; its time is
    the step's checkpoint stall. The loader's sampler (``base_sampler``) is told how many
    batches to hand out, so that its workers read no further than the epoch trains."""
    n_steps = workload.epoch_steps if steps is None else steps
    limit = _epoch_steps_of(loader)
    if limit is not None:
        limit.steps = n_steps
    out = []
    t0 = time.perf_counter()
    it = iter(loader)
    for i in range(n_steps):
        a = time.perf_counter()
        try:
            flat, lengths = next(it)
        except StopIteration:
            break
        b = time.perf_counter()
        compute()
        c = time.perf_counter()
        step += 1
        if checkpoint is not None and workload.checkpoint_due(step, epoch, i == n_steps - 1):
            checkpoint(step)
        d = time.perf_counter()
        out.append(Step(load=b - a, compute=c - b, checkpoint=d - c, end=d - t0,
                        samples=int(lengths.numel()), nbytes=int(flat.numel())))
        del flat, lengths
        if on_step is not None:
            on_step()
    wall = out[-1].end if out else time.perf_counter() - t0
    return Epoch(epoch, tuple(out), wall), step
