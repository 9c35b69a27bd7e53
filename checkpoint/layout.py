"""The directory of checkpoints: naming, committed steps, ``latest``, retention, sweeping.

Each save writes into its own directory ``step_<012d step>-<save id>``, so two savers (or a
retried save of the same step) never write the same file. A directory is committed when its
manifest exists (written last); anything else is in flight or the leftover of a crash.
``latest`` names the newest committed directory and moves only after the commit. Retention
runs after ``latest`` moves and never deletes the newest committed checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import time
import uuid
from typing import Callable

from cachemw.processes import process_alive, process_start
from .storage_io import Location
from .errors import ChecksumError
from .writer import MANIFEST_NAME, parse_manifest

log = logging.getLogger(__name__)

# 12 digits at least (a step of 10**12 or more, a token count, has more: it was not listed)
STEP_DIR = re.compile(r"^step_(\d{12,})-([0-9a-f]{8})$")
OWNER_NAME = ".owner.json"
LATEST_NAME = "latest"
SPARE_NAME = ".spare"
ROOT_ID_NAME = ".cachemw-root-id"  # at a root: its id; in a fast tier: the root's it serves


@dataclasses.dataclass(frozen=True)
class Entry:
    step: int
    name: str
    created: float


def step_dir_name(step: int, save_id: str) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:012d}-{save_id[:8]}"


class CheckpointDir:
    """Checkpoints under one ``Location`` (the root, or a fast tier)."""

    def __init__(self, location: Location, recycle: bool = False) -> None:
        self.location = location
        # Fast (tmpfs) tier: keep one evicted checkpoint as a spare whose files the next save
        # overwrites in place. Fresh tmpfs pages cost a page fault and zeroing each; reused
        # ones cost a memcpy, as reused staging buffers do.
        self.recycle = recycle and location.local
        self._damaged: set[str] = set()  # step directories whose damaged manifest was logged

    def step_dirs(self) -> list[tuple[int, str]]:
        out = []
        for name in self.location.listdir():
            m = STEP_DIR.match(name)
            if m:
                out.append((int(m.group(1)), name))
        return sorted(out)

    def _read_manifest(self, name: str) -> tuple[dict | None, ChecksumError | None]:
        """(the checked manifest of ``name``, None) if committed and whole; (None, the
        ChecksumError) if its manifest is damaged; (None, None) if it has none."""
        try:
            data = self.location.read_bytes(f"{name}/{MANIFEST_NAME}")
        except (FileNotFoundError, NotADirectoryError):
            return None, None
        try:
            return parse_manifest(data, self.location.child(name).url), None
        except ChecksumError as exc:
            return None, exc

    def manifest(self, name: str) -> dict | None:
        """The checked manifest of ``name``; None if it is not committed, or if its manifest
        is damaged (said once per directory: the step is passed over, as uncommitted)."""
        manifest, damage = self._read_manifest(name)
        if damage is not None and name not in self._damaged:
            self._damaged.add(name)
            log.warning("%s; not counted as a committed checkpoint", damage)
        return manifest

    def manifest_damage(self, step: int) -> ChecksumError | None:
        """The ChecksumError of a directory of ``step`` whose manifest is there but damaged
        (None: none is): asked for by its step, such a checkpoint is an error, not absent."""
        for s, name in self.step_dirs():
            damage = self._read_manifest(name)[1] if s == step else None
            if damage is not None:
                return damage
        return None

    def is_committed(self, name: str) -> bool:
        """Cheaper than ``manifest`` when only the commit mark matters (no parsing)."""
        return self.location.exists(f"{name}/{MANIFEST_NAME}")

    def committed(self) -> list[Entry]:
        """Committed checkpoints, oldest first (ties on step broken by commit time)."""
        out = []
        for step, name in self.step_dirs():
            manifest = self.manifest(name)
            if manifest is not None:
                out.append(Entry(step, name, float(manifest.get("created", 0.0))))
        return sorted(out, key=lambda e: (e.step, e.created))

    def find(self, step: int | None = None) -> Entry | None:
        entries = [e for e in self.committed() if step is None or e.step == step]
        return entries[-1] if entries else None

    def complete(self, name: str) -> bool:
        """True if ``name`` is committed here and holds every data file its manifest lists."""
        manifest = self.manifest(name)
        if manifest is None:
            return False
        try:
            return all(self.location.size(f"{name}/{rel}") == size for rel, size in manifest["files"].items())
        except (FileNotFoundError, OSError):
            return False

    def begin(self, name: str, reuse_spare: bool = True) -> None:
        """Create the directory of a save and record who writes it (for the sweeper)."""
        if reuse_spare and self.recycle and self.location.exists(SPARE_NAME):
            try:
                os.rename(self.location.join(SPARE_NAME), self.location.join(name))
            except OSError:
                pass  # another rank of this node took it first, or it is gone: write fresh files
        self.location.makedirs(name)
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                 "pid_start": process_start(os.getpid())}
        self.location.child(name).write_atomic(OWNER_NAME, json.dumps(owner).encode())

    def root_id(self) -> str:
        """This root's id, made by the first Checkpointer of it: a root removed and made
        again has a new one, so that copies of its old steps kept elsewhere (the fast tier,
        a node daemon's, outlives the root's files) are known as another root's."""
        found = self.held_root_id()
        if found is None:
            self.location.write_atomic(ROOT_ID_NAME, uuid.uuid4().hex.encode())
            found = self.held_root_id()  # another's, if two were made at once: the last one
        if not found:
            raise OSError(f"{self.location.url}/{ROOT_ID_NAME}: not readable after writing it")
        return found

    def held_root_id(self) -> str | None:
        """The root id kept here (None if none is)."""
        try:
            return self.location.read_bytes(ROOT_ID_NAME).decode().strip() or None
        except FileNotFoundError:
            return None

    def mark_latest(self, name: str) -> None:
        self.location.write_atomic(LATEST_NAME, name.encode())

    def latest(self) -> str | None:
        try:
            return self.location.read_bytes(LATEST_NAME).decode().strip() or None
        except FileNotFoundError:
            return None

    def retain(self, keep_last: int | None, just_committed: str | None = None,
               keep: Callable[[Entry], bool] | None = None,
               theirs: Callable[[Entry], bool] | None = None) -> list[str]:
        """Delete committed checkpoints beyond the newest ``keep_last`` steps; return their names.

        Also drops older duplicates of one step. The checkpoint of the highest step and the
        one ``just_committed`` are never deleted, whatever ``keep_last`` says: a run restarted
        into a root that holds higher steps (a rerun, a resume from an older step) keeps
        its own saves, which would otherwise go as soon as they are published. Nor is the
        newest of a step for which ``keep`` (asked only of those about to go) says True,
        nor any for which ``theirs`` does (another saver's, its own to retire).
        """
        entries = self.committed()
        if not entries:
            return []
        newest_per_step: dict[int, Entry] = {}
        for e in entries:
            newest_per_step[e.step] = e
        keep_steps = sorted(newest_per_step)
        if keep_last is not None:
            keep_steps = keep_steps[-max(1, keep_last):]
        kept = {newest_per_step[s].name for s in keep_steps} | {entries[-1].name, just_committed}
        doomed = [e.name for e in entries if e.name not in kept
                  and (keep is None or e is not newest_per_step[e.step] or not keep(e))
                  and (theirs is None or not theirs(e))]
        for name in doomed:
            # Uncommit first, so a half-deleted directory is never mistaken for a checkpoint.
            self.location.remove_file(f"{name}/{MANIFEST_NAME}")
            if self.recycle and not self.location.exists(SPARE_NAME) and not self._has_links(name):
                try:
                    os.rename(self.location.join(name), self.location.join(SPARE_NAME))
                    continue
                except OSError:
                    pass
            self.location.remove_tree(name)
        return doomed

    def _has_links(self, name: str) -> bool:
        """True if a file of ``name`` is also linked elsewhere (a pool's mapped file): never a spare."""
        try:
            with os.scandir(self.location.join(name)) as it:
                return any(e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_nlink > 1 for e in it)
        except OSError:
            return True

    def drop_spare(self) -> None:
        self.location.remove_tree(SPARE_NAME)

    def sweep(self, stale_after_s: float) -> list[str]:
        """Remove uncommitted directories whose writer is dead (same host) or that are stale.
        A directory with a manifest is committed, even if that manifest is damaged or of a
        newer format (then it is not loaded, and kept: its chunks may still be sound)."""
        removed = []
        now = time.time()
        for _, name in self.step_dirs():
            if self.is_committed(name):
                continue
            owner = self._owner(name)
            writer = _local_writer(owner)
            if writer is not None:
                dead = not writer[1]
            else:
                started = owner.get("started") if owner else self.location.mtime(name)
                dead = started is not None and now - float(started) > stale_after_s
            if dead:
                self.location.remove_tree(name)
                removed.append(name)
        return removed

    def _owner(self, name: str) -> dict | None:
        """Who began writing ``name`` here (``begin``), or None if that is not recorded."""
        try:
            return json.loads(self.location.read_bytes(f"{name}/{OWNER_NAME}"))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def written_live_by_another(self, name: str, ours: frozenset[int]) -> bool:
        """The process that wrote ``name`` here is one of this host that lives and is none
        of ``ours`` (pids)."""
        writer = _local_writer(self._owner(name))
        return writer is not None and writer[1] and writer[0] not in ours

    def writer_gone(self, name: str) -> bool:
        """The process that wrote ``name`` here ran on this host and is gone: whatever it
        left undone for the step (its drain to the root) nobody else is doing."""
        writer = _local_writer(self._owner(name))
        return writer is not None and not writer[1]

    def remove(self, name: str) -> None:
        self.location.remove_file(f"{name}/{MANIFEST_NAME}")
        self.location.remove_tree(name)


def _local_writer(owner: dict | None) -> tuple[int, bool] | None:
    """(pid, alive) of the writer an owner record (``begin``) names, if it ran on this
    host; None otherwise: another host's pid says nothing here."""
    if owner is None or owner.get("host") != socket.gethostname():
        return None
    pid = int(owner.get("pid", 0))
    return pid, process_alive(pid, owner.get("pid_start") or None)
