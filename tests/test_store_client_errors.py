"""An S3 store that does not answer fails every call through cachemw with an OSError (the
README: "Bytes of exactly one version of the file, or an OSError"), naming the URL and the
cause, chained to it, its errno kept: s3fs lets botocore's EndpointConnectionError, which
is no OSError, and its timeouts, OSErrors without an errno, through as they are.
"""
from __future__ import annotations

import errno
import socket

import fsspec
import pytest

from cachemw.client.fs import CacheFileSystem
from cachemw.store_errors import client_error, from_client

botocore_exceptions = pytest.importorskip("botocore.exceptions")
pytest.importorskip("s3fs")

CREDS = {"key": "testing", "secret": "testing"}


@pytest.fixture
def closed_port():
    """A localhost port nothing listens on (connections refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def silent_port():
    """A localhost port that takes connections (the kernel's backlog) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield s.getsockname()[1]
    s.close()


def _options(port: int, **config) -> dict:
    return {**CREDS, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}",
                                                     "region_name": "us-east-1"},
            "config_kwargs": {"retries": {"max_attempts": 1}, **config}}


def _calls(fs, s3):
    """Every way a caller reaches the store through ``fs`` (and a chained URL)."""
    return {
        "cat_file": lambda: fs.cat_file("bucket/k"),
        "cat_file range": lambda: fs.cat_file("bucket/k", 10, 20),
        "cat": lambda: fs.cat(["bucket/k", "bucket/k2"]),
        "cat_ranges raise": lambda: fs.cat_ranges(["bucket/k"], [0], [5], on_error="raise"),
        "open": lambda: fs.open("bucket/k").read(),
        "info": lambda: fs.info("bucket/k"),
        "ls": lambda: fs.ls("bucket"),
        "find": lambda: fs.find("bucket/dir"),
        "pipe_file": lambda: fs.pipe_file("bucket/w", b"x"),
        "open wb": lambda: fs.open("bucket/w2", "wb").close(),
        "rm": lambda: fs.rm("bucket/k"),
        "chained open": lambda: fsspec.open("cachemw::s3://bucket/k", s3=s3).open().read(),
    }


def _check(name, exc, wanted: type, code: int) -> None:
    assert isinstance(exc, wanted), (name, type(exc), exc)
    assert exc.errno == code, (name, exc)
    assert "s3://bucket" in str(exc), (name, exc)  # the URL
    assert from_client(exc.__cause__), (name, exc.__cause__)  # chained to the original


@pytest.mark.timeout(120)
def test_refused_connection_is_an_oserror(make_cache_fs, closed_port):
    s3 = _options(closed_port)
    fs = make_cache_fs(target_protocol="s3", target_options=s3)
    for name, call in _calls(fs, s3).items():
        with pytest.raises(OSError) as info:
            call()
        _check(name, info.value, ConnectionRefusedError, errno.ECONNREFUSED)
    result = fs.cat_ranges(["bucket/k"], [0], [5])  # on_error="return": the path's error
    _check("cat_ranges return", result[0], ConnectionRefusedError, errno.ECONNREFUSED)
    assert not fs.exists("bucket/k")


@pytest.mark.timeout(120)
def test_timeout_is_a_timeouterror(make_cache_fs, silent_port):
    s3 = _options(silent_port, connect_timeout=1, read_timeout=0.5)
    fs = make_cache_fs(target_protocol="s3", target_options=s3)
    fs.target.retries = 1  # s3fs's own retries of a timeout (5), with their backoff
    for name, call in (("cat_file", lambda: fs.cat_file("bucket/k")),
                       ("info", lambda: fs.info("bucket/k")),
                       ("ls", lambda: fs.ls("bucket"))):
        with pytest.raises(OSError) as info:
            call()
        _check(name, info.value, TimeoutError, errno.ETIMEDOUT)


def test_client_errors_told_apart():
    """Which errors are a client's own, and the errno each becomes; nothing else is
    touched (an OSError of s3fs's, a programming error)."""
    aiohttp = pytest.importorskip("aiohttp")
    fs = fsspec.filesystem("memory")
    refused = botocore_exceptions.EndpointConnectionError(
        endpoint_url="http://h/b/k", error=ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    cases = [
        (refused, ConnectionRefusedError, errno.ECONNREFUSED),
        (botocore_exceptions.EndpointConnectionError(endpoint_url="http://h/b/k", error="?"),
         OSError, errno.EIO),
        (botocore_exceptions.ReadTimeoutError(endpoint_url="http://h/b/k"), TimeoutError,
         errno.ETIMEDOUT),
        (botocore_exceptions.ConnectTimeoutError(endpoint_url="http://h/b/k"), TimeoutError,
         errno.ETIMEDOUT),
        (aiohttp.ServerDisconnectedError(), OSError, errno.EIO),
        (aiohttp.ClientPayloadError("truncated"), OSError, errno.EIO),
    ]
    for exc, wanted, code in cases:
        mapped = client_error(fs, "/b/k", exc)
        assert type(mapped) is wanted and mapped.errno == code, (exc, mapped)
        assert fs.unstrip_protocol("/b/k") in str(mapped) and type(exc).__name__ in str(mapped)
    for exc in (FileNotFoundError(errno.ENOENT, "b/k"), PermissionError("denied"),
                ValueError("bad bucket name"), KeyError("x")):
        assert client_error(fs, "/b/k", exc) is None


def test_no_client_import_for_readers():
    """Telling the errors apart imports nothing: a reader process (a DataLoader worker)
    importing the client does not pay for botocore."""
    import subprocess
    import sys

    code = ("import sys, cachemw.client.fs, cachemw.tiers.source; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('botocore', 'aiobotocore', 's3fs', 'aiohttp')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "[]", out
    assert CacheFileSystem.protocol == "cachemw"
