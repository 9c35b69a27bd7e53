"""Optimizers whose parameters did not all get a gradient (frozen, unused, experts no token
was routed to) have no state for those parameters. A checkpoint of one could not be
resumed: the load gave a fresh optimizer state for every parameter, and DCP found the
unused ones' missing from the checkpoint ("Missing key in checkpoint state_dict:
optim.state.2.step", on every rank). It loads as ``torch.save`` + ``load_state_dict`` does:
those parameters are left without state."""
from __future__ import annotations

import copy

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402

from cachemw.checkpoint import Checkpointer  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 8), "unused": torch.nn.Linear(8, 8)})
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _train(model, opt, steps=2, part="a"):
    for _ in range(steps):
        opt.zero_grad()
        model[part](torch.randn(4, 8)).sum().backward()
        opt.step()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", ["fresh", "stepped everywhere"])
def test_an_optimizer_with_parameters_never_stepped_resumes(tmp_path, target):
    model, opt = _model_and_optimizer(0)
    _train(model, opt)  # only "a" gets gradients: state for params 0 and 1
    saved = copy.deepcopy(opt.state_dict())
    assert sorted(saved["state"]) == [0, 1]
    with Checkpointer(str(tmp_path / "ck")) as ck:
        ck.save(1, {"model": model, "optim": opt}).wait(60)
        model2, opt2 = _model_and_optimizer(1)
        if target == "stepped everywhere":  # state for every parameter before the load
            _train(model2, opt2, 1, "a")
            _train(model2, opt2, 1, "unused")
            assert sorted(opt2.state_dict()["state"]) == [0, 1, 2, 3]
        assert ck.load({"model": model2, "optim": opt2}) == 1
    got = opt2.state_dict()
    assert sorted(got["state"]) == [0, 1]  # as torch.save + load_state_dict leave it
    for pid in (0, 1):
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got["state"][pid][name], saved["state"][pid][name])
    for mine, theirs in zip(model.parameters(), model2.parameters()):
        assert torch.equal(mine, theirs)
    _train(model2, opt2, 1, "unused")  # and it trains on, the unused params included
    assert sorted(opt2.state_dict()["state"]) == [0, 1, 2, 3]


@pytest.mark.timeout(120)
def test_a_checkpoint_without_the_optimizer_still_fails_its_load(tmp_path):
    """Only the per-parameter state of an optimizer may be absent: a checkpoint saved
    without the optimizer is still no checkpoint of it."""
    model, opt = _model_and_optimizer(0)
    _train(model, opt)
    with Checkpointer(str(tmp_path / "ck")) as ck:
        ck.save(1, {"model": model}).wait(60)
        model2, opt2 = _model_and_optimizer(1)
        with pytest.raises(Exception, match="param_groups"):
            ck.load({"model": model2, "optim": opt2}, step=1)
