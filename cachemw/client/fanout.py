"""Requests to the source that one call needs, sent side by side: the blocks a batch misses
(``cat`` of many files, ``cat_ranges``, a read spanning blocks) wait on the store once, not
once per block, as fsspec's own batches over an async store do (S3, HTTP: each request
waits its first byte's latency, 10-100 ms, doing nothing).

A pool of threads per process, made at the first batch of two or more (a DataLoader
worker reading one sample at a time never makes one) and made again in a forked child
(a child has none of its parent's threads). A call made from one of the pool's threads runs
its own batch in that thread, one request after another: a batch never waits on a pool its
own caller fills.
"""
from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

T = TypeVar("T")

LIMIT = 16  # requests in flight per process: a DataLoader worker's batch, a cat of shards

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()
_inside = threading.local()  # set in the pool's threads


def _mark_inside() -> None:
    _inside.yes = True


def _forget_in_child() -> None:
    """A forked child has none of the pool's threads, and the lock may have been held."""
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            # imported here: a DataLoader worker reading one sample at a time never needs
            # it, and each module a worker imports costs it time every epoch
            from concurrent.futures import ThreadPoolExecutor

            _pool = ThreadPoolExecutor(LIMIT, thread_name_prefix="cachemw-fetch",
                                       initializer=_mark_inside)
        return _pool


def run_all(calls: list[Callable[[], T]]) -> list[T | BaseException]:
    """The result of each call, in order, or the exception it raised (every call runs to
    its end, so that the caller can finish or release what each one holds). The first runs
    in the caller's thread."""
    if len(calls) < 2 or getattr(_inside, "yes", False):
        return [_outcome(c) for c in calls]
    futures = [_executor().submit(c) for c in calls[1:]]
    out = [_outcome(calls[0])]
    for f in futures:
        try:
            out.append(f.result())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, as the call's
            out.append(exc)
    return out


def _outcome(call: Callable[[], T]) -> T | BaseException:
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - handed to the caller, as the call's
        return exc
