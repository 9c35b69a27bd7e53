"""Two stores whose paths look the same never share what is cached: two S3-compatible
endpoints with the same bucket and key, two directory filesystems (fsspec's ``dir``) over
different roots. Each process reads its own store's bytes, through the node's shared
metadata and tiers, and a write through one store drops only that store's blocks."""
from __future__ import annotations

import subprocess
import sys

import fsspec
import pytest
from fsspec.implementations.dirfs import DirFileSystem

from cachemw.client.urls import store_of, target_url


def test_the_cache_url_names_the_store_where_the_url_does_not(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    local = fsspec.filesystem("file")
    assert store_of(local) == "" and target_url(local)("/data/x") == "file:///data/x"
    under_a = DirFileSystem(path="/data/a", fs=local)
    under_b = DirFileSystem(path="/data/b", fs=local)
    assert target_url(under_a)("x.bin") == "file:///data/a/x.bin"  # the file it is
    assert target_url(under_b)("x.bin") == "file:///data/b/x.bin"
    s3fs = pytest.importorskip("s3fs")
    aws = s3fs.S3FileSystem(anon=True, skip_instance_cache=True)
    assert target_url(aws)("bucket/k") == "s3://bucket/k"
    other = s3fs.S3FileSystem(anon=True, skip_instance_cache=True,
                              client_kwargs={"endpoint_url": "http://10.0.0.1:9000"})
    assert target_url(other)("bucket/k") == "s3[endpoint_url=http://10.0.0.1:9000]://bucket/k"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://10.0.0.2:9000")  # botocore's own variable
    env = s3fs.S3FileSystem(anon=True, skip_instance_cache=True)
    assert target_url(env)("bucket/k") == "s3[endpoint_url=http://10.0.0.2:9000]://bucket/k"


@pytest.mark.timeout(60)
def test_two_directory_roots_with_the_same_names_read_their_own_bytes(make_cache_fs, tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.bin").write_bytes(name.encode() * 10_000)
    local = fsspec.filesystem("file")
    fs_a = make_cache_fs(fs=DirFileSystem(path=str(tmp_path / "a"), fs=local))
    assert fs_a.cat_file("x.bin") == b"a" * 10_000
    assert fs_a.cat_file("x.bin") == b"a" * 10_000
    fs_b = make_cache_fs(fs=DirFileSystem(path=str(tmp_path / "b"), fs=local))
    assert fs_b.cat_file("x.bin") == b"b" * 10_000
    assert fs_b.open("x.bin").read() == b"b" * 10_000
    # the file under a root and the same file read as itself are one file in the cache
    plain = make_cache_fs()
    assert plain.cat_file(str(tmp_path / "a" / "x.bin")) == b"a" * 10_000
    assert plain.stats()["hits"] == 1


@pytest.mark.timeout(120)
def test_two_s3_endpoints_with_the_same_bucket_and_key(make_cache_fs, s3_server, runtime_dir):
    """Each store's bytes, in this process and in a fresh one (which finds the node's
    metadata and blocks of both); a write through one drops that store's blocks only."""
    import socket
    import time
    with socket.socket() as probe:  # moto's servers in one process share their buckets
        probe.bind(("127.0.0.1", 0))
        host, port = probe.getsockname()
    second = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection((host, port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or second.poll() is not None:
                    raise
                time.sleep(0.1)
        options_b = {**s3_server["target_options"],
                     "client_kwargs": {"endpoint_url": f"http://{host}:{port}",
                                       "region_name": "us-east-1"}}
        bucket, key = s3_server["bucket"], "same/k.bin"
        import boto3
        writer_b = fsspec.filesystem("s3", skip_instance_cache=True, **options_b)
        boto3.client("s3", endpoint_url=f"http://{host}:{port}", aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1"
                     ).create_bucket(Bucket=bucket)
        s3_server["boto3"]().put_object(Bucket=bucket, Key=key, Body=b"A" * 50_000)
        writer_b.pipe_file(f"{bucket}/{key}", b"B" * 50_000)
        fs_a = make_cache_fs(target_protocol="s3", target_options=s3_server["target_options"])
        fs_b = make_cache_fs(target_protocol="s3", target_options=options_b)
        assert fs_a.cat_file(f"{bucket}/{key}") == b"A" * 50_000
        assert fs_b.cat_file(f"{bucket}/{key}") == b"B" * 50_000
        assert fs_b.open(f"{bucket}/{key}").read(8) == b"B" * 8

        code = (
            "import fsspec, json, sys\n"
            "opts = json.loads(sys.argv[1])\n"
            "fs = fsspec.filesystem('cachemw', target_protocol='s3', target_options=opts,\n"
            "                       autostart=False, runtime_dir=sys.argv[2])\n"
            "data = fs.cat_file(sys.argv[3])\n"
            "print(data[:1].decode(), len(data), fs.stats()['hits'])\n")
        import json
        for options, letter in ((s3_server["target_options"], "A"), (options_b, "B")):
            out = subprocess.run([sys.executable, "-c", code, json.dumps(options), runtime_dir,
                                  f"{bucket}/{key}"], capture_output=True, text=True,
                                 timeout=60)
            assert out.returncode == 0, out.stderr
            assert out.stdout.split() == [letter, "50000", "1"]  # a hit, of its own store

        fs_b.pipe_file(f"{bucket}/{key}", b"C" * 50_000)  # through the cache, store B
        assert fs_b.cat_file(f"{bucket}/{key}") == b"C" * 50_000
        before = fs_a.stats()["hits"]
        assert fs_a.cat_file(f"{bucket}/{key}") == b"A" * 50_000
        assert fs_a.stats()["hits"] == before + 1  # store A's block was left alone
    finally:
        second.kill()
        second.wait(10)


@pytest.mark.timeout(90)
def test_a_store_named_by_the_reader_s_environment_is_prefetched_by_a_daemon_without_it(
        s3_server, runtime_dir, spawn_daemon, monkeypatch):
    """A reader whose endpoint came from AWS_ENDPOINT_URL, with a daemon started without
    it: the daemon built the target from the reader's options alone, asked AWS's S3, and
    prefetched nothing (the version check refused nothing, but the order was lost)."""
    from conftest import daemon_stats, wait_for

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    spawn_daemon(runtime_dir, dram_capacity="16MiB")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server["endpoint"])
    bucket, client = s3_server["bucket"], s3_server["boto3"]()
    paths = [f"{bucket}/env/{i}.bin" for i in range(6)]
    for i, path in enumerate(paths):
        client.put_object(Bucket=bucket, Key=path.split("/", 1)[1], Body=bytes([i]) * 70_000)
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"region_name": "us-east-1"}}
    fs = fsspec.filesystem("cachemw", target_protocol="s3", target_options=options,
                           autostart=False, runtime_dir=runtime_dir, skip_instance_cache=True)
    assert fs.announce(paths) == 6
    wait_for(lambda: daemon_stats(runtime_dir)["counters"].get("prefetched", 0) == 6, 30,
             what="the 6 announced objects to be prefetched from the reader's endpoint")
    for i, path in enumerate(paths):
        assert fs.cat_file(path) == bytes([i]) * 70_000
    assert fs.stats()["hits"] == 6 and fs.stats()["misses"] == 0
