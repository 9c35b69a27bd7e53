"""How long one read call may wait on a silent node daemon, in all: one ``daemon_timeout``.

Each wait on the daemon is bounded by ``daemon_timeout`` (connection.py, wire.py), but one call
(a ``cat`` of many files, a ``cat_file``, a read of an open file) may wait on it more than
once: the ring, then a lease, a new connection's check that the daemon is not stopped, a
lease on the fill writer's behalf when its queue is full. With the daemon stopped, a call
waited two timeouts (review faults3, defect 6), where the README promises that a read goes
to the source once the daemon has been silent for ``daemon_timeout`` seconds. So a read
call carries a budget of silence (``ReadCall``): every wait that ends with the daemon
silent spends what it waited, the next waits are bounded by what is left, and once it is
spent the rest of the call asks the daemon nothing (its misses read the source, counted as
fallbacks). A wait that the daemon answers spends nothing (a daemon at work says "busy").

The budget is the calling thread's: threads of one call that fetch side by side do not ask
the daemon, and another thread's call has its own.
"""
from __future__ import annotations

import os
import threading

_local = threading.local()


class ReadCall:
    """``with ReadCall(timeout):`` around a read call; nested ones share the outermost's
    budget (a ``cat_file`` that starts over, a batch read per path again)."""

    __slots__ = ("timeout", "outer")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.outer = False

    def __enter__(self) -> ReadCall:
        if getattr(_local, "left", None) is None:
            self.outer = True
            _local.left = self.timeout
        return self

    def __exit__(self, *exc) -> None:
        if self.outer:
            _local.left = None


def silence_left(timeout: float) -> float:
    """How long this thread may wait on a silent daemon now: ``timeout``, or less in a read
    call that has waited on silence already (0 or less: it may not wait at all)."""
    left = getattr(_local, "left", None)
    return timeout if left is None else min(timeout, left)


def waited_silent(seconds: float) -> None:
    """This thread waited ``seconds`` on a daemon that stayed silent."""
    left = getattr(_local, "left", None)
    if left is not None:
        _local.left = left - seconds


def _reset_in_child() -> None:
    """A child forked inside a read call (by another thread) starts outside of one."""
    global _local
    _local = threading.local()


os.register_at_fork(after_in_child=_reset_in_child)
