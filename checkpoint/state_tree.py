"""Turning a user's state (tensors, modules, optimizers, plain values, nested) into a DCP
state dict, and applying a loaded one back.

DCP loads in place into tensors, but plain values and optimizer hyper-parameters are replaced,
not mutated, so after ``dcp.load`` they are written back: objects through their own
``load_state_dict``, plain values by assignment into the user's dict.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def to_state_dict(state: Any) -> Any:
    """A DCP-ready copy of the structure (tensors are shared, not copied)."""
    if isinstance(state, torch.Tensor):
        return state
    if is_stateful(state):
        return to_state_dict(state.state_dict())
    if isinstance(state, dict):
        return {k: to_state_dict(v) for k, v in state.items()}
    return state


def prepare_for_load(state: Any) -> None:
    """Give optimizers their state tensors before loading (a fresh optimizer has none)."""
    if isinstance(state, torch.optim.Optimizer):
        if not state.state:
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(state)
    elif isinstance(state, dict):
        for v in state.values():
            prepare_for_load(v)


def optimizer_paths(state: Any, path: tuple = ()) -> tuple[tuple, ...]:
    """The keys, from the top, of every optimizer in ``state`` (nested in dicts)."""
    if isinstance(state, torch.optim.Optimizer):
        return (path,)
    if isinstance(state, dict):
        return tuple(p for k, v in state.items() for p in optimizer_paths(v, path + (k,)))
    return ()


def drop_unsaved_optimizer_state(loaded: dict, paths: tuple[tuple, ...], saved: Any) -> None:
    """Take out of ``loaded`` the state of an optimizer's parameters that have none in the
    checkpoint (``saved``: its flattened keys): a parameter that never had a gradient
    (frozen, unused, an expert no token was routed to) has no state when saved, and
    ``prepare_for_load`` gave it some, which DCP would find missing from the checkpoint.
    The optimizer's ``load_state_dict`` then leaves it without, as after ``torch.save``."""
    for path in paths:
        node: Any = loaded
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        params = node.get("state") if isinstance(node, dict) else None
        if not isinstance(params, dict) or not params:
            continue
        prefix = ".".join(str(k) for k in path + ("state",)) + "."
        with_state = {k[len(prefix):].split(".", 1)[0] for k in saved if k.startswith(prefix)}
        for pid in [p for p in params if str(p) not in with_state]:
            del params[pid]


class OptimizerStateLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, told where ``state`` holds optimizers: what their parameters
    lack in the checkpoint is not asked of it (drop_unsaved_optimizer_state). Any other
    key the checkpoint lacks is an error, as ever."""

    def __init__(self, optimizers: tuple[tuple, ...]) -> None:
        super().__init__()
        self.optimizers = optimizers

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        if metadata is not None and self.optimizers:
            drop_unsaved_optimizer_state(state_dict, self.optimizers, metadata.state_dict_metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self):
        """DCP's plan; a key the checkpoint lacks said as the state's shape, a ValueError:
        a list saved [1, 2, {"a": 3}] and loaded into [] was "Missing key in checkpoint
        state_dict: list", a key the checkpoint does hold (review ckpt6)."""
        try:
            return super().create_local_plan()
        except RuntimeError as exc:
            said = str(exc)
            if not said.startswith(_MISSING):
                raise
            raise ValueError(_missing(said[len(_MISSING):].removesuffix("."),
                                      self.metadata.state_dict_metadata)) from exc


_MISSING = "Missing key in checkpoint state_dict: "


def _missing(key: str, saved) -> str:
    under = sorted(k for k in saved if k.startswith(key + "."))
    if under:
        shown = ", ".join(under[:3]) + (", ..." if len(under) > 3 else "")
        return (f"the state given to load holds {key!r} as one value where the checkpoint "
                f"holds {len(under)} entries under it ({shown}): a list or tuple must have "
                f"the length it was saved with (a dict may be given empty)")
    return (f"the state given to load holds {key!r}, which the checkpoint does not (a list "
            f"longer than the one saved, or an entry added since)")


def apply_loaded(state: dict, loaded: dict) -> None:
    """Write what DCP loaded into ``loaded`` (built by ``to_state_dict(state)``) back into ``state``."""
    for key, value in state.items():
        if key not in loaded:
            continue
        if isinstance(value, torch.Tensor):
            if loaded[key] is not value:
                value.copy_(loaded[key])
        elif is_stateful(value):
            value.load_state_dict(loaded[key])
        elif isinstance(value, dict) and isinstance(loaded[key], dict):
            apply_loaded(value, loaded[key])
        else:
            state[key] = loaded[key]


_RANK_KEY = re.compile(r"^rank(\d+)(\.|$)")


def unplaced(metadata: Any, loaded: dict, others: frozenset[int] = frozenset()) -> tuple[str, ...]:
    """The entries of a checkpoint (its DCP ``metadata``) that ``loaded``, the state dict a
    load filled in place, has no place for (DCP's flattened names); () if unknown. Entries
    under ``rank<r>`` for a rank ``r`` in ``others`` (the other ranks loading with this one,
    by global rank) are theirs: a value that differs by rank goes under ``f"rank{rank}"``
    on each rank (README). A rank no one loads now (a resume with fewer ranks) is named."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    def theirs(key: str) -> bool:
        found = _RANK_KEY.match(key)
        return found is not None and int(found.group(1)) in others

    try:
        held = flatten_state_dict(loaded)[0]
        return tuple(sorted(k for k in metadata.state_dict_metadata
                            if k not in held and not theirs(k)))
    except Exception:  # noqa: BLE001 - only for a warning
        return ()
