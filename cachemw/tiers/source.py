"""The source tier: the store the dataset really lives on (a PFS path, S3, any fsspec URL).

It is the bottom of the hierarchy and the fallback for every failure above it, so it is
addressed by path and byte range rather than by block key.

Every read from it names the version it is for (the token of the block key it fills, or
of the file an open handle pinned) and returns bytes of that version or raises
``ChangedSourceError``: a block cached under a version's key holds that version's bytes,
and a read that mixes cached blocks with fetched ones never mixes versions. The check is
here, once, for every caller: a client's fills and direct reads, an owner node's fills for
its peers, the daemon's prefetches. How a read is pinned depends on the store:

- local files (fsspec's own ``LocalFileSystem``): open, ``fstat`` the descriptor and
  compare its token with the version, ``pread``, ``fstat`` again (an in-place rewrite
  during the read moves mtime and ctime): a replaced file is caught by its inode, a
  rewritten one by its times. Costs two ``fstat`` calls on a miss; hits are untouched.
- S3 (s3fs): one GET pinned to the version: ``VersionId`` when the token has one (a
  version-aware bucket: the bytes stay readable after an overwrite), and ``IfMatch`` on the
  ETag; the ETag the response carries is compared too, for stores that ignore ``IfMatch``.
- HTTP (fsspec's ``HTTPFileSystem``): a GET with ``If-Match`` on a strong ETag (412 if the
  resource has another one), and the ETag of the response compared, for servers that
  ignore ``If-Match`` (and weak ETags, which ``If-Match`` cannot compare). Without an
  ETag, the same GET, checked as below. A server that ignores ``Range`` is read all the
  same (its whole body, cut). Its errors are told: 404 and 410 FileNotFoundError, 401
  and 403 PermissionError, others (500, 503, no connection) an OSError naming the URL
  and the cause, never a missing file (fsspec's ``info`` says FileNotFoundError for
  all: ``source_info`` tells them apart).
- anything else (and S3 without an ETag): read, then ask the
  store for the file's info past the target's own caches (``invalidate_cache(path)``
  first) and compare tokens. A change before or during the read is then always seen; a
  change after it costs a spurious retry, never wrong bytes.

A file whose version nobody knows yet (``read_first``): on HTTP and S3 a GET tells the
version along with the bytes (ETag, and the size in ``Content-Range`` or
``Content-Length``), so the first block of a cold read is fetched with a plain GET and the
file's info is made from that response, the same info (so the same version token) a HEAD
would have given: one request per cold file instead of a HEAD, then a GET. Where the
response cannot name the version (no ETag, no size, an encoded body, a refused range) the
caller asks for the info first, as for any other store.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import threading

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..keys import block_length, stat_token
from .fork_safe import ForkSafe
from .pinning import (MOVED_ON, NO_VERSION, ChangedSourceError, FirstBlock, changed, is_http, read_checked,
                      source_info)
from .source_http import first_http, read_http
from .source_s3 import first_s3, read_s3

__all__ = ["MOVED_ON", "PAGE_SIZE", "ChangedSourceError", "FirstBlock", "SourceTier", "source_for",
           "source_info"]

log = logging.getLogger(__name__)

_READ_CHUNK = 1 << 20  # reads to the end of a file whose size is unknown, this much a call

# The size every file of sysfs and configfs states, whatever its content (a page): a file
# stated this large on a local target is checked for its filesystem (on_pseudo_fs)
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Filesystems of the kernel's, whose files' stated sizes are not their contents' (a page,
# or 0): their files are read to their end, as a size of 0 is
_PSEUDO_FS = frozenset({"sysfs", "configfs", "proc", "debugfs", "tracefs", "securityfs",
                        "cgroup", "cgroup2", "bpf"})


class SourceTier:
    name = "source"
    fs = ForkSafe()

    def __init__(self, fs) -> None:
        self.fs = fs
        self._read = _reads_for(fs)
        self._first = _firsts_for(fs)
        self._versioned = False  # a first GET of this store has named a version
        self._local = isinstance(fs, LocalFileSystem)

    @property
    def concurrent(self) -> bool:
        """True if the store takes requests from several threads at once (client/fanout.py):
        fsspec's local filesystem, its async ones (S3, HTTP, GCS, Azure: each request a task
        on the store's loop), a ``dir`` filesystem over either. Not fsspec's tar or zip
        readers (one shared file object, sought then read) nor its FTP (one connection)."""
        return _takes_threads(self.fs)

    def on_pseudo_fs(self, path: str) -> bool:
        """Whether ``path`` (a local target's) is on a pseudo filesystem (sysfs, configfs,
        ...: _PSEUDO_FS), whose files' stated size (a page) is not their content's: it is
        read to its end, uncached, as a file stated as 0 bytes (``/proc``) is, where blocks
        of the stated size would never be whole. Asked only of files stated a page long
        (PAGE_SIZE), on every read of one (a hit too): told from the mount table, read once
        per process, never by a call to the source (a ``stat`` on a shared store is a
        metadata request). A regular file taken for one would still read right (to its
        end, pinned to its version), uncached."""
        return self._local and _pseudo_mount(path)

    @property
    def tells_versions(self) -> bool:
        """True if a GET of this store may name the file's version (see read_first)."""
        return self._first is not None

    def read_first(self, path: str, index: int, block_size: int) -> FirstBlock | None:
        """Block ``index`` of ``path`` and the file's info, both from one GET, for a file
        whose version is not known yet; FileNotFoundError if the store has no such file,
        and on HTTP the OSError its error answer or a failed request says (``read_http``).

        None if the response does not name the version (no ETag, no size, a body encoded
        for transfer, a range the store refused): the caller asks for the file's info, then
        reads (an empty file, a range past the end and a key that is an S3 "directory" take
        that way too, where the info says what they are). A store whose first answer had
        no ETag is not asked this way again (logged once): each of its files would cost a
        wasted GET."""
        first = self._first
        if first is None:
            return None
        start = index * block_size
        got = first(self.fs, path, start, start + block_size)
        if got is NO_VERSION and not self._versioned:
            self._first = None
            log.info("%s: the store sends no ETag with its data; cachemw asks it for each "
                     "file's info (HEAD) before the file's first read", path)
        if not isinstance(got, FirstBlock):
            return None
        self._versioned = True
        length = block_length(int(got.info["size"]), index, block_size)
        if len(got.data) != length:  # a store answering with other bytes than asked
            return None
        return got

    def read_block(self, path: str, index: int, block_size: int, file_size: int,
                   version: str) -> bytes:
        """Bytes of block ``index`` of ``path`` at ``version``, exactly as long as the file's
        size says; ChangedSourceError if the source has another version."""
        length = block_length(file_size, index, block_size)
        start = index * block_size
        if length == 0:
            return b""
        data = self._read(self.fs, path, start, start + length, version)
        if len(data) != length:
            raise changed(path, version, detail=f"{length} bytes expected at offset "
                           f"{start}, the source returned {len(data)}")
        return data

    def read_range(self, path: str, start: int, end: int, version: str) -> bytes:
        """Bytes ``[start, end)`` of ``path`` at ``version`` (``end`` within its size)."""
        if end <= start:
            return b""
        return self._read(self.fs, path, start, end, version)

    def read_all(self, path: str, version: str) -> bytes:
        """The whole file, read to its end: for files whose size the source states as 0
        (``/proc`` files, and empty files), which may hold bytes all the same, and files of
        a pseudo filesystem (on_pseudo_fs), which may hold fewer than they state."""
        return self._read(self.fs, path, 0, None, version)


