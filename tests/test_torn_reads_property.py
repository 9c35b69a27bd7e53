"""Property: every read through the cache returns bytes of exactly one version of the file,
or raises an OSError, whatever happens to the file between reads (issue 16).

Hypothesis draws a sequence of operations on one local file: reads of open handles (opened
at any point, several at once), ``cat_file``/``cat_ranges`` reads, atomic replaces (rename
of a new file), in-place rewrites (same inode, same or larger size), truncations (shorter,
to 0, longer). It runs them under every ``validate`` mode (immutable, ttl, always; a ttl
that expires between operations and one that does not), with a block size small enough
that every file has several blocks, so reads join cached blocks with fetched ones.

Each read's bytes must be one version's bytes at that offset, all of them (a handle's at
the size it was opened with); an OSError (ChangedSourceError: the handle's version is gone)
is allowed, nothing else is.

Honest about the limit (README, "What a read returns"): a local file's version is its size,
mtime, ctime and inode, and POSIX times have the filesystem's granularity (a kernel tick on
ext4 and tmpfs). An in-place rewrite of the same size within the same tick as the version
before it is indistinguishable by metadata; no cache keyed by metadata can tell, and the
test does not pretend otherwise: before each change it waits until the clock has moved past
the current version's ctime (``next_tick``), as it does between writes that are separate
in time in real use.
"""
from __future__ import annotations

import itertools
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BS = 4096
MAX_SIZE = 5 * BS + 100


def _clip(start, end, size):
    start = min(start, size)
    end = size if end is None else min(end, size)
    return start, max(start, end)


def next_tick(path: str) -> None:
    """Wait until a file written now gets a later ctime than ``path`` has (see above)."""
    ctime = os.stat(path).st_ctime_ns
    probe = f"{path}.tick"
    while True:
        with open(probe, "wb"):
            pass
        if os.stat(probe).st_ctime_ns > ctime:
            os.unlink(probe)
            return
        time.sleep(0.0005)


# a few sizes, often drawn: a same-size change is the hard case (only times and inode tell)
sizes = st.one_of(st.sampled_from([0, 1, BS, 3 * BS + 7, MAX_SIZE]),
                  st.integers(min_value=0, max_value=MAX_SIZE))
offsets = st.integers(min_value=0, max_value=MAX_SIZE + 10)
lengths = st.integers(min_value=1, max_value=3 * BS)
operations = st.one_of(
    st.tuples(st.just("open")),
    st.tuples(st.just("read"), st.integers(0, 3), offsets, lengths),
    st.tuples(st.just("read"), st.integers(0, 3), offsets, lengths),
    st.tuples(st.just("read"), st.integers(0, 3), offsets, lengths),
    st.tuples(st.just("read_all"), st.integers(0, 3)),
    st.tuples(st.just("cat"), offsets, st.one_of(st.none(), lengths)),
    st.tuples(st.just("cat_ranges"), offsets, lengths),
    st.tuples(st.just("replace"), sizes),
    st.tuples(st.just("replace"), st.none()),  # at the current size
    st.tuples(st.just("rewrite"), offsets, lengths),
    st.tuples(st.just("truncate"), sizes),
)
MODES = [dict(validate="immutable"), dict(validate="ttl", ttl=60.0),
         dict(validate="ttl", ttl=0.005), dict(validate="always")]


@pytest.fixture
def filesystems(make_cache_fs):
    """One cachemw filesystem per validate mode, over one daemon, shared by the examples
    (each example works on a file of its own)."""
    return [make_cache_fs(block_size=BS, **mode) for mode in MODES]


@pytest.mark.slow
@pytest.mark.timeout(600)
@settings(max_examples=500, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mode=st.integers(0, len(MODES) - 1), first=sizes,
       ops=st.lists(operations, min_size=1, max_size=20))
def test_every_read_returns_one_version_or_raises(filesystems, tmp_path, mode, first, ops):
    fs = filesystems[mode]
    path = str(tmp_path / f"f{next(_files)}.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(first))
    versions = [open(path, "rb").read()]
    handles = []

    def one_version(data: bytes, start: int, end: int | None, size: int | None = None) -> bool:
        for v in versions:
            if size is not None and len(v) != size:
                continue
            s, e = _clip(start, end, len(v))
            if data == v[s:e]:
                return True
        return False

    def read(fn, *args):
        """``fn(*args)``: its bytes, or None if it raised an OSError (allowed)."""
        try:
            return fn(*args)
        except OSError:
            return None

    try:
        for op in ops:
            kind = op[0]
            if kind == "open":
                f = read(fs.open, path, "rb")
                if f is not None:
                    handles.append(f)
            elif kind in ("read", "read_all"):
                if not handles:
                    continue
                f = handles[op[1] % len(handles)]
                start, length = (op[2], op[3]) if kind == "read" else (0, -1)
                f.seek(min(start, f.size))
                data = read(f.read, length)
                end = None if length < 0 else start + length
                assert data is None or one_version(data, start, end, f.size), \
                    (kind, start, length, f.size, [len(v) for v in versions])
            elif kind == "cat":
                start, length = op[1], op[2]
                end = None if length is None else start + length
                data = read(fs.cat_file, path, start, end)
                assert data is None or one_version(data, start, end), \
                    (kind, start, end, [len(v) for v in versions])
            elif kind == "cat_ranges":
                start, end = op[1], op[1] + op[2]
                data = fs.cat_ranges([path], [start], [end])[0]
                assert isinstance(data, OSError) or one_version(data, start, end), \
                    (kind, start, end, [len(v) for v in versions])
            else:
                next_tick(path)
                if kind == "replace":
                    with open(f"{path}.new", "wb") as f:
                        f.write(os.urandom(len(versions[-1]) if op[1] is None else op[1]))
                    os.replace(f"{path}.new", path)
                elif kind == "rewrite":
                    with open(path, "r+b") as f:
                        f.seek(min(op[1], len(versions[-1])))
                        f.write(os.urandom(op[2]))
                else:
                    os.truncate(path, op[1])
                with open(path, "rb") as f:
                    versions.append(f.read())
    finally:
        for f in handles:
            f.close()


_files = itertools.count()
