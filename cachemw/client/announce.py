"""What a process tells its node's daemon about the reads it will make: the checks of an
announcement's stream and its cut into messages (``CacheFileSystem.announce`` sends them).

An order is a list of blocks. Several ranks of one node (DDP: a process per device, each
with its shard) each announce their own, with the same ``group`` for one epoch; the daemon
lays their blocks interleaved, as they will be read (placement/engine.py). Each message
carries its stream: (group, rank, ranks, first, replace, owner), ``first`` being the
index of its first block in the rank's order, so that an order sent in several messages
(or in windows, AnnouncingSampler's ``lookahead``) lands where it belongs. Only the first
message of a replacing order withdraws its owner's unread places; the others add to it.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

#: (group or None, rank, ranks, first, replace, owner): one message's place among the
#: node's orders (ops.ANNOUNCE)
Stream = Tuple[Optional[str], int, int, int, bool, str]


def check_ranks(rank, ranks) -> None:
    """``rank`` is one of a node's ``ranks`` (ints), else a ValueError saying what is not."""
    for name, value in (("rank", rank), ("ranks", ranks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if not rank < ranks:
        raise ValueError(f"rank {rank} is not one of the node's {ranks} ranks")


def stream_owner(*, rank: int, ranks: int, group: Optional[str], first: int, replace: bool,
                 owner: Optional[str], chunk: int) -> str:
    """Check an announcement's stream (ValueError naming what is wrong) and return whose
    orders it adds to: ``owner`` if given, else the group's name up to its last ':' (the
    same on every rank: groups are named ``<owner>:<epoch>``) with several ranks, else this
    process. Every order names its owner, so that a replacing one can withdraw it."""
    check_ranks(rank, ranks)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"announce: chunk must be an int >= 1, got {chunk!r}")
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"announce: first must be an int >= 0, got {first!r}")
    if not isinstance(replace, bool):
        raise ValueError(f"announce: replace must be a bool, got {replace!r}")
    if ranks > 1 and not isinstance(group, str):
        raise ValueError("announce: ranks > 1 needs a group (a str) naming the ranks' epoch")
    if owner is None:
        return (group.rpartition(":")[0] or group) if ranks > 1 else f"pid-{os.getpid()}"
    if not isinstance(owner, str):
        raise ValueError(f"announce: owner must be a str, got {owner!r}")
    return owner


def announce_entries(paths) -> List[Tuple[str, Optional[int], Optional[int]]]:
    """(path, start, end) of each entry of an order: a path (str or os.PathLike) or a
    (path, start, end) range; a ValueError naming an entry of another kind (a single
    path given for the list would be read as one path per character)."""
    if isinstance(paths, (str, bytes, os.PathLike)):
        raise ValueError(f"announce: paths must be a list of paths, got one path: {paths!r}")
    out = []
    for entry in paths:
        if isinstance(entry, (str, os.PathLike)):
            out.append((os.fspath(entry), None, None))
        elif isinstance(entry, (tuple, list)) and len(entry) == 3 \
                and isinstance(entry[0], (str, os.PathLike)):
            out.append((os.fspath(entry[0]), entry[1], entry[2]))
        else:
            raise ValueError(f"announce: an entry must be a path or (path, start, end), "
                             f"got {entry!r}")
    return out


def messages(items: Sequence, chunk: int, *, rank: int, ranks: int, group: Optional[str],
             first: int, replace: bool, owner: str) -> List[Tuple[List, Stream]]:
    """The order's blocks in messages of at most ``chunk``, each with its stream."""
    return [(list(items[i:i + chunk]), (group if ranks > 1 else None, rank, ranks, first + i,
                                        replace and i == 0, owner))
            for i in range(0, len(items), chunk)]
