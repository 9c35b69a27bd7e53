"""torch helpers: a Sampler wrapper that announces each epoch's read order to the cache.

Why: under shuffled epochs a cache that only sees history can at best keep a stable subset
of the dataset (about half the reads of epoch 2+ miss with a cache of half the dataset).
A sampler already knows the whole epoch's order when the epoch starts; told that order,
the node daemon switches its placement engine to the clairvoyant policy (keep the blocks
needed soonest, evict the one needed furthest away) and prefetches ahead of the reader,
as NoPFS does from the shuffle seed.

Usage with a DataLoader (any sampler: RandomSampler, DistributedSampler, a custom one)::

    import fsspec
    from torch.utils.data import DataLoader, RandomSampler
    from cachemw.torch import AnnouncingSampler

    fs = fsspec.filesystem("cachemw", target_protocol="file")
    paths = sorted(fs.glob("/lustre/train/*.jpg"))
    dataset = MyDataset(fs, paths)            # __getitem__(i) reads fs.cat_file(paths[i])
    sampler = AnnouncingSampler(RandomSampler(dataset), paths, fs=fs)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler, num_workers=8)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)              # forwarded to a DistributedSampler; else a no-op
        for batch in loader:
            ...

``paths`` maps a sample index to what it reads: a sequence (``paths[i]``) or a callable
``index -> path`` or ``index -> (path, start, end)`` (a record inside a large file: only the
blocks that range touches are announced). The sampler runs in the trainer's main process
(the DataLoader sends indices to its workers), so announcing costs the workers nothing.

Announcing never breaks training: if no daemon is reachable, or a path cannot be
announced, it logs once and yields the indices as the wrapped sampler does.

This module imports torch; ``import cachemw`` never imports this module.
"""
from __future__ import annotations

import itertools
import logging
import os
from typing import Callable, Iterator, Sequence, Union

import torch.utils.data

from .client.announce import check_ranks

log = logging.getLogger(__name__)

Entry = Union[str, tuple]  # a path, or (path, start, end)


def _local(name: str, default: int) -> int:
    """torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE as an int; ``default`` unset or not one."""
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


