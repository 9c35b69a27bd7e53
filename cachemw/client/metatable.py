"""The node's shared table of file metadata: what every process of the node learned of a
source file (its ``info``), mapped by each process instead of read record by record.

A new DataLoader worker over a warm cache reads thousands of files it has never seen; with
a record file per path, each first read cost an open, a read and a close (30 us and a 4 KiB
tmpfs page per file). Here the records live in a few hash tables the process maps once:
a lookup is a hash, two slices of the mapping and an unpickle, with no system call.

Entries are keyed by a string (the metadata cache uses the file's URL, so two stores with
the same paths, ``s3://b/k`` and ``gs://b/k``, never share an entry). Layout: ``SHARDS``
files ``<dir>/t<nn>``, each a fixed-size file:

    header (magic, format, capacity, count, data size, data used, superseded)
    index: capacity x (u64 path hash, u32 offset, u32 length), open addressing, 0 = empty
    data:  records [u64 xxh3 of payload][payload], payload = pickle((key, fetched, dropped,
           extra, pickled value)), appended; a rewritten entry points to a new record

``extra`` is a small tuple of plain values a reader needs on every lookup (for a file: its
size and version token), so a lookup unpickles the value itself only when it is asked for.

Readers never lock: a record is verified (checksum, and its own path) before it is used,
so a torn read (a writer under way) or a hash collision is a miss, and a miss only costs a
call to the source. Writers (one at a time: ``<dir>/lock``) append the record, then write
the index entry. A shard that fills up is rebuilt, live entries only, into a new file that
replaces it; the old one is then marked superseded, and a reader seeing the mark maps the
new one. A drop is an entry too (a tombstone with its time): a store of metadata fetched
before the drop is refused (metadata learned before a write through the cache must not
come back after it), and readers see the drop at once. A drop says whether the file was
written through the cache (``written``) or only found to have moved on at the source (a
read of its version failed there): its ``extra`` keeps the time of the last write, which a
later drop of the other kind carries over (fills fetched before a write are refused; fills
of a version whose read failed later are still that version's bytes). ``<dir>/drops``
counts the drops written, node-wide: a process tells from one mapped word whether any path
was dropped since it last looked (``drops``).

A shard file can go away under a process that has it mapped: the daemon that made the
directory stopped and freed its DRAM tier (the table with it), and the next write makes
the file anew. A process that writes to a shard and finds another file there than the one
it mapped maps the table again (``_put``): its own drop must be what its next lookup sees,
not the freed file's entries.

The files are in the daemon's 0700 metadata directory, as the records were: anyone able
to write them already controls the daemon.

Every file is mapped only with its space allocated (``files.preallocate`` before a shard is
published, ``files.mappable`` before a reader maps one): the directory is often on tmpfs
(/dev/shm, shared with other jobs), where a read through a mapping of a hole allocates a
page, and on a full one the kernel ends the reader with SIGBUS. A shard that cannot get its
space (ENOSPC) is not made: metadata is then not shared, and reads go on without it.
"""
from __future__ import annotations

import errno
import hashlib
import mmap
import os
import pickle
import struct
import threading

import xxhash

from ..files import flock_within, mappable, preallocate

SHARDS = 64
MAGIC = b"CMWT"
FORMAT = 2  # 2: shard files have their space allocated (1 made them sparse: see below)
_HEADER = struct.Struct("<4sIIIQQI")  # magic, format, capacity, count, data size, used, superseded
HEADER_SIZE = 64
_ENTRY = struct.Struct("<QII")  # path hash, record offset in the data area, record length
_SUM = struct.Struct("<Q")
FIRST_CAPACITY = 256  # index slots of a new shard (kept at most half full)
FIRST_DATA = 64 << 10
MAX_PAYLOAD = 16 << 10  # larger metadata is not shared (it is only an optimisation)
_SUPERSEDED = 32  # offset of the superseded word in the header
STORE_WAIT = 0.5  # seconds a store waits for another process's write; then not shared
DROP_WAIT = 5.0
_hash = xxhash.xxh3_64_intdigest
_COUNT = struct.Struct("<Q")
_DROP_ROOM = 256  # bytes a drop's record takes besides its path, at most (room to rebuild for)
DROPS = "drops"  # the file counting the drops written, node-wide


