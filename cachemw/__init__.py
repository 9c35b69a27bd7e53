"""cachemw: distributed sample caching and asynchronous checkpointing for DL training.

The cache core (this package, its filesystem and client) imports without torch and without
Ray; Ray is imported only by the daemon's actor wrapper and the CLI.
"""
from __future__ import annotations

import os as _os

__version__ = "0.1.0"

# In a source checkout imported without installing (e.g. `python -c` from the repo root),
# `placement/` and `checkpoint/` stand beside this folder, not inside it; the installed
# distribution maps them in (setuptools package-dir). Make the checkout behave the same.
_here = _os.path.dirname(__file__)
_top = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "placement")) and _os.path.isfile(
    _os.path.join(_top, "placement", "__init__.py")
):
    __path__.append(_top)  # type: ignore[name-defined]  # noqa: F821


def start(**kwargs):
    """Start this node's daemon (see :func:`cachemw.cluster.actor.start`)."""
    from .cluster.actor import start as _start

    return _start(**kwargs)


def stop(**kwargs):
    """Stop the daemons started by :func:`start` (see :func:`cachemw.cluster.actor.stop`)."""
    from .cluster.actor import stop as _stop

    return _stop(**kwargs)
