"""The main job's emulated PFS (cachemw/job/store.py, storefs.py): a real HTTP server in a
process of its own, read through fsspec's own HTTP filesystem and through cachemw::http.

Timing checks are lower bounds with a margin (the server's waits are sleeps and its link a
reservation, so they cannot come out shorter); that requests overlap is read from the
server's count of requests in flight, not from a clock."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import fsspec
import pytest

from cachemw.job import storefs
from cachemw.job.store import EmulatedStore, StoreProfile, parse_range
from cachemw.launch import stop_local


@pytest.fixture
def store_root(tmp_path):
    root = tmp_path / "store"
    (root / "train").mkdir(parents=True)
    for i in range(4):
        (root / "train" / f"f{i}.bin").write_bytes(os.urandom(64 * 1024) + bytes([i]))
    (root / "big.bin").write_bytes(os.urandom(4 << 20))
    return root


def _http():
    return fsspec.filesystem("http", skip_instance_cache=True)


@pytest.mark.timeout(60)
def test_each_data_request_waits_the_latency_and_requests_in_flight_wait_side_by_side(store_root):
    with EmulatedStore(str(store_root), StoreProfile(latency=0.1, bandwidth=0, meta_latency=0)) as s:
        fs = _http()
        url = f"{s.url}/train/f0.bin"
        fs.cat_file(url)  # the session's connection made
        t = time.perf_counter()
        for _ in range(5):
            fs.cat_file(url)
        assert time.perf_counter() - t >= 5 * 0.1 * 0.9
        # 8 at once (fsspec's loop sends them together): they wait side by side
        fs.cat([f"{s.url}/train/f{i % 4}.bin" for i in range(8)])
        assert s.stats()["peak_in_flight"]["data"] >= 2


@pytest.mark.timeout(60)
def test_metadata_requests_wait_the_metadata_latency(store_root):
    with EmulatedStore(str(store_root), StoreProfile(latency=0, bandwidth=0, meta_latency=0.1)) as s:
        fs = _http()
        fs.info(f"{s.url}/train/f0.bin")
        t = time.perf_counter()
        for i in range(3):
            fs.invalidate_cache()
            fs.info(f"{s.url}/train/f{i}.bin")  # HEAD
            fs.ls(f"{s.url}/train")  # a listing
        assert time.perf_counter() - t >= 6 * 0.1 * 0.9
        assert s.stats()["requests"]["head"] >= 4 and s.stats()["requests"]["list"] >= 3


def _download(url: str, barrier, q) -> None:
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    barrier.wait(30)  # both start at once, however long each took to start and import
    t = time.perf_counter()
    fs.cat_file(url)
    q.put((t, time.perf_counter()))  # CLOCK_MONOTONIC: comparable across processes


@pytest.mark.timeout(60)
def test_bandwidth_is_one_link_shared_by_every_process(store_root):
    """Two processes each read 4 MiB at once from a store of 8 MiB/s: 8 MiB in total take
    at least one second (a link per connection or per process would take half)."""
    rate = 8 << 20
    with EmulatedStore(str(store_root), StoreProfile(latency=0, bandwidth=rate, meta_latency=0)) as s:
        ctx = multiprocessing.get_context("spawn")
        q, barrier = ctx.Queue(), ctx.Barrier(2)
        procs = [ctx.Process(target=_download, args=(f"{s.url}/big.bin", barrier, q))
                 for _ in range(2)]
        for p in procs:
            p.start()
        spans = [q.get(timeout=50) for _ in procs]
        for p in procs:
            p.join(10)
        # from the first start to the last end, the 8 MiB took the link's time whatever the
        # processes' timing; started together, each took about that long (with a link each,
        # half). Started apart by d, each would take 1 - d s: the barrier keeps d small.
        whole = max(end for _, end in spans) - min(start for start, _ in spans)
        assert whole >= (8 << 20) / rate * 0.9, spans
        assert max(end - start for start, end in spans) >= (8 << 20) / rate * 0.8, spans
        assert s.stats()["bytes_sent"] == 2 * (4 << 20)


def test_range_parsing():
    assert parse_range(None, 10) is None
    assert parse_range("bytes=2-4", 10) == (2, 5)
    assert parse_range("bytes=8-", 10) == (8, 10)
    assert parse_range("bytes=-3", 10) == (7, 10)
    assert parse_range("bytes=5-100", 10) == (5, 10)
    for bad in ("bytes=10-", "bytes=4-2", "items=0-1", "bytes=0-1,3-4"):
        with pytest.raises(ValueError):
            parse_range(bad, 10)


@pytest.mark.timeout(60)
def test_ranges_etags_and_if_match_as_cachemw_pins_them(store_root):
    with EmulatedStore(str(store_root), StoreProfile(latency=0, bandwidth=0, meta_latency=0)) as s:
        url = f"{s.url}/train/f1.bin"
        data = (store_root / "train" / "f1.bin").read_bytes()
        etag = _http().info(url)["ETag"]
        assert etag.startswith('"') and not etag.startswith("W/")
        req = urllib.request.Request(url, headers={"Range": "bytes=10-19", "If-Match": etag})
        with urllib.request.urlopen(req) as r:
            assert r.status == 206 and r.read() == data[10:20] and r.headers["ETag"] == etag
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(url, headers={"If-Match": '"other"'}))
        assert err.value.code == 412
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=99999-"}))
        assert err.value.code == 416


@pytest.mark.timeout(60)
def test_a_file_that_shrinks_while_served_cuts_the_reply_short_at_once(store_root):
    """The store had said the length in its headers, sent what was left and ended the reply
    as if whole: the client waited for the rest until its own timeout (curl's; fsspec's
    aiohttp session: 300 s, review loaders6). The connection is now cut."""
    import http.client
    import threading

    big = store_root / "big.bin"
    with EmulatedStore(str(store_root), StoreProfile(latency=0, bandwidth=2 << 20, meta_latency=0)) as s:
        host, port = s.url.split("//")[1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/big.bin")
        reply = conn.getresponse()  # 4 MiB at 2 MiB/s: two seconds to send
        assert reply.status == 200 and int(reply.headers["Content-Length"]) == 4 << 20
        threading.Timer(0.2, lambda: os.truncate(big, 1 << 20)).start()
        t = time.monotonic()
        with pytest.raises(http.client.IncompleteRead):
            reply.read()
        assert time.monotonic() - t < 10  # not the client's timeout
        conn.close()
        assert s.stats()["requests"]["cut_short"] == 1


@pytest.mark.timeout(60)
def test_cachemw_lists_then_reads_an_http_store(store_root, runtime_dir):
    """A loader lists the dataset, then reads it (as the main job does): fsspec's HTTP
    listing names files without sizes, which cachemw took as their metadata and failed on
    (TypeError: int() of None) instead of asking the store for each file's info."""
    with EmulatedStore(str(store_root), StoreProfile(latency=0, bandwidth=0, meta_latency=0)) as s:
        try:
            fs = fsspec.filesystem("cachemw", target_protocol="http", runtime_dir=runtime_dir,
                                   skip_instance_cache=True)
            names = sorted(e["name"] for e in fs.ls(f"{s.url}/train"))
            assert len(names) == 4
            for name in names:
                expected = (store_root / "train" / name.rsplit("/", 1)[1]).read_bytes()
                assert fs.cat_file(name) == expected  # a miss, pinned with If-Match
                assert fs.cat_file(name, start=5, end=50) == expected[5:50]  # a hit
            assert fs.stats()["hits"] >= 4
            # a rewrite on the store is a new version: seen, never mixed with the old bytes
            (store_root / "train" / "f0.bin").write_bytes(b"new" * 1000)
            fs2 = fsspec.filesystem("cachemw", target_protocol="http", runtime_dir=runtime_dir,
                                    validate="always", skip_instance_cache=True)
            assert fs2.cat_file(names[0]) == b"new" * 1000
        finally:
            stop_local(runtime_dir)


