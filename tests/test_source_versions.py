"""A read returns bytes of one version of a file, or raises an OSError (issue 16, items 1,
2 and 8), against real stores: local files, a moto S3 server through s3fs, an HTTP server
with ranges and ETags through fsspec's own HTTP filesystem.

* Torn reads: a file replaced (or rewritten) while a handle is open, or while part of it is
  cached, never reads back as a mix of versions: an open handle raises ChangedSourceError,
  ``cat_file`` starts over once and returns the new version whole. Under every ``validate``
  mode; on local files, S3, HTTP, and a target read through its own methods.
* A same-size rewrite that restores the mtime is seen under ``always`` (ctime, inode).
* Revalidation reaches the store: after ``ls`` (s3fs keeps the listing and answers
  ``info`` from it), an overwrite is seen under ``always`` and after ``ttl``, also by a new
  cachemw instance (fsspec hands it the same s3fs instance).
* HTTP: pinned by If-Match, and by the response's ETag where a server ignores If-Match.
* Daemon-side source reads are pinned too: an owner node's fill for a peer and a prefetch
  never keep another version's bytes under a version's key.
* Files whose size the source states as 0 (``/proc``) are read to their end, uncached.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import fsspec
import pytest

from cachemw.bench import SlowLocalFileSystem
from cachemw.keys import block_key, stat_token, version_token
from cachemw.tiers.source import ChangedSourceError

BS = 64 << 10
MODES = [dict(validate="immutable"), dict(validate="ttl", ttl=60), dict(validate="always")]
MODE_IDS = ["immutable", "ttl", "always"]


def replace(path: str, data: bytes) -> None:
    """Atomically replace ``path`` (a new inode, as a writer renaming a temp file does)."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def next_tick(path: str) -> None:
    """Wait until a file written now gets a later ctime than ``path`` has: POSIX times have
    the filesystem's granularity (a kernel tick on ext4/tmpfs), and two versions written
    within one tick, of one size, in one inode, cannot be told apart by metadata (README)."""
    probe = f"{path}.tick"
    ctime = os.stat(path).st_ctime_ns
    while True:
        write(probe, b"")
        if os.stat(probe).st_ctime_ns > ctime:
            os.unlink(probe)
            return
        time.sleep(0.001)


