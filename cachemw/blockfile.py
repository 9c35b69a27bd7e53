"""On-disk format of one cached block: the data, then a checksum per page, then a trailer.

    [data: L bytes][xxh3-64 of each 4 KiB page: 8 bytes x n][trailer: 72 bytes]

Data comes first so a whole-block read is one ``read(L)`` straight into the bytes returned
to the caller (no copy) and is verified with the one whole-data checksum in the trailer; a
range read touches only the pages it needs and verifies those against their checksums.
The trailer also carries a tag (the digest of the source URL), so a daemon re-indexing its
tiers after a restart still knows which blocks belong to which file, and the block's key:
a block file is named by its key (``<key>``, or ``<key>.<lease>.staged`` while a fill is
staged), and a file whose trailer names another key, a sound block under a wrong name (a
misdirected write, a copy or rename by hand), is as corrupt as a flipped bit. Every read
verifies what it returns, so a flipped bit, a truncated file, another block's file or a
foreign file in a tier directory is detected, never served.
"""
from __future__ import annotations

import array
import errno
import hashlib
import mmap
import os
import stat
import struct
import sys

import xxhash

from .files import atomic_write, mappable

MAGIC = b"CMWB"
FORMAT_VERSION = 4  # 4: the trailer names the block's key
PAGE_SIZE = 4 * 1024  # a random 4 KiB read verifies 1-2 pages, not a large chunk
# magic, format, data_len, page_size, n_pages, hash of (page table + tag + key), hash of
# all the data, tag (digest of the source URL), key (the block's, as 16 bytes)
_TRAILER = struct.Struct("<4sIQIIQQ16s16s")
TRAILER_SIZE = _TRAILER.size
_hash = xxhash.xxh3_64_intdigest
SMALL_BLOCK = 64 * 1024  # read_block reads blocks up to this size with their tail at once
page_hash = _hash  # a page's checksum, the C function itself (for inlined hot paths)
_pread = os.pread


class CorruptBlock(OSError):
    """A cached block failed verification; the caller drops it and refetches from the source."""


# What a tier's block file may fail with that is the tier's fault (the disk, its permissions,
# its directories), not this process's (EMFILE, ENOMEM) nor a block that is not there. Here,
# with the block files, because every reader of them (the read path, open files) tells the
# two apart the same way. Not ENOTDIR: a tier directory (or a sub-directory) that is a file
# holds no block; the readers here take it as they take ENOENT, for a block absent (a miss:
# a probe of a never-cached block is no fault of a cached one).
TIER_FAULTS = frozenset({errno.EIO, errno.EACCES, errno.EPERM, errno.ELOOP,
                         errno.ENXIO, errno.ESTALE, errno.EROFS})
# the errors of opening a block file that say it is not there
ABSENT = (FileNotFoundError, NotADirectoryError)
# How a block file is opened for reading: never blocking, so that a FIFO (or a device) put
# in a tier by hand is met as damage, not waited on for good (an open of a FIFO waits for
# a writer; review loaders5: readers, and the daemon at its start and stop, hung there).
# O_NONBLOCK changes nothing for a regular file.
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC


def key_id(key: str) -> bytes:
    """The 16 bytes a trailer records for ``key``: a block key (32 hex digits, keys.py) as
    its digest, any other name (tests, tools) hashed to 16 bytes."""
    if len(key) == 32:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def path_key(path: str) -> bytes:
    """``key_id`` of the key a block file's name gives: the name up to its first dot
    (``<key>``, ``<key>.<lease>.staged``, the temp file a write renames into place)."""
    return key_id(path[path.rfind("/") + 1:].partition(".")[0])


def _expected_key(path: str, key: str | None) -> bytes:
    """What a read of the block file ``path`` expects its trailer to name: ``key`` where
    the caller has it, else the key its name gives."""
    return path_key(path) if key is None else key_id(key)


