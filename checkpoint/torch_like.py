"""``save(obj, path)`` / ``load(path)``, shaped like ``torch.save`` / ``torch.load``.

For single-process users and for plug-ins such as Lightning's CheckpointIO, which hand over
one arbitrary nested object and expect it back whole, with no template to load into. The
tensors' storages go through the same planner, writer and reader as the Checkpointer
(chunked, checksummed, optionally lz4, manifest last); the object is pickled as
``torch.save`` pickles it, each storage a reference to one of those, and stored as one
item, so ``load`` gives what ``torch.load`` gives (views, strides, tied tensors, every
type; DCP's own flattening would turn int-keyed dicts into lists), weights-only by default
as ``torch.load`` is.
"""
from __future__ import annotations

import errno
import io
import os
import pickle
import re
import shutil
import socket
import uuid
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.serialization import StorageType, default_restore_location, location_tag

from cachemw.files import exchange
from cachemw.processes import process_alive

from .coordination import unwrap
from .planner import SpreadSavePlanner
from .quiet import single_process_dcp
from .reader import CachemwStorageReader
from .storage_io import as_location
from .writer import MANIFEST_NAME, CachemwStorageWriter, read_manifest

SKELETON_KEY = "__cachemw_skeleton__"  # earlier releases: tensors as placeholder strings
PICKLED_KEY = "__cachemw_pickled__"  # the object pickled with its tensors by reference
PLACEHOLDER = "\x00cachemw-tensor:"


class _StoragePickler(pickle.Pickler):
    """Pickles the object as ``torch.save`` does, every type as pickle rebuilds it (a
    ``Counter``, a ``defaultdict`` with its factory, ``torch.Size``, tensor subclasses and
    attributes, views and strides, Parameters, quantized, sparse and nested tensors), with
    torch's own persistent id for each storage, ``("storage", <storage type>, key,
    location, numel)``: what ``torch.load``'s weights-only unpickler reads. The storages'
    bytes go through DCP (chunked, checksummed) as flat uint8 tensors, one per storage,
    however many tensors view it."""

    def __init__(self, file, storages: dict[str, torch.Tensor]) -> None:
        super().__init__(file, protocol=2)  # torch.save's: what the weights-only one reads
        self.storages = storages
        self._keys: dict[int, str] = {}

    def persistent_id(self, obj):
        if isinstance(obj, torch.storage.TypedStorage):
            untyped = obj._untyped_storage
            storage_type, numel = getattr(torch, obj._pickle_storage_type()), obj._size()
        elif isinstance(obj, torch.UntypedStorage):
            untyped, storage_type, numel = obj, torch.UntypedStorage, obj.nbytes()
        else:
            return None
        key = self._keys.get(untyped._cdata)
        if key is None:
            key = self._keys[untyped._cdata] = f"s{len(self._keys)}"
            self.storages[key] = torch.empty(0, dtype=torch.uint8, device=untyped.device).set_(untyped)
        return ("storage", storage_type, key, location_tag(untyped), numel)


def _storage_loader(storages: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                    map_location: Any):
    """The ``persistent_load`` of both this format's storage ids (``_StoragePickler``) and
    an earlier release's int references to whole tensors (the tensor's number, times 4,
    plus 2 for a Parameter and 1 for ``requires_grad``)."""
    restore = _restore_location(map_location)
    untyped: dict[str, torch.UntypedStorage] = {}
    made: dict[int, torch.Tensor] = {}

    def persistent_load(pid):
        if type(pid) is tuple and len(pid) == 5 and pid[0] == "storage" and pid[2] in storages:
            _, storage_type, key, location, _numel = pid
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            if key not in untyped:
                flat = storages[key]
                if flat.storage_offset() or flat.untyped_storage().nbytes() != flat.numel():
                    flat = flat.clone()
                untyped[key] = restore(flat.untyped_storage(), location)
            return torch.storage.TypedStorage(wrap_storage=untyped[key], dtype=dtype, _internal=True)
        if type(pid) is not int or pid < 0 or f"t{pid // 4}" not in tensors:
            raise pickle.UnpicklingError(f"not a storage or tensor reference of this checkpoint: {pid!r}")
        tensor = made.get(pid)
        if tensor is None:
            tensor = _mapped(tensors[f"t{pid // 4}"], map_location)
            if pid & 2:
                tensor = torch.nn.Parameter(tensor, requires_grad=bool(pid & 1))
            elif pid & 1:
                tensor = tensor.requires_grad_(True)
            made[pid] = tensor
        return tensor

    return persistent_load


