"""Collectives for background checkpoint work, on a dedicated gloo group, never the training one.

Running a collective on the training process group from a background thread interleaves with
the training loop's own collectives and deadlocks (FIELD-NOTES). Each Checkpointer therefore
creates its own gloo group over the same ranks at construction, in the main thread, where
every rank calls it in the same order; all background collectives of one Checkpointer then run
on one worker thread, in the same order on every rank. Without an initialized process group
everything degrades to a single process (``no_dist``).

A second private group, the *front* group, serves the few collectives ``save`` itself runs in
the calling thread before the snapshot (fast tier: busy vote, step name, plan). It is separate
so that they can never interleave with the worker's collectives of a previous save still
running (e.g. one that is being refused).
"""
from __future__ import annotations

import builtins
import contextlib
import datetime
import os
import sys
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from cachemw.store_errors import client_failure


def check_same_step(step: int, steps: list) -> None:
    """Raise on every rank (they all see the same ``steps``, one per rank) unless every rank
    saves the same step: ranks saving under different steps would each commit a part."""
    if any(s != steps[0] for s in steps):
        by_step: dict = {}
        for rank, s in enumerate(steps):
            by_step.setdefault(s, []).append(rank)
        raise ValueError(f"save of step {step}: the ranks save different steps "
                         f"({'; '.join(f'step {s}: rank(s) {r}' for s, r in by_step.items())}); "
                         "every rank must save the same step")


def report(error: BaseException | None) -> tuple | None:
    """What a rank tells the others about its local failure (None: no failure): the class's
    module and name, the errno of an OSError, and the text, so that every rank can raise the
    same type. A store client's own failure (botocore's: no OSError) is told as the OSError
    it is, so that every rank raises an OSError for it."""
    if error is None:
        return None
    error = client_failure(error) or error
    return (type(error).__module__, type(error).__qualname__, getattr(error, "errno", None),
            f"{type(error).__name__}: {error}")


