"""Landing a replica of a remote block in the fill NodeCache.reserve_replica made for it.

Apart from the node cache because a replica is reserved before its bytes are fetched (the
copier of cluster/owner.py asks the placement engine first, then fetches only what got a
tier) and landed once they arrive, or given back if they never do.
"""
from __future__ import annotations


def land(node, key: str, fill, data: bytes | None) -> bool:
    """Stage ``data`` for ``fill`` and publish it (NodeCache.land: unless evicted or
    invalidated meanwhile); None (the owner did not give it) or a failing tier gives the
    room back. Whether a replica was kept (counted ``replicas``)."""
    if data is None:
        node.end_unfilled(key, fill, "error")
        return False
    try:
        stored = node.tier(fill.tier).stage(key, data, fill.lease, tag=fill.tag or b"")
    except OSError:  # a full or failing tier: no replica, the read goes on
        node.end_unfilled(key, fill, "error")
        return False
    except BaseException:  # the fill ends whatever failed, even Ctrl-C; re-raised
        node.end_unfilled(key, fill, "error")
        raise
    if not node.land(key, fill, stored):
        return False
    node.count("replicas")
    return True
