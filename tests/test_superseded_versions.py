"""A file's earlier version, once the node learns the source has moved on from it, has its
blocks dropped node-wide: left to eviction they held the tier's room and, by the reads they
had had, their rank under the history policy. A dataset rewritten in place after 5 epochs
was two thirds uncached for the next 11 epochs through a tier that held both versions'
worth, and a third of the dead blocks stayed for good (review loaders5)."""
from __future__ import annotations

import os

import fsspec
import pytest

from conftest import daemon_stats, published, wait_for

BS = 65536
FILES = 24
SIZE = 3 * BS + 100  # 4 blocks a file


def _write_all(root, seed: int) -> dict:
    out = {}
    for i in range(FILES):
        data = bytes([seed]) * 7 + os.urandom(SIZE - 7)
        path = str(root / f"f{i:02d}.bin")
        with open(path, "wb") as f:
            f.write(data)
        out[path] = data
    return out


def _epoch(fs, files: dict) -> None:
    for path, data in files.items():
        assert fs.cat_file(path) == data
    published(fs)


def _blocks(runtime_dir: str) -> int:
    return daemon_stats(runtime_dir)["tiers"]["dram"]["blocks"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("validate", ["always", "ttl"])
def test_a_rewritten_dataset_s_old_blocks_are_dropped_when_the_new_version_is_learnt(
        tmp_path, runtime_dir, spawn_daemon, validate):
    """The tier holds one version of the dataset and a half: with the old blocks left in
    place (and read five times each), the new version's were refused admission."""
    root = tmp_path / "data"
    root.mkdir()
    one_version = FILES * 4 * (BS + 4096)  # blocks with their page checksums, roughly
    spawn_daemon(runtime_dir, dram_capacity=str(one_version * 3 // 2))
    fs = fsspec.filesystem("cachemw", target_protocol="file", validate=validate, ttl=0.5,
                           block_size=BS, autostart=False, runtime_dir=runtime_dir,
                           skip_instance_cache=True)
    files = _write_all(root, 1)
    for _ in range(5):
        _epoch(fs, files)
    assert _blocks(runtime_dir) == FILES * 4
    files = _write_all(root, 2)
    if validate == "ttl":
        import time
        time.sleep(0.6)
    _epoch(fs, files)  # learns every file's new version, and fills it
    wait_for(lambda: _blocks(runtime_dir) == FILES * 4, 10,
             what="only the new version's blocks left")
    before = daemon_stats(runtime_dir)["counters"]
    _epoch(fs, files)
    after = daemon_stats(runtime_dir)["counters"]
    assert after["misses"] == before["misses"]  # every block of the new version cached
    assert after["bypassed"] == before["bypassed"]


@pytest.mark.timeout(60)
def test_the_blocks_of_a_version_a_read_found_gone_are_dropped(tmp_path, runtime_dir,
                                                                   spawn_daemon):
    """A read of a block not cached, pinned to the version the process knows, met another
    version (ChangedSourceError): that version's other blocks are dead, and go."""
    spawn_daemon(runtime_dir)
    fs = fsspec.filesystem("cachemw", target_protocol="file", validate="immutable",
                           block_size=BS, autostart=False, runtime_dir=runtime_dir,
                           skip_instance_cache=True)
    path = str(tmp_path / "f.bin")
    old = os.urandom(4 * BS)
    with open(path, "wb") as f:
        f.write(old)
    assert fs.cat_file(path, 0, 3 * BS) == old[:3 * BS]  # 3 of its 4 blocks cached
    published(fs)
    assert _blocks(runtime_dir) == 3
    new = os.urandom(4 * BS)
    with open(path + ".new", "wb") as f:
        f.write(new)
    os.replace(path + ".new", path)
    assert fs.cat_file(path) == new  # the old version's last block: gone; started over
    published(fs)
    wait_for(lambda: _blocks(runtime_dir) == 4, 10, what="only the new version's 4 blocks")


@pytest.mark.timeout(120)
def test_one_object_under_two_tokens_is_not_a_superseded_version(tmp_path, runtime_dir,
                                                                    spawn_daemon, s3_server):
    """A versioned bucket's listing gives an object's ETag, its HEAD and GET the VersionId
    too: the same bytes under two tokens. Taken for a new version, each revalidation
    dropped the blocks read under the listing's token: the whole dataset came again every
    few epochs (diffrev-6)."""
    import time

    client = s3_server["boto3"]()
    client.create_bucket(Bucket="versioned")
    client.put_bucket_versioning(Bucket="versioned",
                                 VersioningConfiguration={"Status": "Enabled"})
    for i in range(4):
        client.put_object(Bucket="versioned", Key=f"d/f{i}", Body=os.urandom(4 * BS))
    spawn_daemon(runtime_dir)
    fs = fsspec.filesystem("cachemw", target_protocol="s3", block_size=BS, validate="ttl",
                           ttl=1.0, target_options=s3_server["target_options"],
                           autostart=False, runtime_dir=runtime_dir, skip_instance_cache=True)
    from_source = []
    for _ in range(8):
        before = fs.stats()["bytes_from_source"]
        for path in fs.glob("versioned/d/*"):  # the listing's tokens, then the info's
            fs.cat_file(path)
        from_source.append(fs.stats()["bytes_from_source"] - before)
        time.sleep(1.2)  # past the ttl: revalidated
    assert from_source[3:] == [0] * 5, from_source


def test_the_daemon_drops_a_superseded_version_over_several_passes(tmp_path, monkeypatch):
    """The daemon's part, without a daemon process: only that version's blocks go, a huge
    file's keys are computed a bounded number per maintenance pass (one pass took 10 s for
    64 GiB of 4 KiB blocks, diffrev-7), and a version noted twice is gone through once."""
    from cachemw.config import DaemonConfig
    from cachemw.keys import block_key, url_tag
    from cachemw.node import superseded
    from cachemw.node.cache import NodeCache

    monkeypatch.setattr(superseded, "PASS_KEYS", 1000)
    node = NodeCache(DaemonConfig.build(runtime_dir=str(tmp_path / "rt"), dram_capacity="64MiB"))
    url, bs, size = "file:///data/big.bin", 4096, 4096 * 2500
    old = [block_key(url, "v1", i, bs) for i in (0, 1500, 2499)]
    new = [block_key(url, "v2", i, bs) for i in (0, 1500)]
    for key in old + new:
        node._add(key, "dram", bs, url_tag(url))
    node.superseded(url, "v1", size, bs)
    node.superseded(url, "v1", size, bs)  # another process learnt it too
    passes = []
    while node._superseded:
        passes.append(node.drop_superseded())
    assert passes == [1, 1, 1]  # 1,000 keys a pass: 2,500 in three
    assert not any(key in node._index for key in old)
    assert all(key in node._index for key in new)
    node.superseded("file:///data/other.bin", "v1", size, bs)  # nothing of it here: no work
    assert node._superseded == []
