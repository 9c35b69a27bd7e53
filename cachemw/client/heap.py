"""A DataLoader worker's heap, kept from one batch to the next.

A worker reads a batch of samples into new bytes objects, copies them into the batch's
shared memory (collate) and frees them. glibc gives the top of its heap back to the kernel
as soon as more than ``M_TRIM_THRESHOLD`` (128 KiB) of it is free, so the next batch's
samples land in fresh pages again: a page fault per 4 KiB, each costing about what a
4 KiB copy costs (several microseconds on a VM), for every sample of every batch. Samples of
128 KiB and more are mapped and unmapped one by one until glibc's own dynamic threshold has
risen past them. For a cache whose hit is a copy out of memory, those faults are most of
a hit's cost in a worker (docs/benchmarks.md, "DataLoader workers").

So the first read through cachemw in a torch DataLoader worker sets glibc's trim threshold
to ``TRIM_BYTES`` and its mmap threshold to ``MMAP_BYTES`` (``mallopt``): up to 64 MiB
freed at the top of a heap stay with the worker for the next batch, and allocations under
32 MiB come from the heap. What is kept are pages the worker touched at its peak, never
more, but per arena: a worker's reads allocate in its main thread's arena, and each other
thread that allocates much (a user's decoding threads) may keep as much in its own. The
mmap threshold holds for the user's code in the worker too (decoded arrays under 32 MiB come
from the heap, and a free gap below the top of a heap stays mapped, as on any heap).

Left alone: every process that is not a DataLoader worker (the trainer, a rank started by
torch.multiprocessing.spawn: a long-lived heap is the allocator's business); a worker
whose allocator its user tuned by environment (``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_``, glibc.malloc tunables) — a ``mallopt`` of
the user's own in ``worker_init_fn`` is not seen, and is overridden; C libraries other than
glibc. ``CACHEMW_WORKER_HEAP=0`` turns it off.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

from ..config import keep_heap_in_workers

log = logging.getLogger(__name__)

TRIM_BYTES = 64 << 20
MMAP_BYTES = 32 << 20  # the largest mmap threshold mallopt takes on 64-bit
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
_USERS_OWN = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")

_done_pid = 0
applied = False  # this process's heap is kept (its thresholds set)


def keep_in_worker() -> None:
    """Once per process (cheap to call again): in a DataLoader worker with glibc, keep the
    heap's freed top between batches (see the module's docstring). Never raises: a read
    must not fail over its allocator."""
    global _done_pid, applied
    pid = os.getpid()
    if _done_pid == pid:
        return
    _done_pid, applied = pid, False
    if not _in_dataloader_worker():
        return
    try:
        if not keep_heap_in_workers():
            return
    except ValueError as exc:  # checked when a filesystem is made; set later, in the worker
        log.warning("%s: the worker's heap is left as it is", exc)
        return
    if any(name in os.environ for name in _USERS_OWN) \
            or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return
    mallopt = _mallopt()
    if mallopt is None:
        return
    # the mmap threshold first: refused (a 32-bit glibc), nothing is changed
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)
                   and mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))
    if not applied:
        log.debug("mallopt refused the worker heap's thresholds")


def _mallopt():
    """glibc's mallopt, or None (another C library)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, ValueError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def _in_dataloader_worker() -> bool:
    """A torch DataLoader worker (torch is never imported here for it: a process that
    has not imported torch is no DataLoader's worker)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return torch.utils.data.get_worker_info() is not None
    except AttributeError:  # torch still importing, or a torch without DataLoaders
        return False
