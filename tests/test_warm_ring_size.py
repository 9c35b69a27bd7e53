"""``cachemw warm --nodes N`` against a cache cluster already formed of more alive nodes
than N is refused at once: nodes joining cannot make it fit. It waited the whole
``--ring-wait`` (60 s) first (review nodes3, minor). A ring still forming is waited for
as before, and so is a formed one of fewer nodes (more may join)."""
from __future__ import annotations

import pytest

from cachemw import warm
from cachemw.config import WarmConfig


class Ring:
    """A clustered daemon's client whose ring is ``members`` of ``alive`` nodes."""

    def __init__(self, members, alive):
        self.members, self.alive, self.asked = list(members), alive, 0

    def ring(self, *, strict=False):
        self.asked += 1
        return {"self": self.members[0], "members": self.members, "alive": self.alive,
                "vnodes": 64}


def test_a_formed_ring_larger_than_the_warm_is_refused_at_once():
    client = Ring(["a", "b", "c"], 3)
    with pytest.raises(warm.WarmError, match=r"runs on 2 nodes at once, but the cache cluster "
                                             r"this node's daemon sees has 3 node\(s\) "
                                             r"\(complete; 3 alive\)"):
        warm.node_share(client, WarmConfig.build(nodes=2, ring_wait=5, env={}), poll=0.01)
    assert client.asked == 1  # asked once, not polled until --ring-wait
    # a one-node Slurm step of that cluster, too (it would warm alone only with --nodes 1)
    step = {"SLURM_STEP_NUM_NODES": "1", "SLURM_LOCALID": "0"}
    client = Ring(["a", "b", "c"], 3)
    with pytest.raises(warm.WarmError, match="--nodes 1"):
        warm.node_share(client, WarmConfig.build(ring_wait=5, env=step), poll=0.01)
    assert client.asked == 1


@pytest.mark.parametrize("members, alive, nodes", [
    (["a"], 3, 3),  # still forming: the others are alive but not in the ring yet
    (["a", "b"], 2, 3),  # formed, but fewer than the warm's nodes: more may join
    (["a", "b", "c"], 2, 2),  # a node gone, not yet out of the ring: it may leave it
])
def test_a_ring_that_may_still_fit_is_waited_for(members, alive, nodes):
    client = Ring(members, alive)
    with pytest.raises(warm.WarmError, match="after 0 s"):
        warm.node_share(client, WarmConfig.build(nodes=nodes, ring_wait=0.2, env={}),
                        poll=0.01)
    assert client.asked > 1


def test_a_ring_of_the_warm_s_size_is_its_share():
    share = warm.node_share(Ring(["a", "b", "c"], 3),
                            WarmConfig.build(nodes=3, ring_wait=5, env={}))
    assert share.ring is not None and share.members == ("a", "b", "c") and share.node == "a"