def n_pages(length: int, page_size: int = PAGE_SIZE) -> int:
    return max(1, -(-length // page_size))


def tail_size(length: int, page_size: int = PAGE_SIZE) -> int:
    return 8 * n_pages(length, page_size) + TRAILER_SIZE


def stored_size(length: int) -> int:
    """Bytes a block of ``length`` data bytes takes in a tier: the data, its checksum table
    and trailer (what tiers count against their capacity and placement charges)."""
    return length + tail_size(length)


def encode_tail(data: bytes | memoryview, page_size: int = PAGE_SIZE, tag: bytes = b"",
                key: bytes = b"") -> bytes:
    """Checksum table and trailer for ``data``, the block of ``key`` (``key_id``)."""
    view = memoryview(data)
    length = len(view)
    n = n_pages(length, page_size)
    # map over a list of views: a generator's frame per page cost half as much as the
    # hashing itself (an 8 MiB block has 2,048 pages)
    table = struct.pack(f"<{n}Q", *map(_hash, [view[i:i + page_size]
                                               for i in range(0, n * page_size, page_size)]))
    tag = tag.ljust(16, b"\0")
    key = key.ljust(16, b"\0")
    return table + _TRAILER.pack(MAGIC, FORMAT_VERSION, length, page_size, n,
                                 _hash(table + tag + key), _hash(view), tag, key)


def data_length(file_size: int, where: str = "block") -> int:
    """The data length of a block file of ``file_size`` bytes (the inverse of the layout)."""
    n = max(1, -(-(file_size - TRAILER_SIZE) // (PAGE_SIZE + 8)))
    for pages in (n - 1, n, n + 1):
        length = file_size - TRAILER_SIZE - 8 * pages
        if pages >= 1 and length >= 0 and n_pages(length) == pages:
            return length
    raise CorruptBlock(f"{where}: {file_size} bytes is not the size of any block file")


def _parse_tail(tail: bytes, length: int, page_size: int, where: str,
                key: bytes) -> tuple[tuple[int, ...], int]:
    """(page checksums, whole-data checksum) from a block's tail, checked for consistency."""
    n = n_pages(length, page_size)
    dhash = _check_tail(tail, 0, length, page_size, where, key)
    sums = array.array("Q", tail[:8 * n])  # compact: a table of 2,048 ints, 16 KiB
    if sys.byteorder == "big":  # stored little-endian
        sums.byteswap()
    return sums, dhash


def _check_tail(buf, at: int, length: int, page_size: int, where: str, key: bytes) -> int:
    """The whole-data checksum of the block whose tail starts at ``buf[at:]`` (running to its
    end), once the tail is checked for consistency: its length, the trailer and the key it
    names (``key``), the hash of the page table (not unpacked: a whole-block read needs
    none of its entries)."""
    n = n_pages(length, page_size)
    if len(buf) - at != 8 * n + TRAILER_SIZE:
        raise CorruptBlock(f"{where}: block has {len(buf) - at - 8 * n - TRAILER_SIZE:+d} bytes "
                           f"of unexpected length (truncated or overwritten)")
    magic, fmt, dlen, psize, npg, thash, dhash, tag, named = _TRAILER.unpack_from(buf, at + 8 * n)
    if magic != MAGIC or fmt != FORMAT_VERSION:
        raise CorruptBlock(f"{where}: not a cachemw block (bad trailer)")
    if (dlen, psize, npg) != (length, page_size, n):
        raise CorruptBlock(f"{where}: trailer says {dlen} bytes/{psize} pages/{npg}, "
                           f"expected {length}/{page_size}/{n}")
    if named != key:
        raise CorruptBlock(f"{where}: the file holds another block (its trailer names "
                           f"key {named.hex()})")
    table = bytes(buf[at:at + 8 * n]) if type(buf) is memoryview else buf[at:at + 8 * n]
    if _hash(table + tag + named) != thash:
        raise CorruptBlock(f"{where}: checksum table corrupted")
    return dhash


def _read_exact(fd: int, n: int) -> bytes:
    data = os.read(fd, n)
    if len(data) == n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_block(path: str, length: int, page_size: int = PAGE_SIZE, key: str | None = None) -> bytes | None:
    """The whole block at ``path`` (``length`` data bytes), verified; None if absent.
    ``key``: the block's, where the caller has it (else it is read off the file's name)."""
    try:
        fd = os.open(path, READ_FLAGS)
    except ABSENT:  # no file, or no directory for it (a tier directory made a file)
        return None
    want = tail_size(length, page_size) + 1  # +1: detect trailing garbage
    try:
        if length <= SMALL_BLOCK:  # one read; copying the data out costs less than a call
            whole = os.read(fd, length + want)
            data, tail = whole[:length], whole
            at = length
        else:  # read straight into the bytes returned
            data = _read_exact(fd, length)
            tail, at = os.read(fd, want), 0
    except IsADirectoryError:
        raise CorruptBlock(f"{path}: a directory, not a block file") from None
    except BlockingIOError:  # (READ_FLAGS) a FIFO with a writer: no block file either
        raise CorruptBlock(f"{path}: not a regular file") from None
    finally:
        os.close(fd)
    if len(data) != length:
        raise CorruptBlock(f"{path}: block truncated ({len(data)} of {length} bytes)")
    if _hash(data) != _check_tail(tail, at, length, page_size, path, _expected_key(path, key)):
        raise CorruptBlock(f"{path}: checksum mismatch")
    return data


def read_range(path: str, length: int, start: int, end: int, page_size: int = PAGE_SIZE,
               key: str | None = None) -> bytes | None:
    """Bytes ``[start, end)`` of the block at ``path``, verifying only the pages touched.

    It reads the trailer and just the checksums of those pages (not the whole table, which
    for an 8 MiB block is 16 KiB to read and hash): a damaged checksum entry shows up as a
    mismatch of its page, a damaged trailer or a file of the wrong size as a bad trailer.
    """
    if start <= 0 and end >= length:
        return read_block(path, length, page_size, key)
    try:
        fd = os.open(path, READ_FLAGS)
    except ABSENT:  # no file, or no directory for it (a tier directory made a file)
        return None
    n = n_pages(length, page_size)
    first, last = start // page_size, (max(end, start + 1) - 1) // page_size
    lo = first * page_size
    want = min(length, (last + 1) * page_size) - lo
    try:
        trailer = os.pread(fd, TRAILER_SIZE + 1, length + 8 * n)
        sums = os.pread(fd, 8 * (last - first + 1), length + 8 * first)
        data = os.pread(fd, want, lo)
    except IsADirectoryError:
        raise CorruptBlock(f"{path}: a directory, not a block file") from None
    except (BlockingIOError, OSError) as exc:  # a FIFO (ESPIPE; with a writer, EAGAIN)
        if isinstance(exc, BlockingIOError) or exc.errno == errno.ESPIPE:
            raise CorruptBlock(f"{path}: not a regular file") from None
        raise
    finally:
        os.close(fd)
    if len(trailer) != TRAILER_SIZE:
        raise CorruptBlock(f"{path}: block has the wrong size (truncated or overwritten)")
    magic, fmt, dlen, psize, npg, *_, named = _TRAILER.unpack(trailer)
    if magic != MAGIC or fmt != FORMAT_VERSION or (dlen, psize, npg) != (length, page_size, n):
        raise CorruptBlock(f"{path}: not a cachemw block of {length} bytes (bad trailer)")
    # (the trailer is not hashed here: a damaged key field fails this check too)
    if named != _expected_key(path, key):
        raise CorruptBlock(f"{path}: the file holds another block (its trailer names key "
                           f"{named.hex()})")
    if len(data) != want or len(sums) != 8 * (last - first + 1):
        raise CorruptBlock(f"{path}: block truncated")
    view = memoryview(data)
    for k, expected in enumerate(struct.unpack(f"<{last - first + 1}Q", sums)):
        if _hash(view[k * page_size:(k + 1) * page_size]) != expected:
            raise CorruptBlock(f"{path}: checksum mismatch in page {first + k}")
    return bytes(view[start - lo:end - lo])


def hash_of(data: bytes | memoryview) -> int:
    """The whole-data checksum a block's trailer records for ``data``."""
    return _hash(data)


def data_hash(fd: int, key: str, length: int, page_size: int = PAGE_SIZE) -> int:
    """The whole-data checksum recorded in the trailer of the open block file ``fd`` (the
    block of ``key``, ``length`` data bytes); CorruptBlock if the trailer does not
    describe that block."""
    trailer = os.pread(fd, TRAILER_SIZE + 1, length + 8 * n_pages(length, page_size))
    if len(trailer) != TRAILER_SIZE:
        raise CorruptBlock(f"fd {fd}: block has the wrong size")
    magic, fmt, dlen, psize, npg, _, dhash, _, named = _TRAILER.unpack(trailer)
    if (magic, fmt, dlen, psize, npg, named) != (MAGIC, FORMAT_VERSION, length, page_size,
                                                 n_pages(length, page_size), key_id(key)):
        raise CorruptBlock(f"fd {fd}: not the cachemw block {key} of {length} bytes")
    return dhash


def read_tag(path: str) -> bytes | None:
    """The tag recorded in a block file's trailer; None for a file that is no block of this
    format (another file, a directory, a block an older version wrote, one gone meanwhile).
    OSError for one that cannot be read (EIO, EACCES, ELOOP): a fault of the tier, which
    the caller counts."""
    try:
        fd = os.open(path, READ_FLAGS)
    except (*ABSENT, IsADirectoryError):
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < TRAILER_SIZE:  # (a FIFO: no block)
            return None
        trailer = os.pread(fd, TRAILER_SIZE, st.st_size - TRAILER_SIZE)
    finally:
        os.close(fd)
    magic, fmt, *_, tag, _ = _TRAILER.unpack(trailer)
    return tag if magic == MAGIC and fmt == FORMAT_VERSION else None


def write_block(path: str, data: bytes | memoryview, page_size: int = PAGE_SIZE,
                tag: bytes = b"") -> int:
    """Write a block atomically (temp file in the same directory, then rename).

    Returns the bytes it occupies. A crash leaves at most a ``*.tmp`` file, which the
    tier sweeps on start; readers never see a partial block.
    """
    tail = encode_tail(data, page_size, tag, path_key(path))
    atomic_write(path, data, tail)
    return len(data) + len(tail)


class HeldBlock:
    """A whole block file held open for a read that joins blocks (``join_blocks``), its
    tail checked: its bytes go from the page cache straight into the joined result,
    instead of through a fresh buffer per block (a fresh 8 MiB buffer costs 2,048 page
    faults, more than the copy). The descriptor keeps the file if the daemon evicts it
    meanwhile (a block is immutable under its key). ``tier``: where the reader found it."""

    __slots__ = ("fd", "path", "length", "dhash", "tier")

    def __init__(self, fd: int, path: str, length: int, dhash: int) -> None:
        self.fd, self.path, self.length, self.dhash, self.tier = fd, path, length, dhash, None

    def __len__(self) -> int:
        return self.length

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    __del__ = close  # one dropped between its hold and its read's end (an interrupt)


def hold_block(path: str, length: int, key: str | None = None) -> HeldBlock | None:
    """The whole block at ``path``, held open with its tail checked (see HeldBlock); None if
    absent. Its data is checked where it lands, in the joined result (``join_blocks``)."""
    try:
        fd = os.open(path, READ_FLAGS)
    except ABSENT:  # no file, or no directory for it (a tier directory made a file)
        return None
    try:
        _mappable_size(fd, path, length)
        want = tail_size(length) + 1  # +1: detect trailing garbage
        dhash = _check_tail(os.pread(fd, want, length), 0, length, PAGE_SIZE, path,
                            _expected_key(path, key))
    except BaseException:
        os.close(fd)
        raise
    return HeldBlock(fd, path, length, dhash)


def _mappable_size(fd: int, path: str, length: int) -> int:
    """The size of the block file ``fd``, if it is one a tier wrote whole (else CorruptBlock):
    a read through the mapping of a hole on a full tmpfs is SIGBUS, as is one past the end
    of a file truncated in place."""
    st = os.fstat(fd)
    if st.st_size != stored_size(length) or length == 0:
        raise CorruptBlock(f"{path}: {st.st_size} bytes, expected a block of {length}")
    if not mappable(st):  # never written so by a tier; mapped, a full tmpfs kills us
        raise CorruptBlock(f"{path}: a block file with holes (not one a tier wrote)")
    return st.st_size


def join_blocks(parts: list) -> tuple[bytes, dict[int, CorruptBlock]]:
    """``parts`` (bytes, and HeldBlocks) joined, and what is wrong with each held block
    whose bytes in the result are not the ones its tail records, by its index (corrupt:
    the result is then not to be used). Each held block is mapped only for the join and
    closed with it, and checked in the result, not before it is copied there: checked on
    the mapping and copied after
    the read's misses were fetched (seconds, on a slow store), a block file damaged in
    place meanwhile came back unchecked, and one truncated killed the reader with SIGBUS
    (review faults7). A truncation within the copy itself still would (the daemon never
    truncates a block file; a user damaging the tier by hand might), which is why open
    files, which keep their blocks for long, read them (OpenBlock)."""
    views, maps, bad = [], [], {}
    try:
        for i, part in enumerate(parts):
            if type(part) is not HeldBlock:
                views.append(part)
                continue
            try:
                size = _mappable_size(part.fd, part.path, part.length)
            except CorruptBlock as exc:  # damaged since it was held
                bad[i] = exc
                views.append(b"")
                continue
            mm = mmap.mmap(part.fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ)
            maps.append(mm)
            views.append(memoryview(mm)[:part.length])
        joined = b"".join(views)
    finally:
        for view in views:
            if type(view) is memoryview:
                view.release()
        for mm in maps:
            mm.close()
        for part in parts:
            if type(part) is HeldBlock:
                part.close()
    if bad:
        return joined, bad
    whole, at = memoryview(joined), 0
    for i, part in enumerate(parts):
        if type(part) is HeldBlock and _hash(whole[at:at + part.length]) != part.dhash:
            bad[i] = CorruptBlock(f"{part.path}: checksum mismatch")
        at += len(part)
    whole.release()
    return joined, bad


class OpenBlock:
    """A block file held open with its page table verified once, so an open file's small
    random reads (h5py, pyarrow) read and verify just the pages they touch: one ``pread``,
    no open, no seek, no tail to check again.

    Read, not memory-mapped: a mapped file truncated under a process (a tier file damaged
    in place) ends that process with SIGBUS at its next touch of the lost pages, which
    Python cannot catch; a read of it comes back short and the block is repaired. The
    descriptor keeps the file if the daemon evicts it meanwhile (POSIX keeps unlinked
    files alive); a block is immutable under its key, so it still holds the right bytes.
    """

    def __init__(self, path: str, length: int, known: tuple | None = None) -> None:
        """``known``: (inode, page table) of this block file as an earlier OpenBlock of it
        read them: the same file again needs no second read and check of its tail."""
        fd = os.open(path, READ_FLAGS)
        try:
            st = os.fstat(fd)
            size, self.ino = st.st_size, st.st_ino
            if size != stored_size(length) or length == 0:
                raise CorruptBlock(f"{path}: {size} bytes, expected a block of {length}")
            if known is not None and known[0] == self.ino:
                self.sums = known[1]
            else:
                self.sums, _ = _parse_tail(os.pread(fd, size - length, length), length,
                                           PAGE_SIZE, path, path_key(path))
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.path = path
        self.length = length

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the block (within it), every page they touch verified.
        Written for the random 4 KiB read, which touches one or two pages."""
        first, last = start // PAGE_SIZE, (end - 1) // PAGE_SIZE
        lo = first * PAGE_SIZE
        hi = (last + 1) * PAGE_SIZE
        if hi > self.length:
            hi = self.length
        data = _pread(self.fd, hi - lo, lo)
        if len(data) != hi - lo:
            raise CorruptBlock(f"{self.path}: {len(data)} bytes at {lo}, expected {hi - lo} "
                               f"(truncated)")
        sums = self.sums
        if last == first:
            if _hash(data) != sums[first]:
                raise CorruptBlock(f"{self.path}: checksum mismatch in page {first}")
        else:
            view = memoryview(data)
            for i in range(first, last + 1):
                at = (i - first) * PAGE_SIZE
                if _hash(view[at:at + PAGE_SIZE]) != sums[i]:
                    raise CorruptBlock(f"{self.path}: checksum mismatch in page {i}")
        return data if lo == start and hi == end else data[start - lo:end - lo]

    def still_cached(self) -> bool:
        """Is the open file still the tier's file? (An evicted one only pins memory.)"""
        try:
            return os.stat(self.path).st_ino == self.ino
        except OSError:
            return False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
