"""A tier on a memory filesystem that is full (the DRAM tier on a /dev/shm filled by other
jobs, an NVMe tier on tmpfs) never kills a reader: a page of a file mapped from tmpfs is
allocated when first touched, and on a full tmpfs the kernel answers a touch of a hole
with SIGBUS, which no ``except`` catches. The node's metadata table (the only files the
client maps for long) has its space allocated before anyone maps it, and no one maps a
file with holes there; a table that cannot get its space is not shared, and reads go on.

The real filesystem is a small tmpfs mounted for the test (root only; skipped where the
mount is not permitted); the reader runs in a child process, whose death by a signal is
what the tests look for."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest

from cachemw import files
from cachemw.client import metatable
from cachemw.client.metatable import MetaTable

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs of its own, unmounted after the test; skipped where it cannot be
    mounted (not root, no CAP_SYS_ADMIN in a container)."""
    mnt = tmp_path / "smallfs"
    mnt.mkdir()
    try:
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs",
                               str(mnt)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _fill(directory: str) -> None:
    """Take every byte left on the filesystem of ``directory``."""
    fd = os.open(f"{directory}/filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 16, 4096, 512, 1):
            while True:
                try:
                    if os.write(fd, b"x" * size) < size:
                        break
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    assert os.statvfs(directory).f_bavail == 0


def _run_child(code: str) -> dict:
    """Run ``code`` in a child process; its last stdout line is JSON. Fails the test if
    the child was killed by a signal (SIGBUS) or failed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=90, env=env)
    assert done.returncode >= 0, \
        f"the reader was killed by signal {-done.returncode}: {done.stderr[-2000:]}"
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_table_on_a_full_tmpfs_never_kills_its_writers_or_readers(small_tmpfs):
    table_dir = f"{small_tmpfs}/meta"
    assert MetaTable(table_dir).store("/first", {"size": 1}, 1.0)
    _fill(small_tmpfs)
    # records of ~3 KB cross page boundaries: before the fix a record's write came back
    # short at a page the full tmpfs could not give, the index pointed at it anyway, and
    # the lookup touched the hole through the mapping: SIGBUS
    out = _run_child(f"""
        import json
        from cachemw.client.metatable import MetaTable
        writer, reader = MetaTable({table_dir!r}), MetaTable({table_dir!r})
        stored, wrong, found = 0, 0, 0
        for i in range(60):
            value = {{"size": i, "pad": "p" * 3000}}
            stored += writer.store(f"/f{{i}}", value, 2.0)
            got = reader.get(f"/f{{i}}")
            if got is not None:
                import pickle
                found += 1
                wrong += pickle.loads(got[3]) != value
        first = reader.get("/first")
        print(json.dumps({{"stored": stored, "found": found, "wrong": wrong,
                          "first": first is not None, "drops": reader.drops()}}))
    """)
    assert out["wrong"] == 0
    assert out["found"] <= out["stored"] < 60  # the table filled up: not shared, no failure
    assert out["first"]  # what was shared before the tmpfs filled is still read
    assert out["drops"] == 0


def test_shard_files_are_allocated_not_sparse(small_tmpfs):
    table_dir = f"{small_tmpfs}/meta"
    table = MetaTable(table_dir)
    assert table.store("/a", {"size": 1}, 1.0)
    assert table.drops() == 0
    for name in os.listdir(table_dir):
        st = os.stat(f"{table_dir}/{name}")
        assert st.st_blocks * 512 >= st.st_size, name


def test_a_shard_with_holes_on_tmpfs_is_not_mapped(small_tmpfs, monkeypatch):
    """A shard made sparse (an older version's, one copied by hand) is read as absent on
    tmpfs, where touching a hole of it could kill the reader; the next write rebuilds it
    allocated."""
    table_dir = f"{small_tmpfs}/meta"
    monkeypatch.setattr(metatable, "preallocate", os.ftruncate)  # as before the fix
    assert MetaTable(table_dir).store("/a", {"size": 1}, 1.0)
    assert MetaTable(table_dir).drops() == 0  # the count's file made sparse too
    monkeypatch.undo()
    shard = f"{table_dir}/t{metatable.path_hash('/a') >> 58:02d}.{metatable.FORMAT}"
    st = os.stat(shard)
    assert st.st_blocks * 512 < st.st_size  # the premise: a file with holes
    _fill(small_tmpfs)
    out = _run_child(f"""
        import json
        from cachemw.client.metatable import MetaTable
        table = MetaTable({table_dir!r})
        print(json.dumps({{"a": table.get("/a") is not None, "drops": table.drops()}}))
    """)
    assert out == {"a": False, "drops": 0}


def test_holes_are_harmless_off_memory_filesystems(tmp_path):
    """A disk filesystem needs no space to read a hole (and may hold fewer blocks than
    bytes: compression): a sparse file there is mapped as before."""
    path = tmp_path / "sparse"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 1 << 20)
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_blocks * 512 >= st.st_size:
        pytest.skip("this filesystem allocates on truncate")
    assert files.mappable(st) == (not files._on_memory_filesystem(st.st_dev))


def test_preallocate_reports_a_full_filesystem_and_keeps_contents(small_tmpfs):
    path = f"{small_tmpfs}/f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b"12345678", 0)
        files.preallocate(fd, 8192)
        assert os.pread(fd, 8, 0) == b"12345678"
        assert files.mappable(os.fstat(fd))
        with pytest.raises(OSError) as caught:
            files.preallocate(fd, 4 << 20)
        assert caught.value.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_a_block_file_with_holes_on_a_full_tmpfs_is_corrupt_not_a_sigbus(small_tmpfs):
    """A block file of the right size whose data is a hole (damage: tiers write whole
    files) is not mapped for a joined read: CorruptBlock (dropped, refetched), not SIGBUS."""
    from cachemw import blockfile

    key = "ab" * 16
    data = os.urandom(64 * 1024)
    os.mkdir(f"{small_tmpfs}/whole")
    good = f"{small_tmpfs}/whole/{key}"
    blockfile.write_block(good, data)
    with open(good, "rb") as f:
        whole = f.read()
    os.unlink(good)
    path = f"{small_tmpfs}/{key}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, len(whole))
        os.pwrite(fd, whole[len(data):], len(data))  # the tail only: the data is a hole
    finally:
        os.close(fd)
    _fill(small_tmpfs)
    out = _run_child(f"""
        import json
        from cachemw import blockfile
        try:
            held = blockfile.hold_block({path!r}, {len(data)})
            print(json.dumps("joined: " + str(blockfile.join_blocks([held, b""])[1])))
        except blockfile.CorruptBlock as exc:
            print(json.dumps("corrupt: " + str(exc)))
    """)
    assert out.startswith("corrupt: ") and "with holes" in out, out