def _restore_location(map_location: Any):
    """Where a storage saved at ``location`` goes, as ``torch.load`` places it for each
    form of ``map_location`` (None: where it was saved)."""
    if map_location is None:
        return default_restore_location
    if isinstance(map_location, dict):
        return lambda storage, location: default_restore_location(
            storage, map_location.get(location, location))
    if isinstance(map_location, (str, torch.device)):
        return lambda storage, location: default_restore_location(storage, str(map_location))

    def restore(storage, location):
        moved = map_location(storage, location)
        return default_restore_location(storage, location) if moved is None else moved

    return restore


def _weights_only(weights_only: bool | None) -> bool:
    """``weights_only`` as ``torch.load`` settles it: the argument, True when not given;
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` forces it on, ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` off
    where the argument was not given."""
    truthy = ("1", "y", "yes", "true")
    force_on = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in truthy
    force_off = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in truthy
    if force_on and force_off:
        raise RuntimeError("only one of TORCH_FORCE_WEIGHTS_ONLY_LOAD and "
                           "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD may be set")
    if force_on:
        return True
    if weights_only is None:
        if force_off:
            warnings.warn("Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected, since "
                          "the `weights_only` argument was not explicitly passed to "
                          "cachemw.checkpoint.load, forcing weights_only=False.", UserWarning,
                          stacklevel=3)
        return not force_off
    return bool(weights_only)


class _FullUnpickler(pickle.Unpickler):
    """Every type, as ``torch.load(weights_only=False)`` unpickles it: a storage class
    (``torch.HalfStorage``) named as torch names it (``StorageType``: its dtype, without
    the legacy class's deprecation warning)."""

    def find_class(self, module: str, name: str):
        if "Storage" in name:
            try:
                return StorageType(name)
            except KeyError:
                pass
        return super().find_class(module, name)


def _unpickled(data: bytes, persistent_load, weights_only: bool, url: str, map_location: Any) -> Any:
    """The pickled object, as torch.load unpickles it: with ``weights_only`` through its own
    restricted unpickler (tensors, containers, the types it allows and those given to
    ``torch.serialization.add_safe_globals``, nothing else); ``map_location`` where torch's
    rebuild functions look for it (wrapper subclasses, tensors rebuilt from numpy); and the
    sparse tensors checked as torch.load checks them (under
    ``torch.sparse.check_sparse_tensor_invariants``: an index out of range is an error)."""
    if weights_only:
        from torch import _weights_only_unpickler

        unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(data), encoding="utf-8")
    else:
        unpickler = _FullUnpickler(io.BytesIO(data))
    unpickler.persistent_load = persistent_load
    tls = getattr(torch.serialization, "_serialization_tls", None)
    if tls is not None:
        tls.map_location = map_location
    try:
        obj = unpickler.load()
    except pickle.UnpicklingError as exc:
        torch._utils._sparse_tensors_to_validate.clear()
        if not weights_only:
            raise
        raise pickle.UnpicklingError(
            f"weights-only load of {url} failed (the default, as torch.load's): {exc} -- "
            "if you trust the checkpoint's source, load(..., weights_only=False) loads every "
            "type; or allow the type with torch.serialization.add_safe_globals") from None
    except BaseException:
        torch._utils._sparse_tensors_to_validate.clear()
        raise
    finally:
        if tls is not None:
            tls.map_location = None
    torch._utils._validate_loaded_sparse_tensors()
    return obj