def same_type(reported: tuple, message: str) -> Exception:
    """``message`` as an exception of the class a rank ``report``-ed, where every rank can rebuild
    it (a built-in, or a cachemw class taking a message); else a ``RuntimeError``. So an
    ``except OSError`` around a save works the same at any world size."""
    module, name, code, _ = reported
    cls = None
    if module == "builtins":
        cls = getattr(builtins, name, None)
    elif module.startswith("cachemw.") and module in sys.modules:
        cls = getattr(sys.modules[module], name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            if issubclass(cls, OSError) and isinstance(code, int):
                return cls(code, message)
            return cls(message)
        except Exception:  # noqa: BLE001 - a constructor that wants more: fall back
            pass
    return RuntimeError(message)


def message_of(error: BaseException) -> str:
    """``error``'s text without what ``same_type`` adds again when it rebuilds it (an
    OSError's errno)."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror if error.filename is None else f"{error.strerror}: {error.filename}"
    return str(error)


def failed_on(ranks: list[int], rank: int, reported: tuple) -> Exception:
    """The one error every rank raises for a failure on ``ranks``, the first of which,
    ``rank``, ``report``-ed ``reported``: its type (``same_type``), naming them all."""
    return same_type(reported, f"checkpoint failed on rank(s) {ranks}; rank {rank}: {reported[3]}")


def _raised_by_a_collective(exc: RuntimeError) -> bool:
    """Whether ``exc`` came from torch.distributed's collectives and stores: a ``DistError``,
    or raised in ``distributed_c10d.py`` itself (gloo's errors, "Connection reset by peer",
    "Timed out waiting ... for recv", are plain RuntimeErrors raised there). Not one raised
    elsewhere inside a collective's block: DCP's own code, staging a tensor (CUDA out of
    memory), the caller's state_dict hooks; those say what happened themselves."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and os.path.basename(tb.tb_frame.f_code.co_filename) == "distributed_c10d.py"


def _private_groups(ranks: list[int], process_group: Any, timeout_s: float) -> tuple[Any, Any]:
    """This rank's private gloo group and front group over ``ranks``, made in the calling thread.

    ``new_group`` is a collective over the default group: every rank of the job calls it, in the
    same order and with the same ranks. Both groups are always made, side by side (the front
    group's *use* is voted later; making it on some paths only could leave ranks waiting in
    it). With a subgroup ``process_group`` (e.g. one Checkpointer per pipeline stage) the
    ranks differ between Checkpointers, so every rank first learns all of them, then makes the
    groups of every distinct subgroup in one order and keeps its own.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if process_group is None or process_group == dist.group.WORLD:
        subgroups = [ranks]
    else:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, list(ranks))
        subgroups = sorted({tuple(r) for r in everyone})
    mine = None
    for members in subgroups:
        pair = tuple(dist.new_group(ranks=list(members), backend="gloo", timeout=timeout) for _ in range(2))
        if list(members) == list(ranks):
            mine = pair
    return mine


class Coordinator:
    """Rank info and small object collectives on a private gloo group."""

    def __init__(self, process_group: Any = None, timeout_s: float = 600.0) -> None:
        if dist.is_available() and dist.is_initialized():
            ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
            self.group, self._front = _private_groups(ranks, process_group, timeout_s)
            self.ranks = ranks
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
            self.no_dist = False
        else:
            self.group, self.rank, self.world_size, self.no_dist = None, 0, 1, True
            self._front = None
        self.front: Any = None
        self.timeout_s = timeout_s

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: Any) -> list[Any]:
        if self.no_dist:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self.collective():
            dist.all_gather_object(out, obj, group=self.group)
        return out

    @contextlib.contextmanager
    def collective(self):
        """A collective of the checkpointer: the backend's error (gloo's "Timed out waiting
        20000ms for recv", "Connection reset by peer") says what happened on the wire; this
        says what it means for the checkpoint. Around DCP's own save and load too: the
        errors it does not gather are its collectives' (a rank gone mid-save)."""
        try:
            yield
        except RuntimeError as exc:  # torch.distributed's errors are RuntimeErrors
            if self.no_dist or not _raised_by_a_collective(exc):  # one process: no other
                raise  # rank to blame; or not the wire's (CUDA out of memory staging a save)
            text = (f"checkpoint: a collective with the other ranks failed (a rank died, or did "
                    f"not reach this save or load within collective_timeout_s, "
                    f"{self.timeout_s:g} s?): {exc}")
            try:  # the same type (DistBackendError, ...), for callers that catch it
                wrapped = type(exc)(text)
            except Exception:  # noqa: BLE001 - a type that takes other arguments
                wrapped = RuntimeError(text)
            raise wrapped from exc

    def enable_front(self, wanted: bool) -> bool:
        """Agree (calling thread, at construction) whether every rank wants the front group; use it if so.

        Used for the fast tier: if some rank has none (no daemon on its node), no rank uses one,
        rather than ranks running different sequences of collectives.
        """
        if self.no_dist:
            return wanted
        if not all(self.all_gather(wanted)):
            return False
        self.front = self._front
        return True

    def front_gather(self, obj: Any) -> list[Any]:
        """``all_gather`` on the front group (from the thread calling ``save``)."""
        if self.no_dist:
            return [obj]
        if self.front is None:
            raise RuntimeError("front collectives need enable_front() first")
        return self._front_gather(obj)

    def destroyed(self) -> bool:
        """The default process group was destroyed under us (``destroy_process_group``
        takes the Checkpointer's groups along)."""
        return not self.no_dist and not dist.is_initialized()

    def busy_ranks(self, busy: bool) -> list[int]:
        """The ranks that refuse a save (their previous one still writing), agreed on from
        the thread calling ``save`` (on the front group, which every rank has: a save
        without a fast tier refused on one rank is refused on every rank)."""
        if self.no_dist:
            return [0] if busy else []
        return [r for r, b in enumerate(self._front_gather(busy)) if b]

    def _front_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        with self.collective():
            dist.all_gather_object(out, obj, group=self._front)
        return out

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every rank."""
        if self.no_dist:
            return obj
        box = [obj]
        with self.collective():
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def agree(self, error: BaseException | None) -> None:
        """Raise on every rank if any rank passes an exception; else return.

        In one process the exception itself is raised. With several ranks every rank raises
        one error naming the failed ranks and the first failure, of that failure's type
        (``same_type``) and chained to the local exception where there is one, so no rank
        goes on alone.
        """
        if self.no_dist:
            if error is not None:
                raise error
            return
        self.raise_if_failed(self.all_gather(report(error)), error)

    def raise_if_failed(self, reports: list[tuple | None], error: BaseException | None) -> None:
        """Raise the same error on every rank if any gathered ``report`` is not None.

        The local exception itself in one process; otherwise one naming the failed ranks and
        the first failure, of its type, chained to the local exception where there is one.
        """
        failed = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
        if not failed:
            return
        if self.no_dist and error is not None:
            raise error
        rank, first = failed[0]
        raise failed_on([r for r, _ in failed], rank, first) from error

    def value_of(self, make: Callable[[], Any]) -> Any:
        """``make()`` run by rank 0, its value on every rank; its failure is every rank's,
        of its type (the others would wait for the value until the collective timeout)."""
        value, error = None, None
        if self.is_coordinator:
            try:
                value = ("ok", make())
            except Exception as exc:  # noqa: BLE001 - any: the other ranks wait for it
                value, error = ("failed", report(exc), message_of(exc)), exc
        value = self.broadcast(value)
        if value[0] == "failed":
            if error is not None:
                raise error
            raise same_type(value[1], value[2])
        return value[1]

    def run_everywhere(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on every rank, then fail every rank if it failed on any."""
        error = None
        try:
            fn()
        except Exception as exc:  # any failure fails every rank: none goes on alone
            error = exc
        self.agree(error)

    def run_on_coordinator(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the coordinator only; its failure fails every rank."""
        self.run_everywhere(fn if self.is_coordinator else (lambda: None))


def unwrap(exc: CheckpointException, world_size: int) -> Exception:
    """DCP's CheckpointException (a BaseException) as one ordinary exception, the same on every rank."""
    failures = exc.failures
    rank = min(failures)
    first = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
    if world_size == 1 and isinstance(first, Exception):
        return first
    return failed_on(sorted(failures), rank, report(first))  # RuntimeError for a BaseException
