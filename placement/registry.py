"""Policy names and the default choice.

The default is "clairvoyant" when the sampler announced the access order (the future is
known, so use it), else "history" (frequency with an admission gate, which degrades to pin
under epoch reshuffles and to LFU under skew).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Union

from .future import BeladyPolicy, ClairvoyantPolicy
from .policies import HistoryPolicy, LRUPolicy, PinPolicy, Policy

POLICIES: Dict[str, Callable[[], Policy]] = {
    "lru": LRUPolicy,
    "history": HistoryPolicy,
    "pin": PinPolicy,
    "clairvoyant": ClairvoyantPolicy,
    "belady": BeladyPolicy,
}


# What a running cache can use (Belady needs the whole future: it is for scoring only).
ONLINE_POLICIES = tuple(name for name, cls in POLICIES.items() if not cls.needs_future)


def default_policy_name(announced: bool) -> str:
    """The policy the engine uses when none is named."""
    return "clairvoyant" if announced else "history"


def make_policy(policy: Union[str, Policy, None], *, announced: bool = False) -> Policy:
    """A fresh policy from a name, a Policy object (copied, never shared) or None."""
    if policy is None:
        policy = default_policy_name(announced)
    if isinstance(policy, Policy):
        return policy.spawn()
    if isinstance(policy, str):
        factory: Optional[Callable[[], Policy]] = POLICIES.get(policy)
        if factory is None:
            raise ValueError(
                f"policy must be one of {sorted(POLICIES)}, a Policy or None, got {policy!r}"
            )
        return factory()
    raise ValueError(f"policy must be a str, a Policy or None, got {policy!r}")
