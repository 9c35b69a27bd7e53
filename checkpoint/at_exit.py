"""Saves still pending when a script ends: finished before the process exits.

A script whose last act is ``save()`` (no ``wait()``) reaches the interpreter's exit with the
save's background still to run. Past concurrent.futures' exit hook no thread pool takes work
any more, and that background starts pools of its own: the save failed, and no one was left
to wait for its handle and hear of it (review ckpt6: with 2 ranks, or a fast tier, the step
was lost without a word). The hook here is registered as concurrent.futures registers its
own, and after it, so it runs first (threading's exit hooks run before atexit's, the latest
registered first): it waits for every pending save, says which, and logs a failure.
"""
from __future__ import annotations

import atexit
import importlib
import logging
import os
import threading
import weakref

log = logging.getLogger(__name__)

_live: weakref.WeakSet = weakref.WeakSet()  # the Checkpointers of the process


def _forked() -> None:
    """In a forked child (a DataLoader's worker, a multiprocessing process), whose end runs
    the hook too: its copies of the parent's Checkpointers are not its own, and their
    pending saves are the parent's to finish. Waited for there, the child never ended, and
    a parent joining it waited with it (diffrev-8)."""
    _live.clear()


os.register_at_fork(after_in_child=_forked)


def track(checkpointer) -> None:
    """Have ``checkpointer``'s pending saves finished at the interpreter's exit."""
    _live.add(checkpointer)


def _finish() -> None:
    for ck in list(_live):
        try:
            pending = ck._pending_steps()
        except Exception:  # noqa: BLE001 - one made half-way (its constructor raised)
            continue
        if not pending:
            continue
        log.warning("exiting: waiting for the checkpoint of step(s) %s to commit (call "
                    "wait() before the end to wait yourself; Ctrl-C abandons it)", pending)
        try:
            ck.wait()
        except BaseException as exc:
            log.error("the checkpoint of step(s) %s was not committed: %s", pending, exc)


importlib.import_module("concurrent.futures.thread")  # its exit hook registered before ours
getattr(threading, "_register_atexit", atexit.register)(_finish)
