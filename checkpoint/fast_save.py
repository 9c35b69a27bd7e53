"""The snapshot of a save with a fast tier: straight into the new step's files, own share only.

Without a fast tier a save stages the whole state into reusable buffers (``BufferStager``) and
the writer serializes from there. With one, that would hold three copies of the state in host
memory at the peak (buffers, the new in-memory checkpoint, the previous one). Here instead:

1. Every rank builds the DCP local plan from *placeholders* (meta tensors of the same shapes
   for what DCP saves as tensors; copies of the plain values, and of what DCP pickles whole,
   tuples with their tensors) and the ranks agree, on the Coordinator's front group from the
   calling thread, on busy/refuse, on the step directory's name and on the global plan, which
   is deterministic (``SpreadSavePlanner``), so it is computed once and reused while no rank's
   local plan changes.
2. The previous in-memory copy of this rank's files leaves the fast tier's committed set
   (manifest removed first) before a byte of it is overwritten; it is already committed at the
   root, since a save starts only once the previous one is durable there. If it is not (its
   drain failed), it is kept and fresh files are written instead.
3. Each rank copies only the chunks the plan gives it, into its mapped pool files
   (``FilePool``), hard-linked into the new step directory. That copy is the whole stall.

The background writer then frames the chunks in place and checksums them, and the files drain
to the root as before. States this path does not cover (compression, non-CPU or non-plain
tensors, ``fast_keep_last > 1``, a non-local fast tier) use the buffer stager; so does a rank
whose in-place snapshot fails locally (e.g. a full tmpfs), removing only its own links from the
step directory (a node's ranks share it). Any other local failure fails the save on every rank
alike (one vote at the end of ``prepare``), so the ranks never run different collectives.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import os
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from .coordination import Coordinator, check_same_step, report
from .errors import CheckpointBusyError
from .file_pool import FilePool, blob_reserve
from .layout import CheckpointDir, step_dir_name
from .planner import SpreadSavePlanner, item_key, item_nbytes
from .reader import narrow_box
from .slot_layout import SlotRequest, SnapshotLayout, plan_layout
from .stager import is_plain_tuple, same_sequence

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FastSnapshot:
    """What ``save`` hands to the background worker: the agreed name, the staged dict, the pool if used."""

    name: str
    staged: dict
    pool: FilePool | None


@dataclasses.dataclass
class Described:
    """One walk over the state: the staged dict for DCP, a structural signature, the path to use."""

    staged: Any
    signature: list
    in_place_capable: bool = True


def describe(obj: Any, path: tuple = (), out: Described | None = None, *, in_leaf: bool = False) -> Described:
    """Placeholders for DCP and the state's signature, in one walk.

    Every tensor DCP saves as a tensor item (under dicts and lists, as DCP traverses them)
    becomes a meta tensor of the same shape and dtype: DCP plans from these exactly as from
    snapshot buffers (same sizes, dtypes and properties: not pinned, no grad) without holding
    data; the in-place copy fills its chunks. What DCP pickles whole instead (``in_leaf``: a
    tuple or namedtuple, and everything in it) is snapshotted here, as the buffer stager does
    (tensors copied, other values deep-copied, a namedtuple kept one): its pickle is written
    from this copy, so a placeholder there would be saved as a meta tensor. Other values are
    deep-copied, as the buffer stager does, since they are pickled later in the background.
    The signature records every key, length, tensor shape/dtype and leaf type: a superset of
    what DCP's plan depends on (not the values), so an unchanged signature means an
    unchanged plan and the planning is skipped. ``in_place_capable`` is false if a tensor is
    not a plain (or Parameter) CPU tensor.
    """
    top = out is None
    out = out or Described(None, [])
    if isinstance(obj, dict):
        out.signature.append((path, "dict", tuple(str(k) for k in obj)))
        staged: Any = {k: describe(v, path + (str(k),), out, in_leaf=in_leaf).staged for k, v in obj.items()}
    elif isinstance(obj, list) or is_plain_tuple(obj):
        out.signature.append((path, type(obj).__name__, len(obj)))
        leaf = in_leaf or isinstance(obj, tuple)  # DCP pickles a tuple whole
        staged = same_sequence(obj, [describe(v, path + (i,), out, in_leaf=leaf).staged for i, v in enumerate(obj)])
    elif isinstance(obj, torch.Tensor):
        plain = type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu"
        out.in_place_capable &= plain
        out.signature.append((path, str(obj.dtype), tuple(obj.shape), type(obj).__name__, obj.device.type))
        if in_leaf and plain:  # pickled from this copy: the data itself (a plain tensor, as a staging buffer is)
            staged = torch.empty(obj.shape, dtype=obj.dtype).copy_(obj.detach())
        elif in_leaf:  # (a DTensor, a GPU tensor: the state goes through buffers, never this copy)
            staged = torch.empty(obj.shape, dtype=obj.dtype, device="meta")
        else:
            staged = torch.empty(obj.shape, dtype=obj.dtype, device="meta")
    else:
        out.signature.append((path, type(obj).__name__))
        staged = copy.deepcopy(obj)
    if top:
        out.staged = staged
        return out
    return Described(staged, out.signature)


def slot_requests(items) -> list[SlotRequest]:
    out = []
    for item in items:
        td = item.tensor_data
        if td is None or item_nbytes(item) == 0:
            continue
        out.append(SlotRequest(item_key(item.index), item.index.fqn, tuple(int(o) for o in td.chunk.offsets),
                               tuple(int(s) for s in td.chunk.sizes), str(td.properties.dtype), item_nbytes(item)))
    return out


class FastSaver:
    """The fast-tier half of ``Checkpointer.save`` (one per Checkpointer)."""

    def __init__(self, fast: CheckpointDir, root: CheckpointDir, coord: Coordinator, *, chunk_bytes: int,
                 thread_count: int, in_place: bool) -> None:
        self.fast, self.root, self.coord = fast, root, coord
        self.chunk_bytes, self.thread_count = chunk_bytes, thread_count
        self.in_place = in_place and fast.location.local
        self.pool = FilePool(fast.location.path, coord.rank)
        self._digests: tuple | None = None
        self._layout: SnapshotLayout | None = None

    def prepare(self, step: int, get_state_dict, busy: bool, stage_buffers) -> FastSnapshot:
        """Agree with the other ranks, then snapshot; ``stage_buffers(sd)`` is the fallback stager.

        ``get_state_dict()`` gives the state dict (a user's ``state_dict()`` runs there, and may fail).

        Any local step may fail on one rank only (a value that cannot be copied, a full tmpfs,
        out of memory), while the front collectives must run in the same order on every rank.
        So a failure of ``describe`` or of local planning travels inside the gather that follows
        it, and the local rest ends with one vote: every rank submits the save, or every rank
        raises the same error (and drops what it made of this step).
        """
        state_dict, described, votes = self._vote(get_state_dict, busy, uuid.uuid4().hex, step)
        check_same_step(step, [v[4] for v in votes])
        busy_ranks = [r for r, v in enumerate(votes) if v[0]]
        if busy_ranks:
            raise CheckpointBusyError(f"save of step {step} refused: the previous save is still writing on "
                                      f"rank(s) {busy_ranks}")
        name = step_dir_name(step, votes[0][1])
        digests = tuple(v[2] for v in votes)
        plan = self._plan(described, digests)

        def failed() -> None:  # every rank is past its local work: removing the step directory
            self.fast.remove(name)  # now takes nobody's files

        return self._locally(plan, digests, failed,
                             lambda: self._local_snapshot(name, state_dict, described, stage_buffers))

    def reserve(self, get_state_dict) -> bool:
        """Plan this state's layout and make (and fault in) this rank's pool files now, so that
        the first save of a state of this shape stalls for its copy only, not for planning
        and for the first touch of its memory (~6 us a page on a VM: 0.1 s for 64 MiB).
        Collective, like ``prepare`` (the same gathers, a failure raised on every rank); the
        caller has no save pending. True if the pool is ready; False where saves of this state
        go through buffers (the caller reserves those)."""
        state_dict, described, votes = self._vote(get_state_dict, False, "", None)
        digests = tuple(v[2] for v in votes)
        plan = self._plan(described, digests)

        def make_pool() -> bool:
            if not (self.in_place and described.in_place_capable):
                return False
            self.pool.ensure(self._layout)
            return True

        del state_dict  # only its description is needed
        return self._locally(plan, digests, self.pool.release, make_pool)

    def _vote(self, get_state_dict, busy: bool, name_part: str, step: int | None) -> tuple:
        """The state, its description and every rank's (busy, name part, digest, failure,
        step): the first gather, raised on every rank if any rank failed to describe its
        state."""
        digest, error, state_dict, described = None, None, None, None
        try:
            state_dict = get_state_dict()
            described = describe(state_dict)
            digest = hashlib.blake2b(repr(described.signature).encode(), digest_size=16).hexdigest()
        except Exception as exc:  # any failure travels in the vote: every rank raises it
            error = exc
        votes = self.coord.front_gather((busy, name_part, digest, report(error), step))
        self.coord.raise_if_failed([v[3] for v in votes], error)
        return state_dict, described, votes

    def _plan(self, described: Described, digests: tuple):
        """(planner, every rank's local plan) if some rank's state changed shape (every rank
        plans again: a gather), else None: the layout stands."""
        if digests == self._digests:
            return None
        self._digests, local, error = None, None, None  # until the new layout stands
        try:
            planner = SpreadSavePlanner(chunk_bytes=self.chunk_bytes)
            planner.set_up_planner(described.staged, None, self.coord.is_coordinator)
            local = planner.create_local_plan()
        except Exception as exc:  # any failure travels in the vote: every rank raises it
            error = exc
        plans = self.coord.front_gather((local, report(error)))
        self.coord.raise_if_failed([p[1] for p in plans], error)
        return planner, [p[0] for p in plans]

    def _locally(self, plan, digests: tuple, failed, work):
        """This rank's layout (if planned anew), then ``work()``; one vote ends it: its result
        on every rank, or ``failed()`` and the same error raised on every rank."""
        result, error = None, None
        try:
            if plan is not None:
                planner, local_plans = plan
                global_plans, _ = planner.create_global_plan(local_plans)
                mine = slot_requests(global_plans[self.coord.rank].items)
                reserves = {(r.dtype, len(r.sizes)): blob_reserve(r.dtype, len(r.sizes)) for r in mine}
                self._layout = plan_layout(f"__{self.coord.rank}_", mine, reserves, self.thread_count)
                self._digests = digests
            result = work()
        except Exception as exc:  # any failure travels in the vote: every rank raises it
            error = exc
        reports = self.coord.front_gather(report(error))
        if any(r is not None for r in reports):
            result = None  # staged buffers stay with the stager for reuse
            self._digests = None  # every rank plans again next time, so their collectives match
            failed()
            self.coord.raise_if_failed(reports, error)
        return result

    def _local_snapshot(self, name: str, state_dict: dict, described: Described, stage_buffers) -> FastSnapshot:
        """In place if this state and tier allow it, else (or if that fails here) into buffers."""
        if self.in_place and described.in_place_capable:
            try:
                self._snapshot(name, state_dict)
                return FastSnapshot(name, described.staged, self.pool)
            except Exception as exc:  # any failure here costs only the in-place copy
                log.warning("in-place snapshot into %s failed (%s); staging into buffers instead",
                            self.fast.location.url, exc)
                self._unlink_own(name)  # the directory is shared with the other ranks of this node
        # No pool mapped while saves go through buffers: it would be a third copy of the state.
        self.pool.release()
        return FastSnapshot(name, stage_buffers(state_dict), None)

    def _unlink_own(self, name: str) -> None:
        """Remove this rank's links from the step directory (only its own files: the tier may be shared)."""
        step_dir = self.fast.location.join(name)
        for f in self.pool.layout.files if self.pool.layout else ():
            try:
                os.unlink(os.path.join(step_dir, f.rel))
            except FileNotFoundError:
                pass

    def _snapshot(self, name: str, state_dict: dict) -> None:
        self._evict_previous()
        self.pool.ensure(self._layout)
        self.fast.begin(name, reuse_spare=False)
        self.pool.link_into(self.fast.location.join(name))
        flat, _ = flatten_state_dict(state_dict)
        for f in self._layout.files:
            for slot in f.slots:
                req = slot.request
                src = flat[req.fqn].detach()
                self.pool.view(f, slot).copy_(narrow_box(src, req.offsets, req.sizes))

    def _evict_previous(self) -> None:
        """Take the pool's previous step out of the fast tier's committed set before overwriting it."""
        linked = self.pool.linked
        if linked is None:
            return
        if self.fast.is_committed(linked) and not self.root.is_committed(linked):
            # Committed in memory only (its drain failed): it may be the newest checkpoint, keep it.
            log.warning("fast-tier checkpoint %s is not committed at the root; keeping it, writing fresh files", linked)
            self.pool.release()
            return
        self.fast.remove(linked)  # manifest first: never readable while being overwritten
        self.fast.location.sync_dir()  # on a persistent fast tier, not resurrected by a crash either
        self.pool.linked = None

    def close(self) -> None:
        self.pool.release()

