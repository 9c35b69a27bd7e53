"""A read that meets a changed file drops what was known of it, and its retry (cat_file,
cat_ranges) or reopen reads the new version whole, whatever became of the node's daemon
and its metadata table: gone with its DRAM tier freed under a process that had the table
mapped (an autostarted daemon that followed the process that started it), or a table that
could not mark the drop. The drops of the node's table say what they were: a write
through the cache cancels the fills fetched before it, a read that found its version gone
at the source does not (their bytes are still that version's)."""
from __future__ import annotations

import os
import shutil
import signal

import pytest

from cachemw.client import metatable
from cachemw.client.metatable import MetaTable
from cachemw.launch import free_dram
from cachemw.tiers.source import ChangedSourceError

BS = 65536


def _replace(path: str, data: bytes) -> None:
    """A new version, as a writer that replaces files makes it (same size here)."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _got(table, key):
    """(fetched, dropped) of ``key`` in ``table``, or None."""
    found = table.get(key)
    return None if found is None else (found[0], found[1])


def test_a_table_freed_under_a_process_is_mapped_again_at_its_next_write(tmp_path):
    """The daemon that made the table stopped and freed it (rmtree of its DRAM tier's meta
    directory) while a process had its shards mapped: the process's drop goes to a new
    file, and its next lookup sees the drop, not the freed file's record."""
    d = str(tmp_path / "meta" / "info")
    table = MetaTable(d)
    assert table.store("/f", {"size": 1}, 10.0)
    assert _got(table, "/f") == (10.0, False)
    assert table.drops() == 0
    shutil.rmtree(tmp_path / "meta")
    assert _got(table, "/f") == (10.0, False)  # still mapped: nothing says otherwise yet
    assert table.drop("/f", 11.0)
    assert _got(table, "/f") == (11.0, True)
    assert table.drops() == 1  # the new count, not the freed one
    assert _got(MetaTable(d), "/f") == (11.0, True)


def test_a_drop_tells_a_write_from_a_version_gone_at_the_source(tmp_path):
    d = str(tmp_path / "info")
    a, b = MetaTable(d), MetaTable(d)
    assert a.store("/f", {"size": 1}, 10.0)
    assert a.drop("/f", 11.0, written=False)  # a read found its version gone
    found = b.get("/f")
    assert found[1] and found[0] == 11.0 and metatable.written_at(found) == 0.0
    assert not a.store("/f", {"size": 1}, 10.5)  # fetched before it: refused all the same
    assert a.drop("/f", 12.0)  # a write through the cache
    assert metatable.written_at(b.get("/f")) == 12.0
    assert a.drop("/f", 13.0, written=False)  # a later failed read keeps the write's time
    found = b.get("/f")
    assert found[0] == 13.0 and metatable.written_at(found) == 12.0
    assert a.drop("/f", 12.5)  # an older write than the drop there: its time is kept too
    found = b.get("/f")
    assert found[0] == 13.0 and metatable.written_at(found) == 12.5


def _warm(make_cache_fs, tmp_path, validate, size=3 * BS + 100):
    fs = make_cache_fs(block_size=BS, validate=validate, ttl=3600)
    path = str(tmp_path / "f.bin")
    old = os.urandom(size)
    _replace(path, old)
    assert fs.cat_file(path) == old
    assert fs.reader.fills.drain(30)  # its blocks and its record are the node's
    fs.invalidate_cache()  # what it knows of the file comes from the node's table now
    assert fs.cat_file(path) == old
    return fs, path, old


def _read(fs, path: str, how: str) -> bytes:
    if how == "cat_file":
        return fs.cat_file(path)
    if how == "cat_ranges":
        return fs.cat_ranges([path], [0], [None])[0]
    with fs.open(path, "rb") as f:
        return f.read()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("validate", ["ttl", "immutable"])
@pytest.mark.parametrize("how", ["cat_file", "cat_ranges", "open"])
def test_a_changed_file_is_read_whole_after_the_daemon_freed_its_table(
        make_cache_fs, runtime_dir, tmp_path, validate, how):
    """As an autostarted daemon does when the process that started it ends: it stops and
    frees its DRAM tier, the metadata table with it, under a process that has the table
    mapped and keeps reading (no daemon meanwhile: its reads go to the source)."""
    fs, path, old = _warm(make_cache_fs, tmp_path, validate)
    new = os.urandom(len(old))
    daemon = fs.client._address.pid
    os.kill(daemon, signal.SIGKILL)
    dram = next(t.path for t in fs.client.tiers() if t.name == "dram")
    free_dram(dram)
    _replace(path, new)
    if how == "open":
        with fs.open(path, "rb") as f:  # opened at the version it knew (immutable)...
            f.seek(0)
            try:
                got = f.read()
            except ChangedSourceError:  # ...which is gone: the read fails, and drops it
                got = None
            assert got in (None, new)
    for _ in range(3):
        assert _read(fs, path, how) == new


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["cat_file", "cat_ranges"])
def test_a_retry_does_not_take_the_record_a_drop_could_not_mark(make_cache_fs, tmp_path,
                                                                 monkeypatch, how):
    """The node's table could not mark the drop (its lock held past the wait, say): the
    retry still asks the source, not the node's record of the version just found gone."""
    fs, path, old = _warm(make_cache_fs, tmp_path, "immutable")
    monkeypatch.setattr(MetaTable, "drop", lambda self, path, when, written=True: False)
    new = os.urandom(len(old))
    _replace(path, new)
    fs.client.tiers()[0].clear()  # its blocks gone: the read goes to the source
    assert _read(fs, path, how) == new
    other = make_cache_fs(block_size=BS, validate="immutable")  # the process's others too
    assert _read(other, path, how) == new
