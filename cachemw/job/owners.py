"""Marks of the job's own leftovers: what it leaves in /dev/shm (scratch dirs) and on the
store (a run's checkpoint directory) is marked with the job's pid, start time and host, so
that a later job can remove what a job killed before its cleanup (SIGKILL, an out-of-memory
kill) left, and nothing of a job still running, here or on another node."""
from __future__ import annotations

import os
import socket

from ..processes import process_alive, process_start

OWNER = ".cachemw-job-owner"  # the mark's file name, in each marked directory


def mark() -> str:
    """This process's mark: ``pid start host``."""
    return f"{os.getpid()} {process_start(os.getpid())} {socket.gethostname()}"


def gone(text: str) -> bool:
    """Whether the job of mark ``text`` is gone: on this host, and no longer running. A
    mark of another host is never judged gone (its job may run there); ValueError for a
    text that is no mark."""
    pid, start, host = text.split()
    if host != socket.gethostname():
        return False
    return not process_alive(int(pid), None if start == "None" else int(start))
