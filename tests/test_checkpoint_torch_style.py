"""torch-style checkpoints (cachemw.checkpoint.save / load in torch.save's place): every
type torch.save keeps, what torch.load gives back, earlier releases' files, sparse tensors,
and damaged chunks raised as ChecksumError, never a wrong tensor."""
from __future__ import annotations

import pickle

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402

pytestmark = pytest.mark.torch


class Holder:
    """An object holding a tensor in an attribute (pickled by reference to this module)."""

    def __init__(self, t):
        self.t = t


def test_torch_style_save_keeps_every_type_as_torch_save_does(tmp_path):
    """A Counter came back as a Counter of (key, count) pairs, a defaultdict lost its
    factory, torch.Size became a tuple and a Parameter a plain tensor; one tensor under two
    keys became two. Now the object is pickled as torch.save pickles it."""
    import collections

    from cachemw.checkpoint import load, save

    shared = torch.randn(4)
    param = torch.nn.Parameter(torch.ones(2, 3))
    obj = {"counts": collections.Counter({"cat": 3, "dog": 5}),
           "dd": collections.defaultdict(list, a=[1]), "shape": torch.Size([3, 4]),
           "p": param, "a": shared, "b": shared, "holder": Holder(torch.arange(5)),
           "grad": torch.zeros(2, requires_grad=True), 7: (1, [torch.ones(1)])}
    save(obj, str(tmp_path / "ck"))
    got = load(str(tmp_path / "ck"), weights_only=False)  # Holder, defaultdict: not weights
    assert type(got["counts"]) is collections.Counter and got["counts"] == obj["counts"]
    assert type(got["dd"]) is collections.defaultdict and got["dd"].default_factory is list
    assert type(got["shape"]) is torch.Size and got["shape"] == obj["shape"]
    assert isinstance(got["p"], torch.nn.Parameter) and got["p"].requires_grad
    assert torch.equal(got["p"], param)
    assert got["a"] is got["b"] and torch.equal(got["a"], shared)
    assert torch.equal(got["holder"].t, torch.arange(5))
    assert got["grad"].requires_grad and not obj["a"].requires_grad
    assert torch.equal(got[7][1][0], torch.ones(1))
    # map_location as torch.load takes it: a device, a dict of device names, a callable
    assert load(str(tmp_path / "ck"), map_location={"cpu": "meta"},
                weights_only=False)["a"].device.type == "meta"
    assert load(str(tmp_path / "ck"), map_location=lambda storage, loc: storage,
                weights_only=False)["a"].device.type == "cpu"
    copied = load(str(tmp_path / "ck"), map_location=lambda storage, loc: storage.clone(),
                  weights_only=False)
    assert torch.equal(copied["a"], shared) and torch.equal(copied[7][1][0], torch.ones(1))
    # a lazily conjugated or negated view keeps its values
    c = torch.tensor([1 + 2j, 3 - 4j])
    save({"conj": c.conj(), "neg": torch._neg_view(c)}, str(tmp_path / "c"))
    lazy = load(str(tmp_path / "c"))
    assert torch.equal(lazy["conj"], c.conj()) and torch.equal(lazy["neg"], -c)
    # quantized tensors keep their scale and zero point, weights-only too (torch.load's default)
    q = torch.quantize_per_tensor(torch.tensor([0.5, -1.0, 2.0]), 0.1, 3, torch.qint8)
    save({"q": q}, str(tmp_path / "q"))
    assert torch.equal(load(str(tmp_path / "q"))["q"].dequantize(), q.dequantize())
    # weights_only as torch.load takes it, on by default: tensors and plain containers only
    save({"w": param, "shared": [shared, shared], "n": 3}, str(tmp_path / "weights"))
    plain = load(str(tmp_path / "weights"))
    assert isinstance(plain["w"], torch.nn.Parameter) and plain["shared"][0] is plain["shared"][1]
    with pytest.raises(pickle.UnpicklingError, match="weights_only=False"):
        load(str(tmp_path / "ck"))  # Holder: not a type torch allows
    with pytest.raises(pickle.UnpicklingError):
        load(str(tmp_path / "ck"), weights_only=True)


