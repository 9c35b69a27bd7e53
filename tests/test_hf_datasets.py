"""HF ``datasets`` reads parquet files through cachemw with the URLs a user writes: chained
(``cachemw::file://``, ``cachemw::s3://``) and the ``cachemw:///abs`` shorthand, as a list or
a glob, streaming or not, local or on a real S3 server (moto on localhost).

datasets splits a URL on ``::``, globs, re-appends the hops it split off to every name the
glob returned, and rewrites ``x:///abs`` as ``x://abs`` on the way to fsspec; these tests
pin that every such name still reads the right bytes, through the cache.

The Hub stays unreachable (huggingface_hub offline); datasets' own caches live under the
test's tmp_path. Non-streaming loads need datasets' offline switch off: it refuses every
fsspec URL (not only the Hub's) when on.
"""
from __future__ import annotations

import pytest

datasets = pytest.importorskip("datasets")
pytest.importorskip("s3fs")
import huggingface_hub.constants  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from datasets import config as hf_config  # noqa: E402

from cachemw.client.fs import CacheFileSystem  # noqa: E402
from cachemw.launch import stop_local  # noqa: E402
from conftest import daemon_stats, wait_for  # noqa: E402

ROWS = 50  # rows per file
NFILES = 3


def _table(i: int) -> pa.Table:
    start = i * ROWS
    return pa.table({"i": list(range(start, start + ROWS)),
                     "text": [f"row {n} of file {i}" for n in range(start, start + ROWS)]})


WANT = sorted((r["i"], r["text"]) for i in range(NFILES) for r in _table(i).to_pylist())


@pytest.fixture
def hf(tmp_path, monkeypatch):
    """datasets with its caches under tmp_path and the Hub offline; returns its cache dir."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_config, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(hf_config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(hf_config, "DOWNLOADED_DATASETS_PATH", cache / "downloads")
    monkeypatch.setattr(hf_config, "EXTRACTED_DATASETS_PATH", cache / "downloads" / "extracted")
    monkeypatch.setattr(hf_config, "HF_MODULES_CACHE", tmp_path / "hf-modules")
    return str(cache)


@pytest.fixture
def local_parquet(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    for i in range(NFILES):
        pq.write_table(_table(i), str(root / f"p{i}.parquet"))
    (root / "notes.txt").write_text("not a parquet file")
    return str(root)


@pytest.fixture
def s3_parquet(s3_server, request):
    """The parquet files under a prefix of their own in the test bucket."""
    prefix = f"hf/{request.node.name.replace('[', '-').replace(']', '')}"
    client = s3_server["boto3"]()
    for i in range(NFILES):
        sink = pa.BufferOutputStream()
        pq.write_table(_table(i), sink)
        client.put_object(Bucket=s3_server["bucket"], Key=f"{prefix}/p{i}.parquet",
                          Body=sink.getvalue().to_pybytes())
    client.put_object(Bucket=s3_server["bucket"], Key=f"{prefix}/notes.txt", Body=b"x")
    return f"{s3_server['bucket']}/{prefix}"


def _load(data_files, cache_dir, streaming, **kwargs):
    if not streaming:
        kwargs["download_mode"] = "force_redownload"  # fetch again: the second pass must hit
    ds = datasets.load_dataset("parquet", data_files=data_files, split="train",
                               streaming=streaming, cache_dir=cache_dir, **kwargs)
    return sorted((r["i"], r["text"]) for r in ds)


def _read_through_cache(tmp_path, monkeypatch, data_files, cache_dir, **kwargs):
    """Streaming, then downloading (datasets copies the files into its own cache), each
    from an empty cache (a daemon of its own) and twice: the first load fills one block
    per file (every read went through the cache), the second is served from the tiers (no
    new fill), and both give the rows written."""
    for streaming in (True, False):
        runtime_dir = str(tmp_path / ("runtime" if streaming else "runtime-download"))
        monkeypatch.setenv("CACHEMW_RUNTIME_DIR", runtime_dir)
        CacheFileSystem.clear_instance_cache()  # new filesystems, bound to that daemon
        if not streaming:  # see the module docstring; the Hub itself stays offline
            monkeypatch.setattr(hf_config, "HF_HUB_OFFLINE", False)
        try:
            for _ in range(2):
                assert _load(data_files, cache_dir, streaming, **kwargs) == WANT
                stats = daemon_stats(runtime_dir)
                assert stats["counters"]["leases"] == NFILES  # each file fetched once
                for name in ("fallbacks", "bypassed", "fill_errors", "corrupt_repaired"):
                    assert stats["counters"][name] == 0, name
                # fills written behind the reads are published over datasets' connections
                wait_for(lambda: daemon_stats(runtime_dir)["tiers"]["dram"]["blocks"] == NFILES,
                         30, what="one cached block per file")
        finally:
            CacheFileSystem.clear_instance_cache()
            stop_local(runtime_dir)


LOCAL_FORMS = {
    "chained-list": lambda root: [f"cachemw::file://{root}/p{i}.parquet" for i in range(NFILES)],
    "shorthand-list": lambda root: [f"cachemw://{root}/p{i}.parquet" for i in range(NFILES)],
    "chained-glob": lambda root: [f"cachemw::file://{root}/*.parquet"],
    "shorthand-glob": lambda root: f"cachemw://{root}/*.parquet",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("form", sorted(LOCAL_FORMS))
def test_local_parquet_through_cachemw(hf, monkeypatch, local_parquet, tmp_path, form):
    # a decoy where `cachemw://abs` read as a relative path would land
    monkeypatch.chdir(tmp_path)
    decoy = tmp_path / local_parquet.lstrip("/")
    decoy.mkdir(parents=True)
    for i in range(NFILES):
        pq.write_table(_table(100 + i), str(decoy / f"p{i}.parquet"))
    _read_through_cache(tmp_path, monkeypatch, LOCAL_FORMS[form](local_parquet), hf)


S3_FORMS = {
    "chained-list": lambda prefix: [f"cachemw::s3://{prefix}/p{i}.parquet" for i in range(NFILES)],
    "chained-glob": lambda prefix: [f"cachemw::s3://{prefix}/*.parquet"],
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", ["per-protocol", "flat"])
@pytest.mark.parametrize("form", sorted(S3_FORMS))
def test_s3_parquet_through_cachemw(hf, tmp_path, monkeypatch, s3_server, s3_parquet, form,
                                    options):
    """storage_options as a datasets user writes them for S3: keyed by protocol, fsspec's
    form (cachemw's own options under ``"cachemw"``), or flat (datasets hands them to every
    hop of the URL)."""
    s3 = s3_server["target_options"]
    if options == "per-protocol":
        storage_options = {"s3": s3, "cachemw": {"validate": "immutable"}}
    else:
        storage_options = dict(s3)
    _read_through_cache(tmp_path, monkeypatch, S3_FORMS[form](s3_parquet), hf,
                        storage_options=storage_options)


def _streamed_files(root) -> dict:
    """A text file, a gzipped JSON-lines file and a webdataset tar shard: the builders
    whose streaming hands the filesystem a file's open arguments as options."""
    import gzip
    import io
    import json
    import tarfile

    (root / "a.txt").write_text("".join(f"line {i}\n" for i in range(300)))
    with gzip.open(root / "b.jsonl.gz", "wt") as g:
        g.write("".join(json.dumps({"id": i}) + "\n" for i in range(300)))
    with tarfile.open(root / "shard-000.tar", "w") as tf:
        for k in range(10):
            for ext, data in (("cls", str(k).encode()), ("txt", f"sample {k}".encode())):
                info = tarfile.TarInfo(f"{k:04d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return {"text": ("a.txt", [{"text": f"line {i}"} for i in range(300)]),
            "json": ("b.jsonl.gz", [{"id": i} for i in range(300)]),
            "webdataset": ("shard-000.tar", [(k, f"sample {k}") for k in range(10)])}


