"""A DataLoader worker's heap, kept from one batch to the next.

A worker reads a batch of samples into new bytes objects, copies them into the batch's
shared memory (collate) and frees them. glibc gives the top of its heap back to the kernel
as soon as more than ``M_TRIM_THRESHOLD`` (128 KiB) of it is free, so the next batch's
samples land in fresh pages again: a page fault per 4 KiB, each costing about what a
4 KiB copy costs (several microseconds on a VM), for every sample of every batch. Samples of
128 KiB and more are mapped and unmapped one by one until glibc's own dynamic threshold has
risen past them. For a cache whose hit is a copy out of memory, those faults are most of
a hit's cost in a worker (docs/benchmarks.md, "DataLoader workers").

So the first read through cachemw in a multiprocessing child (a DataLoader worker) sets
glibc's trim threshold to ``TRIM_BYTES`` and its mmap threshold to ``MMAP_BYTES``
(``mallopt``): up to 64 MiB freed at the heap's top stay with the worker for the next
batch, and samples under 32 MiB come from the heap. Those are the pages the worker
touched at its peak, never more. The main process is left alone: its heap is the trainer's,
and a long-lived heap is the allocator's business. Only with glibc; ``CACHEMW_WORKER_HEAP=0``
turns it off. A process whose allocator was tuned by its user (``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_``, glibc.malloc tunables) is left as it is.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os

from ..config import keep_heap_in_workers

log = logging.getLogger(__name__)

TRIM_BYTES = 64 << 20
MMAP_BYTES = 32 << 20  # glibc's own upper bound for its dynamic mmap threshold (64-bit)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h

_USERS_OWN = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
_done_pid = 0


def keep_in_worker() -> None:
    """Once per process (cheap to call again): in a multiprocessing child with glibc, keep
    the heap's freed top between batches (see the module's docstring)."""
    global _done_pid
    pid = os.getpid()
    if _done_pid == pid:
        return
    _done_pid = pid
    if multiprocessing.parent_process() is None or not keep_heap_in_workers():
        return
    if any(name in os.environ for name in _USERS_OWN) \
            or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, ValueError):  # not glibc
        return
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES) and mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES)):
        log.debug("mallopt refused the worker heap's thresholds")