def path_hash(path: str) -> int:
    """A stable 64-bit hash of a path, never 0 (0 marks an empty index slot)."""
    h = int.from_bytes(hashlib.blake2b(path.encode(), digest_size=8).digest(), "little")
    return h or 1


class _Mapped:
    """One shard file as a reader maps it."""

    __slots__ = ("mm", "capacity", "index", "data", "end", "file")

    def __init__(self, mm: mmap.mmap, capacity: int, data_size: int, file: tuple) -> None:
        self.mm = mm
        self.file = file  # (st_dev, st_ino) of the mapped file
        self.capacity = capacity
        self.index = HEADER_SIZE
        self.data = HEADER_SIZE + capacity * _ENTRY.size
        self.end = self.data + data_size

    def superseded(self) -> bool:
        return self.mm[_SUPERSEDED] != 0


def _layout(fd: int) -> tuple[int, int, int, int, int] | None:
    """(capacity, count, data size, data used, file size) of the shard open at ``fd``."""
    head = os.pread(fd, _HEADER.size, 0)
    if len(head) != _HEADER.size:
        return None
    magic, fmt, capacity, count, data_size, used, _ = _HEADER.unpack(head)
    size = os.fstat(fd).st_size
    if (magic, fmt) != (MAGIC, FORMAT) or not capacity or \
            size != HEADER_SIZE + capacity * _ENTRY.size + data_size:
        return None
    return capacity, count, data_size, used, size


