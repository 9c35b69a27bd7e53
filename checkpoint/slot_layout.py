"""Pure layout of a rank's snapshot files in the fast tier: where each chunk's bytes go.

With a fast (tmpfs) tier the snapshot is taken straight into the data files of the new step,
so the staging copy and the in-memory checkpoint are the same pages (one copy of the state in
host memory instead of three). That needs every chunk's file and data offset before the
snapshot, that is before ``torch.save`` has framed the chunk. A chunk is stored, as everywhere
else, as a ``torch.save`` blob (so DCP's default reader loads it); the blob's header and tail
lengths depend only on the tensor's dtype, rank and size, never on its values, so a slot
reserves a bounded room for them around a fixed data offset: the blob starts at
``data_pos - len(header)``, anywhere in the room, and ends before ``end``.

Everything here is a frozen dataclass or a function of them, so equal inputs give equal
layouts: a layout equal to the previous save's means its files (and mapped pages) are reused.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

ALIGN = 64  # torch.save aligns a record's data to 64 bytes; slots keep data as aligned


@dataclasses.dataclass(frozen=True)
class SlotRequest:
    """One tensor chunk a rank writes: DCP's item key, the source box and its bytes."""

    key: str
    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: str  # str(torch.dtype), e.g. "torch.float32"
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one chunk lives in its file: the blob fits in ``[start, end)``, data at ``data_pos``."""

    request: SlotRequest
    start: int
    data_pos: int
    end: int


@dataclasses.dataclass(frozen=True)
class FileLayout:
    rel: str
    size: int
    slots: tuple[Slot, ...]


@dataclasses.dataclass(frozen=True)
class SnapshotLayout:
    """A rank's snapshot files; ``extra_rel`` takes what is not written in place (pickled values)."""

    files: tuple[FileLayout, ...]
    extra_rel: str

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    def slots(self) -> dict[str, tuple[FileLayout, Slot]]:
        return {s.request.key: (f, s) for f in self.files for s in f.slots}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket(requests: Sequence[SlotRequest], buckets: int) -> list[list[SlotRequest]]:
    """Spread requests over ``buckets`` files, largest first to the lightest (as the writer does)."""
    out: list[list[SlotRequest]] = [[] for _ in range(max(1, min(buckets, len(requests))))]
    load = [0] * len(out)
    for req in sorted(requests, key=lambda r: (-r.nbytes, r.key)):
        k = load.index(min(load))
        out[k].append(req)
        load[k] += req.nbytes
    return [b for b in out if b]


def plan_layout(prefix: str, requests: Sequence[SlotRequest], reserves: Mapping[tuple[str, int], tuple[int, int]],
                files: int) -> SnapshotLayout:
    """Lay out ``requests`` (non-empty tensor chunks) in up to ``files`` files named ``<prefix><n>.distcp``.

    ``reserves[(dtype, ndim)]`` is the (header, tail) room a blob of that kind needs at most.
    """
    if files < 1:
        raise ValueError(f"files must be >= 1, got {files}")
    layouts = []
    buckets = bucket([r for r in requests if r.nbytes > 0], files)
    for n, reqs in enumerate(buckets):
        cursor, slots = 0, []
        for req in reqs:
            head, tail = reserves[(req.dtype, len(req.sizes))]
            data_pos = round_up(cursor + head, ALIGN)
            end = data_pos + req.nbytes + tail
            slots.append(Slot(req, cursor, data_pos, end))
            cursor = round_up(end, ALIGN)
        layouts.append(FileLayout(f"{prefix}{n}.distcp", cursor, tuple(slots)))
    return SnapshotLayout(tuple(layouts), f"{prefix}{len(layouts)}.distcp")


__all__ = ["SlotRequest", "Slot", "FileLayout", "SnapshotLayout", "plan_layout", "bucket", "round_up", "ALIGN"]