def _join(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """An earlier release's skeleton, its placeholders replaced by the tensors."""
    if isinstance(obj, str) and obj.startswith(PLACEHOLDER):
        return tensors[obj[len(PLACEHOLDER):]]
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _join(v, tensors)
        return obj
    if isinstance(obj, list):
        return [_join(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_join(v, tensors) for v in obj)
    return obj


def save(obj: Any, path: str | os.PathLike, *, compression: str | None = None, thread_count: int = 2) -> None:
    """Write ``obj`` (any picklable object holding tensors) as a checkpoint directory ``path``.

    A new checkpoint, or one replacing a checkpoint directory that holds nothing else, on a
    local filesystem, is written beside ``path`` (a link: beside where it points) and put
    in its place whole (files.exchange): a crash or a kill leaves the old checkpoint or
    the new one. Where the filesystem cannot swap (NFS), the old one is set aside for the
    two renames; a crash between them leaves it beside ``path`` (``<path>.cachemw-old-...``),
    and the next save puts it back first. Anywhere else (an object store, a directory with
    other files in it, a mount point, a parent we cannot write) ``path`` is rewritten in
    place, as no checkpoint (no manifest) until the new one is whole."""
    location = as_location(path)
    final = os.path.realpath(location.path) if location.local else None
    if final is None and location.fs.isfile(location.path):
        _write_over_object(obj, location, compression, thread_count)
        return
    if final is None or not _swappable(final):
        _write(obj, location, compression, thread_count)
        return
    _sweep_beside(final)
    staged = f"{final}.cachemw-new-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _write(obj, as_location(staged), compression, thread_count)
        if not os.path.lexists(final):
            os.rename(staged, final)
            return
        if not exchange(staged, final):
            aside = f"{final}.cachemw-old-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(final, aside)
            os.rename(staged, final)
            staged = aside
    finally:
        _remove(staged)


_HOST = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())
_OURS = re.compile(r"(__\d+_\d+\.distcp|\.metadata|" + re.escape(MANIFEST_NAME) + r"|.*\.tmp)")


def _swappable(final: str) -> bool:
    """Can a new checkpoint be written beside ``final`` and swapped in? Only over nothing,
    over a file (a ``torch.save`` file: replaced, as ``torch.save`` replaces it) or over a
    checkpoint directory holding only its own files, on the same filesystem as its parent
    (not a mount point), in a parent we may write."""
    parent = os.path.dirname(final) or "."
    if not os.access(parent, os.W_OK | os.X_OK):
        return False
    if not os.path.lexists(final):
        return True
    try:
        if os.stat(final).st_dev != os.stat(parent).st_dev:
            return False
        if os.path.isfile(final):
            return True
        if not os.path.isdir(final):
            return False
        names = os.listdir(final)
    except OSError:
        return False
    return MANIFEST_NAME in names and all(_OURS.fullmatch(n) for n in names)


def _sweep_beside(final: str) -> None:
    """Clear up after saves killed before their swap, by gone processes of this host: a
    checkpoint being written beside ``final`` is removed; an old one set aside is put back
    if ``final`` is missing (killed between the two renames), else removed."""
    parent, name = os.path.split(final)
    try:
        entries = sorted(os.listdir(parent or "."))
    except OSError:
        return
    pattern = re.escape(name) + r"\.cachemw-(new|old)-" + re.escape(_HOST) + r"-(\d+)-[0-9a-f]{8}"
    for entry in entries:
        m = re.fullmatch(pattern, entry)
        if not m or process_alive(int(m.group(2))):
            continue
        if m.group(1) == "old" and not os.path.lexists(final):
            os.rename(os.path.join(parent, entry), final)
        else:
            _remove(os.path.join(parent, entry))


def _write_over_object(obj: Any, location, compression: str | None, thread_count: int) -> None:
    """Replace a file of the name on a store that is not local (a torch.save object on S3),
    as torch.save replaces it: where objects and "directories" share names (S3), the new
    checkpoint is written first and the object removed after (until then torch.load of the
    name reads the old object, and load() the new checkpoint); where they cannot, the file
    goes first."""
    try:
        _write(obj, location, compression, thread_count)
    except (FileExistsError, NotADirectoryError):
        location.fs.rm_file(location.path)
        _write(obj, location, compression, thread_count)
        return
    location.fs.rm_file(location.path)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _write(obj: Any, location, compression: str | None, thread_count: int) -> None:
    location.makedirs()
    location.remove_file(MANIFEST_NAME)  # an overwritten checkpoint is uncommitted while it is rewritten
    tensors: dict[str, torch.Tensor] = {}
    pickled = io.BytesIO()
    _StoragePickler(pickled, tensors).dump(obj)
    # Pickled to bytes so that DCP stores it as one opaque item instead of flattening it.
    state = {"tensors": tensors, PICKLED_KEY: pickled.getvalue()}
    writer = CachemwStorageWriter(location, compression=compression, thread_count=thread_count)
    try:
        with single_process_dcp():
            dcp.save(state, storage_writer=writer, planner=SpreadSavePlanner(), no_dist=True)
    except CheckpointException as exc:
        raise unwrap(exc, 1) from None


def load(path: str | os.PathLike, map_location: Any = None, *, thread_count: int = 2,
         weights_only: bool | None = None) -> Any:
    """Read back what ``save`` wrote. ``map_location`` as ``torch.load`` takes it (a device
    or its name, a dict of device names, a callable); ``weights_only`` as ``torch.load``'s:
    by default only tensors, containers and the types torch's weights-only unpickler allows
    come back (``weights_only=False``: every type, for a checkpoint from a trusted source)."""
    # DCP's own "load without a template" (rebuilds the state dict from the metadata).
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    location = as_location(path)
    if location.local and not os.path.lexists(location.path):  # a save killed mid-swap
        _sweep_beside(os.path.realpath(location.path))  # left the old one beside it
    # checked here, so that a missing or damaged manifest is its own clear error (DCP's
    # loader turns any failure to read metadata into an AssertionError)
    if (os.path.isfile(location.path) if location.local
            else location.fs.isfile(location.path) and not location.exists(MANIFEST_NAME)):
        raise NotADirectoryError(errno.ENOTDIR, "a file, not a checkpoint directory written by "
                                 "cachemw.checkpoint.save (a torch.save file: torch.load "
                                 "reads it)", location.url)
    if read_manifest(location) is None:
        raise FileNotFoundError(errno.ENOENT, "not a committed checkpoint (no manifest)",
                                location.url)
    reader = CachemwStorageReader(location, thread_count=thread_count)
    reader.read_metadata()  # a damaged .metadata: ChecksumError here, not DCP's AssertionError
    try:
        with single_process_dcp():
            state = _load_state_dict_from_keys(storage_reader=reader)
    except CheckpointException as exc:
        raise unwrap(exc, 1) from None
    saved = state.get("tensors", {})
    weights_only = _weights_only(weights_only)
    if PICKLED_KEY in state:
        loader = _storage_loader({k: v for k, v in saved.items() if k.startswith("s")},
                                 {k: v for k, v in saved.items() if k.startswith("t")}, map_location)
        return _unpickled(state[PICKLED_KEY], loader, weights_only, location.url, map_location)
    if SKELETON_KEY not in state:
        raise ValueError(f"{location.url} is a checkpoint of a state dict (a Checkpointer step, "
                         "or dcp.save), not one written by cachemw.checkpoint.save: load it in "
                         "place with Checkpointer(root).load(state) or dcp.load")
    unpickler = (_SkeletonUnpickler if weights_only else pickle.Unpickler)(io.BytesIO(state[SKELETON_KEY]))
    return _join(unpickler.load(), {k: _mapped(v, map_location) for k, v in saved.items()})


class _SkeletonUnpickler(pickle.Unpickler):
    """An earlier release's skeleton (pickled at a protocol torch's weights-only unpickler
    does not read), weights-only: the globals that unpickler allows, nothing else."""

    def find_class(self, module: str, name: str):
        from torch import _weights_only_unpickler as allowed

        found = {**allowed._get_allowed_globals(), **allowed._get_user_allowed_globals()}.get(f"{module}.{name}")
        if found is None:
            raise pickle.UnpicklingError(
                f"weights-only load failed: {module}.{name} is not a type torch.load allows by "
                "default; load(..., weights_only=False) loads every type, for a checkpoint from "
                "a trusted source")
        return found


def _mapped(tensor: torch.Tensor, map_location: Any) -> torch.Tensor:
    """``tensor`` where ``map_location`` puts it, as ``torch.load`` reads it: a device (or
    its name), a dict of device names, or a callable ``(storage, location)``."""
    if map_location is None:
        return tensor
    if isinstance(map_location, dict):
        to = map_location.get(str(tensor.device))
        return tensor if to is None else tensor.to(to)
    if callable(map_location):
        storage = tensor.untyped_storage()
        moved = map_location(storage, str(tensor.device))
        if moved is None or moved is storage:
            return tensor
        out = torch.empty(0, dtype=tensor.dtype, device=moved.device)
        return out.set_(moved, tensor.storage_offset(), tensor.size(), tensor.stride())
    return tensor.to(map_location)