# -- local files ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_an_open_file_replaced_reads_one_version_or_raises(make_cache_fs, tmp_path, mode):
    """The issue's reproducer, at test size: a handle opened on one version, the file then
    replaced by rename, the rest read: that used to join old and new blocks silently."""
    fs = make_cache_fs(block_size=BS, **mode)
    path = str(tmp_path / "f.bin")
    old, new = os.urandom(5 * BS), os.urandom(5 * BS)
    write(path, old)
    f = fs.open(path, "rb")
    head = f.read(BS // 2)
    assert head == old[:BS // 2]
    replace(path, new)
    with pytest.raises(ChangedSourceError) as err:
        f.read()
    assert isinstance(err.value, OSError) and path in str(err.value)
    f.close()
    assert fs.cat_file(path) == new  # a new read: the new version, whole


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("how", ["replaced", "deleted"])
def test_reopen_after_a_changed_source_error_reads_the_new_version(make_cache_fs, tmp_path,
                                                                   mode, how):
    """README: an open file that meets a changed source raises; reopen it to read the new
    version, under every validate mode (immutable trusts the old metadata for good, so the
    failed read must drop it), from this process and from a new filesystem."""
    fs = make_cache_fs(block_size=BS, **mode)
    path = str(tmp_path / "f.bin")
    old, new = os.urandom(5 * BS), os.urandom(4 * BS + 9)
    write(path, old)
    assert fs.cat_file(path, 0, 100) == old[:100]  # block 0 cached, the rest not
    with fs.open(path, "rb") as f:
        assert f.read(100) == old[:100]  # a hit, at the version it was opened with
        if how == "replaced":
            replace(path, new)
        else:
            os.unlink(path)
        with pytest.raises(ChangedSourceError if how == "replaced" else FileNotFoundError):
            f.read()
    for reader in (fs, make_cache_fs(block_size=BS, **mode)):
        if how == "replaced":
            with reader.open(path, "rb") as f:
                assert f.read() == new
        else:
            with pytest.raises(FileNotFoundError):
                reader.open(path, "rb")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reader", ["cat_file", "cat_ranges", "cat"])
def test_a_partly_cached_file_replaced_under_ttl_reads_the_new_version_whole(
        make_cache_fs, tmp_path, reader):
    """Within ``ttl`` the old metadata is trusted: its cached block is a hit, the next block
    a miss read from the new file. The miss finds the version moved and the call starts over
    with fresh metadata (the new file is longer: it is returned whole, not cut at the old
    size)."""
    fs = make_cache_fs(block_size=BS, validate="ttl", ttl=60)
    path = str(tmp_path / "f.bin")
    old, new = os.urandom(3 * BS), os.urandom(4 * BS + 77)
    write(path, old)
    assert fs.cat_file(path, 0, 100) == old[:100]  # block 0 cached
    replace(path, new)
    if reader == "cat_file":
        got = fs.cat_file(path)
    elif reader == "cat_ranges":
        got = fs.cat_ranges([path], [None], [None])[0]
    else:
        got = fs.cat([path])[path]
    assert got == new


@pytest.mark.timeout(60)
def test_a_same_size_rewrite_restoring_the_mtime_is_seen_under_always(make_cache_fs, tmp_path):
    fs = make_cache_fs(block_size=BS, validate="always")
    path = str(tmp_path / "f.bin")
    old, new = os.urandom(BS + 10), os.urandom(BS + 10)
    write(path, old)
    assert fs.cat_file(path) == old
    st = os.stat(path)
    next_tick(path)
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.write(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the mtime put back
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns
    assert fs.cat_file(path) == new


def test_the_local_version_token_is_the_same_from_info_and_from_a_descriptor(tmp_path):
    """One function computes both (keys.stat_info): a descriptor's token must equal the one
    its file's metadata gave, or every miss would look like a change."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 1000)
    link = tmp_path / "link.bin"
    link.symlink_to(path)
    local = fsspec.filesystem("file")
    for p in (str(path), str(link)):
        fd = os.open(p, os.O_RDONLY)
        try:
            assert stat_token(os.fstat(fd)) == version_token(local.info(p))
        finally:
            os.close(fd)
        assert stat_token(os.stat(p)) == version_token(local.info(p))


@pytest.mark.timeout(60)
def test_a_listed_symlink_is_read_through(make_cache_fs, tmp_path):
    """fsspec's local listing gives a symlink's own mtime and inode: its entry must not
    stand for the file the link points to (every read would then look changed)."""
    fs = make_cache_fs(block_size=BS, validate="ttl", ttl=60)
    data = os.urandom(2 * BS + 5)
    write(str(tmp_path / "real.bin"), data)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "link.bin").symlink_to(tmp_path / "real.bin")
    assert fs.ls(str(tmp_path / "d"), detail=False) == [str(tmp_path / "d" / "link.bin")]
    with fs.open(str(tmp_path / "d" / "link.bin"), "rb") as f:
        assert f.read() == data


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_target_read_through_its_own_methods_is_checked_after_the_read(
        make_cache_fs, tmp_path, mode):
    """A target that is not plain local (here the benchmark's slow local store, which
    overrides cat_file) is read through its cat_file, then asked for the file's info past
    its caches: a replaced file is caught the same."""
    fs = make_cache_fs(block_size=BS, fs=SlowLocalFileSystem(latency=0.0), **mode)
    path = str(tmp_path / "f.bin")
    old, new = os.urandom(4 * BS), os.urandom(4 * BS)
    write(path, old)
    with fs.open(path, "rb") as f:
        assert f.read(10) == old[:10]
        replace(path, new)
        with pytest.raises(ChangedSourceError):
            f.read()
    assert fs.cat_file(path) == new


# -- files whose size the source cannot state ------------------------------------------------


@pytest.mark.timeout(60)
def test_proc_files_are_read_to_their_end_and_bypass_the_cache(make_cache_fs, tmp_path):
    fs = make_cache_fs(block_size=BS, validate="ttl", ttl=60)
    status = "/proc/self/status"
    assert os.stat(status).st_size == 0  # what the source states
    assert fs.cat_file(status).startswith(b"Name:")
    assert fs.cat_file(status, 0, 5) == b"Name:"
    with fs.open(status, "rb") as f:
        assert f.read().startswith(b"Name:")
    with fsspec.open(f"cachemw::file://{status}", "rb", cachemw={"runtime_dir": fs.options.runtime_dir,
                                                                 "autostart": False}) as f:
        assert b"Name:" in f.read()
    empty = str(tmp_path / "empty.bin")
    write(empty, b"")
    got = fs.cat([status, "/proc/self/cmdline", empty])
    assert got[status].startswith(b"Name:") and got["/proc/self/cmdline"] and got[empty] == b""
    assert fs.cat_ranges([status, empty], [0, 0], [5, 5]) == [b"Name:", b""]
    assert fs.cat_file(empty) == b""
    with fs.open(empty, "rb") as f:
        assert f.read() == b""
    stats = fs.stats()
    assert stats["bypassed"] == 6 and stats["misses"] == 0 and stats["hits"] == 0


@pytest.mark.timeout(60)
def test_an_empty_file_of_an_immutable_dataset_stays_readable_without_its_source(
        make_cache_fs, tmp_path):
    fs = make_cache_fs(block_size=BS, validate="immutable")
    path = str(tmp_path / "empty.bin")
    write(path, b"")
    assert fs.cat_file(path) == b""
    os.unlink(path)
    assert fs.cat_file(path) == b""
    with fs.open(path, "rb") as f:
        assert f.read() == b""
    assert fs.stats()["bypassed"] == 0


@pytest.mark.timeout(60)
def test_an_empty_file_that_grows_is_read_at_its_new_size(make_cache_fs, tmp_path):
    fs = make_cache_fs(block_size=BS, validate="immutable")
    path = str(tmp_path / "f.bin")
    write(path, b"")
    assert fs.cat_file(path) == b""
    data = os.urandom(BS + 3)
    with open(path, "ab") as f:  # same inode: caught by size and times
        f.write(data)
    assert fs.cat_file(path) == data


# -- S3 (moto server, s3fs) ------------------------------------------------------------------


def _s3_fs(make_cache_fs, s3_server, **options):
    return make_cache_fs(target_protocol="s3", target_options=s3_server["target_options"],
                         block_size=BS, **options)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_s3_an_open_object_overwritten_reads_one_version_or_raises(make_cache_fs, s3_server,
                                                                   mode):
    s3 = s3_server["boto3"]()
    bucket, key = s3_server["bucket"], f"torn/{mode['validate']}.bin"
    old, new = os.urandom(4 * BS), os.urandom(4 * BS)
    s3.put_object(Bucket=bucket, Key=key, Body=old)
    fs = _s3_fs(make_cache_fs, s3_server, **mode)
    path = f"{bucket}/{key}"
    with fs.open(path, "rb") as f:
        assert f.read(100) == old[:100]
        s3.put_object(Bucket=bucket, Key=key, Body=new)
        with pytest.raises(ChangedSourceError):
            f.read()
    assert fs.cat_file(path) == new


@pytest.mark.timeout(60)
def test_s3_revalidation_after_a_listing_reaches_the_store(make_cache_fs, s3_server):
    """The issue's sequence under ``always``: ls, cat, overwrite with boto3, cat."""
    s3 = s3_server["boto3"]()
    bucket = s3_server["bucket"]
    s3.put_object(Bucket=bucket, Key="always/x", Body=b"old bytes")
    fs = _s3_fs(make_cache_fs, s3_server, validate="always")
    assert fs.ls(f"{bucket}/always", detail=False) == [f"{bucket}/always/x"]
    assert fs.cat_file(f"{bucket}/always/x") == b"old bytes"
    s3.put_object(Bucket=bucket, Key="always/x", Body=b"new bytes")
    assert fs.cat_file(f"{bucket}/always/x") == b"new bytes"
    assert fs.info(f"{bucket}/always/x")["ETag"] == s3.head_object(Bucket=bucket, Key="always/x")["ETag"]
    s3.put_object(Bucket=bucket, Key="always/x", Body=b"3rd bytes")
    again = _s3_fs(make_cache_fs, s3_server, validate="always")  # same s3fs instance under it
    assert again.target is fs.target
    assert again.cat_file(f"{bucket}/always/x") == b"3rd bytes"
    s3.put_object(Bucket=bucket, Key="always/y", Body=b"y")
    assert fs.ls(f"{bucket}/always", detail=False) == [f"{bucket}/always/x", f"{bucket}/always/y"]


@pytest.mark.timeout(60)
def test_s3_the_ttl_bound_holds_after_a_listing(make_cache_fs, s3_server):
    s3 = s3_server["boto3"]()
    bucket = s3_server["bucket"]
    s3.put_object(Bucket=bucket, Key="ttl/x", Body=b"old bytes")
    fs = _s3_fs(make_cache_fs, s3_server, validate="ttl", ttl=1)
    fs.ls(f"{bucket}/ttl")
    assert fs.cat_file(f"{bucket}/ttl/x") == b"old bytes"
    s3.put_object(Bucket=bucket, Key="ttl/x", Body=b"new bytes")
    time.sleep(1.2)  # past the bound
    assert fs.cat_file(f"{bucket}/ttl/x") == b"new bytes"


@pytest.mark.timeout(60)
def test_an_owner_never_serves_another_version_of_a_block(tmp_path, s3_server):
    """An owner node fetching a block for a peer: the peer's version token pins the read.
    The owner's s3fs instance (shared through fsspec's instance cache) still holds a listing
    from before the overwrite; a version check answered by it let the new bytes be cached
    and served under the old version's key."""
    from cachemw.config import DaemonConfig
    from cachemw.node.cache import NodeCache
    from cachemw.cluster.owner import serve_blocks

    s3 = s3_server["boto3"]()
    bucket = s3_server["bucket"]
    old, new = os.urandom(BS), os.urandom(BS)
    s3.put_object(Bucket=bucket, Key="owner/x", Body=old)
    target = fsspec.filesystem("s3", **s3_server["target_options"])
    target.ls(f"{bucket}/owner")
    path = f"{bucket}/owner/x"
    version = version_token(target.info(path))
    url = target.unstrip_protocol(path)
    key = block_key(url, version, 0, BS)
    node = NodeCache(DaemonConfig.build(runtime_dir=str(tmp_path / "rt"),
                                        dram_dir=str(tmp_path / "dram"), dram_capacity="16MiB"))
    s3.put_object(Bucket=bucket, Key="owner/x", Body=new)
    assert serve_blocks(node, [(key, BS, url, (target.to_json(), path, 0, BS, BS, version))]) \
        == [None]
    assert node.read_local(key, BS) is None


def test_a_prefetch_of_a_replaced_file_is_not_kept_under_the_old_version(tmp_path):
    """A file announced with the version its reader knows (metadata trusted under ttl),
    replaced before the daemon prefetches it: the prefetch must not keep the new bytes under
    the old version's key, where they would join the old version's cached blocks."""
    from fsspec.implementations.local import LocalFileSystem

    from cachemw.config import DaemonConfig
    from cachemw.node.cache import NodeCache
    from cachemw.node.prefetch import run_prefetch

    path = str(tmp_path / "f.bin")
    write(path, os.urandom(2 * BS))
    local = LocalFileSystem()
    version = version_token(local.info(path))
    url = local.unstrip_protocol(path)
    keys = [block_key(url, version, i, BS) for i in range(2)]
    node = NodeCache(DaemonConfig.build(runtime_dir=str(tmp_path / "rt"),
                                        dram_dir=str(tmp_path / "dram"), dram_capacity="16MiB"))
    replace(path, os.urandom(2 * BS))
    node.announce([(key, BS, url, (local.to_json(), path, i, BS, 2 * BS, version))
                   for i, key in enumerate(keys)])
    run_prefetch(node, 1 << 20)
    assert [node.read_local(key, BS) for key in keys] == [None, None]
    assert node.stats()["counters"]["prefetch_changed"] == 2 and not node.stats()["inflight"]


# -- HTTP (a real server with ranges and ETags, fsspec's HTTPFileSystem) --------------------


class _Handler(BaseHTTPRequestHandler):
    """Serves files of one directory with Range (206), a strong ETag (a digest of the
    content served) and If-Match (412 when it does not match), as an object store or a
    static file server does."""

    root = ""
    if_match = True  # False: a server that ignores If-Match (its ETags still tell)
    etags = True  # False: a server that sends no ETag at all (versions by size alone)

    def log_message(self, *args):
        pass

    def _load(self):
        try:
            with open(os.path.join(self.root, self.path.lstrip("/")), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self.send_error(404)
            return None, None
        etag = '"' + hashlib.blake2b(data, digest_size=16).hexdigest() + '"'
        match = self.headers.get("If-Match")
        if self.if_match and match is not None and match != "*" and etag not in [m.strip() for m in match.split(",")]:
            self.send_error(412)
            return None, None
        return data, etag

    def do_HEAD(self):
        data, etag = self._load()
        if data is not None:
            self._headers(200, len(data), etag)

    def do_GET(self):
        data, etag = self._load()
        if data is None:
            return
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            first, _, last = rng[len("bytes="):].partition("-")
            start = int(first)
            if start >= len(data):  # past the end: not satisfiable, as servers answer
                self.send_error(416)
                return
            end = min(int(last) + 1 if last else len(data), len(data))
            self._headers(206, end - start, etag, f"bytes {start}-{end - 1}/{len(data)}")
            self.wfile.write(data[start:end])
        else:
            self._headers(200, len(data), etag)
            self.wfile.write(data)

    def _headers(self, status, length, etag, content_range=None):
        self.send_response(status)
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        if self.etags:
            self.send_header("ETag", etag)
        if content_range:
            self.send_header("Content-Range", content_range)
        self.end_headers()


@pytest.fixture(params=["if-match", "ignores-if-match"])
def http_root(tmp_path, request):
    """A threaded HTTP server on 127.0.0.1 serving a fresh directory; yields (dir, base URL).
    Once as a server honouring If-Match, once as one ignoring it."""
    root = tmp_path / "www"
    root.mkdir()
    handler = type("Handler", (_Handler,), {"root": str(root),
                                            "if_match": request.param == "if-match"})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_http_an_open_file_replaced_reads_one_version_or_raises(make_cache_fs, http_root, mode):
    root, base = http_root
    fs = make_cache_fs(target_protocol="http", block_size=BS, **mode)
    old, new = os.urandom(3 * BS + 9), os.urandom(3 * BS + 9)
    write(str(root / "f.bin"), old)
    url = f"{base}/f.bin"
    with fs.open(url, "rb") as f:
        assert f.read(100) == old[:100]
        replace(str(root / "f.bin"), new)
        with pytest.raises(ChangedSourceError):
            f.read()
    assert fs.cat_file(url) == new
    assert fs.cat_file(url, BS - 5, BS + 5) == new[BS - 5:BS + 5]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("server", ["ignores-if-match", "no-etag"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_http_a_file_that_shrank_is_a_changed_file_not_an_error(make_cache_fs, tmp_path,
                                                                 server, mode):
    """Behind a server that ignores If-Match, or sends no ETag, a file replaced by a shorter
    one answers the old version's later blocks with 416: that is the file changing
    (ChangedSourceError for the open file, the new version for the next read, under
    immutable too), not an EIO for as long as the old metadata is trusted."""
    root = tmp_path / "www"
    root.mkdir()
    handler = type("Handler", (_Handler,), {"root": str(root), "if_match": False,
                                            "etags": server != "no-etag"})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/f.bin"
        fs = make_cache_fs(target_protocol="http", block_size=BS, **mode)
        old, new = os.urandom(3 * BS + 9), os.urandom(BS // 2)
        write(str(root / "f.bin"), old)
        with fs.open(url, "rb") as f:
            assert f.read(100) == old[:100]
            write(str(root / "f.bin"), new)
            f.seek(2 * BS)
            with pytest.raises(ChangedSourceError):
                f.read(10)
        assert fs.cat_file(url) == new
        with fs.open(url, "rb") as f:
            assert f.read() == new
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["dev-shm", "tmp_path"])
def test_a_local_file_rewritten_in_place_during_a_read_is_never_cached_torn(
        make_cache_fs, tmp_path, where):
    """Another process's in-place rewrite (one pwrite of the whole file) sets the file's
    times when it begins: a block read while it runs saw the new times before and after,
    half the old bytes, and was cached under the new version for good. Reads during the
    writes return one version or raise; once each write is done, the file reads whole."""
    from cachemw.tiers.source import _fs_type, _SEEK_WAITS_FOR_WRITES

    if where == "dev-shm":
        root = f"/dev/shm/cachemw-torn-{os.getpid()}-{os.urandom(4).hex()}"
        os.makedirs(root)
    else:
        root = str(tmp_path)
    if _fs_type(os.stat(root).st_dev) not in _SEEK_WAITS_FOR_WRITES:
        pytest.skip(f"{root} is on a filesystem where the check is a limit (README)")
    bs, blocks = 4 << 20, 8
    path = os.path.join(root, "r.bin")
    try:
        with open(path, "wb") as f:
            f.write(b"\1" * (bs * blocks))
        fs = make_cache_fs(validate="always", block_size=bs)

        def rewrite(version):
            fd = os.open(path, os.O_WRONLY)
            try:
                os.pwrite(fd, bytes([version]) * (bs * blocks), 0)
            finally:
                os.close(fd)

        for version in range(2, 14):
            writer = threading.Thread(target=rewrite, args=(version,))
            writer.start()
            while writer.is_alive():
                try:
                    got = fs.cat_file(path, (blocks - 1) * bs, blocks * bs)
                except ChangedSourceError:
                    continue
                assert len(set(got)) == 1, version  # one version's bytes
            writer.join()
            whole = fs.cat_file(path)
            assert set(whole[::bs]) == {version}, (version, list(whole[::bs]))
    finally:
        if where == "dev-shm":
            import shutil
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("status, content_range, whole", [
    (206, None, False),  # a part, its range not said: its size is not the object's
    (206, "bytes 0-9/*", False),  # the object's size not known
    (206, "Bytes 0-9/100", True),  # the unit in another case: still bytes
    (200, None, True),  # the store ignored Range: the whole object came
])
def test_an_s3_first_read_takes_a_size_only_from_what_names_it(monkeypatch, status, content_range, whole):
    """The first GET of an S3 object names its version and size (source_s3.first_s3). A
    part the store answered without a Content-Range (or with "*" for the total) was taken
    for the whole object: its size, the part's, was the file's size, and every read of
    the file stopped there (no error; an S3-compatible store or proxy sending such a 206).
    Such an answer now sends the read to the object's info (HeadObject), as a missing ETag
    does."""
    from types import SimpleNamespace

    from cachemw.tiers import source_s3

    obj = bytes(range(100))
    data = obj[:10] if status == 206 else obj
    resp = {"ETag": '"e"', "ContentLength": len(data), "LastModified": "t",
            "ResponseMetadata": {"HTTPStatusCode": status}}
    if content_range:
        resp["ContentRange"] = content_range
    monkeypatch.setattr(source_s3, "sync", lambda fs, coroutine, *args: (resp, data))
    fs = SimpleNamespace(split_path=lambda path: ("b", "k", None))
    got = source_s3.first_s3(fs, "b/k", 0, 10)
    if whole:
        assert got.info["size"] == 100 and got.data == obj[:10]
    else:
        assert got is None
