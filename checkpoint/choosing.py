"""Which step a Checkpointer loads: the newest one committed at the root, or in the fast
tier (a node daemon's DRAM) while that copy still counts.

A fast-tier copy is of the root that made it: the fast tier keeps the root's id
(layout.ROOT_ID_NAME), and when a Checkpointer of a root finds another id there (the root
was removed and made again, to start afresh: the fast tier, the node daemon's, outlives the
root's files), the copies are another root's and are removed, never loaded. A copy of this
root counts whether or not its step is at the root yet (its drain under way, or failed:
``handle.in_memory`` promises it loadable on its node), unless the root holds that step
with a damaged manifest: then the step is passed over, as it is without a fast tier, so
that every node, with the copy in its memory or not, loads the same step.
"""
from __future__ import annotations

import logging

from .errors import CheckpointNotFoundError
from .layout import ROOT_ID_NAME, CheckpointDir, Entry
from .reader import metadata_damage

log = logging.getLogger(__name__)


def counted_entries(root: CheckpointDir, fast: CheckpointDir | None) -> tuple[list[Entry], list[Entry]]:
    """(the steps committed at the root, the fast tier's copies that count)."""
    at_root = root.committed()
    if fast is None:
        return at_root, []
    committed = {e.name for e in at_root}
    copies = [e for e in fast.committed()
              if e.name in committed or not root.is_committed(e.name)]  # else: damaged there
    return at_root, copies


def adopt_root(fast: CheckpointDir, root_id: str, root_url: str) -> None:
    """Make ``fast`` the fast tier of the root whose id is ``root_id``: copies it holds of
    a root of another id are removed first (best effort: the node's other ranks may be
    removing them too)."""
    held = fast.held_root_id()
    if held == root_id:
        return
    if held is not None:
        removed = []
        for _, name in fast.step_dirs():
            try:
                fast.remove(name)
                removed.append(name)
            except OSError as exc:
                log.debug("could not remove %s from %s: %s", name, fast.location.url, exc)
        if removed:
            log.info("removed %s from the fast tier %s: copies of an earlier root at %s, "
                     "removed and made again since", removed, fast.location.url, root_url)
    fast.location.write_atomic(ROOT_ID_NAME, root_id.encode())


def choose(root: CheckpointDir, fast: CheckpointDir | None, step: int | None,
           said: set[str], passed: set[str] = frozenset()) -> tuple[int, str, bool]:
    """(step, directory name, committed at root) of the checkpoint to load: the newest one
    (or ``step``'s) complete in a tier that counts. A fast-tier copy whose files are gone (a
    shared tier cleaned by a failed save, a lost node) is skipped, not chosen and found
    unloadable. A damaged ``.metadata`` is passed over with a warning (once per directory,
    kept in ``said``), as a damaged manifest is; asked for by its step, either is a
    ChecksumError. Not the newest: the steps in ``passed`` (their load failed on a
    damaged or lost file)."""
    at_root, copies = counted_entries(root, fast)
    committed = {e.name for e in at_root}
    for e in sorted(at_root + copies, key=lambda e: (e.step, e.created), reverse=True):
        if (step is not None and e.step != step) or (step is None and e.name in passed):
            continue
        if e.name in committed:
            tier, in_root = root, True
        elif fast is not None and fast.complete(e.name):
            tier, in_root = fast, False
        else:
            continue
        damage = metadata_damage(tier.location.child(e.name))
        if damage is None:
            return e.step, e.name, in_root
        if step is not None:
            raise damage
        if e.name not in said:
            said.add(e.name)
            log.warning("checkpoint %s is damaged (%s): loading the step before it", e.name, damage)
    if step is not None:
        for tier in (root, fast):
            damage = None if tier is None else tier.manifest_damage(step)
            if damage is not None:
                raise damage
    raise CheckpointNotFoundError(f"no committed checkpoint{'' if step is None else f' of step {step}'} "
                                  f"under {root.location.url}")


def only_copies(root: CheckpointDir, fast: CheckpointDir, keep_last: int | None,
                fast_keep_last: int) -> frozenset[str]:
    """The fast-tier copies kept beyond ``fast_keep_last``: their step's only copy (its
    drain failed or was cut short), among the steps the root's ``keep_last`` keeps,
    and the newest ``fast_keep_last`` of those besides the one just committed (whose
    drain is under way): while the root fails, memory holds at most twice what it
    holds otherwise, never a copy per save."""
    at_root, copies = counted_entries(root, fast)
    durable = {e.name for e in at_root}
    steps = sorted({e.step for e in at_root + copies})
    if keep_last is not None:
        steps = steps[-keep_last:]
    kept = set(steps)
    only = [e for e in sorted(copies, key=lambda e: (e.step, e.created))
            if e.name not in durable and e.step in kept]
    return frozenset(e.name for e in only[-(fast_keep_last + 1):])
