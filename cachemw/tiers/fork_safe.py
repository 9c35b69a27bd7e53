"""A filesystem attribute that a forked child reads through an instance of its own, and
the parent's event loop kept out of a forked child's reach.

An async fsspec filesystem (s3fs, fsspec's HTTP) runs on an event loop of the process that
made it; a forked child (a DataLoader worker given a ``Dataset`` holding a cachemw
filesystem) inherits the object but not the loop, and fsspec refuses it ("not fork-safe").

The child does inherit the loop's epoll instance, which is the parent's: a fork shares it.
When the child drops an instance it inherited (fsspec clears its instance cache in a new
process; a ``ForkSafe`` attribute replaces it), fsspec closes that instance's connections
there, and closing a connection unregisters its socket from the epoll instance: the
parent's. The parent's next request on that keep-alive connection then waits for a reply
its loop is no longer told of, until the request's timeout (fsspec's HTTP default: 5
minutes). Over TLS the close also sends the server a close_notify on the shared socket,
ending the parent's connection. So in a forked child the parent's loop gets a selector of
the child's own (the inherited epoll descriptor closed there, which leaves the parent's
open) and counts as not running and closed: fsspec and aiohttp then leave its connections
alone there.
"""
from __future__ import annotations

import os
import selectors
import sys

import fsspec
from fsspec.spec import make_instance


def for_this_process(fs):
    """``fs``, or where it (or a filesystem it wraps) is an async one made by another
    process, a new instance of it for this one. A wrapper is the child's own copy, so the
    filesystem it wraps is replaced in it."""
    asyn = sys.modules.get("fsspec.asyn")  # not imported: no async filesystem exists
    if asyn is None:
        return fs
    inner = getattr(fs, "fs", None)
    if isinstance(inner, fsspec.AbstractFileSystem) and inner is not fs:
        fresh = for_this_process(inner)
        if fresh is not inner:
            fs.fs = fresh
        return fs  # a wrapper (dir, simplecache) reads through the filesystem it wraps
    if isinstance(fs, asyn.AsyncFileSystem) and getattr(fs, "_pid", os.getpid()) != os.getpid():
        return make_instance(type(fs), fs.storage_args, fs.storage_options)
    return fs


class ForkSafe:
    """An attribute holding a filesystem that a forked child reads through an instance of
    its own where the one made by its parent cannot serve it (``for_this_process``),
    found at its first use in the child: not at the fork, when fsspec may not have
    reset its own event loop for the child yet."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = f"_{name}_of_process"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        fs, pid = obj.__dict__[self.slot]
        if pid != os.getpid():
            fs = for_this_process(fs)
            obj.__dict__[self.slot] = (fs, os.getpid())
        return fs

    def __set__(self, obj, fs) -> None:
        obj.__dict__[self.slot] = (fs, os.getpid())


_parent_loops: list = []  # the event loops of fsspec when this process last forked


def _before_fork() -> None:
    asyn = sys.modules.get("fsspec.asyn")
    loop = None if asyn is None else asyn.loop[0]
    _parent_loops[:] = [] if loop is None else [loop]


def _after_fork_in_parent() -> None:
    _parent_loops.clear()


def _after_fork_in_child() -> None:
    """The parent's loops, detached from what this child shares with the parent."""
    for loop in _parent_loops:
        try:
            inherited = loop._selector
            loop._selector = selectors.DefaultSelector()
            inherited.close()  # this child's descriptor only: the parent's epoll stays whole
            loop._thread_id = None  # its thread is the parent's: not running here
            # and closed: aiohttp then closes none of its connections here (a TLS one's
            # close would send the parent's server a close_notify on the shared socket)
            loop._closed = True
        except Exception:  # noqa: BLE001 - another event loop implementation: left as it is
            pass
    _parent_loops.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)

