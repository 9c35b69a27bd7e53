"""A checkpoint as one ``torch.save`` file, for tools that expect a file (Lightning's ``.ckpt``).

The file is exactly what ``torch.save`` writes, so ``torch.load`` and everything built on it
read it. What cachemw adds around it:

- Commit: the file is written under a temp name beside ``path``, fsynced, then renamed, so
  ``path`` holds the previous checkpoint or the whole new one, never a part; a save that fails
  removes its temp file and leaves ``path`` as it was, and raises the write's own ``OSError``
  (ENOSPC on a full disk; torch's zip writer would turn it into a ``RuntimeError``). The
  temp name says who writes it (host, pid, process start): a save removes the temp files of
  writers of the same ``path`` on this host that are gone (killed mid-save), never a live one's.
- Checksums: torch's format is a zip archive whose every record (the pickle, each tensor
  storage) carries the CRC32 of its bytes, computed by ``torch.save`` from memory as it writes.
  ``torch.load`` does not check them; ``load_file`` checks every record before loading and
  raises ``ChecksumError`` naming the bad one. ``save_file`` records them even where torch's
  process-wide ``set_crc32_options(False)`` turned them off.
- Any fsspec URL (``cachemw::s3://...``), as the rest of the checkpointer.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import socket
import threading
import uuid
import zipfile
import zlib
from typing import IO, Any, Iterator

import torch

from cachemw.processes import process_alive, process_start

from .errors import ChecksumError
from .storage_io import Location, split_file

log = logging.getLogger(__name__)
ZIP_MAGIC = b"PK\x03\x04"
# torch's pre-1.6 format: a pickle (protocol 2) of its magic number, 0x1950a86a20f9469cfc6c
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
READ_BYTES = 4 << 20

_crc_lock = threading.Lock()


@contextlib.contextmanager
def _crc32_recorded() -> Iterator[None]:
    """torch.save stores no CRC32s under ``set_crc32_options(False)``: turn them on meanwhile.

    The option is process-wide: our saves hold the lock while it may be flipped, so one save
    never turns it back off under another.
    """
    get = getattr(torch.serialization, "get_crc32_options", None)
    if get is None:  # torch < 2.5: always recorded
        yield
        return
    with _crc_lock:
        previous = get()
        if not previous:
            torch.serialization.set_crc32_options(True)
        try:
            yield
        finally:
            if not previous:
                torch.serialization.set_crc32_options(False)


def save_file(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)``, committed atomically and durably, with CRC32s recorded.

    A failed write raises its ``OSError`` (with its errno) and leaves ``path`` as it was,
    with no temp file; temp files of gone writers of ``path`` (killed saves) are removed."""
    location, name = split_file(path)
    location.makedirs()
    _sweep_dead_temps(location, name)
    tmp = f".{name}.cachemw-{_HOST}-{os.getpid()}-{process_start(os.getpid()) or 0}-{uuid.uuid4().hex[:8]}.tmp"
    with _crc32_recorded(), location.open_atomic(name, tmp) as f:
        out = _KeepsWriteError(f)
        try:
            torch.save(obj, out)
        except Exception as exc:
            if out.error is not None and exc is not out.error:
                raise out.error from None  # torch's writer hides the failed write behind its own error
            raise


