"""``cachemw warm`` of HTTP URLs reads each block once, with a Range GET, and lists only
directories: a file's URL was listed (fsspec's HTTP ``find``/``ls`` GETs the URL to look
for links in it), a GET of the whole file on every node on top of its owner's block read
(review nodes3, defect 4). Counted on a real HTTP server: Range, ETag, a directory index
as ``text/html``, and a file's Content-Type as given (none, or octet-stream)."""
from __future__ import annotations

import collections
import hashlib
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cachemw import warm
from cachemw.config import WarmConfig
from cachemw.launch import stop_local

BS = 65536


class _Store(BaseHTTPRequestHandler):
    """Files of ``root`` with ETag and Range; a directory's URL (ending in /) answers with
    an HTML index of links. Every request is counted by kind in ``counts``."""

    protocol_version = "HTTP/1.1"
    root = ""
    content_type: str | None = None
    counts: collections.Counter

    def log_message(self, *args):
        pass

    def _answer(self, status, body=b"", headers=()):
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def _serve(self):
        path = os.path.join(self.root, self.path.lstrip("/"))
        rng = self.headers.get("Range")
        if os.path.isdir(path):
            self.counts[f"{self.command} directory"] += 1
            names = [n + "/" if os.path.isdir(os.path.join(path, n)) else n
                     for n in sorted(os.listdir(path))]  # as servers list them
            index = "".join(f'<a href="{n}">{n}</a>\n' for n in names)
            return self._answer(200, f"<html><body>{index}</body></html>".encode(),
                                [("Content-Type", "text/html")])
        self.counts[f"{self.command} file" + (" range" if rng and self.command == "GET" else "")] += 1
        if not os.path.isfile(path):
            return self._answer(404)
        data = open(path, "rb").read()
        st = os.stat(path)
        headers = [("ETag", '"%s"' % hashlib.blake2b(f"{st.st_size}-{st.st_mtime_ns}".encode(),
                                                      digest_size=8).hexdigest()),
                   ("Accept-Ranges", "bytes")]
        if self.content_type:
            headers.append(("Content-Type", self.content_type))
        if rng and self.command == "GET":
            first, _, last = rng[len("bytes="):].partition("-")
            start, end = int(first), min(int(last) + 1 if last else len(data), len(data))
            headers.append(("Content-Range", f"bytes {start}-{end - 1}/{len(data)}"))
            return self._answer(206, data[start:end], headers)
        if self.command == "HEAD":  # the size without the body
            self.send_response(200)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            return None
        return self._answer(200, data, headers)

    do_GET = do_HEAD = _serve


@pytest.fixture(params=[None, "application/octet-stream"], ids=["no-type", "octet-stream"])
def store(request, tmp_path, make_tree):
    files = make_tree([100_000] * 6 + [3 * BS + 7], name="data")
    (tmp_path / "data" / "sub").mkdir()
    (tmp_path / "data" / "sub" / "s0.bin").write_bytes(os.urandom(5000))
    handler = type("Store", (_Store,), {"root": str(tmp_path), "counts": collections.Counter(),
                                         "content_type": request.param})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", files, handler.counts
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def warm_dir(runtime_dir, monkeypatch):
    """The runtime dir passed to each warm: by the environment alone, a later test got the
    instance fsspec cached for an earlier one (its runtime dir), whose daemon then outlived
    both tests."""
    monkeypatch.setenv("CACHEMW_BLOCK_SIZE", str(BS))
    monkeypatch.setenv("CACHEMW_DRAM_CAPACITY", "64MiB")
    yield runtime_dir
    stop_local(runtime_dir)


@pytest.mark.timeout(180)
def test_warm_of_http_files_reads_each_block_once_and_lists_no_file(store, warm_dir):
    base, files, counts = store
    urls = [f"cachemw::{base}/data/{os.path.basename(p)}" for p in sorted(files)]
    report = warm.run(urls, WarmConfig.build(nodes=1, env={}), runtime_dir=warm_dir)
    assert report.ok and report.files == len(files), report.as_dict()
    blocks = sum(-(-len(data) // BS) for data in files.values())
    assert report.blocks == blocks
    assert counts["GET file"] == 0, counts  # no whole file: nothing listed
    assert counts["GET file range"] == blocks, counts  # each block once
    assert counts["GET directory"] == 0, counts


@pytest.mark.timeout(180)
def test_warm_of_an_http_directory_lists_it(store, warm_dir):
    base, files, counts = store
    report = warm.run([f"cachemw::{base}/data/"], WarmConfig.build(nodes=1, env={}),
                      runtime_dir=warm_dir)
    assert report.ok and report.files == len(files) + 1, report.as_dict()  # sub/ too
    assert counts["GET file"] == 0, counts
    assert counts["GET file range"] == report.blocks == sum(
        -(-len(data) // BS) for data in files.values()) + 1, counts
    assert 1 <= counts["GET directory"] <= 2, counts  # data/, sub/: each index once


@pytest.mark.timeout(120)
def test_warm_of_a_server_that_does_not_answer_names_the_connection_not_a_missing_file(
        store, warm_dir):
    """fsspec's HTTP ``info`` calls every failure "not found": the warm said a server
    nothing listened on had no such file (review readme4, defect 4). A 404 is still one."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(warm.WarmError) as got:
        warm.run([f"cachemw::http://127.0.0.1:{port}/data/"],
                 WarmConfig.build(nodes=1, env={}), runtime_dir=warm_dir)
    assert "not found" not in str(got.value) and "cannot list" in str(got.value), got.value
    base, _, _ = store
    with pytest.raises(warm.WarmError, match="not found at the store"):
        warm.run([f"cachemw::{base}/data/nothing.bin"], WarmConfig.build(nodes=1, env={}),
                 runtime_dir=warm_dir)
