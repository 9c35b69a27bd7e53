"""A cold read costs one request per file (issue 13): the GET of the block the read starts
in names the file's version (ETag, size from Content-Range or Content-Length), so no HEAD
goes before it. Requests are counted at the servers: the main job's emulated store, a
small HTTP server in the test that logs every request, and moto behind a logging proxy.

* N one-block files read cold: N GETs, 0 HEADs; another process, and a HEAD-revalidating
  reader, then hit the same blocks (the version token is the one a HEAD gives) with no
  request to the store.
* A multi-block file: the first GET plain, every later block pinned with If-Match (a weak
  ETag: no If-Match, the response's ETag compared).
* A file changed between its first GET and a later block's reads back as the new version
  whole, on a server that honours If-Match and on one that ignores it.
* A server without ETags: the first answer says so, and from then on the file's info is
  asked first, as before; 404s, empty files and files smaller than a block.
* Two processes reading the same cold file at once: one fill, the duplicate fetch counted,
  the same bytes; a write through the cache while a cold GET is under way leaves no old
  bytes cached under a reused (weak) ETag.
* S3: the same through GetObject (moto, counted by a proxy).
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cachemw.job.store import EmulatedStore, StoreProfile
from cachemw.keys import version_token

BS = 64 * 1024


class _Server:
    """A threaded HTTP server over a directory that logs each request as (method, path,
    Range, If-Match, status). ``etags``: "strong" (a digest of the content), "weak" (the
    same, ``W/``), "reused" (one weak ETag for every content), "none". ``if_match``:
    False for a server that ignores it. ``hold``: GETs without If-Match wait for it
    (``waiting`` of them now). ``after_get(n)``: called once the n-th GET is answered."""

    def __init__(self, root, etags="strong", if_match=True) -> None:
        self.root, self.etags, self.if_match = str(root), etags, if_match
        self.log: list[tuple] = []
        self.hold: threading.Event | None = None
        self.waiting = 0  # GETs held now
        self.after_get = None
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"server_state": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def etag(self, data: bytes) -> str | None:
        digest = hashlib.blake2b(data, digest_size=16).hexdigest()
        return {"strong": f'"{digest}"', "weak": f'W/"{digest}"', "reused": 'W/"v1"',
                "none": None}[self.etags]

    def requests(self, method=None) -> list[tuple]:
        with self._lock:
            return [r for r in self.log if method is None or r[0] == method]

    def close(self) -> None:
        if self.hold is not None:
            self.hold.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


class _Handler(BaseHTTPRequestHandler):
    server_state: _Server

    def log_message(self, *args):
        pass

    def _record(self, status: int) -> None:
        st = self.server_state
        with st._lock:
            st.log.append((self.command, self.path, self.headers.get("Range"),
                           self.headers.get("If-Match"), status))

    def _send(self, status, body=b"", headers=()):
        self._record(status)
        self.send_response(status)
        for name, value in headers:
            if value is not None:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _load(self):
        try:
            with open(os.path.join(self.server_state.root, self.path.lstrip("/")), "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError):
            return None

    def do_HEAD(self):
        data = self._load()
        if data is None:
            return self._send(404)
        self._record(200)
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        if self.server_state.etag(data):
            self.send_header("ETag", self.server_state.etag(data))
        self.end_headers()

    def do_GET(self):
        st = self.server_state
        match = self.headers.get("If-Match")
        data = self._load()  # the version of now, sent after the hold if any
        if st.hold is not None and match is None:
            with st._lock:
                st.waiting += 1
            st.hold.wait(30)
            with st._lock:
                st.waiting -= 1
        if data is None:
            return self._send(404)
        etag = st.etag(data)
        if st.if_match and match is not None and etag not in [m.strip() for m in match.split(",")]:
            self._send(412, headers=[("ETag", etag)])
        else:
            rng = self.headers.get("Range")
            if rng:
                first, _, last = rng[len("bytes="):].partition("-")
                start, end = int(first), min(int(last) + 1, len(data))
                if start >= len(data):
                    self._send(416, headers=[("Content-Range", f"bytes */{len(data)}")])
                else:
                    self._send(206, data[start:end], [
                        ("ETag", etag), ("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")])
            else:
                self._send(200, data, [("ETag", etag)])
        if st.after_get is not None:
            st.after_get(len(st.requests("GET")))

    def do_PUT(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        path = os.path.join(self.server_state.root, self.path.lstrip("/"))
        with open(path + ".tmp", "wb") as f:
            f.write(body)
        os.replace(path + ".tmp", path)
        self._send(201)


@pytest.fixture
def serve(tmp_path):
    servers = []

    def start(**options) -> _Server:
        root = tmp_path / f"www{len(servers)}"
        root.mkdir()
        servers.append(_Server(root, **options))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _write(server: _Server, name: str, data: bytes) -> str:
    with open(os.path.join(server.root, name), "wb") as f:
        f.write(data)
    return f"{server.url}/{name}"


def _http_fs(make_cache_fs, **options):
    return make_cache_fs(target_protocol="http", block_size=BS, **options)


# -- the job's emulated store -------------------------------------------------------------


_READER = """
import hashlib, json, sys, fsspec
fs = fsspec.filesystem("cachemw", target_protocol=sys.argv[1], runtime_dir=sys.argv[2],
                       autostart=False, block_size=int(sys.argv[3]), skip_instance_cache=True,
                       target_options=json.loads(sys.argv[4]))
