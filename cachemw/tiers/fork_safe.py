"""A filesystem attribute that a forked child reads through an instance of its own.

An async fsspec filesystem (s3fs, fsspec's HTTP) runs on an event loop of the process that
made it; a forked child (a DataLoader worker given a ``Dataset`` holding a cachemw
filesystem) inherits the object but not the loop, and fsspec refuses it ("not fork-safe").
"""
from __future__ import annotations

import os
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