class _KeepsWriteError:
    """The file ``torch.save`` writes through, keeping the first ``OSError`` of a write:
    torch's zip writer does not pass it on but fails later with a RuntimeError of its own
    ("unexpected pos"), which says nothing of a full disk."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, attr: str) -> Any:  # flush, seek, tell: the file's own
        return getattr(self.file, attr)


_HOST = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())


def _sweep_dead_temps(location: Location, name: str) -> None:
    """Remove the temp files of saves of ``name`` by processes of this host that are gone
    (a save killed mid-write leaves a full-size one); a live writer's, or another host's,
    stay. Best effort: a file that cannot be listed or removed is left."""
    pattern = re.compile(re.escape(f".{name}.cachemw-{_HOST}-") + r"(\d+)-(\d+)-[0-9a-f]{8}\.tmp")
    try:
        entries = location.listdir()
    except OSError:
        return
    for entry in entries:
        m = pattern.fullmatch(entry)
        if m is None or process_alive(int(m.group(1)), int(m.group(2)) or None):
            continue
        try:
            location.remove_file(entry)
        except OSError as exc:
            log.warning("could not remove %s, left by a killed save: %s", location.join(entry), exc)
        else:
            log.info("removed %s, left by a killed save", location.join(entry))


def verify(f: IO[bytes], url: str) -> bool:
    """Check every record of the torch file open as ``f`` against its CRC32; True if checked.

    Raises ``ChecksumError`` for a record whose bytes do not match, and for a zip archive that
    is not whole (a truncated copy). A file in torch's pre-1.6 format (not a zip) or one saved
    with CRC32s turned off cannot be checked: False, and a warning.
    """
    f.seek(0)
    head = f.read(len(LEGACY_MAGIC))
    if head[:len(ZIP_MAGIC)] != ZIP_MAGIC:
        if head != LEGACY_MAGIC:  # neither format: empty, cut short, its magic damaged
            raise ChecksumError(f"{url} is not a whole torch checkpoint file (empty, truncated "
                                f"or damaged: it starts with {head!r})")
        log.warning("%s is not in torch's zip format: loaded without checking it", url)
        return False
    f.seek(0)
    try:
        archive = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, NotImplementedError, ValueError, OSError, EOFError) as exc:
        raise ChecksumError(f"{url} is not a whole torch checkpoint file (truncated or damaged): {exc}") from None
    with archive:
        records = archive.infolist()
        names = [r.filename for r in records]
        if not records or len(set(names)) != len(names):  # no record, or one name twice
            raise ChecksumError(f"{url} is not a whole torch checkpoint file (damaged: "
                                f"{len(records)} records, {len(set(names))} names)")
        if all(r.CRC == 0 for r in records):
            log.warning("%s was saved without CRC32s (torch.serialization.set_crc32_options(False)): "
                        "loaded without checking it", url)
            return False
        for record in records:
            odd = _odd_header(record)
            if odd:  # fields torch's reader trusts and a CRC does not cover
                raise ChecksumError(f"record {record.filename!r} of checkpoint {url} has a "
                                    f"damaged header ({odd})")
            try:
                with archive.open(record) as data:
                    while data.read(READ_BYTES):
                        pass
            except (zipfile.BadZipFile, EOFError, NotImplementedError, ValueError,
                    UnicodeDecodeError, RuntimeError, OSError, zlib.error) as exc:  # a damaged record or
                # its header (an "encrypted" flag, a negative offset: EINVAL from a seek)
                if isinstance(exc, OSError) and exc.errno != errno.EINVAL:
                    raise  # the store failing, not the file's bytes
                raise ChecksumError(
                    f"checksum mismatch in record {record.filename!r} ({record.file_size} bytes from offset "
                    f"{record.header_offset}) of checkpoint {url}: {exc}") from None
    return True


def _odd_header(record: zipfile.ZipInfo) -> str:
    """What in a record's central-directory entry torch never writes ('' if nothing): its
    records are stored (not compressed), unencrypted files, not directories."""
    if record.compress_type != zipfile.ZIP_STORED:
        return f"compression method {record.compress_type}"
    if record.flag_bits & 0x1:
        return "marked encrypted"
    if record.is_dir() or record.external_attr & 0x10:  # the MS-DOS directory attribute
        return "marked a directory"
    if record.compress_size != record.file_size:
        return f"stored size {record.compress_size} != size {record.file_size}"
    return ""


def load_file(path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None) -> Any:
    """``torch.load(path, ...)`` after ``verify``; both read one open file, so one version of it."""
    location, name = split_file(path)
    url = os.fspath(path)
    with location.open(name, "rb") as f:
        verify(f, url)
        f.seek(0)
        try:
            return torch.load(f, map_location=map_location, weights_only=weights_only)
        except (RuntimeError, OSError) as exc:  # the archive's structure, which zipfile
            # does not check (torch's reader: its own messages, or EINVAL from an offset)
            if isinstance(exc, OSError) and exc.errno != errno.EINVAL or \
                    isinstance(exc, RuntimeError) and not any(
                        mark in str(exc) for mark in ("PytorchStreamReader", "archive",
                                                      "hasRecord")):
                raise
            raise ChecksumError(f"{url} is not a whole torch checkpoint file (damaged): "
                                f"{str(exc).splitlines()[0][:200]}") from None
