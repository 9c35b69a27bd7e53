"""Which process is which on this node: a pid and its start time name one process, even
after the pid is recycled (a container restarted with /dev/shm kept counts pids from 1
again). The daemon's lock file, the checkpointer's pools and its step owners record both."""
from __future__ import annotations


def _stat_fields(pid: int) -> list[bytes] | None:
    """/proc/<pid>/stat after the command name (field 3 on); None if no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2:].split()


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``R``, ``S``, ``D``, ``T`` stopped, ``Z``...);
    None if there is no such process."""
    fields = _stat_fields(pid)
    return fields[0].decode() if fields else None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22);
    None if there is no such process."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, start: int | None = None) -> bool:
    """``pid`` runs (a zombie does not) and, if ``start`` is given, is the process that
    started then, not a later one that got the same pid."""
    if not pid or process_state(pid) in (None, "Z"):
        return False
    return start is None or process_start(pid) == start
