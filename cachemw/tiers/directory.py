"""A tier that keeps each block as one file in a directory: DRAM (/dev/shm) and NVMe.

Block files are spread over 256 sub-directories by the first two hex digits of the key.
Files are the data plane: any process of the node reads a hit with one open and two reads,
with no daemon round trip. Fills are atomic (temp + rename). Everything is private to the
job's user (0700 directories, 0600 files) because HPC nodes are shared.

A client's fill is staged: it writes ``<key>.<lease>.staged`` (itself atomically) and the
daemon, which granted lease number ``lease``, publishes it under its key, or drops it if the
lease was cancelled meanwhile (the file was written through the cache). Hits read files by
key without asking the daemon, so a block fetched before a write must never appear under
its key after it; and the name is the lease's own, so a late or leftover file of an ended
lease is never taken for another lease's fill.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from typing import Iterator

from .. import blockfile
from .base import BlockEntry, TierInfo

log = logging.getLogger(__name__)

FANOUT = tuple(f"{i:02x}" for i in range(256))  # the sub-directories, by first two hex digits
_STAGED = ".staged"


class DirectoryTier:
    def __init__(self, name: str, path: str, *, create: bool = False) -> None:
        self.name = name
        self.path = os.path.abspath(path)
        self.unreadable = 0  # block files (and sub-directories) scan could not read: forgotten
        if create:
            self._prepare()

    def _prepare(self) -> None:
        """Create the tier directory and its sub-directories, 0700; an OSError names the
        tier and its directory (the daemon's start-up error its starter shows)."""
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            st = os.stat(self.path)
            if st.st_uid != os.getuid():
                raise PermissionError(errno.EPERM, f"owned by uid {st.st_uid}, not by us")
            # a shared directory (others may write, or sticky, as /tmp and /dev/shm are): made
            # 0700 below, it would lock its other users out. Group-writable alone is what a
            # umask of 002 gives a directory of one's own: made private as any other.
            if st.st_mode & (stat.S_ISVTX | 0o002):
                raise PermissionError(errno.EPERM, "other users can write to it (a shared "
                                      "directory, as /tmp or /dev/shm are): give a directory of "
                                      f"its own, e.g. {os.path.join(self.path, f'cachemw-{os.getuid()}')}")
            os.chmod(self.path, 0o700)
            present = self._fanout_present()
            for sub in FANOUT:
                if sub in present:
                    continue
                path = os.path.join(self.path, sub)
                try:
                    os.mkdir(path, 0o700)
                except FileExistsError:  # a file or link under a sub-directory's name, in a
                    os.unlink(path)      # directory only we can write to: debris, replaced
                    os.mkdir(path, 0o700)
        except OSError as exc:
            raise type(exc)(exc.errno, f"{self.name}_dir {self.path} is unusable: "
                                       f"{exc.strerror or exc}") from None
        self._identity = (st.st_dev, st.st_ino)

    def intact(self) -> bool:
        """Is the directory the one prepared, private, with its sub-directories? (It may be
        removed under a running daemon, or recreated by someone else's makedirs 0755.)"""
        try:
            st = os.stat(self.path)  # as _prepare saw it (a tier dir may be a link the user set)
        except OSError:
            return False
        if (st.st_dev, st.st_ino) != getattr(self, "_identity", None) or st.st_mode & 0o077:
            return False
        try:
            return len(self._fanout_present()) == len(FANOUT)
        except OSError:
            return False

    def _fanout_present(self) -> set[str]:
        """The sub-directories there are (a file in one's place is none): one listing."""
        with os.scandir(self.path) as it:
            return {e.name for e in it if len(e.name) == 2 and e.is_dir(follow_symlinks=False)}

    def repair(self) -> None:
        """Make the directory whole and private again (raises OSError if it cannot be)."""
        self._prepare()

    def block_path(self, key: str) -> str:
        return f"{self.path}/{key[:2]}/{key}"

    def get(self, key: str, length: int, start: int = 0, end: int | None = None) -> bytes | None:
        path = f"{self.path}/{key[:2]}/{key}"
        if start == 0 and (end is None or end >= length):
            return blockfile.read_block(path, length, key=key)
        return blockfile.read_range(path, length, start, length if end is None else end, key=key)

    def view(self, key: str, length: int) -> blockfile.HeldBlock | None:
        """The whole block of ``key`` held open, its tail checked, for a read that joins it
        with others (see blockfile.join_blocks, which checks its data); None if absent."""
        return blockfile.hold_block(f"{self.path}/{key[:2]}/{key}", length, key)

    def put(self, key: str, data: bytes, tag: bytes = b"") -> int:
        return blockfile.write_block(self.block_path(key), data, tag=tag)

    def staged_path(self, key: str, lease: int) -> str:
        return f"{self.path}/{key[:2]}/{key}.{lease}{_STAGED}"

    def stage(self, key: str, data: bytes, lease: int, tag: bytes = b"") -> int:
        """Write the fill of lease ``lease``, for the daemon to publish (or drop)."""
        return blockfile.write_block(self.staged_path(key, lease), data, tag=tag)

    def publish(self, key: str, lease: int) -> bool:
        """Make lease ``lease``'s staged fill the block of ``key``; False if none is staged."""
        try:
            os.rename(self.staged_path(key, lease), self.block_path(key))
        except OSError:  # none staged (or the tier directory is gone): not published
            return False
        return True

    def unstage(self, key: str, lease: int) -> None:
        try:
            os.unlink(self.staged_path(key, lease))
        except OSError:  # none staged: nothing to do; a failing directory: not ours to fix
            pass

    def delete(self, key: str) -> int:
        path = self.block_path(key)
        try:
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):  # a directory under a block's name: never ours
                shutil.rmtree(path)  # (reads count it corrupt), gone with what it holds
            else:
                os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):  # not there (its directory is no directory)
            return 0
        return st.st_size

    def contains(self, key: str) -> bool:
        return os.path.exists(self.block_path(key))

    def stat(self) -> TierInfo:
        usage = shutil.disk_usage(self.path)
        return TierInfo(self.name, self.path, usage.total, usage.free)

    def scan(self) -> Iterator[BlockEntry]:
        """Blocks on disk; leftover temp and staged files of fills whose writer or lease
        died (the daemon is starting: no lease is held), and files under a block's name
        that are no block of this format (an older version's, after an upgrade), are
        removed on the way. A file or sub-directory that cannot be read (EIO, EACCES, a
        symlink loop) is a fault of this tier, not of the daemon: it is forgotten (removed
        where it can be), counted in ``unreadable`` and logged once per scan, and the scan
        goes on (one bad sector must not keep every daemon of the node from starting)."""
        faults: list[str] = []
        for sub in FANOUT:
            d = os.path.join(self.path, sub)
            try:
                with os.scandir(d) as it:
                    for entry in it:
                        found = self._scanned(sub, entry, faults)
                        if found is not None:
                            yield found
            except (FileNotFoundError, NotADirectoryError):  # gone, or a file in its place
                continue
            except OSError as exc:  # the sub-directory cannot be listed (or listed whole)
                faults.append(f"{d}: {exc.strerror or exc}")
        if faults:
            self.unreadable += len(faults)
            log.warning("%s tier: forgot %d block file(s) that could not be read (first: %s)",
                        self.name, len(faults), faults[0])

    def sweep_leftovers(self, sub: str, before: float, live=lambda key, lease: False) -> tuple[int, int]:
        """Remove the fill files in the sub-directory ``sub`` whose writer died while a
        daemon ran (scan removes them only at start): temp files (``*.tmp``) and staged
        fills (``<key>.<lease>.staged``) last written before ``before`` (a time.time()),
        but not the staged fill of a lease ``live(key, lease)`` says is held. Returns the
        files and bytes removed."""
        files = freed = 0
        try:
            with os.scandir(os.path.join(self.path, sub)) as it:
                entries = [e for e in it if e.name.endswith((".tmp", _STAGED))]
        except OSError:  # gone, no directory: check_tiers' business
            return 0, 0
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
                if st.st_mtime >= before:
                    continue
                if entry.name.endswith(_STAGED):
                    key, _, lease = entry.name[:-len(_STAGED)].partition(".")
                    if lease.isdigit() and live(key, int(lease)):
                        continue
                os.unlink(entry.path)
            except OSError:  # gone meanwhile (published, renamed into place, unstaged)
                continue
            files += 1
            freed += st.st_size
        return files, freed

    def _scanned(self, sub: str, entry: os.DirEntry, faults: list[str]) -> BlockEntry | None:
        """The block of one entry of the sub-directory ``sub``, or None (not a block: a
        leftover removed, a foreign name left alone, a file that cannot be read forgotten
        and noted in ``faults``)."""
        if entry.name.endswith((".tmp", _STAGED)):
            try:
                os.unlink(entry.path)
            except OSError:
                pass
            return None
        if len(entry.name) != 32 or not entry.name.startswith(sub):
            return None
        try:
            st = entry.stat()
            tag = blockfile.read_tag(entry.path)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP (a link to itself), EIO (a bad sector), EACCES
            faults.append(f"{entry.path}: {exc.strerror or exc}")
            self._forget(entry.name)
            return None
        if tag is None:  # under a block's name, no block of this format (one an older
            self._forget(entry.name)  # version wrote): not served, nor counted as
            return None  # corrupt; its room is freed
        return BlockEntry(entry.name, st.st_size, max(st.st_atime, st.st_mtime), tag)

    def _forget(self, key: str) -> None:
        """Remove the file of ``key`` if it can be (what cannot is left, unindexed)."""
        try:
            self.delete(key)
        except OSError:
            pass

    def clear(self) -> int:
        """Delete every block file (and leftover temp file) of this tier; nothing else.
        Returns the bytes freed. Only names this tier creates are touched, so a tier
        pointed at a shared directory never deletes anything that is not ours."""
        freed = 0
        for entry in list(self.scan()):
            freed += self.delete(entry.key)
        for sub in FANOUT:
            try:
                os.rmdir(os.path.join(self.path, sub))
            except OSError:
                pass
        return freed

    def close(self) -> None:
        pass
