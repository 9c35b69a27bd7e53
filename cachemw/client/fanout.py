"""Requests to the source that one call needs, sent side by side: the blocks a batch misses
(``cat`` of many files, ``cat_ranges``, a read spanning blocks) wait on the store once, not
once per block, as fsspec's own batches over an async store do (S3, HTTP: each request
waits its first byte's latency, 10-100 ms, doing nothing). Only over a source that takes
requests from several threads at once (tiers/source.py ``concurrent``): fsspec's tar and
zip readers share one file object, its FTP one connection; those go one after another.

Three pools of threads per process, each made at its first batch of two or more (a
DataLoader worker reading one sample at a time never makes one) and made again in a forked
child (a child has none of its parent's threads):

* ``FETCH``: source requests only. Such a call waits on the store and nothing else, so the
  pool always drains; a call made from one of its threads runs its own batch inline.
* ``READ``: whole reads (the cold files of a ``cat``), which may wait on a claim another
  thread of the process holds while that thread's fetches run in the FETCH pool: in one
  pool, a READ batch filling every thread could hold those fetches back until the daemon's
  lease wait ran out.
* ``CLAIMED``: a read's fetches of the blocks it holds the claims of, run beside its wait
  on the daemon for the others (``beside``, misses.py). They wait on the store only (their
  requests go to FETCH) and hand their blocks on, never on a claim; in READ, a READ batch
  waiting on those very claims could hold them back.

A caller interrupted (Ctrl-C) cancels what has not started; a batch made while the
interpreter shuts down runs inline.
"""
from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

T = TypeVar("T")

LIMIT = 16  # requests in flight per batch and pool: a DataLoader worker's batch, a cat of shards
FETCH, READ, CLAIMED = "fetch", "read", "claimed"

_pools: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()
_inside = threading.local()  # .pool: the pool whose thread this is


def _forget_in_child() -> None:
    """A forked child has none of the pools' threads, and the lock may have been held."""
    global _lock
    _pools.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def _executor(kind: str) -> ThreadPoolExecutor:
    with _lock:
        pool = _pools.get(kind)
        if pool is None:
            # imported here: a DataLoader worker reading one sample at a time never needs
            # it, and each module a worker imports costs it time every epoch
            from concurrent.futures import ThreadPoolExecutor

            def mark() -> None:
                _inside.pool = kind

            # the caller runs one call of its batch itself: LIMIT in flight in all
            pool = _pools[kind] = ThreadPoolExecutor(LIMIT - 1, initializer=mark,
                                                     thread_name_prefix=f"cachemw-{kind}")
        return pool


def run_all(calls: list[Callable[[], T]], kind: str = FETCH,
            parallel: bool = True) -> list[T | Exception]:
    """The result of each call, in order, or the exception it raised (every call that
    started runs to its end, so that the caller can finish or release what each holds).
    ``parallel`` False (a source that takes one request at a time), a single call, or a
    call from a thread of the same pool or of the FETCH pool: one after another, here."""
    inside = getattr(_inside, "pool", None)
    if not parallel or len(calls) < 2 or inside in (kind, FETCH):
        return [_outcome(c) for c in calls]
    try:
        futures = [_executor(kind).submit(c) for c in calls[1:]]
    except RuntimeError:  # the interpreter is shutting down: no new threads
        return [_outcome(c) for c in calls]
    try:
        out = [_outcome(calls[0])]
        for f in futures:
            try:
                out.append(f.result())
            except Exception as exc:  # noqa: BLE001 - handed to the caller, as the call's
                out.append(exc)
        return out
    except BaseException:  # Ctrl-C: what has not started does not start
        for f in futures:
            f.cancel()
        raise


def beside(side: Callable[[], T], main: Callable[[], T], kind: str = CLAIMED,
           never_run: Callable[[], None] | None = None) -> tuple[T | Exception, T]:
    """(``side``'s result or the exception it raised, ``main``'s result): ``side`` runs in
    the ``kind`` pool while ``main`` runs here, in the calling thread (whose connection to
    the daemon a lease must be taken on). Where a pool cannot be used (see run_all),
    ``side`` runs first, then ``main``. ``main`` raising: ``side`` runs on to its end
    unwaited if it has started (it releases what it holds itself), or never starts, and
    then ``never_run()`` releases what it would have."""
    inside = getattr(_inside, "pool", None)
    if inside in (kind, FETCH):
        return _outcome(side), main()
    try:
        future = _executor(kind).submit(side)
    except RuntimeError:  # the interpreter is shutting down: no new threads
        return _outcome(side), main()
    try:
        got = main()
    except BaseException:
        if future.cancel() and never_run is not None:
            never_run()
        raise
    try:
        return future.result(), got
    except Exception as exc:  # noqa: BLE001 - handed to the caller, as the call's
        return exc, got


def _outcome(call: Callable[[], T]) -> T | Exception:
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - handed to the caller, as the call's
        return exc