sys.stdin.readline()  # go
digests = [hashlib.sha256(fs.cat_file(url)).hexdigest() for url in sys.argv[5:]]
print(json.dumps({"digests": digests, "stats": fs.stats()}))
"""


def _reader(protocol, runtime_dir, urls, target_options=None):
    """A reader in a process of its own (as a DataLoader worker is): reads ``urls`` once
    told to go (a line on stdin); prints the digests and its counters."""
    return subprocess.Popen([sys.executable, "-c", _READER, protocol, runtime_dir, str(BS),
                             json.dumps(target_options or {}), *urls],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _result(proc) -> dict:
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    return json.loads(out)


@pytest.mark.timeout(90)
def test_cold_one_block_files_cost_one_get_each_and_no_head(tmp_path, make_cache_fs,
                                                           runtime_dir):
    root = tmp_path / "store"
    (root / "train").mkdir(parents=True)
    files = {f"f{i}.bin": os.urandom(1000 + 997 * i) for i in range(6)}
    for name, data in files.items():
        (root / "train" / name).write_bytes(data)
    with EmulatedStore(str(root), StoreProfile(latency=0, bandwidth=0, meta_latency=0)) as s:
        fs = _http_fs(make_cache_fs, validate="immutable")
        urls = [f"{s.url}/train/{name}" for name in files]
        for url, data in zip(urls, files.values()):
            assert fs.cat_file(url) == data
        counts = s.stats()["requests"]
        assert (counts["head"], counts["get_range"] + counts["get"]) == (0, len(files))
        assert fs.stats()["cold_gets"] == len(files)
        # the version is the one a HEAD gives: the same block keys, whoever learns it
        for url in urls:
            assert fs.meta.file(url).version == version_token(fs.target.info(url))
        heads = s.stats()["requests"]["head"]
        # another process (a DataLoader worker) knows the files from the node's table
        fs.stats()  # the fills and the metadata written behind the reads have landed
        worker = _reader("http", runtime_dir, urls)
        worker.stdin.write("go\n")
        worker.stdin.flush()
        result = _result(worker)
        assert result["digests"] == [hashlib.sha256(d).hexdigest() for d in files.values()]
        assert result["stats"]["hits"] == len(files) and not result["stats"]["misses"]
        after = s.stats()["requests"]
        assert (after["head"], after["get_range"] + after["get"]) == (heads, len(files))
        # one that revalidates by HEAD (ttl expired) finds the same blocks: hits, no GET
        revalidating = _http_fs(make_cache_fs, validate="ttl", ttl=0)
        for url, data in zip(urls, files.values()):
            revalidating.meta.file(url)  # known now (stale at once): revalidated by HEAD
            assert revalidating.cat_file(url) == data
        after = s.stats()["requests"]
        assert after["get_range"] + after["get"] == len(files)
        assert revalidating.stats()["hits"] == len(files)


# -- a server that logs every request -------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("etags", ["strong", "weak"])
def test_a_multi_block_file_is_read_first_get_then_pinned_to_its_etag(serve, make_cache_fs,
                                                                      etags):
    server = serve(etags=etags)
    data = os.urandom(3 * BS + 123)
    url = _write(server, "big.bin", data)
    fs = _http_fs(make_cache_fs)
    assert fs.cat_file(url) == data
    etag = server.etag(data)
    pinned = etag if etags == "strong" else None  # If-Match compares strong ETags only
    got = server.requests()
    assert got[0] == ("GET", "/big.bin", f"bytes=0-{BS - 1}", None, 206)
    assert sorted(got[1:]) == sorted(  # the rest side by side (client/fanout.py): any order
        ("GET", "/big.bin", f"bytes={i * BS}-{min((i + 1) * BS, len(data)) - 1}", pinned, 206)
        for i in range(1, 4))
    assert fs.meta.file(url).version == version_token(fs.target.info(url))
    # a range read of a cold file starts at the block it asks for
    url2 = _write(server, "big2.bin", data)
    assert fs.cat_file(url2, 2 * BS + 5, 2 * BS + 50) == data[2 * BS + 5:2 * BS + 50]
    assert server.requests()[-1] == ("GET", "/big2.bin", f"bytes={2 * BS}-{3 * BS - 1}",
                                     None, 206)
    assert [r[1] for r in server.requests("HEAD")] == ["/big.bin"]  # the test's own info()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("if_match", [True, False], ids=["if-match", "ignores-if-match"])
def test_a_file_changed_after_its_first_get_reads_as_the_new_version_whole(
        serve, make_cache_fs, if_match):
    server = serve(if_match=if_match)
    old, new = os.urandom(3 * BS + 7), os.urandom(3 * BS + 7)
    url = _write(server, "f.bin", old)

    def replace(n):
        if n == 1:  # right after the first block was sent
            _write(server, "f.bin", new)

    server.after_get = replace
    fs = _http_fs(make_cache_fs)
    assert fs.cat_file(url) == new
    assert not server.requests("HEAD")
    # the old version's first block stays cached under its own key only: no mix later
    fs2 = _http_fs(make_cache_fs)
    assert fs2.cat_file(url) == new
    assert fs2.cat_file(url, BS - 3, BS + 3) == new[BS - 3:BS + 3]


@pytest.mark.timeout(60)
def test_a_server_without_etags_falls_back_to_asking_the_info_once_seen(serve, make_cache_fs):
    server = serve(etags="none")
    files = [os.urandom(5000 + i) for i in range(3)]
    urls = [_write(server, f"f{i}.bin", d) for i, d in enumerate(files)]
    fs = _http_fs(make_cache_fs)
    for url, data in zip(urls, files):
        assert fs.cat_file(url) == data
    methods = [r[0] for r in server.requests()]
    # the first answer had no ETag: that GET is wasted once; then as before: the info,
    # the GET, the info again (what pins a read to a version without an ETag)
    assert methods == ["GET"] + ["HEAD", "GET", "HEAD"] * 3
    assert fs.stats()["cold_get_fallbacks"] == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("write_behind", [None, 0], ids=["written-behind", "written-inline"])
def test_missing_empty_and_small_files_read_cold(serve, make_cache_fs, write_behind):
    server = serve()
    fs = _http_fs(make_cache_fs, write_behind=write_behind)
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{server.url}/nope.bin")
    assert [r[0] for r in server.requests()] == ["GET"]  # a 404 needs no HEAD to tell
    small = os.urandom(100)
    url = _write(server, "small.bin", small)
    assert fs.cat_file(url) == small
    assert fs.cat_file(url, 10, 20) == small[10:20]  # a hit
    assert fs.stats()["fills"] == 1
    assert server.requests()[1:] == [("GET", "/small.bin", f"bytes=0-{BS - 1}", None, 206)]
    assert fs.cat_file(_write(server, "small2.bin", small), 150) == b""  # past its end
    empty = _write(server, "empty.bin", b"")
    assert fs.cat_file(empty) == b""  # a range of nothing is refused (416): the info tells
    assert fs.cat_file(empty) == b""


@pytest.mark.timeout(90)
def test_two_processes_reading_one_cold_file_at_once_fill_it_once(serve, make_cache_fs,
                                                                  runtime_dir):
    server = serve()
    data = os.urandom(BS // 2)
    url = _write(server, "f.bin", data)
    _http_fs(make_cache_fs)  # the daemon
    server.hold = threading.Event()
    readers = [_reader("http", runtime_dir, [url]) for _ in range(2)]
    for proc in readers:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    _wait_for(lambda: server.waiting == 2)  # both cold GETs at the server: a real race
    server.hold.set()
    results = [_result(proc) for proc in readers]
    assert [r["digests"] for r in results] == [[hashlib.sha256(data).hexdigest()]] * 2
    assert sum(r["stats"]["fills"] for r in results) == 1
    assert sum(r["stats"]["cold_get_duplicates"] for r in results) == 1
    assert [r[0] for r in server.requests()] == ["GET", "GET"]
    fs = _http_fs(make_cache_fs)
    assert fs.cat_file(url) == data and fs.stats()["hits"] == 1
    assert [r[0] for r in server.requests()] == ["GET", "GET"]


def _wait_for(condition, timeout: float = 30.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        done.wait(0.05)
    raise AssertionError("timed out waiting")


@pytest.mark.timeout(60)
def test_a_write_through_the_cache_during_a_cold_get_leaves_no_old_bytes_cached(
        serve, make_cache_fs):
    """On a server that reuses one weak ETag for new content the old and the new version
    have the same token (so the same block keys): the block a cold GET brought from before
    a write through the cache must not be cached."""
    server = serve(etags="reused")
    old, new = os.urandom(5000), os.urandom(5000)
    url = _write(server, "f.bin", old)
    reader, writer = _http_fs(make_cache_fs), _http_fs(make_cache_fs)
    server.hold = threading.Event()
    got = []
    thread = threading.Thread(target=lambda: got.append(reader.cat_file(url)))
    thread.start()
    _wait_for(lambda: server.waiting == 1)
    writer.pipe_file(url, new)
    server.hold.set()
    thread.join(30)
    assert got == [old]  # the version the store had when the read was sent
    reader.stats()  # its fill (if any) has landed
    fresh = _http_fs(make_cache_fs)
    assert fresh.cat_file(url) == new
    assert fresh.cat_file(url) == new  # and again, from whatever the cache kept
    assert _http_fs(make_cache_fs).cat_file(url) == new
    assert not server.requests("HEAD")


# -- S3 (moto, its requests counted by a proxy in front of it) --------------------------


class _Proxy(BaseHTTPRequestHandler):
    """Forwards each request to moto as it came; logs (method, path) of each."""

    target = ""
    log: list

    def log_message(self, *args):
        pass

    def _forward(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        host, port = self.target.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request(self.command, self.path, body=body or None,
                         headers={k: v for k, v in self.headers.items()})
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        self.log.append((self.command, self.path.split("?")[0], self.headers.get("Range"),
                         self.headers.get("If-Match"), resp.status))
        self.send_response(resp.status)
        for name, value in resp.getheaders():
            if name.lower() not in ("transfer-encoding", "connection", "content-length",
                                    "server", "date"):
                self.send_header(name, value)
        self.send_header("Content-Length", resp.getheader("Content-Length", "0")
                         if self.command == "HEAD" else str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


@pytest.fixture
def s3_proxied(s3_server):
    """s3fs options that reach moto through a proxy, and the list it logs requests in."""
    log: list = []
    handler = type("Proxy", (_Proxy,), {"target": s3_server["endpoint"][len("http://"):],
                                        "log": log})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    options = json.loads(json.dumps(s3_server["target_options"]))
    options["client_kwargs"]["endpoint_url"] = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        yield options, log
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


@pytest.mark.timeout(60)
def test_s3_cold_objects_cost_one_getobject_each(make_cache_fs, s3_server, s3_proxied):
    options, log = s3_proxied
    bucket, s3 = s3_server["bucket"], s3_server["boto3"]()
    small = {f"cold/s{i}": os.urandom(2000 + i) for i in range(3)}
    big = os.urandom(2 * BS + 9)
    for key, data in {**small, "cold/big": big, "cold/dir/x": b"x"}.items():
        s3.put_object(Bucket=bucket, Key=key, Body=data)
    fs = make_cache_fs(target_protocol="s3", target_options=options, block_size=BS,
                       validate="immutable")
    for key, data in small.items():
        assert fs.cat_file(f"s3://{bucket}/{key}") == data
    assert [r[0] for r in log] == ["GET"] * len(small)
    assert fs.cat_file(f"s3://{bucket}/cold/big") == big
    big_requests = [r for r in log if r[1].endswith("/cold/big")]
    etag = s3.head_object(Bucket=bucket, Key="cold/big")["ETag"]
    got = [(r[0], r[2], r[3]) for r in big_requests]
    assert got[0] == ("GET", f"bytes=0-{BS - 1}", None)
    assert sorted(got[1:]) == sorted([  # the rest side by side (client/fanout.py): any order
        ("GET", f"bytes={BS}-{2 * BS - 1}", etag), ("GET", f"bytes={2 * BS}-{len(big) - 1}", etag)])
    assert not [r for r in log if r[0] == "HEAD"]
    for key in [*small, "cold/big"]:  # the version a HeadObject gives
        path = f"{bucket}/{key}"
        assert fs.meta.file(path).version == version_token(fs.target.info(path, refresh=True))
    n = len(log)
    fs.stats()
    fs2 = make_cache_fs(target_protocol="s3", target_options=options, block_size=BS,
                        validate="immutable")
    for key, data in small.items():
        assert fs2.cat_file(f"s3://{bucket}/{key}") == data
    assert len(log) == n and fs2.stats()["hits"] == len(small)
    with pytest.raises(IsADirectoryError):  # a prefix: no such object, the info tells
        fs.cat_file(f"s3://{bucket}/cold/dir")
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"s3://{bucket}/cold/nope")
