"""An emulated parallel filesystem: a local directory mounted through FUSE with a PFS's costs.

DLIO reads POSIX paths only, so a slow store for it has to be a mount. This one passes every
call through to ``backing`` and charges, per call:

- ``--open-ms`` per file opened: the first-byte latency of a busy Lustre/GPFS (a metadata
  lookup plus the first RPC to a storage target);
- ``--meta-ms`` per stat or directory listing;
- every byte read or written draws on one FIFO bandwidth budget of ``--mbps`` MB/s shared by
  all processes: the node's share of a store under load. Requests queue for it, as RPCs queue
  at a busy storage target.

Mounted with ``direct_io``: no page cache, so every epoch reads the store again, as a dataset
larger than the node's memory would. Needs libfuse2 (Debian ``libfuse2``) and ``fusepy``;
as root, no ``fusermount``. Runs in the foreground until unmounted (``umount MOUNT``).

    python benchmarks/slowfs.py BACKING MOUNT --open-ms 10 --meta-ms 2 --mbps 40
"""
from __future__ import annotations

import argparse
import errno
import os
import threading
import time

from fuse import FUSE, FuseOSError, Operations


class Bandwidth:
    """One FIFO budget of ``rate`` bytes/s: each request ends when its bytes have had their turn."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.lock = threading.Lock()
        self.free_at = time.monotonic()

    def spend(self, nbytes: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.free_at = max(now, self.free_at) + nbytes / self.rate
            wait = self.free_at - now
        time.sleep(wait)


class SlowFS(Operations):
    def __init__(self, backing: str, open_s: float, meta_s: float, bandwidth: Bandwidth) -> None:
        self.root = os.path.realpath(backing)
        self.open_s, self.meta_s, self.bw = open_s, meta_s, bandwidth

    def _p(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except OSError as exc:
            raise FuseOSError(exc.errno or errno.EIO) from None

    # metadata
    def getattr(self, path, fh=None):
        time.sleep(self.meta_s)
        st = self._call(os.lstat, self._p(path))
        return {k: getattr(st, k) for k in ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime",
                                             "st_nlink", "st_size", "st_uid", "st_ino")}

    def readdir(self, path, fh):
        time.sleep(self.meta_s)
        return [".", ".."] + self._call(os.listdir, self._p(path))

    def access(self, path, mode):
        if not os.access(self._p(path), mode):
            raise FuseOSError(errno.EACCES)

    def statfs(self, path):
        st = os.statvfs(self._p(path))
        return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                             "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

    def chmod(self, path, mode):
        return self._call(os.chmod, self._p(path), mode)

    def chown(self, path, uid, gid):
        return self._call(os.chown, self._p(path), uid, gid)

    def utimens(self, path, times=None):
        return self._call(os.utime, self._p(path), times)

    def mkdir(self, path, mode):
        time.sleep(self.meta_s)
        return self._call(os.mkdir, self._p(path), mode)

    def rmdir(self, path):
        time.sleep(self.meta_s)
        return self._call(os.rmdir, self._p(path))

    def unlink(self, path):
        time.sleep(self.meta_s)
        return self._call(os.unlink, self._p(path))

    def rename(self, old, new):
        time.sleep(self.meta_s)
        return self._call(os.rename, self._p(old), self._p(new))

    def link(self, target, source):
        return self._call(os.link, self._p(source), self._p(target))

    def symlink(self, target, source):
        return self._call(os.symlink, source, self._p(target))

    def readlink(self, path):
        return self._call(os.readlink, self._p(path))

    # data
    def open(self, path, flags):
        time.sleep(self.open_s)
        return self._call(os.open, self._p(path), flags)

    def create(self, path, mode, fi=None):
        time.sleep(self.open_s)
        return self._call(os.open, self._p(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def read(self, path, size, offset, fh):
        data = self._call(os.pread, fh, size, offset)
        self.bw.spend(len(data))
        return data

    def write(self, path, data, offset, fh):
        self.bw.spend(len(data))
        return self._call(os.pwrite, fh, data, offset)

    def truncate(self, path, length, fh=None):
        if fh is not None:
            return self._call(os.ftruncate, fh, length)
        return self._call(os.truncate, self._p(path), length)

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        return self._call(os.fsync, fh)

    def release(self, path, fh):
        return self._call(os.close, fh)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("backing")
    ap.add_argument("mount")
    ap.add_argument("--open-ms", type=float, default=10.0)
    ap.add_argument("--meta-ms", type=float, default=2.0)
    ap.add_argument("--mbps", type=float, default=40.0, help="MB/s (10^6 bytes) shared by all readers")
    args = ap.parse_args()
    fs = SlowFS(args.backing, args.open_ms / 1000, args.meta_ms / 1000, Bandwidth(args.mbps * 1e6))
    FUSE(fs, args.mount, foreground=True, nothreads=False, direct_io=True, big_writes=True)


if __name__ == "__main__":
    main()
