"""A file's size and version learnt from its directory's listing are the node's, not only
the listing process's: ``cachemw warm``, ``find`` and ``glob`` list a dataset, and a process
that had not listed it asked the source for each file again; under ``immutable`` a warmed
dataset was unreadable once its source had gone (README, Options: "a warmed dataset stays
readable if the source goes away"). A file written through the cache after the listing is
not read at the listed version."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import fsspec
import pytest

BS = 1 << 16


def _in_a_process(runtime_dir: str, code: str) -> dict:
    """Run ``code`` in a new Python process with ``fs`` (immutable) bound to the daemon;
    it sets ``out``, returned."""
    prog = ("import fsspec, json\n"
            f"fs = fsspec.filesystem('cachemw', target_protocol='file', validate='immutable', "
            f"runtime_dir={runtime_dir!r}, autostart=False, block_size={BS})\n"
            f"out = {{}}\n{code}\n"
            "fs.client.flush()\nfrom cachemw.client.fills import drain_all\ndrain_all()\n"
            "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _dataset(tmp_path) -> tuple[str, dict[str, bytes]]:
    root = tmp_path / "ds"
    os.makedirs(root / "sub")
    files = {}
    for name in ("a.bin", "b.bin", "sub/c.bin"):
        files[str(root / name)] = os.urandom(BS + 1000)
        with open(root / name, "wb") as f:
            f.write(files[str(root / name)])
    return str(root), files


@pytest.mark.timeout(180)
@pytest.mark.parametrize("lister", ["find", "glob"])
def test_files_a_process_listed_and_read_are_read_by_the_next_with_their_source_gone(
        runtime_dir, spawn_daemon, tmp_path, lister):
    spawn_daemon(runtime_dir)
    root, files = _dataset(tmp_path)
    listed = ("paths = fs.find(%r)" % root if lister == "find"
              else "paths = [fs._strip_protocol(u) for u in fs.glob(%r)]" % (root + "/**/*.bin"))
    got = _in_a_process(runtime_dir, f"{listed}\nfor p in paths:\n    fs.cat_file(p)\n"
                                      "out['paths'] = sorted(paths)")
    assert set(files) <= set(got["paths"])
    # the source still there: the next process asks it nothing
    again = _in_a_process(runtime_dir, "for p in %r:\n    fs.cat_file(p)\n"
                                       "out['calls'] = fs.meta.source_calls" % sorted(files))
    assert again["calls"] == 0  # before: one info call per file
    shutil.rmtree(root)  # the source goes away
    fs = fsspec.filesystem("cachemw", target_protocol="file", validate="immutable",
                           runtime_dir=runtime_dir, autostart=False, block_size=BS,
                           skip_instance_cache=True)
    for path, data in files.items():
        assert fs.cat_file(path) == data  # before: FileNotFoundError
    assert fs.meta.source_calls == 0


@pytest.mark.timeout(180)
def test_a_file_written_through_the_cache_after_it_was_listed_is_read_at_its_new_version(
        runtime_dir, spawn_daemon, tmp_path):
    spawn_daemon(runtime_dir)
    root, files = _dataset(tmp_path)
    target = os.path.join(root, "a.bin")
    _in_a_process(runtime_dir, "fs.find(%r)\nfs.cat_file(%r)" % (root, target))
    new = os.urandom(len(files[target]))  # the same size
    writer = fsspec.filesystem("cachemw", target_protocol="file", runtime_dir=runtime_dir,
                               autostart=False, block_size=BS, skip_instance_cache=True)
    writer.pipe_file(target, new)
    writer.client.flush()
    got = _in_a_process(runtime_dir, "out['data'] = fs.cat_file(%r).hex()" % target)
    assert bytes.fromhex(got["data"]) == new


@pytest.mark.timeout(180)
def test_a_listed_version_a_read_found_gone_is_not_taken_again_by_the_next_process(
        runtime_dir, spawn_daemon, tmp_path):
    """A process lists the dataset; a file is then replaced at the source (not through the
    cache); the next process's read meets the new version (ChangedSourceError for a file
    it opened at the listed one) and drops the listed one node-wide, so a third process
    opens the file at its new version, not at the listed one again."""
    spawn_daemon(runtime_dir)
    root, files = _dataset(tmp_path)
    target = os.path.join(root, "b.bin")
    _in_a_process(runtime_dir, "fs.find(%r)" % root)
    new = os.urandom(len(files[target]))
    with open(target + ".tmp", "wb") as f:
        f.write(new)
    os.replace(target + ".tmp", target)  # another inode: another version
    # opened at the listed version (immutable: no call to the source), which is gone
    first = _in_a_process(runtime_dir, "try:\n    with fs.open(%r, 'rb') as f:\n"
                                       "        out['data'] = f.read().hex()\n"
                                       "except OSError as e:\n"
                                       "    out['error'] = type(e).__name__" % target)
    assert first.get("error") == "ChangedSourceError" or bytes.fromhex(first["data"]) == new
    got = _in_a_process(runtime_dir, "with fs.open(%r, 'rb') as f:\n"
                                     "    out['data'] = f.read().hex()" % target)
    assert bytes.fromhex(got["data"]) == new


@pytest.mark.timeout(180)
def test_a_sibling_read_first_does_not_bring_back_a_listed_version_found_gone(
        runtime_dir, spawn_daemon, tmp_path):
    """As above, but each later process reads another file of the directory first: the
    listing it learnt that file from held the gone version of b.bin too, and b.bin was
    then taken from it unchecked (review diffrev-5: ChangedSourceError in 3 of 3)."""
    spawn_daemon(runtime_dir)
    root, files = _dataset(tmp_path)
    a, b = os.path.join(root, "a.bin"), os.path.join(root, "b.bin")
    _in_a_process(runtime_dir, "fs.find(%r)" % root)
    new = os.urandom(len(files[b]))
    with open(b + ".tmp", "wb") as f:
        f.write(new)
    os.replace(b + ".tmp", b)
    _in_a_process(runtime_dir, "try:\n    fs.open(%r, 'rb').read()\nexcept OSError:\n"
                               "    pass" % b)  # meets the new version: drops the listed one
    for _ in range(2):
        got = _in_a_process(runtime_dir, "fs.open(%r, 'rb').read()\nwith fs.open(%r, 'rb') as f:\n"
                                         "    out['data'] = f.read().hex()" % (a, b))
        assert bytes.fromhex(got["data"]) == new


@pytest.mark.timeout(180)
def test_a_write_elsewhere_on_the_node_leaves_a_warmed_dataset_readable(
        runtime_dir, spawn_daemon, tmp_path):
    """Under immutable, with the source gone, a write through the cache of an unrelated
    file (a process forgets what it learnt when the node's drops move) made the dataset's
    other files unreadable in that process (review diffrev-5)."""
    spawn_daemon(runtime_dir)
    root, files = _dataset(tmp_path)
    a, b = os.path.join(root, "a.bin"), os.path.join(root, "b.bin")
    _in_a_process(runtime_dir, "for p in fs.find(%r):\n    fs.cat_file(p)" % root)
    shutil.rmtree(root)  # the source goes away
    other = str(tmp_path / "other.bin")
    got = _in_a_process(runtime_dir, f"out['a'] = fs.open({a!r}, 'rb').read().hex()\n"
                                     f"fs.pipe_file({other!r}, b'unrelated')\n"
                                     f"out['b'] = fs.open({b!r}, 'rb').read().hex()")
    assert bytes.fromhex(got["a"]) == files[a] and bytes.fromhex(got["b"]) == files[b]


@pytest.mark.timeout(120)
def test_a_stale_listing_is_not_read_again_at_every_lookup_of_its_files(
        runtime_dir, spawn_daemon, tmp_path):
    """Under ttl, a directory's shared listing gone stale was read and unpickled at every
    lookup of one of its files (64 ms a lookup in a directory of 50,000: review
    diffrev-5); it is read once, and again only after RELOOK seconds."""
    import time

    from cachemw.client.fills import drain_all

    spawn_daemon(runtime_dir)
    root = tmp_path / "many"
    root.mkdir()
    for i in range(50):
        (root / f"f{i:03d}").write_bytes(b"x")

    def fs_():
        return fsspec.filesystem("cachemw", target_protocol="file", validate="ttl", ttl=0.5,
                                 runtime_dir=runtime_dir, autostart=False,
                                 skip_instance_cache=True)

    fs_().ls(str(root))  # the node's listing of the directory
    drain_all()
    time.sleep(1.0)  # stale now
    fs = fs_()
    loads = []
    load = fs.meta._load_shared
    fs.meta._load_shared = lambda kind, *a, **k: (loads.append(kind), load(kind, *a, **k))[1]
    for i in range(50):
        assert fs.info(str(root / f"f{i:03d}"))["size"] == 1
    assert loads.count("ls") <= 2, loads.count("ls")  # before: 50


@pytest.mark.timeout(120)
def test_two_stores_with_the_same_paths_do_not_share_their_listings(
        runtime_dir, spawn_daemon, tmp_path):
    """Two ``dir`` filesystems of different roots (as two endpoints of one bucket name):
    the node's listing records were named by the path alone, so the second store's ``ls``
    gave the first's listing, and its files were looked up there."""
    spawn_daemon(runtime_dir)
    for root, name in (("A", "only_in_a"), ("B", "only_in_b")):
        (tmp_path / root / "x").mkdir(parents=True)
        (tmp_path / root / "x" / name).write_bytes(name.encode())
    made = ("from fsspec.implementations.dirfs import DirFileSystem\n"
            "from fsspec.implementations.local import LocalFileSystem\n"
            "fs = fsspec.filesystem('cachemw', fs=DirFileSystem(path=%r, fs=LocalFileSystem()), "
            "runtime_dir=%r, autostart=False, skip_instance_cache=True)\n")
    _in_a_process(runtime_dir, made % (str(tmp_path / "A"), runtime_dir) + "fs.ls('x')")
    got = _in_a_process(runtime_dir, made % (str(tmp_path / "B"), runtime_dir)
                        + "out['ls'] = [e['name'] for e in fs.ls('x')]\n"
                          "out['data'] = fs.cat_file('x/only_in_b').decode()")
    assert got == {"ls": ["x/only_in_b"], "data": "only_in_b"}  # before: ['x/only_in_a']
