"""Which step a Checkpointer loads: the newest one committed at the root, or in the fast
tier (a node daemon's DRAM) while that copy still counts.

A fast-tier copy counts while its step's directory is at the root, committed there with a
sound manifest or still being written (its drain under way). The fast tier outlives the
root's files (it is the node daemon's, kept until ``cachemw stop``), so a copy whose root
directory is gone (the root removed to start afresh, a crashed save's leftover swept) is a
stale one, never loaded; and a step whose root manifest is damaged is passed over as it is
without a fast tier, so that every node, with the copy in its memory or not, loads the same
step.
"""
from __future__ import annotations

import logging

from .errors import CheckpointNotFoundError
from .layout import CheckpointDir, Entry
from .reader import metadata_damage

log = logging.getLogger(__name__)


def counted_entries(root: CheckpointDir, fast: CheckpointDir | None) -> tuple[list[Entry], list[Entry]]:
    """(the steps committed at the root, the fast tier's copies that count)."""
    at_root = root.committed()
    if fast is None:
        return at_root, []
    committed = {e.name for e in at_root}
    begun = {name for _, name in root.step_dirs()}
    copies = [e for e in fast.committed() if e.name in committed
              or (e.name in begun and not root.is_committed(e.name))]
    return at_root, copies


def drop_stale_fast_copies(root: CheckpointDir, fast: CheckpointDir) -> None:
    """Remove the fast tier's committed copies whose root directory is gone: their memory is
    the node's. Best effort: the node's other ranks may be removing them too."""
    begun = {name for _, name in root.step_dirs()}
    for e in fast.committed():
        if e.name not in begun:
            try:
                fast.remove(e.name)
                log.info("removed %s from the fast tier %s: its step is no longer at the root %s",
                         e.name, fast.location.url, root.location.url)
            except OSError:
                pass


def choose(root: CheckpointDir, fast: CheckpointDir | None, step: int | None,
           said: set[str]) -> tuple[int, str, bool]:
    """(step, directory name, committed at root) of the checkpoint to load: the newest one
    (or ``step``'s) complete in a tier that counts. A fast-tier copy whose files are gone (a
    shared tier cleaned by a failed save, a lost node) is skipped, not chosen and found
    unloadable. A damaged ``.metadata`` is passed over with a warning (once per directory,
    kept in ``said``), as a damaged manifest is; asked for by its step, either is a
    ChecksumError."""
    at_root, copies = counted_entries(root, fast)
    committed = {e.name for e in at_root}
    for e in sorted(at_root + copies, key=lambda e: (e.step, e.created), reverse=True):
        if step is not None and e.step != step:
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