@pytest.mark.timeout(60)
def test_storefs_writes_streams_and_manages_files(store_root):
    with EmulatedStore(str(store_root), StoreProfile(latency=0.01, bandwidth=0, meta_latency=0.01)) as s:
        fs = fsspec.filesystem(storefs.PROTOCOL)
        base = f"{storefs.PROTOCOL}://{s.url.split('://')[1]}/ckpt"
        fs.makedirs(base, exist_ok=True)
        with pytest.raises(FileExistsError):
            fs.makedirs(base, exist_ok=False)
        payload = os.urandom(3 * (1 << 20) + 17)
        with fs.open(f"{base}/a.bin", "wb", block_size=1 << 20) as f:  # several chunks
            for i in range(0, len(payload), 100_000):
                f.write(payload[i:i + 100_000])
        assert (store_root / "ckpt" / "a.bin").read_bytes() == payload
        # writes of a block or more go out as they are (no copy), between buffered ones;
        # any object of the buffer protocol
        pieces = [payload[:10], payload[10:(2 << 20) + 10], memoryview(payload)[(2 << 20) + 10:],
                  bytearray(payload[:1 << 20])]
        with fs.open(f"{base}/c.bin", "wb", block_size=1 << 20) as f:
            for p in pieces:  # after a small one (torch.save's headers) too: sent as they are
                assert f.write(p) == len(p)
                assert f.buffer.tell() == (len(p) if len(p) < 1 << 20 else 0)
            assert f.tell() == len(payload) + (1 << 20)
        assert (store_root / "ckpt" / "c.bin").read_bytes() == payload + payload[:1 << 20]
        with fs.open(f"{base}/d.bin", "wb", block_size=1 << 20) as f:  # large ones first
            f.write(payload[:2 << 20])
            assert f.buffer.tell() == 0  # sent, not copied into the buffer
            f.write(payload[2 << 20:])
        assert (store_root / "ckpt" / "d.bin").read_bytes() == payload
        fs.rm([f"{base}/c.bin", f"{base}/d.bin"])
        assert fs.cat_file(f"{base}/a.bin", start=5, end=99) == payload[5:99]
        with fs.open(f"{base}/a.bin", "rb") as f:
            f.seek(1 << 20)
            assert f.read(10) == payload[1 << 20:(1 << 20) + 10]
        assert fs.info(f"{base}/a.bin")["size"] == len(payload)
        assert fs.info(base)["type"] == "directory"
        fs.mv(f"{base}/a.bin", f"{base}/sub/b.bin")
        assert not fs.exists(f"{base}/a.bin") and fs.exists(f"{base}/sub/b.bin")
        assert [e["name"].rsplit("/", 1)[1] for e in fs.ls(base)] == ["sub"]
        with pytest.raises(FileNotFoundError):
            fs.cat_file(f"{base}/missing")
        fs.rm(base, recursive=True)
        assert not (store_root / "ckpt").exists()
        assert s.stats()["bytes_received"] == 3 * len(payload) + (1 << 20)