def test_torch_style_load_reads_an_earlier_release_s_checkpoint(tmp_path):
    """Checkpoints whose object was kept as a skeleton of placeholder strings still load."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from cachemw.checkpoint import load
    from cachemw.checkpoint.planner import SpreadSavePlanner
    from cachemw.checkpoint.quiet import single_process_dcp
    from cachemw.checkpoint.torch_like import PLACEHOLDER, SKELETON_KEY
    from cachemw.checkpoint.writer import CachemwStorageWriter

    t = torch.randn(3, 2)
    skeleton = {"w": PLACEHOLDER + "t0", "step": 3, "nested": [PLACEHOLDER + "t0"]}
    state = {"tensors": {"t0": t}, SKELETON_KEY: pickle.dumps(skeleton)}
    with single_process_dcp():
        dcp.save(state, storage_writer=CachemwStorageWriter(str(tmp_path / "old")),
                 planner=SpreadSavePlanner(), no_dist=True)
    got = load(str(tmp_path / "old"))
    assert got["step"] == 3 and torch.equal(got["w"], t) and torch.equal(got["nested"][0], t)
    state[SKELETON_KEY] = pickle.dumps({"w": PLACEHOLDER + "t0", "holder": Holder(None)})
    with single_process_dcp():
        dcp.save(state, storage_writer=CachemwStorageWriter(str(tmp_path / "other")),
                 planner=SpreadSavePlanner(), no_dist=True)
    with pytest.raises(pickle.UnpicklingError, match="weights_only=False"):
        load(str(tmp_path / "other"))  # weights-only by default, as torch.load
    assert isinstance(load(str(tmp_path / "other"), weights_only=False)["holder"], Holder)


class _Tagged(torch.Tensor):
    """A tensor subclass (pickled by reference to this module)."""


class _Halved:
    """Pickles a tensor made for the pickle (freed once pickled, its id and memory then
    free for the next one's)."""

    def __init__(self, t):
        self.t = t

    def __getstate__(self):
        return {"t": self.t.half()}

    def __eq__(self, other):
        return type(other) is _Halved and torch.equal(self.t, other.t)


def _same_as_torch_load(ours, theirs, where="obj", ptrs=None):
    """Differences between what load gave and what torch.load gave for the same object:
    types, tensors' dtype, shape, strides, offset, lazy bits, grad, attributes, values."""
    diffs = []
    if type(ours) is not type(theirs):
        return [f"{where}: {type(ours).__name__} vs {type(theirs).__name__}"]
    if isinstance(ours, torch.Tensor):
        for attr in ("dtype", "shape", "requires_grad", "is_quantized", "layout", "device"):
            if getattr(ours, attr) != getattr(theirs, attr):
                diffs.append(f"{where}.{attr}")
        if ours.layout is torch.strided and not ours.is_quantized and ours.device.type != "meta":
            if (ours.stride(), ours.storage_offset(), ours.is_conj(), ours.is_neg()) != \
                    (theirs.stride(), theirs.storage_offset(), theirs.is_conj(), theirs.is_neg()):
                diffs.append(f"{where}: strides, offset or lazy bits")
            if not torch.equal(ours.detach().resolve_conj().resolve_neg(),
                               theirs.detach().resolve_conj().resolve_neg()):
                diffs.append(f"{where}: values")
            ptrs.append((ours.untyped_storage().data_ptr(), theirs.untyped_storage().data_ptr()))
        if ours.__dict__.keys() != theirs.__dict__.keys():
            diffs.append(f"{where}: attributes")
        return diffs
    if isinstance(ours, dict):
        if list(ours) != list(theirs):
            return [f"{where}: keys"]
        for k in ours:
            diffs += _same_as_torch_load(ours[k], theirs[k], f"{where}.{k}", ptrs)
        return diffs
    if isinstance(ours, (list, tuple)):
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            diffs += _same_as_torch_load(a, b, f"{where}[{i}]", ptrs)
        return diffs
    return [] if ours == theirs else [f"{where}: {ours!r} vs {theirs!r}"]


def test_torch_style_load_gives_what_torch_load_gives(tmp_path):
    """Views of one storage came back as separate tensors (a transposed one contiguous), a
    lazy conjugate resolved, tied weights as two copies, a tensor subclass as a plain tensor
    with its attributes lost, and quantized tensors failed a weights-only load: storages
    are now what is referenced, as in torch.save, so the object is torch.load's."""
    from cachemw.checkpoint import load, save

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    linear = torch.nn.Linear(4, 4)
    tagged = torch.randn(3).as_subclass(_Tagged)
    tagged.note = 7
    with_attr = torch.ones(3)
    with_attr.origin = "sensor"
    cases = {
        "views": {"base": base, "row": base[1], "col": base[:, 2], "t": base.t(), "tile": base[1:3, 2:5]},
        "lazy": {"conj": torch.randn(3, dtype=torch.complex64).conj(), "neg": torch._neg_view(torch.randn(3))},
        "tied": {"a": linear.weight, "b": linear.weight.detach(), "sd": linear.state_dict()},
        "dtypes": {str(d): torch.ones(2, dtype=d) for d in (torch.bfloat16, torch.float16, torch.int8,
                                                          torch.bool, torch.complex128)},
        "edges": {"scalar": torch.tensor(3.5), "empty": torch.empty(0, 5), "grad": torch.ones(2, requires_grad=True)},
        "quantized": {"q": torch.quantize_per_channel(torch.randn(3, 4), torch.tensor([0.1, 0.2, 0.3]),
                                                      torch.tensor([0, 1, 2]), 0, torch.quint8)},
        "subclass": {"tagged": tagged, "attr": with_attr},
        # each object's tensor came back as an earlier one's: tensors were told apart by id
        "temporaries": [_Halved(torch.full((3,), float(i))) for i in range(6)],
    }
    for name, obj in cases.items():
        torch.save(obj, tmp_path / f"{name}.pt")
        save(obj, str(tmp_path / name))
        for weights_only in (None, False):
            try:
                theirs = torch.load(tmp_path / f"{name}.pt", weights_only=weights_only)
            except pickle.UnpicklingError:  # torch refuses it weights-only: so do we
                with pytest.raises(pickle.UnpicklingError):
                    load(str(tmp_path / name), weights_only=weights_only)
                continue
            ptrs = []
            ours = load(str(tmp_path / name), weights_only=weights_only)
            assert _same_as_torch_load(ours, theirs, name, ptrs) == [], (name, weights_only)
            sharing = [[a for a, _ in ptrs].index(a) for a, _ in ptrs]
            assert sharing == [[b for _, b in ptrs].index(b) for _, b in ptrs], (name, "storage sharing")


def test_torch_style_load_reads_an_earlier_release_s_tensor_references(tmp_path, monkeypatch):
    """The release before storages were referenced pickled each tensor as an int (its
    number times 4, plus 2 for a Parameter, plus 1 for requires_grad): still read, weights-only
    by default as torch.load; TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns that off as for torch."""
    import io

    import torch.distributed.checkpoint as dcp

    from cachemw.checkpoint import load
    from cachemw.checkpoint.planner import SpreadSavePlanner
    from cachemw.checkpoint.quiet import single_process_dcp
    from cachemw.checkpoint.torch_like import PICKLED_KEY
    from cachemw.checkpoint.writer import CachemwStorageWriter

    w, b = torch.randn(3, 2), torch.randn(2)

    class OldPickler(pickle.Pickler):
        def persistent_id(self, obj):
            if obj is w:
                return 0 * 4 + 2 + 1  # a Parameter that requires grad
            if obj is b:
                return 1 * 4
            return None

    buf = io.BytesIO()
    OldPickler(buf, protocol=2).dump({"w": w, "b": [b, b], "holder": Holder(3)})
    state = {"tensors": {"t0": w, "t1": b}, PICKLED_KEY: buf.getvalue()}
    with single_process_dcp():
        dcp.save(state, storage_writer=CachemwStorageWriter(str(tmp_path / "old")),
                 planner=SpreadSavePlanner(), no_dist=True)
    with pytest.raises(pickle.UnpicklingError, match="weights_only=False"):
        load(str(tmp_path / "old"))  # Holder: not a type torch.load allows by default
    got = load(str(tmp_path / "old"), weights_only=False)
    assert isinstance(got["w"], torch.nn.Parameter) and got["w"].requires_grad and torch.equal(got["w"], w)
    assert got["b"][0] is got["b"][1] and torch.equal(got["b"][0], b)
    assert got["holder"].t == 3
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.warns(UserWarning, match="forcing weights_only=False"):  # as torch.load says
        assert load(str(tmp_path / "old"))["holder"].t == 3
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(RuntimeError, match="(?i)only one"):
        load(str(tmp_path / "old"))


def test_a_truncated_chunk_file_is_a_checksum_error(tmp_path):
    from cachemw.checkpoint import ChecksumError, load, save

    path = tmp_path / "ck"
    save({"w": torch.randn(100_000), "b": torch.randn(1000)}, str(path))
    chunk = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    chunk.write_bytes(chunk.read_bytes()[:chunk.stat().st_size // 2])
    with pytest.raises(ChecksumError, match="truncated"):
        load(str(path))


def test_torch_style_save_over_a_torch_save_file_and_tensors_dcp_cannot_hold(tmp_path):
    """save onto a torch.save file replaces it (as torch.save does; it was FileExistsError);
    sparse and meta tensors are pickled inline (DCP cannot hold them: a RuntimeError);
    load of a plain file says what it is."""
    from cachemw.checkpoint import load, save

    path = tmp_path / "model.pt"
    torch.save({"old": 1}, path)
    with pytest.raises(NotADirectoryError, match="torch.load"):
        load(str(path))
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    save({"sparse": sparse, "meta": torch.empty(3, device="meta"), "w": torch.ones(2)}, str(path))
    assert path.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
    got = load(str(path))
    assert torch.equal(got["sparse"].to_dense(), sparse.to_dense())
    assert got["meta"].device.type == "meta" and got["meta"].shape == (3,)
    assert torch.equal(got["w"], torch.ones(2))


def test_torch_style_load_checks_sparse_tensors_as_torch_load_does(tmp_path):
    """Under torch.sparse.check_sparse_tensor_invariants torch.load refuses a sparse tensor
    whose indices are out of its size (reading it is out of bounds); load returned it."""
    from cachemw.checkpoint import load, save

    bad = torch.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.tensor([1.0, 2.0]), (3,),
                                  check_invariants=False)
    save({"s": bad}, str(tmp_path / "ck"))
    with torch.sparse.check_sparse_tensor_invariants():
        with pytest.raises(RuntimeError, match="inconsistent with indices"):
            load(str(tmp_path / "ck"))
    assert load(str(tmp_path / "ck"))["s"].shape == (3,)  # unchecked, as torch.load by default
    good = torch.randn(4, 4).to_sparse()
    save({"s": good}, str(tmp_path / "good"))
    with torch.sparse.check_sparse_tensor_invariants():
        assert torch.equal(load(str(tmp_path / "good"))["s"].to_dense(), good.to_dense())


def test_torch_style_load_of_a_checkpointer_step_says_what_it_is(tmp_path):
    """It raised a bare KeyError naming an internal key."""
    from cachemw.checkpoint import Checkpointer, load

    with Checkpointer(str(tmp_path / "run"), fast_root=None) as ck:
        ck.save(3, {"w": torch.ones(2)}).wait(60)
    step = next((tmp_path / "run").glob("step_*"))
    with pytest.raises(ValueError, match=r"Checkpointer\(root\)\.load"):
        load(str(step))