@pytest.mark.timeout(120)
def test_text_compressed_and_tar_files_stream_through_cachemw(hf, tmp_path, monkeypatch):
    """datasets' streaming ``xopen`` hands the open's keywords to the filesystem as
    options: a text file's ``encoding`` and ``errors``, a tar archive's ``block_size=0``
    (fsspec's "no read-ahead"), and a compression hop's ``client_kwargs`` (aiohttp's
    ``trust_env``). cachemw refused each as an unknown option or a cache unit under 4 KiB,
    where every fsspec filesystem takes them (found by a black-box check)."""
    root = tmp_path / "stream"
    root.mkdir()
    files = _streamed_files(root)
    runtime_dir = str(tmp_path / "runtime")
    monkeypatch.setenv("CACHEMW_RUNTIME_DIR", runtime_dir)
    CacheFileSystem.clear_instance_cache()
    try:
        for builder, (name, want) in files.items():
            ds = datasets.load_dataset(builder, data_files=f"cachemw://{root}/{name}",
                                       split="train", streaming=True, cache_dir=hf)
            rows = list(ds)
            if builder == "webdataset":
                rows = [(r["cls"], r["txt"]) for r in rows]
            assert rows == want, builder
        stats = daemon_stats(runtime_dir)
        assert stats["counters"]["leases"] == len(files)  # every file through the cache
        assert stats["counters"]["fallbacks"] == 0 and stats["counters"]["bypassed"] == 0
    finally:
        CacheFileSystem.clear_instance_cache()
        stop_local(runtime_dir)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", ["per-protocol", "flat"])
def test_a_compressed_file_on_s3_streams_through_cachemw(hf, tmp_path, monkeypatch, s3_server,
                                                         options):
    """datasets' compression hop merges its aiohttp options into the S3 target's own
    ``client_kwargs`` and hands them to the cachemw hop: with flat storage options that
    was refused as an unknown option (diffrev-6)."""
    import gzip
    import json

    client = s3_server["boto3"]()
    key = f"hf-gz/{options}/b.jsonl.gz"
    client.put_object(Bucket=s3_server["bucket"], Key=key, Body=gzip.compress(
        "".join(json.dumps({"id": i}) + "\n" for i in range(100)).encode()))
    s3 = s3_server["target_options"]
    storage_options = ({"s3": s3, "cachemw": {"validate": "immutable"}}
                       if options == "per-protocol" else dict(s3))
    runtime_dir = str(tmp_path / "runtime")
    monkeypatch.setenv("CACHEMW_RUNTIME_DIR", runtime_dir)
    CacheFileSystem.clear_instance_cache()
    try:
        ds = datasets.load_dataset("json", data_files=f"cachemw::s3://{s3_server['bucket']}/{key}",
                                   split="train", streaming=True, cache_dir=hf,
                                   storage_options=storage_options)
        assert [r["id"] for r in ds] == list(range(100))
        assert daemon_stats(runtime_dir)["counters"]["leases"] == 1  # through the cache
    finally:
        CacheFileSystem.clear_instance_cache()
        stop_local(runtime_dir)
