"""Claims: which process of the node fetches a block from the source, decided without a
round trip to the daemon.

A miss used to ask the daemon for the block's lease before fetching it, so that one process
fetches a block while the others wait for its fill (single flight). That round trip sat on
the reader's path before every source request: 0.2-0.3 ms a miss on two busy cores, a
third of a miss's time against a 1 ms store. A claim gives the same single flight for the
cost of creating a file: the first process to create ``<runtime_dir>/claims/<key>``
(``O_EXCL``) fetches the block, and asks for its lease afterwards, from its fill writer,
with the bytes in hand (client/adopt.py). Everyone else who would fetch the block takes the
lease first as before, and the daemon grants a lease only together with the block's claim
(it creates the file for its own fills and for leases asked without one, and waits while
another process holds it), so a claim and a lease never both fetch one block.

The daemon removes a claim when the lease that came with it ends (the block published, or
not); a process whose claim brought no lease removes it itself. A claim whose process died
is stale: it names its holder (pid and start time, processes.py), and a waiter removes it.
The daemon empties the directory when it starts.

A client whose lease request went unanswered (a timeout, a broken connection) cannot know
whether the lease was granted: it removes the claims it brought itself, and the daemon,
ending the leases of the connection that is gone, removes them too. Each removes a claim
only while it still names that client (its lease request said who it is), so neither removes one
another process has taken since. Reading a claim and removing it are two steps: two
removers at the same instant can still remove a claim taken between them, at worst a
block fetched twice, never wrong bytes.

Claims are an optimisation over leases, so a claims directory that cannot be used (a file
in its place, unwritable, a full tmpfs) never fails a lease nor a read: taking a claim
raises for the caller to lease without one (the daemon) or to ask its lease first (a
client); releasing and looking at claims never raise (what cannot be removed is counted
in ``faults``, and a claim that cannot be read is not held); the daemon makes the
directory again where it can (``make``: a file in its place is debris in the private
runtime dir, replaced), and its start does not fail for it.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import time

from .processes import process_alive, process_start

log = logging.getLogger(__name__)

CLAIMS_DIR = "claims"
# a claim file is written right after it is created: an empty one this young is being written
_EMPTY_GRACE = 5.0


def claims_dir(runtime_dir: str) -> str:
    return os.path.join(runtime_dir, CLAIMS_DIR)


_me: tuple[int, str] = (0, "")


def holder_name() -> str:
    """What this process's claims hold: its pid and start time (a forked child, such as
    a DataLoader worker, has its own)."""
    global _me
    pid = os.getpid()
    if _me[0] != pid:
        _me = (pid, f"{pid} {process_start(pid) or 0}")
    return _me[1]


class Claims:
    """The claims directory of one node (made by its daemon, 0700 like the runtime dir)."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.faults = 0  # claims that could not be removed, and failed makes of the directory
        self._warned = False

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key)

    def take(self, key: str) -> bool:
        """True if this process now holds ``key``'s claim; False if another process does.
        Raises FileNotFoundError if there is no claims directory (no daemon made one), and
        another OSError if no claim can be made there (a full tmpfs, say), leaving none."""
        me = holder_name().encode()
        path = self._path(key)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return False
        try:
            os.write(fd, me)
        except OSError:  # an empty claim would hold others up until it is found stale
            os.close(fd)
            self.release(key)
            raise
        os.close(fd)
        return True

    def release(self, key: str, holder: str | None = None) -> None:
        """Remove ``key``'s claim; with ``holder`` (a ``holder_name()``), only while the
        claim names it (see the module docstring). A claim read empty is being written by
        whoever just took it, and one that cannot be read is not known to be ``holder``'s:
        both stay. Never raises: no claims directory (gone, a file in its place) holds no
        claim, and one that cannot be removed (EACCES, EIO) is counted in ``faults`` and
        logged once (it is found stale once its holder has died)."""
        path = self._path(key)
        try:
            if holder is not None:
                with open(path, "rb") as f:
                    if f.read() != holder.encode():
                        return
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as exc:
            if holder is None:
                self._fault(f"cannot remove the claim {path}", exc)

    def held(self, key: str) -> bool:
        """True while a live process holds ``key``'s claim; a stale claim (its holder died) is
        removed on the way. A holder that dies just after this has looked is seen next time.
        A claim path that cannot be read (a directory, a symlink loop, EIO) raises its
        OSError: no claim can be taken there, and the caller leases without one (counted),
        where "not held" would have it wait for a claim no one can take or end."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                text = f.read()
            age = time.time() - os.stat(path).st_mtime
        except (FileNotFoundError, NotADirectoryError):  # none, or no claims directory
            return False
        if not text:
            if age < _EMPTY_GRACE:
                return True
        else:
            try:
                pid, start = (int(x) for x in text.split())
            except ValueError:
                pid, start = 0, 0
            if process_alive(pid, start or None):
                return True
        self.release(key)  # stale: at worst a claim taken since is lost (a second fetch)
        return False

    def clear(self) -> int:
        """Remove every claim (the daemon, at its start: no lease survives a daemon). What
        cannot be listed or removed is counted in ``faults`` and left: such claims are
        found stale once their holders are gone."""
        removed = 0
        try:
            names = os.listdir(self.dir)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        except OSError as exc:
            self._fault(f"cannot list the claims in {self.dir}", exc)
            return 0
        for name in names:
            try:
                os.unlink(os.path.join(self.dir, name))
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._fault(f"cannot remove the claim {name} in {self.dir}", exc)
        return removed

    def make(self) -> bool:
        """Make the claims directory (0700) if it is not there; a file or link in its place
        (debris: the runtime dir is ours alone) is replaced. False, counted and logged
        once, if it cannot be made: then leases go without claims."""
        try:
            try:
                os.makedirs(self.dir, mode=0o700, exist_ok=True)
            except FileExistsError:  # something that is no directory under its name
                if stat.S_ISDIR(os.lstat(self.dir).st_mode):
                    return True
                os.unlink(self.dir)
                os.mkdir(self.dir, 0o700)
                log.warning("%s was no directory: made it again", self.dir)
        except OSError as exc:
            if exc.errno == errno.EEXIST and os.path.isdir(self.dir):
                return True  # made by another at the same instant
            self._fault(f"cannot make the claims directory {self.dir}", exc)
            return False
        return True

    def _fault(self, what: str, exc: OSError) -> None:
        self.faults += 1
        if not self._warned:
            self._warned = True
            log.warning("%s (%s): leases go on without claims (at worst a block fetched "
                        "twice; counted, logged once)", what, exc.strerror or exc)
