"""Values DCP pickles whole (tuples, namedtuples, sets, objects) through the in-place fast tier.

A black-box review found that with a node daemon (the fast tier's in-place path) a tensor
inside a tuple or namedtuple was saved as a meta tensor, at the root too: the planning
placeholders replaced every tensor, and DCP pickles a tuple whole, placeholders included.
Without a fast tier the same state saved fine. A fast tier at a local directory
(``fast_root=``) takes the same in-place path as the daemon's.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import os

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402

from cachemw.checkpoint import Checkpointer  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]

NT = collections.namedtuple("NT", "a b")


@dataclasses.dataclass
class Box:
    t: torch.Tensor


def state(v: float) -> dict:
    return {
        "w": torch.full((1000,), v),  # a tensor item: copied in place
        "pair": (1, torch.full((3,), v)),
        "nt": NT(torch.full((2,), v), {"inner": torch.full((2,), v)}),
        "lst": [int(v), (torch.full((2,), v),)],  # a list DCP pickles whole (no tensor of its own)
        "mixed": [torch.full((4,), v), (torch.full((1,), v), "x")],  # traversed: a tensor and a tuple
        "box": Box(torch.full((2,), v)),
        "tags": {"a", "b"},
    }


def empty() -> dict:
    return {"w": torch.zeros(1000), "pair": (0, torch.zeros(3)), "nt": NT(torch.zeros(2), {"inner": torch.zeros(2)}),
            "lst": [0, (torch.zeros(2),)], "mixed": [torch.zeros(4), (torch.zeros(1), "")],
            "box": Box(torch.zeros(2)), "tags": set()}


def check(out: dict, v: float) -> None:
    def full(t, n):
        assert t.device.type == "cpu", f"a {t.device} tensor"
        assert torch.equal(t, torch.full((n,), v))

    full(out["w"], 1000)
    assert out["pair"][0] == 1 and type(out["pair"]) is tuple
    full(out["pair"][1], 3)
    assert type(out["nt"]) is NT  # as the buffered path and plain DCP give it
    full(out["nt"].a, 2)
    full(out["nt"].b["inner"], 2)
    assert out["lst"][0] == int(v)
    full(out["lst"][1][0], 2)
    full(out["mixed"][0], 4)
    full(out["mixed"][1][0], 1)
    assert out["mixed"][1][1] == "x"
    full(out["box"].t, 2)
    assert out["tags"] == {"a", "b"}


def _step_dir(root: str, step: int) -> str:
    return glob.glob(os.path.join(root, f"step_{step:012d}-*"))[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fast", [True, False], ids=["in-place fast tier", "no fast tier"])
def test_values_pickled_whole_are_saved_with_their_tensors(tmp_path, fast):
    root = str(tmp_path / "root")
    with Checkpointer(root, fast_root=str(tmp_path / "fast") if fast else None) as ck:
        for step, v in ((1, 1.0), (2, 2.0)):  # the second save reuses the first's plan
            ck.save(step, state(v)).wait(60)
            if fast:
                assert ck.fast_saver.pool.layout is not None and ck.stager.nbytes == 0  # in place, not buffered
            out = empty()
            assert ck.load(out) == step
            check(out, v)
    for step, v in ((1, 1.0), (2, 2.0)):
        out = empty()  # the durable copy at the root, with no fast tier ...
        assert Checkpointer(root, fast_root=None).load(out, step=step) == step
        check(out, v)
        out = empty()  # ... and read by plain DCP
        dcp.load(out, storage_reader=FileSystemReader(_step_dir(root, step)), no_dist=True)
        check(out, v)


@pytest.mark.timeout(120)
def test_a_dtensor_inside_a_tuple_goes_through_buffers(tmp_path):
    """A DTensor DCP pickles whole (inside a tuple) is no plain CPU tensor: the state goes
    through the buffer stager. Describing the state copied it into a plain tensor first,
    which a DTensor refuses: every save with a fast tier failed."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        with Checkpointer(str(tmp_path / "root"), fast_root=str(tmp_path / "fast")) as ck:
            d = distribute_tensor(torch.arange(6.0), mesh, [Replicate()])
            ck.save(1, {"w": torch.ones(10), "pair": (d, 3)}).wait(60)
            out = {"w": torch.zeros(10), "pair": None}
            assert ck.load(out) == 1
        assert torch.equal(out["w"], torch.ones(10)) and out["pair"][1] == 3
        assert torch.equal(out["pair"][0].full_tensor(), torch.arange(6.0))
    finally:
        dist.destroy_process_group()
