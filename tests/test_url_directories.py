"""A ``cachemw`` URL of a directory, handed to what parses it with fsspec's ``url_to_fs``
(pandas' ``read_parquet``, ``pyarrow.dataset`` over the path it returns, HF datasets):
the path ``url_to_fs`` returns is the one ``ls``, ``find`` and ``info`` answer with, so
pyarrow finds the files under it (it refused every one as "outside base dir" when the path
was the ``cachemw://`` URL itself), for every URL form of the README, local and on S3.
"""
from __future__ import annotations

import io

import fsspec
import pytest

from cachemw.client.fs import CacheFileSystem
from cachemw.launch import stop_local
from conftest import daemon_stats

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
ds = pytest.importorskip("pyarrow.dataset")
pd = pytest.importorskip("pandas")

ROWS = 10  # rows of each parquet file


@pytest.fixture
def autostarted(runtime_dir):
    """Filesystems built by fsspec from URLs autostart this test's private daemon."""
    CacheFileSystem.clear_instance_cache()
    yield runtime_dir
    CacheFileSystem.clear_instance_cache()
    stop_local(runtime_dir)


def _parquet(i: int) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.table({"x": list(range(i * ROWS, (i + 1) * ROWS))}), out)
    return out.getvalue()


def _first_hop(url: str) -> str:
    """The part of ``url`` a filesystem method takes: ``cachemw::<url>`` whole, the
    ``cachemw://`` hop of a URL with hops after it."""
    return url if url.startswith("cachemw::") else url.split("::")[0]


def _check_directory(fs, path: str, files: int) -> None:
    """``path`` (as url_to_fs returned it) is the base of what find and ls name, and
    pyarrow reads the directory through ``fs``."""
    assert isinstance(fs, CacheFileSystem)
    found = fs.find(path, withdirs=True, detail=True)  # the directory itself too
    under = [name for name in found if name != path]
    assert under and all(name.startswith(path.rstrip("/") + "/") for name in under), found
    assert all(info["name"] == name for name, info in found.items())
    assert all(name.startswith(path.rstrip("/") + "/") for name in fs.ls(path, detail=False))
    assert fs.info(path)["type"] == "directory"
    table = ds.dataset(path, filesystem=fs, format="parquet").to_table()
    assert sorted(table.column("x").to_pylist()) == list(range(files * ROWS))


@pytest.mark.timeout(120)
def test_local_directory_urls(autostarted, tmp_path, monkeypatch):
    root = tmp_path / "pq"
    (root / "sub").mkdir(parents=True)
    for i in range(3):
        (root / ("sub" if i == 2 else "") / f"f{i}.parquet").write_bytes(_parquet(i))
    root = str(root)
    monkeypatch.chdir(tmp_path)  # cachemw://abs is never relative to the working directory
    for url in (f"cachemw://{root}",                # the README's shorthand
                f"cachemw://{root}/",
                f"cachemw://{root.lstrip('/')}",     # HF datasets' rewrite of it
                f"cachemw::file://{root}",
                f"cachemw://{root}::file://{root}/*.parquet"):  # as HF datasets re-chains
        frame = pd.read_parquet(url)
        assert sorted(frame["x"]) == list(range(3 * ROWS)), url
        fs, path = fsspec.core.url_to_fs(url)
        assert path == root, url
        assert path == fs._strip_protocol(_first_hop(url)), url  # the filesystem's own
        _check_directory(fs, path, 3)
    assert daemon_stats(autostarted)["counters"]["leases"] >= 1  # read through the cache


@pytest.mark.timeout(120)
def test_s3_directory_urls(autostarted, s3_server):
    s3 = s3_server["target_options"]
    bucket = s3_server["bucket"]
    client = s3_server["boto3"]()
    for i in range(3):
        client.put_object(Bucket=bucket, Key=f"pqdir/f{i}.parquet", Body=_parquet(i))
    root = f"{bucket}/pqdir"
    for url, options in ((f"cachemw::s3://{root}", {"s3": s3}),
                         (f"cachemw://{root}::s3://{root}", {"s3": s3}),
                         (f"cachemw://{root}::s3://{root}/*.parquet", {"s3": s3}),
                         (f"cachemw://{root}", {"target_protocol": "s3", "target_options": s3}),
                         (f"cachemw://{root}", {"cachemw": {"target_protocol": "s3",
                                                            "target_options": s3}})):
        if "::" in url:  # pandas: storage_options as for the plain URL
            frame = pd.read_parquet(url, storage_options=options)
            assert sorted(frame["x"]) == list(range(3 * ROWS)), url
        fs, path = fsspec.core.url_to_fs(url, **options)
        assert path == root, url
        assert path == fs._strip_protocol(_first_hop(url)), url
        _check_directory(fs, path, 3)
    # fsspec.open of the HF datasets form still reads the file it names
    name = f"cachemw://{root}/f1.parquet::s3://{root}/*.parquet"
    with fsspec.open(name, "rb", s3=s3) as f:
        assert isinstance(f.fs, CacheFileSystem)
        assert f.read() == _parquet(1)


def test_class_resolution_matches_the_instance(tmp_path, monkeypatch):
    """The path url_to_fs takes from the class is the filesystem's own resolution of the
    same URL, for the URL forms of each target; a target whose paths its instance says (a
    filesystem over another one) keeps the URL whole, for the instance to resolve."""
    monkeypatch.chdir(tmp_path)
    rt = str(tmp_path / "rt")
    for url in ("cachemw:///data/x.bin", "cachemw://data/x.bin", "cachemw:///data/dir/",
                "cachemw:///", "cachemw://data/x.bin::file:///data/*.bin",
                "cachemw:///a b/\u00fc.bin", "cachemw://b/k::memory://b/*"):
        fs, path = fsspec.core.url_to_fs(url, cachemw={"runtime_dir": rt, "autostart": False})
        assert path == fs._strip_protocol(_first_hop(url)), url
        assert not path.startswith("cachemw"), url
    fs, path = fsspec.core.url_to_fs(
        "cachemw://b/k", target_protocol="memory", runtime_dir=rt, autostart=False)
    assert path == fs._strip_protocol("cachemw://b/k") == "/b/k"  # memory's own path form
    fs, path = fsspec.core.url_to_fs("cachemw://b/k::simplecache::memory://b/*",
                                     cachemw={"runtime_dir": rt, "autostart": False})
    assert path == "cachemw://b/k" and fs._strip_protocol(path) == "/b/k"
