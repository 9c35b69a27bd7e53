"""Access reports left in the runtime dir for the node's daemon, by processes that have no
connection to it.

A DataLoader worker reading a warm cache only hits: it needs no lease, so it never opens a
connection to the daemon (a handshake and a daemon thread per worker per epoch), yet its
hits must still be counted and reach the placement engine. It writes what it would have
sent as a ``REPORT`` (cachemw.ops) into ``<runtime_dir>/reports/`` instead: one small file
per flush, written atomically, which the daemon takes (renames, reads, deletes) within a
second, and before it answers ``stats``. A process that is connected sends its reports on
the socket as before.

Format: JSON ``{"counters": {name: int, "tier_hit_bytes": {tier: int}}, "hits": {tier:
"<key><key>..."}}``, the hit keys (32 hex characters each) joined per tier, so a report of
thousands of hits costs one string, not a tuple per hit. The directory is private (in the
0700 runtime dir, itself 0700); anything in it that does not parse is dropped.

Hits at other nodes (blocks sent straight from their owners' block servers, which the
daemon never sees otherwise) are reported as hits of the "tier" ``remote:<length>:<url
tag, hex>`` (``remote_hit_tier``), what the daemon needs to copy a block read again and
again here (cluster/owner.py), in either way of reporting.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import time

from .files import atomic_write, make_private_dirs

REPORTS = "reports"
SUFFIX = ".json"
_TAKEN = ".taken"
KEY_LENGTH = 32  # hex characters of a block key (keys.block_key)
MAX_BYTES = 16 << 20  # a report larger than this is no report of ours
_seq = itertools.count()


REMOTE = "remote:"


def remote_hit_tier(length: int, tag: bytes) -> str:
    """The "tier" a hit at an owner node is reported under: its block's data length and
    the tag of its file's URL (keys.url_tag)."""
    return f"{REMOTE}{length}:{tag.hex()}"


def remote_hit(tier: str) -> tuple[int, bytes] | None:
    """(length, url tag) of a tier named by ``remote_hit_tier``; None for any other."""
    if not tier.startswith(REMOTE):
        return None
    length, _, tag = tier[len(REMOTE):].partition(":")
    try:
        length, tag = int(length), bytes.fromhex(tag)
    except ValueError:
        return None
    return (length, tag) if length >= 0 and tag else None


def spool_dir(runtime_dir: str) -> str:
    return os.path.join(runtime_dir, REPORTS)


def write(runtime_dir: str, counters: dict, hits: dict[str, list[str]]) -> bool:
    """Leave one report for the daemon; False if it could not be written (the caller keeps
    it and sends it another way)."""
    payload = json.dumps({"counters": counters,
                          "hits": {tier: "".join(keys) for tier, keys in hits.items()}})
    path = os.path.join(spool_dir(runtime_dir), f"{os.getpid()}.{next(_seq)}{SUFFIX}")
    try:
        try:
            atomic_write(path, payload.encode())
        except FileNotFoundError:
            make_private_dirs(os.path.dirname(path))
            atomic_write(path, payload.encode())
    except OSError:
        return False
    return True


def take_all(runtime_dir: str) -> list[tuple[dict, list[tuple[str, str]]]]:
    """Every report left so far, as (counters, [(key, tier) hit, ...]), each taken once
    (renamed before it is read, so two takers never both count one)."""
    d = spool_dir(runtime_dir)
    try:
        names = os.listdir(d)
    except OSError:
        return []
    out = []
    for name in names:
        if not name.endswith(SUFFIX):
            continue
        path = os.path.join(d, name)
        taken = path + _TAKEN
        try:
            os.rename(path, taken)
        except OSError:  # taken by another thread meanwhile
            continue
        try:
            with open(taken, "rb") as f:
                data = f.read(MAX_BYTES + 1)
        except OSError:
            continue
        finally:
            try:
                os.unlink(taken)
            except OSError:
                pass
        report = _parse(data)
        if report is not None:
            out.append(report)
    return out


def _parse(data: bytes) -> tuple[dict, list[tuple[str, str]]] | None:
    if len(data) > MAX_BYTES:
        return None
    try:
        doc = json.loads(data)
        counters, hits = doc["counters"], doc["hits"]
        if not isinstance(counters, dict) or not isinstance(hits, dict):
            return None
        accesses = [(keys[i:i + KEY_LENGTH], tier) for tier, keys in hits.items()
                    if isinstance(tier, str) and isinstance(keys, str)
                    for i in range(0, len(keys) - KEY_LENGTH + 1, KEY_LENGTH)]
    except (ValueError, KeyError, TypeError):
        return None
    # counts are ints, the readers' seconds (cachemw.readtime) floats
    clean = {k: v for k, v in counters.items()
             if isinstance(k, str) and type(v) in (int, float) and 0 <= v < math.inf}
    tier_bytes = counters.get("tier_hit_bytes")
    if isinstance(tier_bytes, dict):
        clean["tier_hit_bytes"] = {t: n for t, n in tier_bytes.items()
                                   if isinstance(t, str) and type(n) is int and n >= 0}
    return clean, accesses


def clear_stale(runtime_dir: str, older_than: float = 60.0) -> None:
    """At a daemon's start: reports a dead daemon had taken but not read, and temp files of
    writers that died mid-write (a live writer's temp file is younger than ``older_than``)."""
    d = spool_dir(runtime_dir)
    try:
        names = os.listdir(d)
    except OSError:
        return
    now = time.time()
    for name in names:
        if not name.endswith((_TAKEN, ".tmp")):
            continue
        path = os.path.join(d, name)
        try:
            if name.endswith(_TAKEN) or now - os.lstat(path).st_mtime > older_than:
                os.unlink(path)
        except OSError:
            pass
