"""``cachemw job``'s arguments -> ``JobSettings``: each bad one a ValueError that names it
(the CLI says it in one line, exit 2)."""
from __future__ import annotations

import json
import sys
import warnings

from ..config_values import parse_size
from .settings import METHODS, JobSettings, StoreProfile
from .workload import load


def _overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. train.epochs=2")
        out[key.strip()] = value
    return out


def _methods(given: str) -> tuple:
    """``--checkpoints``: a comma-separated list of methods, or none alone."""
    names = [m.strip() for m in given.split(",") if m.strip()]
    if not names:
        raise ValueError(f"--checkpoints: expected a comma-separated list of "
                         f"{', '.join(METHODS)}, or none; got {given!r}")
    if "none" in names:
        if len(names) > 1:
            raise ValueError(f"--checkpoints {given}: none (no checkpoints) cannot be "
                             f"combined with a method")
        return ()
    return tuple(names)


def settings_from(args) -> JobSettings:
    """The JobSettings ``cachemw job``'s arguments ask for (ValueError naming a bad one).
    A workload's keys the job does not emulate are printed as a warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        workload = load(args.workload, _overrides(args.set))
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    profile = StoreProfile(latency=args.store_latency_ms / 1e3,
                           meta_latency=args.store_meta_latency_ms / 1e3,
                           bandwidth=parse_size(args.store_bandwidth, name="--store-bandwidth"))
    if args.source_options is not None and args.source is None:
        raise ValueError("--source-options: only with --source (they are its filesystem's "
                         "options; the emulated store takes none)")
    try:
        options = json.loads(args.source_options or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"--source-options: not JSON ({exc})") from None
    if not isinstance(options, dict):
        raise ValueError(f"--source-options: expected a JSON object, got {args.source_options}")
    return JobSettings(workload=workload, profile=profile, source=args.source,
                       source_options=options,
                       systems=tuple(s.strip() for s in args.systems.split(",") if s.strip()),
                       methods=_methods(args.checkpoints), checkpoint_saves=args.checkpoint_saves,
                       io_epochs=args.io_epochs,
                       out_dir=args.out, progress=not args.quiet)
