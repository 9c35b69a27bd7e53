"""Saves still pending when a script ends: finished before the process exits.

A script whose last act is ``save()`` (no ``wait()``) reaches the interpreter's exit with the
save's background still to run. Past concurrent.futures' exit hook no thread pool takes work
any more, and that background starts pools of its own: the save failed, and no one was left
to wait for its handle and hear of it (review ckpt6: with 2 ranks, or a fast tier, the step
was lost without a word). The hook here is registered as concurrent.futures registers its
own, and after it, so it runs first (threading's exit hooks run before atexit's, the latest
registered first): it waits for every pending save, says which, and logs a failure.

The same wait runs first when the script destroys its default process group
(``dist.destroy_process_group()``, how torchrun scripts end), whose end takes the
Checkpointer's own groups along: a save still pending there failed on every rank (review
ckpt7, without a word when no fast tier held its copy).
"""
from __future__ import annotations

import atexit
import functools
import importlib
import logging
import os
import threading
import weakref

log = logging.getLogger(__name__)

_live: weakref.WeakSet = weakref.WeakSet()  # the Checkpointers of the process
_given_up = False  # a Ctrl-C stopped a wait (in destroy_process_group): the exit does not wait again


def _forked() -> None:
    """In a forked child (a DataLoader's worker, a multiprocessing process), whose end runs
    the hook too: its copies of the parent's Checkpointers are not its own, and their
    pending saves are the parent's to finish. Waited for there, the child never ended, and
    a parent joining it waited with it (diffrev-8)."""
    _live.clear()


os.register_at_fork(after_in_child=_forked)


def track(checkpointer) -> None:
    """Have ``checkpointer``'s pending saves finished at the interpreter's exit, and before
    the default process group is destroyed."""
    _live.add(checkpointer)
    _guard_destroy()


def _guard_destroy() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` (once) so that destroying the default
    group (no argument, or WORLD) first waits for the pending saves (the module docstring)."""
    import torch.distributed as dist

    original = getattr(dist, "destroy_process_group", None)
    if original is None or getattr(original, "_cachemw_original", None) is not None:
        return

    @functools.wraps(original)
    def destroy_process_group(group=None, *args, **kwargs):
        if group is None or group is getattr(dist.group, "WORLD", None):
            _finish("the process group is being destroyed")
        return original(group, *args, **kwargs)

    destroy_process_group._cachemw_original = original
    dist.destroy_process_group = destroy_process_group


def _finish(why: str = "exiting") -> None:
    global _given_up
    for ck in list(_live):
        try:
            pending = ck._pending_steps()
        except Exception:  # noqa: BLE001 - one made half-way (its constructor raised)
            continue
        if pending and _given_up:
            log.warning("%s: not waiting for the checkpoint of step(s) %s (Ctrl-C stopped "
                        "the wait before)", why, pending)
        elif pending:
            log.warning("%s: waiting for the checkpoint of step(s) %s to commit first (call "
                        "wait() to wait yourself; Ctrl-C stops the wait)", why, pending)
            try:
                ck.wait()
            except KeyboardInterrupt:  # the save's threads may still end it: whole, or not at all
                log.error("Ctrl-C: no longer waiting for the checkpoint of step(s) %s (what is "
                          "already writing may still commit it before the process ends; a "
                          "step is committed whole or not at all)", pending)
                if why != "exiting":  # in destroy_process_group: the script's to handle
                    _given_up = True
                    raise
            except BaseException as exc:
                log.error("the checkpoint of step(s) %s was not committed: %s", pending, exc)
        log_unreported(ck)


def log_unreported(ck) -> None:
    """Log the saves of ``ck`` that failed without a ``wait()`` having raised it: a save
    that failed before the end, with nobody waiting, ended the script with exit 0 and not
    a word (review ckpt7)."""
    for handle in ck._unreported():
        handle._reported = True
        log.error("the checkpoint of step %d failed, and no wait() reported it: %s",
                  handle.step, handle._error)


importlib.import_module("concurrent.futures.thread")  # its exit hook registered before ours
getattr(threading, "_register_atexit", atexit.register)(_finish)