class MetaTable:
    def __init__(self, directory: str) -> None:
        self.dir = directory
        self._maps: list[_Mapped | None] = [None] * SHARDS
        self._drops: mmap.mmap | None = None  # the drop count, mapped at its first reading
        self._write_lock = threading.Lock()  # the file lock is per process, not per thread

    def forked(self) -> "MetaTable":
        """This table for a forked child: the mappings stay, the writer lock is new (the
        parent's writer thread, which did not come along, may have held it)."""
        child = MetaTable(self.dir)
        child._maps = list(self._maps)
        child._drops = self._drops
        return child

    def drops(self) -> int:
        """How many drops were written to the table, by every process of the node (0 if
        the count cannot be read: then no process can have written one either)."""
        m = self._drops
        if m is None:
            try:
                fd = self._open_drops()
            except OSError:
                return 0
            try:
                st = os.fstat(fd)
                if st.st_size < _COUNT.size or not mappable(st):
                    preallocate(fd, _COUNT.size)  # (keeps a count another process wrote)
                    if not mappable(os.fstat(fd)):
                        return 0
                m = self._drops = mmap.mmap(fd, _COUNT.size, mmap.MAP_SHARED, mmap.PROT_READ)
            except (OSError, ValueError):
                return 0
            finally:
                os.close(fd)
        return _COUNT.unpack_from(m, 0)[0]

    def _open_drops(self) -> int:
        return os.open(f"{self.dir}/{DROPS}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                       0o600)

    def _count_drop(self) -> None:
        """One more drop (under the writers' lock)."""
        fd = self._open_drops()
        try:
            head = os.pread(fd, _COUNT.size, 0)
            count = _COUNT.unpack(head)[0] if len(head) == _COUNT.size else 0
            os.pwrite(fd, _COUNT.pack(count + 1), 0)
        finally:
            os.close(fd)

    def _path(self, shard: int) -> str:
        """A shard's file, named by its format: processes of an earlier release still
        running on the node keep theirs (rebuilding a file of another format would empty
        it under them and leave them reading the replaced one)."""
        return f"{self.dir}/t{shard:02d}.{FORMAT}"

    # -- reading -----------------------------------------------------------------------

    def _mapped(self, shard: int) -> _Mapped | None:
        m = self._maps[shard]
        if m is not None and not m.superseded():
            return m
        try:
            fd = os.open(self._path(shard), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            layout = _layout(fd) if st.st_uid == os.getuid() and mappable(st) else None
            if layout is None:
                return None
            mm = mmap.mmap(fd, layout[4], mmap.MAP_SHARED, mmap.PROT_READ)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        # the superseded mapping is not closed here: another thread may be reading it
        # (it is unmapped once no one holds it)
        m = self._maps[shard] = _Mapped(mm, layout[0], layout[2], (st.st_dev, st.st_ino))
        return m

    def get(self, path: str) -> tuple | None:
        """(fetched, dropped, extra, pickled value) of ``path``, or None if the table has no
        (readable) entry for it (the value: ``pickle.loads`` of the last item)."""
        h = path_hash(path)
        m = self._mapped(h >> 58)
        if m is None:
            return None
        mm, capacity = m.mm, m.capacity
        i = h % capacity
        for _ in range(capacity):
            eh, off, length = _ENTRY.unpack_from(mm, m.index + i * _ENTRY.size)
            if eh == 0:
                return None
            if eh == h:
                found = _decode(mm, m.data + off, length, m.end, path)
                if found is not None:
                    return found
            i = (i + 1) % capacity
        return None

    # -- writing -----------------------------------------------------------------------

    def store(self, path: str, value, fetched: float, extra: tuple = ()) -> bool:
        """Share ``value`` (and ``extra``) fetched at ``fetched``, unless the entry was
        dropped since; False if not shared (dropped since, or the table busy or unusable)."""
        blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        payload = pickle.dumps((path, fetched, False, extra, blob),
                               protocol=pickle.HIGHEST_PROTOCOL)
        if len(payload) > MAX_PAYLOAD:
            return False
        return self._put(path, payload, fetched, False, STORE_WAIT)

    def drop(self, path: str, when: float, written: bool = True) -> bool:
        """Mark ``path`` dropped at ``when``: no store of metadata fetched before then, and
        no reader gets what was shared before. ``written``: the file was written through
        the cache (``written_at``); else a read found the version known moved on at the
        source. False if it could not be written."""
        return self._put(path, (when, True, written), when, True, DROP_WAIT)

    def _put(self, path: str, payload, when: float, dropped: bool, wait: float) -> bool:
        """``payload``: a record's pickled payload, or a drop's (when, True, written)."""
        h = path_hash(path)
        shard = h >> 58
        try:
            with self._write_lock, _FileLock(f"{self.dir}/lock", wait):
                for _ in range(3):
                    fd = self._open_for_write(shard)
                    try:
                        layout = _layout(fd)
                        if layout is not None:
                            done = _put_in(fd, layout, h, path, payload, when, dropped)
                            if done is not None:
                                self._follow(shard, fd)
                                if done and dropped:
                                    self._count_drop()
                                return done
                        need = (len(payload) + _SUM.size if isinstance(payload, bytes)
                                else len(path.encode()) + _DROP_ROOM)
                        self._rebuild(shard, fd, layout, need)
                    finally:
                        os.close(fd)
        except OSError:
            return False  # sharing metadata is an optimisation: never fail a read for it
        return False

    def _follow(self, shard: int, fd: int) -> None:
        """After a write to ``shard`` (open at ``fd``): if this process has another file of
        it mapped (the table's directory was freed and made anew since: a daemon that
        stopped), it maps the table again, every shard and the drop count, so that its
        lookups see what is written now rather than the freed files' entries."""
        m = self._maps[shard]
        if m is None or m.superseded():  # (rebuilt: the next lookup maps the new file)
            return
        st = os.fstat(fd)
        if m.file != (st.st_dev, st.st_ino):
            self._maps = [None] * SHARDS  # the old mappings go once no reader holds them
            self._drops = None

    def _open_for_write(self, shard: int) -> int:
        path = self._path(shard)
        try:
            return os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            self._write_shard(shard, FIRST_CAPACITY, FIRST_DATA, [])
            return os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)

    def _rebuild(self, shard: int, fd: int, layout, need: int) -> None:
        """Replace the shard by one with room for another entry of ``need`` bytes: the live
        entries (the newest record of each path, tombstones included) copied over."""
        live: list[tuple[int, bytes]] = []
        capacity, data_size = FIRST_CAPACITY, FIRST_DATA
        if layout is not None:
            capacity, count, data_size, _, _ = layout
            index = os.pread(fd, capacity * _ENTRY.size, HEADER_SIZE)
            base = HEADER_SIZE + capacity * _ENTRY.size
            for i in range(capacity):
                eh, off, length = _ENTRY.unpack_from(index, i * _ENTRY.size)
                if eh and length <= MAX_PAYLOAD + _SUM.size and off + length <= data_size:
                    live.append((eh, os.pread(fd, length, base + off)))
            if 2 * (len(live) + 1) > capacity:
                capacity *= 2
            data_size = max(data_size, 2 * (sum(len(r) for _, r in live) + need))
        self._write_shard(shard, capacity, data_size, live)
        if layout is not None:  # readers of the old file map the new one
            os.pwrite(fd, b"\1", _SUPERSEDED)

    def _write_shard(self, shard: int, capacity: int, data_size: int,
                     entries: list[tuple[int, bytes]]) -> None:
        index = bytearray(capacity * _ENTRY.size)
        data = bytearray()
        for eh, record in entries:
            i = eh % capacity
            while _ENTRY.unpack_from(index, i * _ENTRY.size)[0]:
                i = (i + 1) % capacity
            _ENTRY.pack_into(index, i * _ENTRY.size, eh, len(data), len(record))
            data += record
        tmp = f"{self._path(shard)}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                preallocate(fd, HEADER_SIZE + len(index) + data_size)  # ENOSPC: no shard
                _pwrite_whole(fd, _HEADER.pack(MAGIC, FORMAT, capacity, len(entries),
                                               data_size, len(data), 0), 0)
                _pwrite_whole(fd, bytes(index), HEADER_SIZE)
                if data:
                    _pwrite_whole(fd, bytes(data), HEADER_SIZE + len(index))
            finally:
                os.close(fd)
            os.rename(tmp, self._path(shard))
        except BaseException:  # no temp file left, whatever failed; re-raised
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


def _decode(buf, start: int, length: int, end: int, path: str) -> tuple | None:
    """The (fetched, dropped, extra, pickled value) of the record at ``start`` if it is
    whole and names ``path``; None otherwise (torn, foreign, another path of the hash)."""
    if length <= _SUM.size or start + length > end:
        return None
    payload = buf[start + _SUM.size:start + length]
    if _hash(payload) != _SUM.unpack_from(buf, start)[0]:
        return None
    try:
        stored, when, dropped, extra, blob = pickle.loads(payload)
    except Exception:  # a record of ours always loads; anything else is no record
        return None
    return (when, dropped, extra, blob) if stored == path else None


def written_at(found: tuple) -> float:
    """The time of the last write through the cache an entry (``MetaTable.get``) knows of:
    a drop's (one made before drops told their kind: its own time), or the one a record
    stored since the drop carries on (the 4th of its ``extra``; 0.0 for none)."""
    extra = found[2]
    if not found[1]:
        return extra[3] if len(extra) > 3 else 0.0
    return extra[0] if extra else found[0]


def _carry_write(payload: bytes, old: tuple | None) -> bytes:
    """A record's payload that keeps the time of the last write through the cache of the
    entry it replaces: a read of the file after a write must not make the write forgotten
    (a block fetched before it, still pending in a process, is not that file's any more)."""
    write = written_at(old) if old is not None else 0.0
    if not write:
        return payload
    path, when, dropped, extra, blob = pickle.loads(payload)
    if len(extra) != 3:  # (a record of a file: size, version, kind)
        return payload
    return pickle.dumps((path, when, dropped, extra + (write,), blob), protocol=pickle.HIGHEST_PROTOCOL)


def _drop_payload(path: str, when: float, written: bool, old: tuple | None) -> bytes | None:
    """The payload of a drop at ``when`` over the entry ``old`` (None: none), the later
    drop time and write time of the two kept; None if ``old`` says as much already."""
    last = old[0] if old is not None and old[1] else 0.0
    last_write = written_at(old) if old is not None else 0.0
    write = max(last_write, when) if written else last_write
    if old is not None and old[1] and last >= when and last_write >= write:
        return None
    return pickle.dumps((path, max(last, when), True, (write,), b""),
                        protocol=pickle.HIGHEST_PROTOCOL)


def _put_in(fd: int, layout, h: int, path: str, payload, when: float,
            dropped: bool) -> bool | None:
    """Write the entry into the open shard: True (written), False (refused: dropped since
    ``when``), None (no room: rebuild first). ``payload``: a record's, or for a drop
    (when, True, written), made here from the entry it replaces."""
    capacity, count, data_size, used, _ = layout
    base = HEADER_SIZE + capacity * _ENTRY.size
    i = h % capacity
    slot = None
    new = False
    old = None
    for _ in range(capacity):  # the probes a lookup makes (a shard is at most half full)
        eh, off, length = _ENTRY.unpack(os.pread(fd, _ENTRY.size, HEADER_SIZE + i * _ENTRY.size))
        if eh == 0:
            slot, new = i, True
            break
        if eh == h and off + length <= data_size:
            old = _decode(os.pread(fd, length, base + off), 0, length, length, path)
            if old is not None:
                if old[1] and not dropped and old[0] >= when:
                    return False  # dropped after this metadata was fetched
                slot = i
                break
        i = (i + 1) % capacity
    if dropped:
        payload = _drop_payload(path, when, payload[2], old)
        if payload is None:
            return True  # dropped already, as late or later (and written as late)
    else:
        payload = _carry_write(payload, old)
    record = _SUM.pack(_hash(payload)) + payload
    if slot is None or (new and 2 * (count + 1) > capacity) or used + len(record) > data_size:
        return None
    _pwrite_whole(fd, record, base + used)
    os.pwrite(fd, _HEADER.pack(MAGIC, FORMAT, capacity, count + new, data_size,
                               used + len(record), 0), 0)
    os.pwrite(fd, _ENTRY.pack(h, used, len(record)), HEADER_SIZE + slot * _ENTRY.size)
    return True


def _pwrite_whole(fd: int, data: bytes, at: int) -> None:
    """Write all of ``data`` at ``at``, or raise: a short write (a filesystem out of
    room) must not be followed by the index entry that points at the bytes not written."""
    if os.pwrite(fd, data, at) != len(data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FileLock:
    """An exclusive flock on ``path`` for one write (released by the kernel if we die),
    waited for ``wait`` seconds at most (its holder may be a stopped process): then
    BlockingIOError.

    A flock belongs to the open file, which a forked child shares: a process forked while
    its fill writer held the lock (a trainer forking its DataLoader workers just after
    reading) kept it for the child's whole life, since only the parent's thread closes it.
    Every store of the node's metadata then waited its 0.5 s in vain, and a worker's exit,
    draining its stores, took up to 30 s (review faults7). A forked child closes its copy
    at once (``_HELD``), which leaves the lock with the parent."""

    def __init__(self, path: str, wait: float) -> None:
        self.path = path
        self.wait = wait
        self.fd = -1

    def __enter__(self):
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                              0o600)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                              0o600)
        if not flock_within(self.fd, wait=self.wait, poll=0.001):
            os.close(self.fd)
            raise BlockingIOError(errno.EWOULDBLOCK, os.strerror(errno.EWOULDBLOCK))
        _HELD.add(self.fd)
        return self

    def __exit__(self, *exc) -> None:
        _HELD.discard(self.fd)
        os.close(self.fd)  # closing drops the lock


_HELD: set = set()  # descriptors of the locks this process holds (see _FileLock)


def _close_inherited() -> None:
    """In a forked child: close its copies of the locks its parent held (not unlock: that
    would drop the parent's lock too)."""
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited)
