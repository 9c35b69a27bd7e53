"""Loading a checkpoint into a training state: the step chosen (choosing.py) read from the
node's fast tier or from the root, a fast copy that fails under the reader read again, whole,
from the root, and a damaged newest step passed over for the one before it.

Apart from checkpointer.py, which saves: a load shares with the saves only the tiers and the
ranks' group (Coordinator), not the background worker, the stager or the handles, and its
failure rules are its own. The Checkpointer waits for its saves, then loads through a
StepLoader; a step found in memory only goes back to it to be drained (``drain_left``).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .choosing import choose
from .coordination import Coordinator, unwrap
from .errors import CheckpointNotFoundError, ChecksumError
from .layout import CheckpointDir
from .quiet import single_process_dcp
from .reader import CachemwStorageReader
from .state_tree import (OptimizerStateLoadPlanner, apply_loaded, optimizer_paths, prepare_for_load,
                         to_state_dict, unplaced)

log = logging.getLogger("cachemw.checkpoint.checkpointer")  # its name before the move


class StepLoader:
    """Loads the checkpoints under ``root`` and ``fast`` (None: no fast tier) on every rank
    of ``coord`` alike; ``drain_left(step, name)`` is told of a step loaded from the fast
    tier that the root does not have."""

    def __init__(self, root: CheckpointDir, fast: CheckpointDir | None, coord: Coordinator,
                 thread_count: int, drain_left: Callable[[int, str], None]) -> None:
        self.root, self.fast, self.coord = root, fast, coord
        self.thread_count = thread_count
        self._drain_left = drain_left
        self._damaged_metadata: set[str] = set()  # steps passed over for it, said once
        self._said_unplaced: set[tuple] = set()  # (step, entries the state had no place for), said

    def load(self, state: dict, step: int | None = None) -> int:
        """Checkpointer.load (see there), its saves waited for."""
        first = None  # the first step passed over's error: raised if no step before it loads
        passed: set[str] = set()  # steps whose load failed on a damaged or lost file
        while True:
            try:
                chosen = self.coord.value_of(lambda: self._choose(step, passed))
            except CheckpointNotFoundError:
                if first is None:
                    raise
                raise first from None
            try:
                return self._load_chosen(state, *chosen)
            except (ChecksumError, FileNotFoundError) as exc:  # a file of it damaged, or lost
                if step is not None:
                    raise
                first = first or exc
                passed.add(chosen[1])  # every rank is here: the error is every rank's
                log.warning("checkpoint %s could not be loaded (%s): loading the step before it",
                            chosen[1], exc)
            except Exception as exc:  # noqa: BLE001 - the step before a damaged one failed otherwise
                if first is None:  # (a key the state has that it lacks): the damage is the news
                    raise
                log.warning("checkpoint %s, the step before a damaged one, could not be loaded either "
                            "(%s)", chosen[1], exc)
                raise first from exc

    def _choose(self, step: int | None, passed: set[str]) -> tuple[int, str, bool]:
        """(step, directory name, committed at root) of the checkpoint to load, chosen by rank 0."""
        return choose(self.root, self.fast, step, self._damaged_metadata, passed)

    def _load_chosen(self, state: dict, step: int, name: str, at_root: bool) -> int:
        """``load`` of the checkpoint ``_choose`` picked."""
        fast_ok = self.fast is not None and self.fast.complete(name)
        fast_ok = all(self.coord.all_gather(fast_ok))
        tiers = ([self.fast] if fast_ok else []) + ([self.root] if at_root else [])
        if not tiers:
            raise CheckpointNotFoundError(f"checkpoint {name} is not complete in any tier reachable by every rank")
        loaded, error = None, None
        try:  # a state that fails here on one rank (its state_dict() raises) fails every rank
            prepare_for_load(state)
            loaded = to_state_dict(state)
        except Exception as exc:  # noqa: BLE001 - any: the others would wait in dcp.load
            error = exc
        self.coord.agree(error)
        while tiers:
            tier = tiers.pop(0)
            try:
                reader = CachemwStorageReader(tier.location.child(name), thread_count=self.thread_count)
                with single_process_dcp(self.coord.no_dist), self.coord.collective():
                    dcp.load(loaded, storage_reader=reader, process_group=self.coord.group,
                             no_dist=self.coord.no_dist,
                             planner=OptimizerStateLoadPlanner(optimizer_paths(state)))
                self._say_unplaced(name, reader.metadata, loaded)
                break
            except (CheckpointException, OSError, ValueError, AssertionError) as exc:
                # A fast-tier copy may vanish under a reader (the next save recycles it): DCP
                # reports that as an AssertionError in one process; the root copy is intact.
                # DCP fails every rank alike, so every rank is here and takes part in the broadcast.
                error = unwrap(exc, self.coord.world_size) if isinstance(exc, CheckpointException) else exc
                if tier is self.fast and not self._fast_copy_failed(name, error):
                    raise error from None  # the state's fault (a shape that differs): the root's copy is no better
                if tier is self.fast and not at_root:
                    at_root = bool(self.coord.broadcast(self.root.is_committed(name)
                                                        if self.coord.is_coordinator else None))
                    if at_root:
                        tiers.append(self.root)
                if not tiers:
                    raise error from None
                # the failure in one line (its traceback, 50 lines, read as a failed load
                # that then succeeded: review ckpt6), the traceback for debugging
                log.warning("loading %s from %s failed (%s); loading it again from %s", name, tier.location.url,
                            error, tiers[0].location.url)
                log.debug("the failed load of %s from %s", name, tier.location.url, exc_info=True)
        error = None
        try:
            apply_loaded(state, loaded)
        except Exception as exc:  # noqa: BLE001 - any: no rank returns a step the others did not load
            error = exc
        self.coord.agree(error)
        if tier is self.fast and not at_root:
            self._drain_left(step, name)
        return step

    def _say_unplaced(self, name: str, metadata: Any, loaded: dict) -> None:
        """Warn (once per step and set of entries) of saved entries the state has no place
        for: a load is in place, so a dict saved full and loaded into an empty one stays
        empty; that should not pass in silence."""
        ranks = getattr(self.coord, "ranks", [0])  # global ranks, as users name them
        missing = unplaced(metadata, loaded, frozenset(ranks) - {ranks[self.coord.rank]})
        if missing and (name, missing) not in self._said_unplaced:
            self._said_unplaced.add((name, missing))
            log.warning("checkpoint %s holds %d entries the state given to load has no place for, "
                        "not loaded: %s%s (a load is in place: give the state the keys it was "
                        "saved with)", name, len(missing), ", ".join(missing[:5]),
                        ", ..." if len(missing) > 5 else "")

    def _fast_copy_failed(self, name: str, error: BaseException) -> bool:
        """True on every rank if the fast tier's copy of ``name`` failed the load on some rank:
        a read error there (a damaged or vanished file: DCP's AssertionError in one process),
        or the copy is no longer complete (recycled by the next save). Not a ValueError of a
        copy still whole, e.g. a tensor whose shape differs from the saved one."""
        failed = isinstance(error, (OSError, AssertionError)) or not self.fast.complete(name)
        return any(self.coord.all_gather(failed))
