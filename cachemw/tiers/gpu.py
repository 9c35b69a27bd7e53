"""A device-memory tier in the trainer process: hot samples kept as uint8 tensors.

Why: a hit from the node's DRAM tier still costs a host read and a host-to-device copy per
step. Samples kept on the device skip both. Device memory is small and belongs to one
process, so this tier lives in the trainer (not in the node daemon) and holds only what the
placement engine (:mod:`cachemw.placement`, the same one the daemon runs) chooses to keep:
each read is an ``access(key, size)``, and the engine's Admit/Evict moves are carried out on
the tier's dict of tensors. The device is a parameter (``"cuda"``, ``"cuda:1"``, ``"cpu"``).

What is verified, and what is not:

* Bytes enter the tier only from a host read that cachemw verified (each cached block is
  checked against its checksums, or read straight from the source). The tier records the
  xxh3-64 of those host bytes with the tensor.
* :meth:`GpuTier.get` (bytes) copies the tensor back to the host and checks it against that
  checksum: a corrupted copy raises :class:`~cachemw.blockfile.CorruptBlock` and is dropped.
* :meth:`GpuTier.get_tensor` returns the device tensor itself, with no host copy and **no
  check**: hashing on the device would cost a kernel per read and a sync. Device memory
  errors are left to the GPU's ECC; call :meth:`GpuTier.verify` to check a tensor on demand.
* The returned tensor is the cached one: treat it as read-only (clone before changing it in
  place, or the cache serves the changed bytes).

Usage in a Dataset::

    fs = fsspec.filesystem("cachemw", target_protocol="file")
    reader = GpuCachedReader(fs, capacity="8GiB", device="cuda")
    sample = reader.read(path)          # a uint8 tensor on the device
"""
from __future__ import annotations

import hashlib
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Iterator

import xxhash

from ..blockfile import CorruptBlock
from ..config_values import parse_size
from ..keys import url_tag
from ..placement import NOMINAL_BANDWIDTH, Admit, Engine, Evict, Plan, TierSpec
from .base import BlockEntry, TierInfo

_hash = xxhash.xxh3_64_intdigest


@dataclass
class _Resident:
    tensor: object  # torch.Tensor of dtype uint8 on the tier's device
    checksum: int  # xxh3-64 of the host bytes it was made from
    tag: bytes
    last_used: float


