"""``cat_ranges`` of the cachemw filesystem: many byte ranges in one call, their misses
fetched as one batch (to the daemon, and on to owner nodes, together).

The ranges of one path come from one version of it, as a ``cat_file`` of it would: its
metadata is looked up once per call (a lookup per range, revalidating under ``always``,
could meet a file replaced between two of them). If the batch fails, each of its paths is
read again on its own: a file whose version the source no longer has was dropped by the
read that met it (metadata.moved_on), so it starts over with fresh metadata, once; the
others keep theirs (what the node knows of them, a warmed file under ``immutable`` gone
from the source, is not dropped for another file's failure). fsspec's ``on_error``: with
"return" a path's failure is its ranges' result;
otherwise it is raised, as fsspec's own ``cat_ranges`` does. Cold files of a store whose
GET names the version (HTTP, S3) are read side by side (fanout.py), and so are the blocks
the batch misses.
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from . import fanout
from .openfile import clip, offset
from .silence import ReadCall
from ..tiers.source import ChangedSourceError

if TYPE_CHECKING:
    from .fs import CacheFileSystem
    from .metadata import FileMeta


def read_ranges(fs: CacheFileSystem, paths, starts, ends, on_error: str = "return") -> list:
    """``fs.cat_ranges``: the bytes of each range (or, with on_error="return", its error).
    Its waits on a silent daemon, every path's read again included, add up to one
    ``daemon_timeout`` at most (silence.py)."""
    with ReadCall(fs.client.timeout):
        return _read_all_ranges(fs, paths, starts, ends, on_error)


def _read_all_ranges(fs: CacheFileSystem, paths, starts, ends, on_error: str) -> list:
    if not isinstance(starts, list):
        starts = [starts] * len(paths)
    if not isinstance(ends, list):
        ends = [ends] * len(paths)
    if len(starts) != len(paths) or len(ends) != len(paths):
        raise ValueError("cat_ranges: paths, starts and ends must have the same length")
    starts, ends = [offset(s) for s in starts], [offset(e) for e in ends]
    out: list = [None] * len(paths)
    by_path: dict[str, list[int]] = {}
    for i, p in enumerate(paths):
        try:
            by_path.setdefault(fs._strip_protocol(p), []).append(i)
        except Exception as exc:  # fsspec's on_error: any error of a path is its result
            if on_error != "return":  # fsspec's: "raise" and "omit" raise
                raise
            out[i] = exc
    failed, batch = _read_ranges(fs, by_path, starts, ends, out, on_error)
    if failed is not None:  # each path again, alone
        for path, meta in batch.items():
            for _ in range(2):
                exc, again = _read_ranges(fs, {path: by_path[path]}, starts, ends, out,
                                          on_error)
                # met a change at the batch's metadata (the batch failed on another
                # file): dropped now (metadata.moved_on), it starts over once, fresh
                if not (isinstance(exc, ChangedSourceError) and again.get(path) == meta):
                    break
            if exc is not None:
                if on_error != "return":  # fsspec's: "raise" and "omit" raise
                    raise exc
                for i in by_path[path]:
                    out[i] = exc
    return out


def _read_ranges(fs: CacheFileSystem, by_path: dict[str, list[int]], starts, ends, out: list,
                 on_error: str) -> tuple[OSError | None, dict[str, FileMeta]]:
    """Fill ``out`` with the ranges of ``by_path`` (path -> indices), every path at one
    version, the blocks they miss fetched as one batch. Returns the batch's OSError
    (None if it succeeded) and the paths it read, with the metadata they were read at."""
    requests, where, batch, cold = [], [], {}, []
    for path, idx in by_path.items():
        try:
            meta, seen = fs.meta.known_file(path)
            if meta is None and not seen and len(idx) == 1 \
                    and fs.options.validate != "always" and fs.reader.source.tells_versions:
                cold.append((path, idx[0]))  # read cold, its version from its GET (below)
                continue
            meta = meta or fs.meta.ask_file(path)
            if fs._reads_to_end(meta):  # read to its end once (fs._read), each range cut from it
                data = fs.cat_file(path)
                for i in idx:
                    out[i] = data[slice(*clip(starts[i], ends[i], len(data)))]
                continue
        except Exception as exc:  # fsspec's on_error: any error of a path is its result
            if on_error != "return":  # fsspec's: "raise" and "omit" raise
                raise
            for i in idx:
                out[i] = exc
            continue
        batch[path] = meta
        for i in idx:
            requests.append((meta, *clip(starts[i], ends[i], meta.size)))
            where.append(i)
    if cold:  # each file's GET names its version (fs._read_path); side by side
        got = fanout.run_all([partial(fs.cat_file, path, starts[i], ends[i]) for path, i in cold],
                             kind=fanout.READ, parallel=fs.reader.source.concurrent)
        for (_, i), data in zip(cold, got):
            if isinstance(data, Exception) and on_error != "return":
                raise data
            out[i] = data
    try:
        results = fs.reader.read_many(requests)
    except OSError as exc:
        return exc, batch
    for i, data in zip(where, results):
        out[i] = data
    return None, batch
