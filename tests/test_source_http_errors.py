"""How an HTTP source's failures surface, and a server without ETags or Range support.

* A server in trouble (500, 503), one that refuses (403) and one that cannot be reached
  (connection refused) fail a cold ``cat_file`` and an ``open().read()`` with an OSError
  that names the URL and the cause (PermissionError for 403), never FileNotFoundError: an
  outage must not read as a missing file (fsspec's HTTP ``info`` says FileNotFoundError for
  all of them). A 404 (and a 410) stays FileNotFoundError, saying why.
* The same for a file already known whose later block fails (a server without ETags:
  its read is checked by asking the info again, which failed as "not found").
* python's ``http.server`` (no ETag, no Range): a file of several blocks reads whole,
  again and again, and a file changed between reads is still seen as changed.
"""
from __future__ import annotations

import io
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cachemw.tiers.source import ChangedSourceError

BS = 64 * 1024


class _Failing(BaseHTTPRequestHandler):
    """Answers ``/<status>/<name>`` with that status, to GET and HEAD alike."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _fail(self):
        self.send_response(int(self.path.split("/")[1]))
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = _fail


class _Plain(SimpleHTTPRequestHandler):
    """python's own file server (no ETag, Range ignored); ``fail_with``: every request
    answered with that status instead, while it is set; ``ranges``: Range honoured."""

    root = ""
    fail_with: int | None = None
    ranges = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, directory=self.root, **kwargs)

    def log_message(self, *args):
        pass

    def send_head(self):
        if self.fail_with is not None:
            self.send_error(self.fail_with)
            return None
        rng = self.headers.get("Range")
        if not (self.ranges and self.command == "GET" and rng):
            return super().send_head()
        data = open(self.translate_path(self.path), "rb").read()
        first, _, last = rng[len("bytes="):].partition("-")
        start, end = int(first), min(int(last) + 1 if last else len(data), len(data))
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        return io.BytesIO(data[start:end])


class _Chunked(BaseHTTPRequestHandler):
    """Files of ``root`` with an ETag and Range, sent chunked: no Content-Length, so
    fsspec's HTTP ``info`` gives no size (review stores4)."""

    protocol_version = "HTTP/1.1"
    root = ""

    def log_message(self, *args):
        pass

    def _serve(self):
        path = os.path.join(self.root, self.path.lstrip("/"))
        if not os.path.isfile(path):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = open(path, "rb").read()
        st = os.stat(path)
        rng = self.headers.get("Range")
        status = 200
        if rng and self.command == "GET":
            first, _, last = rng[len("bytes="):].partition("-")
            start, end = int(first), min(int(last) + 1 if last else len(data), len(data))
            data, status = data[start:end], 206
        self.send_response(status)
        self.send_header("ETag", f'"{st.st_ino}-{st.st_mtime_ns}"')
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if self.command == "GET":
            for i in range(0, len(data), 10_000):
                piece = data[i:i + 10_000]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")

    do_GET = do_HEAD = _serve