def _job() -> str:
    """What the ranks of one training share, so that two trainings at once on a node never
    make one group: torchrun's run id, else the rendezvous address, else the Slurm job
    step, else the PMIx namespace of an MPI job (mpirun of Open MPI, as DLIO is run); and
    the restart (torchrun's restart count). A later run of the same name begins the group
    anew (the engine sees a rank begin its order in it twice). Ranks started with none
    of these share the name "local" with any other such job on the node (review
    announce2): their orders are then laid as one group's."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    addr = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    job = os.environ.get("SLURM_JOB_ID")
    pmix = os.environ.get("PMIX_NAMESPACE")
    if run and run != "none":
        name = run
    elif all(addr):
        name = f"{addr[0]}:{addr[1]}"
    elif job:
        name = f"slurm-{job}.{os.environ.get('SLURM_STEP_ID', '')}"
    elif pmix:
        name = f"pmix-{pmix}"
    else:
        name = "local"
    return f"{name}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


#: samplers made in this process, by (rank, ranks, length): see AnnouncingSampler._owner
_MADE: dict = {}


class AnnouncingSampler(torch.utils.data.Sampler):
    """Yields exactly what ``sampler`` yields; first announces it to the node daemon.

    ``lookahead``: how many samples to announce at once. None (the default) announces the
    whole epoch when it starts: the best placement, at the cost of one metadata lookup per
    sample at each epoch start (cached by the filesystem's ``validate`` policy). A number
    announces a window of that many samples ahead of the reader, topped up each time half of
    it has been yielded; keep it well above ``batch_size x num_workers x prefetch_factor``
    (how far the DataLoader runs ahead of training) and, for the placement to pay off, at
    least as large as the cache. Where the dataset is larger than the cache, a window
    trades store reads for the trainer's waits: its prefetches take the room of blocks
    read later in the epoch, beyond the window, which are then read again (4 epochs of
    512 samples through a cache of 181 blocks: 1,772-1,878 store reads with a window of
    100 or 256, 1,505 without announcing, 1,508-1,586 announcing whole epochs, review
    announce2); announce whole epochs there, if the store's load matters more.

    Works with batch samplers too: an element that is a list of indices announces each.

    ``rank`` and ``ranks``: this process's place among the ranks of its node that read at
    the same time (DDP: one process per device, each sampler a DistributedSampler giving
    it its shard), by default torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (1 rank
    without them). With several, each epoch's orders are announced as one group, so the
    daemon lays them interleaved, as the ranks read them step by step: one after another,
    the node's reads would match neither and prefetch would run ahead of one rank only.
    An epoch the loop stops early (max steps, ``limit_train_batches``) leaves the rest of
    its order announced: the next epoch's announcement replaces it (this sampler's order
    only: another sampler's, another job's stay), so it is not laid after that rest.

    Every rank of the node must announce, each making its samplers in the same order (a
    sampler is named by its length and its place among the process's samplers of that
    length, so that all ranks agree on it; one that only some ranks make takes
    ``ranks=1``) and each iterating its sampler once an epoch (the
    group is named by the iteration, not by ``set_epoch``); until all have, the daemon
    holds its prefetch back, at most 5 s per epoch. The ranks' samplers must have the same
    length (DistributedSampler's shards do: it pads them); shards of different lengths
    name different samplers, so each rank's order waits the 5 s alone and is laid apart
    from the others (a sampler padded to the longest shard's length groups). The layout
    counts blocks: ranks whose samples span different numbers of blocks read a little out
    of the laid order (tolerated, as several workers' reads are).
    """

    def __init__(self, sampler, paths: Union[Sequence[Entry], Callable[[int], Entry]],
                 fs=None, *, lookahead: int | None = None, rank: int | None = None,
                 ranks: int | None = None) -> None:
        if not hasattr(sampler, "__iter__"):
            raise ValueError(f"sampler: expected an iterable of indices, got {sampler!r}")
        if not callable(paths) and not hasattr(paths, "__getitem__"):
            raise ValueError("paths: expected a sequence of paths or a callable index -> path "
                             f"or (path, start, end), got {type(paths).__name__}")
        if lookahead is not None and (isinstance(lookahead, bool) or not isinstance(lookahead, int)
                                      or lookahead < 1):
            raise ValueError(f"lookahead: expected None or an int >= 1, got {lookahead!r}")
        if rank is None and ranks is None:  # torchrun's, when they make sense; else alone
            rank, ranks = _local("LOCAL_RANK", 0), _local("LOCAL_WORLD_SIZE", 1)
            if not 0 <= rank < ranks:
                rank, ranks = 0, 1
        if rank is None and "LOCAL_RANK" not in os.environ:
            raise ValueError("ranks given without rank (and no LOCAL_RANK): give both")
        rank = _local("LOCAL_RANK", 0) if rank is None else rank
        ranks = _local("LOCAL_WORLD_SIZE", 1) if ranks is None else ranks
        check_ranks(rank, ranks)
        self.sampler = sampler
        self.paths = paths
        self.fs = fs
        self.lookahead = lookahead
        self.rank, self.ranks = rank, ranks
        self._fs_given = fs is not None
        self._warned = False
        self._epochs = 0  # iterations begun: the same count on every rank of a node
        # this sampler among the process's of its rank and length (the same on every rank
        # that makes its samplers alike; by length too, so that a validation sampler only
        # rank 0 makes does not shift the training sampler's name): its orders are its own
        try:
            length = len(sampler)
        except TypeError:
            length = None
        made = _MADE.setdefault((rank, ranks, length), itertools.count())
        self._owner = f"{_job()}:{length}:{next(made)}"
        self._group = None
        self._sent = 0  # blocks of this epoch's order announced so far
        self._ended = True  # the last iteration ran to its end (else: replaced; see __iter__)

    # -- the Sampler surface ------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the wrapped sampler (a DistributedSampler reshuffles by epoch)."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    def __iter__(self) -> Iterator:
        order = list(self.sampler)  # materialise the epoch: it is what gets announced
        n = len(order)
        self._group = f"{self._owner}:{self._epochs}"
        self._epochs += 1
        self._sent = 0
        # a loop that stopped the last epoch early (max steps, limit_train_batches) left
        # the rest of its order announced: this one replaces it, starting at the reader
        replace, self._ended = not self._ended, False
        if self.lookahead is None:
            self._announce(order, 0, n, replace)
            yield from order
            self._ended = True
            return
        window, step = self.lookahead, max(1, self.lookahead // 2)
        announced = self._announce(order, 0, min(n, window), replace)
        for i, item in enumerate(order):
            if announced < n and announced - i <= step:
                announced = self._announce(order, announced, min(n, i + window))
            yield item
        self._ended = True

    # -- announcing ---------------------------------------------------------------------

    def entries(self, items: Sequence) -> list[Entry]:
        """What the given sampler elements read, in order (a batch gives each index's)."""
        out: list[Entry] = []
        for item in items:
            if isinstance(item, (list, tuple)):
                out.extend(self._entry(i) for i in item)
            else:
                out.append(self._entry(item))
        return out

    def _entry(self, index) -> Entry:
        index = int(index)
        return self.paths(index) if callable(self.paths) else self.paths[index]

    def _filesystem(self):
        if self.fs is None:
            import fsspec

            self.fs = fsspec.filesystem("cachemw")
        return self.fs

    def _announce(self, order: list, lo: int, hi: int, replace: bool = False) -> int:
        """Announce ``order[lo:hi]``; returns ``hi`` whatever happened (training goes on)."""
        if hi <= lo:
            return hi
        try:
            entries = self.entries(order[lo:hi])
            if self.ranks > 1:
                sent = self._filesystem().announce(entries, rank=self.rank, ranks=self.ranks,
                                                   group=self._group, first=self._sent,
                                                   replace=replace)
                self._sent += sent
            else:
                sent = self._filesystem().announce(entries, replace=replace,
                                                   owner=f"pid-{os.getpid()}:{self._owner}")
        except Exception as exc:  # announcing is an optimisation: never fail the epoch
            self._warn_once("could not announce the sampler's order (%s: %s); reading on "
                            "without it", type(exc).__name__, exc)
            return hi
        if sent == 0 and entries:
            self._warn_once("no cachemw daemon reachable: the sampler's order is not announced "
                            "(placement falls back to access history)")
        return hi

    def _warn_once(self, msg: str, *args) -> None:
        if not self._warned:
            self._warned = True
            log.warning(msg, *args)

    # -- pickling (spawn/forkserver workers, checkpointing a loader) --------------------

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_warned"] = False  # each process says it once
        if not self._fs_given:
            state["fs"] = None  # the default is rebuilt from fsspec's registry where needed
        return state
