"""How one chunk becomes bytes in a data file, and back: torch.save blob, lz4 frames, xxh3.

A tensor chunk is stored as a ``torch.save`` blob, which is what DCP's default reader expects,
so an uncompressed checkpoint loads with plain ``dcp.load``. While the blob streams out we note
where the raw tensor bytes sit inside it (``data_offset``): our reader then reads those bytes
straight into the destination tensor, skipping ``torch.load``'s intermediate copy.

With ``compression="lz4"`` the blob is cut into frames (1 MiB by default: lz4 on one huge
buffer is slower, FIELD-NOTES) each ``<raw_len:u32><stored_len:u32><payload>``; a frame that
does not shrink is stored raw (random float32 does not compress). The checksum is xxh3-64 of
the stored bytes of the chunk.
"""
from __future__ import annotations

import dataclasses
import io
import struct
from typing import IO

import lz4.block
import numpy as np
import torch
import xxhash

FRAME_HEADER = struct.Struct("<II")
CODECS = ("raw", "lz4")


@dataclasses.dataclass(frozen=True)
class StoredItem:
    """Where and how one chunk is stored (travels from each rank to the coordinator)."""

    relative_path: str
    offset: int
    length: int
    checksum: str
    codec: str = "raw"
    raw_length: int = 0
    data_offset: int = -1  # offset of the raw tensor bytes inside the raw blob, -1 if unknown
    data_nbytes: int = 0
    file_size: int = 0  # size of the whole data file when it is laid out ahead (fast-tier snapshot files)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "StoredItem":
        return cls(**obj)


def exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor whose storage is exactly its own bytes, so ``torch.save`` writes no more.

    ``torch.save`` of a view writes the whole underlying storage; DCP's writer clones to avoid
    that. A contiguous CPU view can instead be re-wrapped through numpy without copying.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        return t.contiguous()
    if t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    same_size_int = _INT_OF_SIZE.get(t.element_size())
    if same_size_int is None:
        return t.clone()
    return torch.from_numpy(t.view(same_size_int).numpy()).view(t.dtype)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _address(mv: memoryview) -> int:
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data


class _Sink(io.RawIOBase):
    """Write-only stream over a file region; subclasses decide what reaches the file."""

    def __init__(self, out: IO[bytes], watch_nbytes: int, watch_ptr: int = 0) -> None:
        super().__init__()
        self.watch_ptr = watch_ptr
        self.out = out
        self.hasher = xxhash.xxh3_64()
        self.raw_pos = 0
        self.stored = 0
        self.watch_nbytes = watch_nbytes
        self.data_offset = -1
        self.error: OSError | None = None  # torch.save masks a failed write with its own error

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.raw_pos

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        if n and n == self.watch_nbytes and self.data_offset < 0 and _address(mv) == self.watch_ptr:
            self.data_offset = self.raw_pos  # torch.save handed us the tensor's own memory
        try:
            self._put(mv)
        except OSError as exc:
            self.error = exc
            raise
        self.raw_pos += n
        return n

    def _emit(self, data) -> None:
        self.out.write(data)
        self.hasher.update(data)
        self.stored += memoryview(data).nbytes

    def _put(self, mv: memoryview) -> None:
        self._emit(mv)

    def finish(self) -> None:
        pass


class _FrameSink(_Sink):
    def __init__(self, out: IO[bytes], watch_nbytes: int, watch_ptr: int, frame_bytes: int) -> None:
        super().__init__(out, watch_nbytes, watch_ptr)
        self.frame_bytes = frame_bytes
        self.pending = bytearray()

    def _frame(self, raw) -> None:
        packed = lz4.block.compress(raw, store_size=False)
        if len(packed) >= len(raw):
            self._emit(FRAME_HEADER.pack(len(raw), len(raw)))
            self._emit(raw)
        else:
            self._emit(FRAME_HEADER.pack(len(raw), len(packed)))
            self._emit(packed)

    def _put(self, mv: memoryview) -> None:
        if self.pending:
            take = min(len(mv), self.frame_bytes - len(self.pending))
            self.pending += mv[:take]
            mv = mv[take:]
            if len(self.pending) == self.frame_bytes:
                self._frame(bytes(self.pending))
                self.pending.clear()
        while len(mv) >= self.frame_bytes:
            self._frame(mv[: self.frame_bytes])
            mv = mv[self.frame_bytes:]
        if len(mv):
            self.pending += mv

    def finish(self) -> None:
        if self.pending:
            self._frame(bytes(self.pending))
            self.pending.clear()


def write_chunk(out: IO[bytes], rel: str, offset: int, data, codec: str, frame_bytes: int) -> StoredItem:
    """Write one chunk (a tensor or a BytesIO of pickled bytes) at the current file position."""
    if codec not in CODECS:
        raise ValueError(f"compression must be one of None, 'lz4'; got {codec!r}")
    if isinstance(data, torch.Tensor):
        tensor = exact_storage(data)
        nbytes = tensor.numel() * tensor.element_size()
    else:
        tensor, nbytes = None, 0
    ptr = tensor.data_ptr() if tensor is not None else 0
    sink = _FrameSink(out, nbytes, ptr, frame_bytes) if codec == "lz4" else _Sink(out, nbytes, ptr)
    try:
        if tensor is not None:
            torch.save(tensor, sink)
        else:
            sink.write(data.getbuffer())
        sink.finish()
    except Exception:  # always re-raised, as the sink's own error if it had one
        if sink.error is not None:
            raise sink.error from None  # e.g. ENOSPC, not torch's "unexpected pos"
        raise
    return StoredItem(rel, offset, sink.stored, sink.hasher.hexdigest(), codec, sink.raw_pos,
                      sink.data_offset if tensor is not None else -1, nbytes)


def decode(stored: bytes | memoryview, item: StoredItem) -> memoryview:
    """The raw blob of a chunk from its stored bytes (checksum already verified)."""
    if item.codec == "raw":
        return memoryview(stored)
    out = bytearray(item.raw_length)
    mv = memoryview(stored)
    pos = dst = 0
    while pos < len(mv):
        raw_len, stored_len = FRAME_HEADER.unpack_from(mv, pos)
        pos += FRAME_HEADER.size
        payload = mv[pos: pos + stored_len]
        pos += stored_len
        out[dst: dst + raw_len] = payload if raw_len == stored_len else lz4.block.decompress(payload, uncompressed_size=raw_len)
        dst += raw_len
    return memoryview(out)


def checksum(*parts) -> str:
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.hexdigest()


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of a contiguous CPU tensor's bytes."""
    return tensor.reshape(-1).view(torch.uint8).numpy()
