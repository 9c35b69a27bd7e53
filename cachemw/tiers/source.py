"""The source tier: the store the dataset really lives on (a PFS path, S3, any fsspec URL).

It is the bottom of the hierarchy and the fallback for every failure above it, so it is
addressed by path and byte range rather than by block key.
"""
from __future__ import annotations

from ..keys import block_length


class SourceTier:
    name = "source"

    def __init__(self, fs) -> None:
        self.fs = fs

    def read_block(self, path: str, index: int, block_size: int, file_size: int) -> bytes:
        """Bytes of block ``index`` of ``path``, exactly as long as the file's size says."""
        length = block_length(file_size, index, block_size)
        start = index * block_size
        if length == 0:
            return b""
        if start == 0 and length == file_size:
            data = self.fs.cat_file(path)
        else:
            data = self.fs.cat_file(path, start=start, end=start + length)
        if len(data) != length:
            raise ChangedSourceError(
                f"{path}: expected {length} bytes at offset {start}, the source returned "
                f"{len(data)}: the file changed while being read"
            )
        return data

    def read_range(self, path: str, start: int, end: int) -> bytes:
        return self.fs.cat_file(path, start=start, end=end)


class ChangedSourceError(OSError):
    """The source file no longer matches the version the cache recorded for it."""
