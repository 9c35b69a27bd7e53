"""What a ``cachemw`` URL names on the target, and which options given to a ``cachemw``
hop are its own.

Kept apart from the filesystem because two parties shape these strings: fsspec's URL
chaining (``cachemw::s3://b/k``: the path comes from the last hop, the options per
protocol) and HF datasets, which splits URLs on ``::`` itself, re-appends the hops it split
off to whatever glob returned, rewrites ``x:///abs`` as ``x://abs`` and hands flat
``storage_options`` to every hop.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Mapping

import fsspec
import fsspec.core
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

try:  # fsspec >= 2025.x: the marker of filesystems layered over another one
    from fsspec.implementations.chained import ChainedFileSystem as _Layered
except ImportError:  # pragma: no cover - older fsspec: none told apart
    _Layered = ()

# Options of fsspec's own base class, passed through; anything else unknown is an error.
FSSPEC_BASE_OPTIONS = {"use_listings_cache", "listings_expiry_time", "max_paths",
                       "asynchronous", "loop"}
# Arguments of a file's open that callers hand to the filesystem as options, which every
# fsspec filesystem takes and ignores there: HF datasets' streaming ``xopen`` passes the
# open's keywords (a text file's ``encoding``, ``errors``) as storage options.
OPEN_ARGUMENTS = {"encoding", "errors", "newline"}
# aiohttp session options that HF datasets' compression hop (``gzip::``, ...) gives its
# target as ``client_kwargs``, whatever the target is: an HTTP target takes them, and
# over any other there is no HTTP client for them to set.
HF_SESSION_OPTIONS = {"trust_env", "requote_redirect_url"}


class TargetPaths:
    """What a string names on the target ``fs``, as the target's own path.

    - ``cachemw::<url>``: the target's path of ``<url>``, whose protocol must be the
      target's (a ``file://`` URL handed to a filesystem over S3 is an error, not a read of
      some other object);
    - ``cachemw://<rest>``: what ``<protocol>://<rest>`` names on the target
      (``cachemw://bucket/key`` over S3). Over a local target the path is absolute, always:
      ``cachemw:///data/x`` and ``cachemw://data/x`` (what HF datasets makes of the first)
      are both ``/data/x``, wherever the working directory is;
    - anything else: the target's path for it (a bare relative local path is relative to
      the working directory, as for fsspec's local filesystem); a URL of a store fsspec
      knows that the target does not read (nor a filesystem it wraps), as with
      ``cachemw::``, is an error.
    """

    def __init__(self, fs: AbstractFileSystem) -> None:
        self.fs = fs
        self.protocols = _protocols(fs)
        self.local = isinstance(fs, LocalFileSystem)
        self._own = own_protocols(fs)
        self.plain = plain_local(fs)  # absolute paths are their own target paths

    def relative(self, path: str) -> bool:
        """Whether what ``path`` names depends on the working directory (a relative local
        path, or a ``file://`` URL of one): such a resolution must not be remembered."""
        if not self.local or path.startswith("cachemw://"):
            return False
        for prefix in ("cachemw::", "file://", "local://"):
            if path.startswith(prefix):
                path = path[len(prefix):]
        return not path.startswith("/")

    def __call__(self, path: str) -> str:
        fs = self.fs
        if path.startswith("cachemw::"):
            url = path[len("cachemw::"):]
            self._check_store(path, url)
            return fs._strip_protocol(url)
        if path.startswith("cachemw://"):
            return url_path_on(fs, path[len("cachemw://"):])
        self._check_store(path, path)
        return fs._strip_protocol(path)

    def _check_store(self, path: str, url: str) -> None:
        """A URL of another store than the target is an error, not a read of some other
        object: the target would take ``gcs://b/k`` for a key of its own, or fail in its
        own words (botocore: 'Invalid bucket name "gcs:"')."""
        protocol, sep, _ = url.partition("://")
        if (sep and protocol.isalnum() and protocol.lower() not in self._own
                and protocol.lower() in fsspec.available_protocols()):
            raise ValueError(f"{path!r}: {protocol}:// is another store than this cachemw "
                             f"filesystem's ({self.protocols[0]}://); open it with "
                             f"fsspec.open('cachemw::{url}') or give "
                             f"target_protocol={protocol!r}")


# fsspec's parser of (chained) URLs, the caller whose hops say what store a URL names
_UN_CHAIN = getattr(getattr(fsspec.core, "_un_chain", None), "__code__", None)


def url_path(url: str, caller) -> str:
    """What the ``cachemw://<rest>`` URL ``url`` names on its target, as the target's path,
    where the filesystem's class is asked before a filesystem exists: fsspec's
    ``url_to_fs`` (pandas, pyarrow, HF datasets) returns that answer as the path, then
    hands it to the filesystem, and pyarrow takes it for the base of what ``find``
    returns, which are target paths: ``cachemw:///data/dir`` must be ``/data/dir``.

    The target is the one ``url_to_fs`` is about to build from the same URL: the hop's own
    ``fs`` or ``target_protocol``, else the next hop's protocol
    (``cachemw://bucket/key::s3://...``), else the local filesystem (a ``cachemw://`` URL
    alone). The class knows neither, so they are read from ``caller``, the frame that asks:
    fsspec's ``_un_chain``, which has parsed them (``kw``: this hop's options; ``out``:
    the hops after it, the next one last). Asked from anywhere else, or where a target's
    paths are its instance's to say (a filesystem over another one: ``simplecache``,
    ``dir``), the URL stays whole, as it was: the filesystem, once built, resolves it the
    same way (TargetPaths), which ``url_path_on`` shares."""
    if caller is None or caller.f_code is not _UN_CHAIN:
        return url
    try:
        options = caller.f_locals.get("kw")
        later = caller.f_locals.get("out")
    except Exception:  # pragma: no cover - a frame without readable locals
        return url
    if not isinstance(options, dict) or not isinstance(later, list):
        return url  # an fsspec that parses otherwise: the instance resolves it
    rest = url[len("cachemw://"):]
    fs = options.get("fs")
    if isinstance(fs, AbstractFileSystem):
        try:
            return TargetPaths(fs)(url)
        except ValueError:
            return url
    protocol = options.get("target_protocol")
    if protocol is None and later:
        hop = later[-1]
        protocol = hop[1] if isinstance(hop, tuple) and len(hop) == 3 else None
        if not isinstance(protocol, str):
            return url
    try:
        cls = fsspec.get_filesystem_class(protocol or "file")
    except (ValueError, ImportError):
        return url  # the filesystem's creation says what is wrong
    if issubclass(cls, _Layered):
        return url
    return url_path_on(cls, rest)


def url_path_on(fs, rest: str) -> str:
    """What ``cachemw://<rest>`` names on the target ``fs`` (a filesystem, or its class,
    whose paths do not depend on the instance): ``<protocol>://<rest>`` as its path, or on a
    local filesystem the absolute path ``/<rest>`` (``cachemw:///data/x`` and
    ``cachemw://data/x``, what HF datasets makes of the first, are both ``/data/x``)."""
    if isinstance(fs, LocalFileSystem) or (isinstance(fs, type) and issubclass(fs, LocalFileSystem)):
        return fs._strip_protocol("/" + rest.lstrip("/"))
    return fs._strip_protocol(f"{_protocols(fs)[0]}://{rest}")


def _protocols(fs: AbstractFileSystem) -> tuple:
    """``fs``'s protocols (fsspec gives one as a str, several as a tuple)."""
    return tuple(fs.protocol) if isinstance(fs.protocol, (list, tuple)) else (fs.protocol,)


def own_protocols(fs: AbstractFileSystem) -> set:
    """The protocols whose URLs ``fs`` takes for its own paths: its own, those of the
    filesystems it wraps (``simplecache::s3://``, a DirFileSystem: ``fs.fs``), and for a
    local filesystem (a subclass's too) ``file`` and ``local``."""
    out: set = set()
    seen = set()
    while isinstance(fs, AbstractFileSystem) and id(fs) not in seen:
        seen.add(id(fs))
        out.update(p.lower() for p in _protocols(fs))
        if isinstance(fs, LocalFileSystem):
            out.update(("file", "local"))
        fs = getattr(fs, "fs", None)
    return out


def plain_local(fs: AbstractFileSystem) -> bool:
    """Whether ``fs`` takes paths as fsspec's local filesystem does on POSIX, where an
    absolute path without a trailing slash is its own path (``_strip_protocol`` returns it
    as it is) and its URL is ``<protocol>://`` + the path. A fresh DataLoader worker reads
    every file once: fsspec's two calls for it cost ~10 us of a 4 KiB read's ~50."""
    cls = type(fs)
    return (os.sep == "/" and isinstance(fs, LocalFileSystem)
            and getattr(cls._strip_protocol, "__func__", None)
            is LocalFileSystem._strip_protocol.__func__
            and cls.unstrip_protocol is LocalFileSystem.unstrip_protocol)


# Options that say which store a filesystem reads where its URLs do not: an S3-compatible
# store's endpoint, an account, a host. Two stores whose paths look the same
# (``s3://bucket/key`` of two endpoints) must not share cached blocks or metadata.
_STORE_OPTIONS = ("endpoint_url", "endpoint", "account_name", "host", "port")
# botocore's own variables for the endpoint, when no option names one
_S3_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def store_of(fs: AbstractFileSystem) -> str:
    """What names the store ``fs`` reads beyond its URLs ('' where the URLs say it all: a
    local filesystem, HTTP, AWS's own S3), for this filesystem and each it wraps."""
    found, seen = [], set()
    while isinstance(fs, AbstractFileSystem) and id(fs) not in seen:
        seen.add(id(fs))
        options = getattr(fs, "storage_options", None) or {}
        client = options.get("client_kwargs") or {}
        for name in _STORE_OPTIONS:
            value = options.get(name)
            if value is None and isinstance(client, dict):
                value = client.get(name)
            if value not in (None, ""):
                found.append(f"{name}={value}")
        if not any(f.startswith("endpoint") for f in found):
            endpoint = env_endpoint(fs)
            if endpoint:
                found.append(f"endpoint_url={endpoint}")
        fs = getattr(fs, "fs", None)
    return ",".join(found)


def env_endpoint(fs: AbstractFileSystem) -> str | None:
    """The S3 endpoint this process's environment gives ``fs`` (botocore's variables), where
    ``fs`` is an S3 filesystem whose options name none: another process (a daemon started
    with another environment) needs it written into the options to read the same store."""
    if "s3" not in _protocols(fs):
        return None
    options = getattr(fs, "storage_options", None) or {}
    client = options.get("client_kwargs") or {}
    if options.get("endpoint_url") or (isinstance(client, dict) and client.get("endpoint_url")):
        return None
    return next((os.environ[v] for v in _S3_ENDPOINT_ENV if os.environ.get(v)), None)


def target_url(fs: AbstractFileSystem) -> Callable[[str], str]:
    """The URL that names a path's file in the cache: its blocks' keys and its metadata.

    ``fs.unstrip_protocol``, except that a directory filesystem (fsspec's ``dir``) names
    the file of the filesystem under it (``dir://x`` of two roots are two files), and a
    store that its URLs do not name (``store_of``) is written into the scheme
    (``s3[endpoint_url=http://host:9000]://bucket/key``: no URL has ``[`` before its
    ``://``), so that two stores with the same paths never share what is cached."""
    # fsspec's dir module (and fsspec.asyn, which it imports: ~1 ms a DataLoader worker) is
    # not imported here: where it was never imported, no filesystem is one of its
    dirfs = sys.modules.get("fsspec.implementations.dirfs")
    if dirfs is not None and isinstance(fs, dirfs.DirFileSystem) and isinstance(fs.fs, AbstractFileSystem):
        inner = target_url(fs.fs)
        return lambda path: inner(fs._join(path))
    base = _unstrip(fs)
    store = store_of(fs)
    if not store:
        return base

    def url(path: str) -> str:
        scheme, sep, rest = base(path).partition("://")
        return f"{scheme}[{store}]://{rest}" if sep else f"[{store}]{scheme}"

    return url


def _unstrip(fs: AbstractFileSystem) -> Callable[[str], str]:
    """``fs.unstrip_protocol``, made without its calls for the paths of plain_local: its
    answer for one such path gives the prefix (fsspec before 2026.4 wrote ``file://`` for
    every local filesystem, later ones the filesystem's own protocol)."""
    unstrip = fs.unstrip_protocol
    if not plain_local(fs):
        return unstrip
    probe = unstrip("/x")
    if not probe.endswith("/x"):
        return unstrip
    scheme = probe[:-2]

    def url(path: str) -> str:
        if path[:1] == "/" and path[-1:] != "/":
            return scheme + path
        return unstrip(path)

    return url


def protocols_of(protocol: str) -> tuple:
    """Every name of ``protocol``'s filesystem (file and local, s3 and s3a, gs and gcs):
    options under any of them are the target's own (own_options; diffrev-9)."""
    try:
        names = fsspec.get_filesystem_class(protocol).protocol
    except (ImportError, ValueError):  # said where the target is made
        return (protocol,)
    return (names,) if isinstance(names, str) else tuple(names) + (protocol,)


def own_options(kwargs: dict, target_options: dict, target_protocols=()) -> dict:
    """The options of fsspec's base class among ``kwargs``; unknown ones are a ValueError,
    except a file's open arguments (``OPEN_ARGUMENTS``, ignored), another filesystem's
    options (``{protocol: {...}}`` for a protocol the target is not: fsspec hands those a
    chain has no hop for to its first one, and simplecache ignores them too: one
    ``storage_options`` for ``cachemw::s3://`` and ``cachemw:///`` URLs alike, review
    api7) and copies of the target's options: HF datasets hands its flat
    ``storage_options`` to every hop of a chained URL, so the cachemw hop gets the target's
    options too, as themselves or as ``{protocol: {...}}`` under the protocol datasets takes
    a ``cachemw::`` hop for (``file``)."""
    unknown = []
    for name, value in kwargs.items():
        if name in FSSPEC_BASE_OPTIONS or name in OPEN_ARGUMENTS:
            continue
        if name in target_options and target_options[name] == value:
            continue
        if (isinstance(value, dict) and name not in target_protocols
                and name in fsspec.available_protocols() and name != "cachemw"):
            continue
        if (name in fsspec.available_protocols() and isinstance(value, dict)
                and all(k in target_options and target_options[k] == v
                        for k, v in value.items())):
            continue
        unknown.append(name)
    if unknown:
        raise ValueError(f"unknown cachemw option(s): {', '.join(sorted(unknown))}")
    return {k: v for k, v in kwargs.items() if k in FSSPEC_BASE_OPTIONS}


def with_client_kwargs(target_protocol: str | None, target_options: dict,
                       client_kwargs: object) -> dict:
    """The target's options with ``client_kwargs`` given to the cachemw hop: an HTTP
    target's client takes them (under its own, which win); over any other target only
    the aiohttp options HF datasets' compression hop adds are dropped (there is no HTTP
    client to set), and the rest must be empty or a copy of the target's own (HF datasets'
    flat storage options, which its compression hop merges those two into: see
    own_options); anything else there is the unknown option it was."""
    if client_kwargs is None or client_kwargs == target_options.get("client_kwargs"):
        return target_options
    if not isinstance(client_kwargs, Mapping):
        raise ValueError(f"client_kwargs: must be a dict of options, got {client_kwargs!r}")
    if target_protocol in ("http", "https"):
        mine = target_options.get("client_kwargs") or {}
        return {**target_options, "client_kwargs": {**client_kwargs, **mine}}
    rest = {k: v for k, v in client_kwargs.items() if k not in HF_SESSION_OPTIONS}
    if not rest or rest == target_options.get("client_kwargs"):
        return target_options
    raise ValueError("unknown cachemw option(s): client_kwargs (the target's client options "
                     "go in target_options)")
