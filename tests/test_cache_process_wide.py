"""A process is one reader of the node however many cachemw filesystems it makes (a second
instance with other options, made by pandas or HF datasets, or with
``skip_instance_cache``): what one of them fetched and still holds in memory (fills written
behind, metadata records not yet written for the node) serves the others, which neither
fetch it again nor find a warmed file gone when the source went away meanwhile. A file not
at the source found by a reader that knew no version of it drops nothing the node or the
process knows: the fills and the record of the version read before are kept, so an
``immutable`` dataset warmed once stays readable."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

from conftest import daemon_stats

BS = 65536


def _dataset(tmp_path, sizes=(1000, BS, 3 * BS + 100)):
    root = tmp_path / "src"
    root.mkdir()
    files = {}
    for i, size in enumerate(sizes):
        path = str(root / f"f{i}.bin")
        files[path] = os.urandom(size)
        with open(path, "wb") as f:
            f.write(files[path])
    return str(root), files


def _read_all(fs, paths) -> dict:
    """Each path's bytes, or the name of the error its cat_file raised."""
    out = {}
    for path in paths:
        try:
            out[path] = fs.cat_file(path)
        except OSError as exc:
            out[path] = type(exc).__name__
    return out


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(r=fn()))
    thread.start()
    return thread, got


def _read_in_new_process(runtime_dir: str, paths, validate: str = "immutable") -> list:
    code = (
        "import json, sys, fsspec\n"
        f"fs = fsspec.filesystem('cachemw', validate={validate!r}, autostart=False, "
        f"runtime_dir={runtime_dir!r}, block_size={BS})\n"
        "out = []\n"
        f"for p in {list(paths)!r}:\n"
        "    try:\n"
        "        out.append(fs.cat_file(p).hex())\n"
        "    except OSError as exc:\n"
        "        out.append(type(exc).__name__)\n"
        "print(json.dumps(out))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("validate", ["immutable", "ttl"])
def test_a_second_filesystem_reads_the_pending_fills_of_a_source_gone(
        make_cache_fs, runtime_dir, tmp_path, gate, validate):
    root, files = _dataset(tmp_path)
    first = make_cache_fs(block_size=BS, validate=validate)
    assert _read_all(first, files) == files  # their fills and records held (the gate)
    assert first.reader.fills.pending
    shutil.rmtree(root)
    second = make_cache_fs(block_size=BS, validate=validate)
    reader, got = _in_thread(lambda: _read_all(second, files))
    reader.join(0.5)
    gate.set()  # the fills land; the second waited for them, from the first's memory
    reader.join(60)
    assert got["r"] == files
    assert second.meta.source_calls == 0
    assert first.reader.fills.drain(30) and second.reader.fills.drain(30)
    s = second.stats()
    assert s["bytes_from_source"] == 0 and s["fallbacks"] == 0
    assert daemon_stats(runtime_dir)["tiers"]["dram"]["blocks"] == 1 + 1 + 4
    assert _read_in_new_process(runtime_dir, files, validate) == [d.hex() for d in files.values()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("validate", ["immutable", "ttl"])
def test_a_second_filesystem_does_not_fetch_what_the_first_holds(
        make_cache_fs, counting_target, tmp_path, gate, validate):
    """The source still there: the second instance asks it nothing (no info, no read),
    where it used to fetch every block again (a duplicate fetch the claims were to spare)."""
    _, files = _dataset(tmp_path)
    first = make_cache_fs(fs=counting_target, block_size=BS, validate=validate)
    assert _read_all(first, files) == files
    counting_target.reset()
    second = make_cache_fs(fs=counting_target, block_size=BS, validate=validate, ttl=59)
    reader, got = _in_thread(lambda: _read_all(second, files))
    reader.join(0.5)
    gate.set()
    reader.join(60)
    assert got["r"] == files
    assert counting_target.calls() == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("who", ["always", "other process"])
def test_a_file_not_found_by_a_reader_that_knew_no_version_keeps_the_warmed_one(
        make_cache_fs, runtime_dir, tmp_path, gate, who):
    """While the first filesystem's fills and records are still held, the source goes and
    a reader that knew no version of the files (one that asks the store on every read, or
    another process, which cannot see them yet) finds them missing: it says so, and drops
    nothing the node or the first one know. The fills land, the records are written, and
    the dataset stays readable (immutable) for every process."""
    root, files = _dataset(tmp_path)
    first = make_cache_fs(block_size=BS, validate="immutable")
    assert _read_all(first, files) == files
    shutil.rmtree(root)
    if who == "always":
        assert set(_read_all(make_cache_fs(block_size=BS, validate="always"), files).values()) \
            == {"FileNotFoundError"}
    else:
        assert set(_read_in_new_process(runtime_dir, files)) == {"FileNotFoundError"}
    gate.set()
    assert first.reader.fills.drain(30)
    s = first.stats()
    assert s["bypassed"] == 0 and s["fills"] == 1 + 1 + 4
    assert _read_in_new_process(runtime_dir, files) == [d.hex() for d in files.values()]
    assert _read_all(make_cache_fs(block_size=BS, validate="immutable"), files) == files


@pytest.mark.timeout(120)
def test_a_batch_failing_on_one_file_drops_nothing_of_the_others(make_cache_fs, runtime_dir,
                                                                 tmp_path):
    """cat_ranges over warmed files and one the cache knows but never read, the source
    gone: the unread one fails (FileNotFoundError), the others are read from the cache, and
    stay readable for every process (its failure used to drop them all node-wide)."""
    root, files = _dataset(tmp_path)
    paths = list(files)
    fs = make_cache_fs(block_size=BS, validate="immutable")
    for path in paths[:-1]:
        assert fs.cat_file(path) == files[path]
    assert fs.info(paths[-1])["size"] == len(files[paths[-1]])  # known, not read
    assert fs.reader.fills.drain(30)
    shutil.rmtree(root)
    got = fs.cat_ranges(paths, [0] * len(paths), [None] * len(paths))
    assert got[:-1] == [files[p] for p in paths[:-1]]
    assert isinstance(got[-1], FileNotFoundError)
    assert _read_in_new_process(runtime_dir, paths[:-1]) == [files[p].hex() for p in paths[:-1]]
