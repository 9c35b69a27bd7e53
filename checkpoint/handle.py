"""The handle of one asynchronous save: two commit levels and one outcome.

``fast`` is set when the checkpoint is committed in the fast node-local tier (or at the root
when there is no fast tier), ``durable`` when it is committed at the root. A failure sets both
events and is raised by every ``wait``, so a waiter never blocks on a save that died.
"""
from __future__ import annotations

import threading
import traceback


class SaveHandle:
    def __init__(self, step: int) -> None:
        self.step = step
        self.path: str | None = None  # root directory of the checkpoint once known
        self.bytes_written = 0  # by this rank (set once written)
        self._fast = threading.Event()
        self._durable = threading.Event()
        self._error: BaseException | None = None
        self._fast_ok = False
        self._reported = False  # its failure raised by a wait(), or asked for (exception())

    def __repr__(self) -> str:
        state = "failed" if self._error else "durable" if self.durable else "in memory" if self.in_memory else "writing"
        return f"SaveHandle(step={self.step}, {state})"

    @property
    def in_memory(self) -> bool:
        """Committed in the fast tier (readable by ``load`` on this node)."""
        return self._fast_ok

    @property
    def durable(self) -> bool:
        """Committed at the root."""
        return self._durable.is_set() and self._error is None

    def done(self) -> bool:
        """True once the save is durable or has failed."""
        return self._durable.is_set()

    def exception(self) -> BaseException | None:
        if self._error is not None:  # (asked while still writing, a later failure is not seen)
            self._reported = True
        return self._error

    def wait(self, timeout: float | None = None) -> None:
        """Block until durable at the root; raise the save's exception if it failed."""
        self._wait(self._durable, timeout)

    def wait_in_memory(self, timeout: float | None = None) -> None:
        """Block until committed in the fast tier (a later failure to drain does not count)."""
        if not self._fast.wait(timeout):
            raise TimeoutError(f"checkpoint of step {self.step} not in memory within {timeout} s")
        if not self._fast_ok and self._error is not None:
            self._reported = True
            raise self._error

    def _wait(self, event: threading.Event, timeout: float | None) -> None:
        if not event.wait(timeout):
            raise TimeoutError(f"checkpoint of step {self.step} not committed within {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error

    # -- set by the checkpointer's worker ------------------------------------------------------
    def _set_fast(self) -> None:
        self._fast_ok = True
        self._fast.set()

    def _set_durable(self) -> None:
        self._fast_ok = True
        self._fast.set()
        self._durable.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._fast.set()
        self._durable.set()


def without_frames(error: BaseException, cause: BaseException) -> BaseException:
    """``error`` (``cause`` itself, or what it is told as, chained to it) as a handle keeps
    it until ``wait()``: its traceback as text (a note), not as frames. The frames lead up
    the worker's stack to the save's staged snapshot, which the stager cannot reuse while
    they live: with saves failing on a full disk, every save would otherwise hold one more
    copy of the state."""
    if error is not cause:
        error.__cause__ = cause
    text = "".join(traceback.format_exception(error))
    seen, link = set(), error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    error.add_note("in the checkpoint's background save:\n" + text.rstrip())
    return error