_sources: dict[str, SourceTier] = {}
_sources_lock = threading.Lock()


def source_for(target_json: str) -> SourceTier:
    """The source a client described in fsspec's own JSON form (owner fills for other
    nodes, prefetches of announced blocks), built once per process."""
    with _sources_lock:
        src = _sources.get(target_json)
        if src is None:
            src = _sources[target_json] = SourceTier(fsspec.AbstractFileSystem.from_json(target_json))
        return src


def _takes_threads(fs) -> bool:
    inner = getattr(fs, "fs", None)
    if type(fs).__name__ == "DirFileSystem" and inner is not None:
        return _takes_threads(inner)
    return isinstance(fs, LocalFileSystem) or bool(getattr(fs, "async_impl", False))


def _reads_for(fs):
    """The version-pinned read for ``fs``. Descriptor reads are taken only by fsspec's own
    local filesystem and subclasses that keep its read methods: a subclass that changes
    how a file is read (adds latency, logs calls) is read through its own ``cat_file``."""
    cls = type(fs)
    if (isinstance(fs, LocalFileSystem) and cls.cat_file is LocalFileSystem.cat_file
            and cls._open is LocalFileSystem._open):
        return _read_local
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "s3" in protocols and hasattr(fs, "_call_s3"):
        return read_s3
    if is_http(fs):
        return read_http
    return read_checked


def _firsts_for(fs):
    """The version-telling first GET for ``fs`` (see SourceTier.read_first), or None."""
    read = _reads_for(fs)
    if read is read_http:
        return first_http
    if read is read_s3:
        return first_s3
    return None


