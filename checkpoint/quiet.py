"""Silence DCP's "torch.distributed is ... uninitialized, assuming the intent is to save/load in
a single process" warning, and only it, only while a single-process DCP call of ours runs.

``dcp.save``/``dcp.load`` warn on every call without a process group, even when told
``no_dist=True``; a single-process save is what cachemw meant, so the warning is noise (and
an error under ``-W error``). ``warnings.catch_warnings`` is not usable here: it swaps the
whole filter list and restores a snapshot on exit, and the Checkpointer calls DCP from its
worker thread, so leaving it would undo (or keep) filters the main thread set meanwhile. This
adds one entry matching that message and removes exactly that entry when the last such call
ends; every other warning is shown as the user's filters say.
"""
from __future__ import annotations

import contextlib
import re
import threading
import warnings
from typing import Iterator

MESSAGE = (r"torch\.distributed is (disabled, )?unavailable or uninitialized, "
           r"assuming the intent is to (save|load) in a single process")
# The entry exactly as ``warnings.filterwarnings`` stores it (it compiles messages with re.I).
_ENTRY = ("ignore", re.compile(MESSAGE, re.I), UserWarning, None, 0)

_lock = threading.Lock()
_active = 0
_installed_in: list | None = None


@contextlib.contextmanager
def single_process_dcp(no_dist: bool = True) -> Iterator[None]:
    """Around a DCP call made without a process group (``no_dist``); a no-op otherwise."""
    global _active, _installed_in
    if not no_dist:
        yield
        return
    with _lock:
        _active += 1
        if _active == 1:
            warnings.filterwarnings("ignore", message=MESSAGE, category=UserWarning)
            _installed_in = warnings.filters
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                # The list may have been swapped by a catch_warnings in another thread since:
                # take the entry out of both. No cache to invalidate: "ignore" records nothing.
                for filters in (_installed_in, warnings.filters):
                    while filters is not None and _ENTRY in filters:
                        filters.remove(_ENTRY)
                _installed_in = None