class GpuTier:
    """Blocks as uint8 device tensors, placed by a :class:`cachemw.placement.Engine`.

    Speaks the tier protocol of :mod:`cachemw.tiers.base`, with placement inside: ``put``
    offers a block just read from the host (the engine may decline: it returns 0), ``get``
    and ``get_tensor`` of a cached block count as a read. Thread-safe (DataLoader threads
    and the training loop may share it). ``policy``: an engine policy name ("history" by
    default, "lru", "pin", "clairvoyant" with :meth:`announce`).
    """

    def __init__(self, capacity: int | str, device="cuda", *, policy: str | None = None,
                 name: str = "gpu") -> None:
        import torch

        capacity = parse_size(capacity, name="capacity")
        if capacity <= 0:
            raise ValueError(f"capacity: must be > 0 bytes, got {capacity}")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: {device!r} is not a torch device ({exc})") from None
        self._torch = torch
        self.name = name
        self.capacity = capacity
        self._engine = Engine([TierSpec(name, capacity, NOMINAL_BANDWIDTH["gpu"])], policy,
                              announced=policy == "clairvoyant")
        self._blocks: dict[str, _Resident] = {}
        self._used = 0
        self._lock = threading.Lock()
        self.counters = dict(hits=0, misses=0, admitted=0, declined=0, evictions=0, corrupt=0)

    # -- the tier protocol -------------------------------------------------------------

    def get(self, key: str, length: int, start: int = 0, end: int | None = None) -> bytes | None:
        """Bytes ``[start, end)`` of a cached block, copied to the host and verified against
        the checksum of the host read it came from; None if absent."""
        tensor = self.get_tensor(key)
        if tensor is None:
            return None
        data = tensor.cpu().numpy().tobytes()
        with self._lock:
            resident = self._blocks.get(key)
        if resident is None or _hash(data) != resident.checksum or len(data) != length:
            self._corrupt(key)
            raise CorruptBlock(f"{self.name} tier: block {key} does not match the checksum of "
                               "the host read it was copied from")
        return data[start:end]

    def get_tensor(self, key: str):
        """The cached tensor itself (no host copy, not verified; see the module docstring),
        or None. A read: the engine hears of it."""
        with self._lock:
            resident = self._blocks.get(key)
            if resident is None:
                return None
            self.counters["hits"] += 1
            resident.last_used = time.time()
            self._execute(self._engine.access(key, resident.tensor.numel()), None)
            return resident.tensor

    def put(self, key: str, data: bytes, tag: bytes = b"") -> int:
        """Offer a block just read (and verified) on the host: a read the engine hears of.
        Stores it on the device if the engine admits it; returns the bytes it occupies
        (0 if not admitted, or for an empty block)."""
        return self.put_tensor(key, data, tag)[1]

    def put_tensor(self, key: str, data: bytes, tag: bytes = b""):
        """Like :meth:`put`; returns ``(tensor on the device, bytes stored)``, the tensor
        made from ``data`` whether the engine kept it or not."""
        tensor = self._to_device(data)
        if not data:
            return tensor, 0
        with self._lock:
            resident = self._blocks.get(key)
            if resident is not None:  # another thread put it meanwhile
                return resident.tensor, 0
            self.counters["misses"] += 1
            stored = self._execute(self._engine.access(key, len(data)),
                                   _Resident(tensor, _hash(data), tag, time.time()), key)
        return tensor, stored

    def delete(self, key: str) -> int:
        with self._lock:
            self._engine.drop(key)
            return self._remove(key)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._blocks

    def stat(self) -> TierInfo:
        with self._lock:
            return TierInfo(self.name, str(self.device), self.capacity, self.capacity - self._used)

    def scan(self) -> Iterator[BlockEntry]:
        with self._lock:
            entries = [BlockEntry(k, r.tensor.numel(), r.last_used, r.tag)
                       for k, r in self._blocks.items()]
        return iter(entries)

    def close(self) -> None:
        """Free the device memory (the engine forgets every block)."""
        with self._lock:
            for key in list(self._blocks):
                self._engine.drop(key)
                self._remove(key)

    # -- beyond the protocol -----------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used

    def placement(self) -> dict:
        """What the engine believes is cached (equal to the tier's keys, by construction)."""
        with self._lock:
            return self._engine.placement()

    def announce(self, order: list[tuple[str, int]]) -> None:
        """The next reads, as (key, size) in order, for a tier built with policy="clairvoyant"."""
        with self._lock:
            self._engine.announce(order)

    def checksum(self, key: str) -> int | None:
        """xxh3-64 of the host bytes the cached tensor was made from."""
        with self._lock:
            resident = self._blocks.get(key)
            return None if resident is None else resident.checksum

    def verify(self, key: str) -> bool:
        """Copy a cached tensor to the host and check it; a corrupted one is dropped."""
        with self._lock:
            resident = self._blocks.get(key)
        if resident is None:
            return False
        if _hash(resident.tensor.cpu().numpy().tobytes()) == resident.checksum:
            return True
        self._corrupt(key)
        return False

    # -- internals (called with the lock held, except _to_device and _corrupt) ----------

    def _to_device(self, data: bytes):
        torch = self._torch
        if not data:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        with warnings.catch_warnings():  # bytes are read-only: the copy below never writes them
            warnings.simplefilter("ignore", UserWarning)
            host = torch.frombuffer(data, dtype=torch.uint8)
        return host.to(self.device, copy=True)

    def _execute(self, plan: Plan, offered: _Resident | None, key: str | None = None) -> int:
        """Carry out the engine's moves: evictions first, then the admission of ``offered``."""
        stored = 0
        for move in plan.moves:
            if isinstance(move, Evict):
                self.counters["evictions"] += bool(self._remove(move.key))
            elif isinstance(move, Admit) and offered is not None and move.key == key:
                size = offered.tensor.numel()
                if self._used + size > self.capacity:  # cannot happen if the engine is right
                    self._engine.drop(key)
                    continue
                self._blocks[key] = offered
                self._used += size
                stored = size
                self.counters["admitted"] += 1
        if offered is not None and not stored:
            self.counters["declined"] += 1
        return stored

    def _remove(self, key: str) -> int:
        resident = self._blocks.pop(key, None)
        if resident is None:
            return 0
        size = resident.tensor.numel()
        self._used -= size
        return size

    def _corrupt(self, key: str) -> None:
        with self._lock:
            self.counters["corrupt"] += 1
            self._engine.drop(key)
            self._remove(key)


class GpuCachedReader:
    """A GPU tier in front of a cachemw filesystem: ``read(path) -> uint8 tensor``.

    A device hit costs no host I/O at all; a miss reads through ``fs`` (the node's DRAM/NVMe
    tiers or the source, verified there), copies the bytes to the device, and offers them
    to the tier. Keys include the file's version token from ``fs``'s metadata cache, so a
    changed file is never served from the device past ``fs``'s revalidation bound (its
    ``validate`` / ``ttl`` options), the same bound as the host tiers. Picklable only as
    far as its filesystem is: build one per process (device memory is per process anyway).
    """

    def __init__(self, fs, capacity: int | str, device="cuda", *, policy: str | None = None) -> None:
        if not hasattr(fs, "cat_file"):
            raise ValueError(f"fs: expected an fsspec filesystem, got {fs!r}")
        self.fs = fs
        self.tier = GpuTier(capacity, device, policy=policy)

    def read(self, path: str, start: int | None = None, end: int | None = None):
        """Bytes ``[start, end)`` of ``path`` as a uint8 tensor on the tier's device (the
        cached tensor on a hit: treat it as read-only)."""
        key, tag = self._key(path, start, end)
        tensor = self.tier.get_tensor(key)
        if tensor is not None:
            return tensor
        data = self.fs.cat_file(path, start=start, end=end)
        return self.tier.put_tensor(key, data, tag)[0]

    def _key(self, path: str, start, end) -> tuple[str, bytes]:
        """A stable key of (file, version, range), like the host tiers' block keys."""
        meta = self.fs.meta.file(self.fs._strip_protocol(path))
        h = hashlib.blake2b(digest_size=16, person=b"cachemw-gpu")
        h.update(f"{meta.url}\0{meta.version}\0{start}\0{end}".encode())
        return h.hexdigest(), url_tag(meta.url)

    def stats(self) -> dict:
        return {**self.tier.counters, "used_bytes": self.tier.used_bytes,
                "capacity_bytes": self.tier.capacity}

    def close(self) -> None:
        self.tier.close()
