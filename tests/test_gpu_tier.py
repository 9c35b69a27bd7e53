"""The GPU tier: exact bytes in and out, capacity never exceeded, eviction decided by the
placement engine, checksums from the host read, the device as a parameter ("cpu" always,
"cuda" where present), and GpuCachedReader in front of a real cachemw filesystem.
"""
from __future__ import annotations

import os
import random

import pytest

torch = pytest.importorskip("torch")

from cachemw.blockfile import CorruptBlock  # noqa: E402
from cachemw.placement import Engine, TierSpec  # noqa: E402
from cachemw.tiers.base import Tier  # noqa: E402
from cachemw.tiers.gpu import GpuCachedReader, GpuTier  # noqa: E402

pytestmark = pytest.mark.torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here"))]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def test_put_get_exact_bytes_on_the_device(device):
    tier = GpuTier(1 << 20, device)
    assert isinstance(tier, Tier)
    data = os.urandom(5000)
    assert tier.put("a", data) == 5000
    assert tier.contains("a")
    assert tier.get("a", 5000) == data
    assert tier.get("a", 5000, 10, 20) == data[10:20]
    t = tier.get_tensor("a")
    assert t.dtype == torch.uint8 and t.device.type == torch.device(device).type
    assert bytes(t.cpu().numpy()) == data
    assert tier.get("missing", 1) is None and tier.get_tensor("missing") is None
    assert tier.delete("a") == 5000 and not tier.contains("a")
    assert tier.stat().free_bytes == tier.stat().total_bytes == 1 << 20
    assert tier.put("empty", b"") == 0  # an empty block is never cached...
    assert tier.put_tensor("empty", b"")[0].numel() == 0  # ...but still becomes a tensor


def test_capacity_is_never_exceeded(device):
    rng = random.Random(0)
    cap = 50_000
    tier = GpuTier(cap, device, policy="lru")
    blobs = {f"k{i}": rng.randbytes(rng.randint(1, 12_000)) for i in range(40)}
    for _ in range(600):
        key = rng.choice(list(blobs))
        if rng.random() < 0.1:
            tier.delete(key)
        elif tier.get_tensor(key) is None:
            tier.put(key, blobs[key])
        resident = [e.stored_bytes for e in tier.scan()]
        assert sum(resident) == tier.used_bytes <= cap
        assert tier.stat().free_bytes == cap - tier.used_bytes
    for entry in tier.scan():
        assert tier.get(entry.key, len(blobs[entry.key])) == blobs[entry.key]
    tier.close()
    assert tier.used_bytes == 0 and not list(tier.scan())


@pytest.mark.parametrize("policy", [None, "lru", "pin"])
def test_eviction_is_the_engines(device, policy):
    """The tier holds exactly what an engine fed the same reads would hold."""
    rng = random.Random(1)
    sizes = {f"k{i}": rng.randint(100, 3000) for i in range(30)}
    tier = GpuTier(20_000, device, policy=policy)
    engine = Engine([TierSpec("gpu", 20_000, 1e9)], policy)
    for _ in range(400):
        key = rng.choice(list(sizes))
        if tier.get_tensor(key) is None:
            tier.put(key, os.urandom(sizes[key]))
        engine.access(key, sizes[key])
        assert set(tier.placement()) == {e.key for e in tier.scan()} == set(engine.placement())
    assert tier.counters["evictions"] > 0 or policy == "pin"


def test_lru_evicts_the_least_recently_read(device):
    tier = GpuTier(3000, device, policy="lru")
    for key in "abc":
        tier.put(key, key.encode() * 1000)
    tier.get_tensor("a")  # a read: b is now the least recent
    tier.put("d", b"d" * 1000)
    assert sorted(e.key for e in tier.scan()) == ["a", "c", "d"]
    assert tier.counters["evictions"] == 1


def test_clairvoyant_tier_follows_an_announced_order(device):
    tier = GpuTier(2000, device, policy="clairvoyant")
    tier.announce([("a", 1000), ("b", 1000), ("c", 1000), ("a", 1000), ("b", 1000)])
    for key in "abc":
        tier.put(key, key.encode() * 1000)
    assert sorted(e.key for e in tier.scan()) == ["a", "b"]  # c is never read again


def test_a_corrupted_tensor_is_caught_by_get_not_by_get_tensor(device):
    tier = GpuTier(1 << 20, device)
    data = os.urandom(4096)
    tier.put("a", data)
    assert tier.checksum("a") is not None and tier.verify("a")
    tier.get_tensor("a")[7] ^= 0xFF  # device memory flips a byte
    assert tier.get_tensor("a") is not None  # the zero-copy path does not check
    with pytest.raises(CorruptBlock):
        tier.get("a", 4096)
    assert not tier.contains("a") and tier.counters["corrupt"] == 1
    tier.put("b", data)
    tier.get_tensor("b")[0] ^= 1
    assert tier.verify("b") is False and not tier.contains("b")


def test_bad_arguments_are_value_errors_naming_them():
    with pytest.raises(ValueError, match="capacity"):
        GpuTier(0, "cpu")
    with pytest.raises(ValueError, match="capacity"):
        GpuTier("lots", "cpu")
    with pytest.raises(ValueError, match="device"):
        GpuTier(1000, "warp-drive")
    with pytest.raises(ValueError, match="fs"):
        GpuCachedReader(object(), 1000, "cpu")


@pytest.mark.timeout(60)
def test_gpu_cached_reader_in_front_of_a_cachemw_filesystem(device, make_cache_fs, dataset):
    _, files = dataset
    fs = make_cache_fs(validate="always")
    reader = GpuCachedReader(fs, 1 << 20, device)
    paths = sorted(files)[:8]
    for _ in range(2):
        for p in paths:
            t = reader.read(p)
            assert t.device.type == torch.device(device).type
            assert bytes(t.cpu().numpy()) == files[p]
        assert bytes(reader.read(paths[0], 5, 50).cpu().numpy()) == files[paths[0]][5:50]
    stats = reader.stats()
    assert stats["hits"] > 0 and stats["used_bytes"] <= stats["capacity_bytes"]
    # a changed source file is never served from the device (validate="always")
    with open(paths[0], "wb") as f:
        f.write(b"new bytes")
    assert bytes(reader.read(paths[0]).cpu().numpy()) == b"new bytes"
    reader.close()
    assert reader.tier.used_bytes == 0