# Filesystems whose SEEK_DATA takes the inode lock that a write() holds while it copies
# its bytes in: an lseek there returns only once a write in progress has ended.
_SEEK_WAITS_FOR_WRITES = frozenset({"tmpfs", "ext4", "ext3", "ext2", "btrfs"})
_seek_waits: dict[int, bool] = {}  # st_dev -> whether its filesystem is one of those


_mounts: list | None = None  # [(mount point, on a pseudo filesystem)], longest first


def _pseudo_mount(path: str) -> bool:
    """Whether the filesystem mounted where ``path`` lies (the longest mount point that
    holds it) is a pseudo one; a path under none of their mount points costs one
    ``startswith``."""
    global _mounts
    if _mounts is None:
        _mounts = _read_mounts()
    if not _mounts or not path.startswith(_mounts[0]):
        return False
    for point, pseudo in _mounts[1]:
        if path.startswith(point) or path + "/" == point:
            return pseudo
    return False


def _read_mounts() -> tuple:
    """(the mount points of pseudo filesystems, as a tuple for ``startswith``; every mount
    point with whether its filesystem is one, longest first), from /proc/self/mountinfo."""
    points = [(point, kind in _PSEUDO_FS) for _, point, kind in _mountinfo()]
    # each as a prefix ending in "/" ("/proc/", not "/proc": no "/processed" taken for it)
    points = [(p if p.endswith("/") else p + "/", is_pseudo) for p, is_pseudo in points]
    points.sort(key=lambda p: len(p[0]), reverse=True)
    pseudo = tuple(p for p, is_pseudo in points if is_pseudo)
    return (pseudo, points) if pseudo else ()


def _waits_for_writes(dev: int) -> bool:
    known = _seek_waits.get(dev)
    if known is None:
        known = _seek_waits[dev] = _fs_type(dev) in _SEEK_WAITS_FOR_WRITES
    return known


def _fs_type(dev: int) -> str:
    """The type of the filesystem mounted from device ``dev`` ('' if not found)."""
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    return next((kind for device, _, kind in _mountinfo() if device == wanted), "")


def _mountinfo() -> list[tuple[str, str, str]]:
    """(device as "major:minor", mount point, filesystem type) of each mount this process
    sees, from /proc/self/mountinfo ([] where it cannot be read)."""
    mounts = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and "-" in fields:
                    mounts.append((fields[2], fields[4].replace("\\040", " "),
                                   fields[fields.index("-") + 1]))
    except OSError:
        return []
    return mounts


def _read_local(fs, path: str, start: int, end: int | None, version: str) -> bytes:
    """The bytes of ``path`` at ``version``, by ``fstat`` of the descriptor before and
    after the read. A write() already under way when the read begins (another process
    rewriting the file in place) set the file's times when it began, so both stats would
    show the new version while the read saw part of the old bytes: on filesystems whose
    SEEK_DATA waits for it (tmpfs, ext4, btrfs), an lseek first lets it end. A write that
    begins during the read changes the times the second stat sees (the README's limits).
    Opened without blocking: a FIFO with no writer blocked its open for good, before the
    check below could refuse it (review loaders6). A regular file's reads then block as
    usual (O_NONBLOCK cleared: on Lustre it made lock requests non-waiting), and an open
    a write lease holds up (EAGAIN: Samba, an NFS server's delegations) is made again,
    waiting for it, as before (diffrev-11)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except BlockingIOError:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):  # a FIFO or device may never end
            raise OSError(errno.EINVAL, f"{path}: not a regular file (a device, FIFO "
                          f"or socket); read it directly, not through cachemw")
        os.set_blocking(fd, True)
        if _waits_for_writes(before.st_dev):
            try:
                os.lseek(fd, 0, os.SEEK_DATA)
            except OSError:  # ENXIO: no data (empty); anything else: it did not wait
                pass
        if stat_token(before) != version:
            raise changed(path, version, stat_token(before))
        if end is None:
            chunks = []
            while True:
                chunk = os.pread(fd, _READ_CHUNK, start)
                if not chunk:
                    break
                chunks.append(chunk)
                start += len(chunk)
            data = b"".join(chunks)
        else:
            data = os.pread(fd, end - start, start)
            while len(data) < end - start:  # a short read: very large ones, signals
                more = os.pread(fd, end - start - len(data), start + len(data))
                if not more:
                    break  # the file is shorter than its version says: read_block tells
                data += more
        after = os.fstat(fd)
        if stat_token(after) != version:
            raise changed(path, version, stat_token(after))
        return data
    finally:
        os.close(fd)


