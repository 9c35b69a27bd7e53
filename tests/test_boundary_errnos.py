"""Errors at the fsspec boundary carry their errno, as ``open()`` and fsspec's local
filesystem give them: code that checks ``e.errno == errno.EISDIR`` (or ENOENT) must not
misread cachemw's (review loaders3, defect 3: IsADirectoryError had errno None)."""
from __future__ import annotations

import errno

import fsspec
import pytest


def _raised(call):
    try:
        call()
    except OSError as exc:
        return exc
    pytest.fail("no OSError raised")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("validate", ["always", "ttl"])
def test_a_directory_read_raises_eisdir(make_cache_fs, tmp_path, validate):
    d = tmp_path / "adir"
    d.mkdir()
    local = fsspec.filesystem("file")
    expected = _raised(lambda: local.cat_file(str(d)))
    assert expected.errno == errno.EISDIR
    fs = make_cache_fs(validate=validate)
    again = make_cache_fs(validate=validate)
    for f in (fs, again):  # ``again`` (ttl): from the node's table, where ``fs`` shared it
        for call in (lambda: f.cat_file(str(d)), lambda: f.open(str(d)).read(),
                     lambda: _range_result(f, str(d))):
            exc = _raised(call)
            assert isinstance(exc, IsADirectoryError), exc
            assert exc.errno == errno.EISDIR and exc.strerror == expected.strerror, exc
            assert exc.filename == str(d), exc
        assert f.reader.fills.drain(30)  # the shared record written


def _range_result(fs, path):
    result = fs.cat_ranges([path], [0], [10])[0]  # on_error="return": the error is the result
    if isinstance(result, Exception):
        raise result
    return result


@pytest.mark.timeout(60)
def test_a_missing_file_raises_enoent(make_cache_fs, tmp_path):
    fs = make_cache_fs()
    missing = str(tmp_path / "none.bin")
    for call in (lambda: fs.cat_file(missing), lambda: fs.open(missing).read(),
                 lambda: fs.info(missing)):
        exc = _raised(call)
        assert isinstance(exc, FileNotFoundError) and exc.errno == errno.ENOENT, exc
