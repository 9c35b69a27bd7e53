"""cachemw: distributed sample caching and asynchronous checkpointing for DL training.

The cache core (this package, its filesystem and client) imports without torch and without
Ray; Ray is imported only by the daemon's actor wrapper and the CLI.
"""
from __future__ import annotations

__version__ = "0.1.0"


def start(**kwargs):
    """Start this node's daemon (see :func:`cachemw.cluster.actor.start`)."""
    from .cluster.actor import start as _start

    return _start(**kwargs)


def stop(**kwargs):
    """Stop the daemons started by :func:`start` (see :func:`cachemw.cluster.actor.stop`)."""
    from .cluster.actor import stop as _stop

    return _stop(**kwargs)