def _serve(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def failing():
    server, thread, base = _serve(_Failing)
    yield base
    server.shutdown()
    server.server_close()
    thread.join(10)


def _serving_a_dir(tmp_path, kind):
    """(directory, base URL, handler class) of a server of ``kind`` over a fresh dir."""
    root = tmp_path / "www"
    root.mkdir()
    handler = type("Handler", (kind,), {"root": str(root)})
    server, thread, base = _serve(handler)
    yield root, base, handler
    server.shutdown()
    server.server_close()
    thread.join(10)


@pytest.fixture
def plain(tmp_path):
    """(directory, base URL, handler class) of python's file server over a fresh dir."""
    yield from _serving_a_dir(tmp_path, _Plain)


def _http_fs(make_cache_fs):
    return make_cache_fs(target_protocol="http", block_size=BS)


def _read(fs, url, how):
    if how == "cat_file":
        return fs.cat_file(url)
    with fs.open(url, "rb") as f:
        return f.read()


def _refused_url() -> str:
    """A URL on a local port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/f.bin"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["cat_file", "open"])
@pytest.mark.parametrize("status,kind", [(500, OSError), (503, OSError),
                                         (403, PermissionError)])
def test_a_server_error_is_an_oserror_naming_the_url_and_status(make_cache_fs, failing, how,
                                                                status, kind):
    fs = _http_fs(make_cache_fs)
    url = f"{failing}/{status}/f.bin"
    with pytest.raises(kind) as raised:
        _read(fs, url, how)
    assert not isinstance(raised.value, FileNotFoundError)
    assert url in str(raised.value) and f"HTTP {status}" in str(raised.value)
    # fsspec's on_error="return": the error itself, not a missing file
    [result] = fs.cat([url], on_error="return").values()
    assert isinstance(result, kind) and not isinstance(result, FileNotFoundError)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["cat_file", "open"])
def test_connection_refused_is_an_oserror_naming_the_url(make_cache_fs, how):
    fs = _http_fs(make_cache_fs)
    url = _refused_url()
    with pytest.raises(ConnectionRefusedError) as raised:
        _read(fs, url, how)
    assert url in str(raised.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["cat_file", "open"])
@pytest.mark.parametrize("status", [404, 410])
def test_a_missing_file_stays_file_not_found_saying_why(make_cache_fs, failing, how, status):
    fs = _http_fs(make_cache_fs)
    url = f"{failing}/{status}/f.bin"
    with pytest.raises(FileNotFoundError) as raised:
        _read(fs, url, how)
    assert url in str(raised.value) and f"HTTP {status}" in str(raised.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ranges", [False, True], ids=["no-range", "range"])
def test_a_known_file_whose_server_fails_later_is_not_a_missing_file(make_cache_fs, plain,
                                                                     ranges):
    root, base, handler = plain
    handler.ranges = ranges
    data = os.urandom(3 * BS + 11)
    (root / "f.bin").write_bytes(data)
    fs = _http_fs(make_cache_fs)
    with fs.open(f"{base}/f.bin", "rb") as f:
        assert f.read(100) == data[:100]
        handler.fail_with = 503
        f.seek(2 * BS)
        with pytest.raises(OSError) as raised:
            f.read(10)
        assert not isinstance(raised.value, (FileNotFoundError, ChangedSourceError))
        assert "HTTP 503" in str(raised.value) and f"{base}/f.bin" in str(raised.value)
        handler.fail_with = None
        f.seek(2 * BS)
        assert f.read(10) == data[2 * BS:2 * BS + 10]  # the server is back: the same version


@pytest.mark.timeout(60)
def test_a_server_without_etags_or_ranges_reads_multi_block_files(make_cache_fs, plain):
    root, base, _ = plain
    data = os.urandom(3 * BS + 1234)
    (root / "f.bin").write_bytes(data)
    url = f"{base}/f.bin"
    fs = _http_fs(make_cache_fs)
    for _ in range(3):  # cold, then from the cache
        assert fs.cat_file(url, 100, 200) == data[100:200]
        assert fs.cat_file(url, BS - 5, 2 * BS + 5) == data[BS - 5:2 * BS + 5]
        assert fs.cat_file(url) == data
        with fs.open(url, "rb") as f:
            assert f.read() == data
    other = _http_fs(make_cache_fs)  # another reader of the node: the same bytes
    assert other.cat_file(url) == data
    (root / "g.bin").write_bytes(data[:2 * BS])  # read through an open file first
    with fs.open(f"{base}/g.bin", "rb") as f:
        f.seek(BS + 1)
        assert f.read() == data[BS + 1:2 * BS]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", ["resized", "same-size"])
def test_a_file_changed_between_reads_without_etags_is_still_seen(make_cache_fs, plain,
                                                                   change):
    root, base, _ = plain
    path = root / "f.bin"
    old = os.urandom(3 * BS + 9)
    new = os.urandom(len(old) + (BS // 2 if change == "resized" else 0))
    path.write_bytes(old)
    url = f"{base}/f.bin"
    fs = _http_fs(make_cache_fs)
    with fs.open(url, "rb") as f:
        assert f.read(100) == old[:100]
        stat = os.stat(path)
        path.write_bytes(new)
        # Last-Modified is in whole seconds: make sure it moves (with the size, the
        # version of a server without ETags)
        os.utime(path, (stat.st_atime + 10, stat.st_mtime + 10))
        f.seek(2 * BS)
        with pytest.raises(ChangedSourceError):
            f.read(10)
    assert fs.cat_file(url) == new
    with fs.open(url, "rb") as f:
        assert f.read() == new


@pytest.mark.timeout(60)
@pytest.mark.parametrize("validate", ["ttl", "always", "immutable"])
def test_a_server_that_sends_no_content_length_is_read_whole_uncached(make_cache_fs, tmp_path,
                                                                      validate):
    """Such a file has no stated size (fsspec's info: None): it is read whole from the
    server, uncached, counted as bypassed, through every read call; a change is seen.
    Before, every read but a cold cat_file failed with TypeError (review stores4)."""
    root = tmp_path / "chunked"
    root.mkdir()
    data = os.urandom(3 * BS + 1234)
    (root / "f.bin").write_bytes(data)
    handler = type("Handler", (_Chunked,), {"root": str(root)})
    server, thread, base = _serve(handler)
    try:
        url = f"{base}/f.bin"
        fs = make_cache_fs(target_protocol="http", block_size=BS, validate=validate)
        for _ in range(2):
            assert fs.cat_file(url) == data
            assert fs.cat_file(url, BS - 5, 2 * BS + 5) == data[BS - 5:2 * BS + 5]
            with fs.open(url, "rb") as f:
                f.seek(BS + 1)
                assert f.read(100) == data[BS + 1:BS + 101]
            assert fs.cat_ranges([url, url], [0, 10], [5, 20]) == [data[:5], data[10:20]]
        assert fs.info(url)["size"] is None
        assert fs.stats()["bypassed"] >= 8
        new = os.urandom(len(data) - 7)
        (root / "f.bin").write_bytes(new)
        assert fs.cat_file(url) == new  # (immutable: its read at the version known failed)
        other = make_cache_fs(target_protocol="http", block_size=BS, validate=validate)
        assert other.cat_file(url) == new
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


class _Ranges(BaseHTTPRequestHandler):
    """Files of ``root`` with a strong ETag and Range; ``mode`` "shift": a range answered
    one byte later than asked, saying so in its Content-Range (a buggy server or proxy);
    "cap": ranges answered up to ``CAP`` bytes (some CDNs and gateways cap them)."""

    protocol_version = "HTTP/1.1"
    root = ""
    mode = ""
    CAP = 10_000
    etag = True  # False: no ETag (and no Last-Modified), as some servers send
    requests = None  # a list (set by a test): the methods asked, in order

    def log_message(self, *args):
        pass

    def _serve(self):
        path = os.path.join(self.root, self.path.lstrip("/"))
        if self.requests is not None:
            self.requests.append(self.command)
        data = open(path, "rb").read()
        st = os.stat(path)
        etag = f'"{st.st_ino}-{st.st_mtime_ns}"'
        rng = self.headers.get("Range")
        status, start, end = 200, 0, len(data)
        if rng and self.command == "GET":
            first, _, last = rng[len("bytes="):].partition("-")
            start, end = int(first), min(int(last) + 1 if last else len(data), len(data))
            if self.mode == "shift" and end < len(data):
                start, end = start + 1, end + 1
            elif self.mode == "cap":
                end = min(end, start + self.CAP)
            status = 206
        self.send_response(status)
        if self.etag:
            self.send_header("ETag", etag)
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.send_header("Content-Length", str(end - start if self.command == "GET" else len(data)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data[start:end])

    do_GET = do_HEAD = _serve


@pytest.fixture
def ranges(tmp_path):
    yield from _serving_a_dir(tmp_path, _Ranges)


@pytest.mark.timeout(60)
def test_a_range_answered_with_another_range_is_an_error_and_never_cached(make_cache_fs, ranges):
    """A 206 whose Content-Range is not the range asked (shifted by a byte, same length and
    ETag) was kept as the block asked for, and served under every validate, by every
    process, after the server was fixed (review loaders6)."""
    import errno

    root, base, handler = ranges
    data = os.urandom(3 * BS + 100)
    (root / "f.bin").write_bytes(data)
    fs = make_cache_fs(target_protocol="http", block_size=BS, validate="always")
    handler.mode = "shift"
    with pytest.raises(OSError) as info:
        fs.cat_file(f"{base}/f.bin")
    assert info.value.errno == errno.EIO and "another range than asked" in str(info.value)
    assert not isinstance(info.value, ChangedSourceError)
    handler.mode = ""
    assert fs.cat_file(f"{base}/f.bin") == data  # nothing wrong was kept
    assert fs.cat_file(f"{base}/f.bin", BS - 5, 2 * BS + 5) == data[BS - 5:2 * BS + 5]


@pytest.mark.timeout(60)
def test_a_server_that_caps_ranges_is_read_in_several_gets(make_cache_fs, ranges):
    """Every read of an unchanged file from a server that answers at most CAP bytes a
    range failed as changed ("reopen the file"), whatever was asked (review loaders6)."""
    root, base, handler = ranges
    data = os.urandom(3 * BS + 100)
    (root / "f.bin").write_bytes(data)
    handler.mode = "cap"
    fs = make_cache_fs(target_protocol="http", block_size=BS, validate="always")
    assert fs.cat_file(f"{base}/f.bin", 0, 100) == data[:100]
    assert fs.cat_file(f"{base}/f.bin") == data
    assert fs.cat_file(f"{base}/f.bin", BS - 5, 2 * BS + 5) == data[BS - 5:2 * BS + 5]


@pytest.mark.timeout(60)
def test_a_capped_range_without_an_etag_is_checked_once_after_all_its_parts(
        make_cache_fs, ranges):
    """Without an ETag to pin a GET to the version, a read is checked after it by asking
    the version again (a HEAD): a block read in several GETs from a server that caps
    ranges asked it after every part (diffrev-11), 7 HEADs for a 64 KiB block."""
    root, base, handler = ranges
    data = os.urandom(BS)
    (root / "f.bin").write_bytes(data)
    handler.mode, handler.etag, handler.requests = "cap", False, []
    fs = make_cache_fs(target_protocol="http", block_size=BS, validate="always")
    fs.info(f"{base}/f.bin")
    del handler.requests[:]
    assert fs.cat_file(f"{base}/f.bin") == data
    assert handler.requests.count("GET") == -(-BS // handler.CAP) == 7
    assert handler.requests.count("HEAD") <= 2, handler.requests  # validate="always": one more
    # the file is replaced (another size) between two parts of a read: the check after
    # them all sees it, and no mix of the two versions is returned nor kept
    (root / "g.bin").write_bytes(os.urandom(BS))
    fs.info(f"{base}/g.bin")
    handler.requests = _Replaced(root / "g.bin", after=3)
    try:
        got = fs.cat_file(f"{base}/g.bin", 0, BS)
    except ChangedSourceError:
        got = None
    handler.requests = None
    new = (root / "g.bin").read_bytes()
    assert got in (None, new[:BS])
    assert fs.cat_file(f"{base}/g.bin") == new


class _Replaced(list):
    """The methods a server was asked (see _Ranges.requests); the file is replaced by
    another of another size once ``after`` GETs were answered."""

    def __init__(self, path, after: int) -> None:
        super().__init__()
        self.path, self.after = path, after

    def append(self, method) -> None:
        super().append(method)
        if method == "GET" and self.count("GET") == self.after + 1:
            self.path.write_bytes(os.urandom(BS + 5))


def test_a_content_range_s_unit_is_read_whatever_its_case():
    """The unit of a Content-Range is case-insensitive (RFC 9110): "Bytes" is a range of
    bytes like "bytes", not another range than asked (diffrev-11)."""
    from cachemw.tiers.source_http import _sent_range

    assert _sent_range("u", "Bytes 0-9/100", 0, 10, 10) == 9
    assert _sent_range("u", "bytes 10-19/*", 10, 20, 10) == 19
    with pytest.raises(OSError):
        _sent_range("u", "bytes 11-20/100", 10, 20, 10)