@pytest.mark.timeout(90)
def test_an_announced_epoch_asks_for_metadata_and_prefetches_concurrently(tmp_path, runtime_dir):
    """cachemw over a store whose listing gives no versions (HTTP): announcing an epoch asks
    for each file's metadata (a HEAD each) and the daemon prefetches the announced blocks.
    One request at a time, a 2,048-file epoch's announcement held the trainer for seconds
    and the prefetcher was no faster than one reader (readers wait on planned fills)."""
    from conftest import daemon_stats, wait_for

    root = tmp_path / "store"
    (root / "train").mkdir(parents=True)
    for i in range(12):
        (root / "train" / f"f{i:02d}.bin").write_bytes(os.urandom(8192) + bytes([i]))
    profile = StoreProfile(latency=0.05, bandwidth=0, meta_latency=0.05)
    with EmulatedStore(str(root), profile) as s:
        try:
            fs = fsspec.filesystem("cachemw", target_protocol="http", runtime_dir=runtime_dir,
                                   validate="immutable", skip_instance_cache=True)
            assert fs.client.connected()
            urls = [f"{s.url}/train/f{i:02d}.bin" for i in range(12)]
            assert fs.announce(urls) == 12
            assert s.stats()["requests"]["head"] == 12
            assert s.stats()["peak_in_flight"]["meta"] > 1
            wait_for(lambda: daemon_stats(runtime_dir)["counters"].get("prefetched", 0) == 12,
                     timeout=30, what="the 12 announced files prefetched")
            assert s.stats()["peak_in_flight"]["data"] > 1
            for i, url in enumerate(urls):  # and they are hits, with the right bytes
                assert fs.cat_file(url)[-1] == i
            assert fs.stats()["hits"] == 12 and s.stats()["requests"]["get_range"] == 12
        finally:
            stop_local(runtime_dir)


@pytest.mark.timeout(60)
def test_the_store_on_its_own_runs_with_any_stdin_until_a_signal(store_root):
    """Run on its own (backgrounded: stdin /dev/null) it died at start (epoll refuses
    /dev/null); with an empty pipe it exited at once. Only --owned watches stdin."""
    import signal
    import urllib.request

    for stdin in (subprocess.DEVNULL, subprocess.PIPE):
        proc = subprocess.Popen([sys.executable, "-m", "cachemw.job.store", "--root", str(store_root),
                                 "--latency-ms", "0", "--meta-latency-ms", "0"],
                                stdin=stdin, stdout=subprocess.PIPE, text=True)
        try:
            if stdin == subprocess.PIPE:
                proc.stdin.close()
            url = proc.stdout.readline().split()[-1]
            with urllib.request.urlopen(url + "/", timeout=10) as r:
                assert r.status == 200
            assert proc.poll() is None
            proc.send_signal(signal.SIGINT)
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.stdout.close()
