"""DLIO workload files (YAML, dlio_benchmark 2.0.0's own keys) -> ``Workload``, the job's settings.

A user can bring a workload file written for DLIO (``configs/workload/*.yaml`` of
dlio_benchmark 2.0.0, the version cachemw pins): every key DLIO reads is known here
(dlio_keys.py). Those the job emulates set a field; those it does not (formats,
TensorFlow options, evaluation, profiling, storage, ...) are named in one warning, since a
run that silently drops a setting would measure something else than the file says. A key
DLIO does not know either is an error naming it (a typo would otherwise be a setting that
never applies), with the nearest known key, or 2.0.0's name for a later release's key.

Names and defaults follow dlio_benchmark 2.0.0's ``utils/config.py`` (``ConfigArguments``
and ``LoadConfig``): ``dataset.record_length`` is a sample's size in bytes,
``checkpoint.model_size`` the checkpointed state's, ``model`` the workload's name;
checkpoints are off unless ``workflow.checkpoint`` is true; ``train.total_training_steps``
stops each epoch after that many steps (2.0.0 counts them per epoch); AU leaves out the
first step, as 2.0.0's statistics do.

``--set dataset.num_files_train=64`` (``overrides``) changes one key from the command line,
as DLIO's ``++workload.dataset.num_files_train=64`` does.
"""
from __future__ import annotations

import dataclasses
import os
import re
import warnings
from typing import Any, Mapping

import yaml

from .dlio_keys import AS_EMULATED, EMULATED, LATER_NAMES, NOT_EMULATED, SECTIONS, known, unknown_key_hint
from .settings import WORKLOAD_DIR, shipped


@dataclasses.dataclass(frozen=True)
class Workload:
    """One DLIO workload as the job runs it. Defaults are DLIO's, except where noted."""

    name: str = "default"
    train: bool = True
    checkpoint: bool = False
    generate_data: bool = False  # the job generates a missing dataset whatever this says
    num_files_train: int = 8
    num_samples_per_file: int = 1
    record_length_bytes: int = 64 * 1024
    record_length_bytes_stdev: int = 0
    file_prefix: str = "img"
    batch_size: int = 1
    read_threads: int = 1
    prefetch_size: int = 2
    sample_shuffle: str = "off"
    multiprocessing_context: str = "fork"
    epochs: int = 1
    computation_time: float = 0.0
    computation_time_stdev: float = 0.0
    total_training_steps: int = -1
    seed: int = 123
    steps_between_checkpoints: int = -1
    epochs_between_checkpoints: int = 1
    checkpoint_after_epoch: int = 1
    model_size_bytes: int = 10240
    au: float = 0.90
    # AU leaves out the first step, as 2.0.0's statistics do (no key sets these)
    exclude_start_steps: int = 1
    exclude_end_steps: int = 0
    not_emulated: tuple = ()  # DLIO keys the file set that the job does not emulate

    def __post_init__(self) -> None:
        if not self.train:
            raise ValueError("workflow.train: the job emulates training; a workload with "
                             "train: false (checkpoint or generation only) is not supported")
        for name in ("num_files_train", "num_samples_per_file", "record_length_bytes",
                     "batch_size", "epochs", "epochs_between_checkpoints",
                     "checkpoint_after_epoch", "model_size_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_key_of(name)}: must be >= 1, got {getattr(self, name)}")
        for name in ("read_threads", "prefetch_size", "record_length_bytes_stdev",
                     "computation_time", "computation_time_stdev"):
            if getattr(self, name) < 0:
                raise ValueError(f"{_key_of(name)}: must be >= 0, got {getattr(self, name)}")
        if self.steps_between_checkpoints == 0 or self.steps_between_checkpoints < -1:
            raise ValueError("checkpoint.steps_between_checkpoints: must be >= 1, or -1 for "
                             f"per-epoch checkpoints, got {self.steps_between_checkpoints}")
        if self.multiprocessing_context not in ("fork", "spawn", "forkserver"):
            raise ValueError("reader.multiprocessing_context: expected fork, spawn or "
                             f"forkserver, got {self.multiprocessing_context!r}")
        if not 0 < self.au <= 1:
            raise ValueError(f"metric.au: expected a fraction in (0, 1], got {self.au}")
        if self.samples < self.batch_size:  # whole batches only, as DLIO: no step at all
            raise ValueError(f"reader.batch_size: {self.batch_size} is more than the dataset's "
                             f"{self.samples} samples (dataset.num_files_train x "
                             f"dataset.num_samples_per_file): an epoch would have no step")

    # -- derived ---------------------------------------------------------------------

    @property
    def samples(self) -> int:
        return self.num_files_train * self.num_samples_per_file

    @property
    def steps_per_epoch(self) -> int:
        """DLIO's: floor(samples / batch_size) (a last partial batch is dropped)."""
        return self.samples // self.batch_size

    @property
    def epoch_steps(self) -> int:
        """Steps an epoch trains: ``steps_per_epoch``, at most ``total_training_steps``
        when that is set (> 0): dlio_benchmark 2.0.0 counts a run's steps per epoch and
        stops each epoch there (``main.py``, ``_train``), every epoch still run."""
        if self.total_training_steps > 0:
            return min(self.steps_per_epoch, self.total_training_steps)
        return self.steps_per_epoch

    @property
    def dataset_bytes(self) -> int:
        return self.samples * self.record_length_bytes

    @property
    def prefetch_factor(self) -> int:
        """DLIO's torch loader: ceil(prefetch_size / read_threads) batches per worker, 2 if 0."""
        if self.read_threads == 0 or self.prefetch_size == 0:
            return 2
        return -(-self.prefetch_size // self.read_threads)

    def checkpoint_due(self, step: int, epoch: int, last_step_of_epoch: bool) -> bool:
        """Whether the job checkpoints after global ``step`` (1-based, counted over epochs),
        in ``epoch`` (1-based): every ``steps_between_checkpoints`` steps, or at the end
        of epoch ``checkpoint_after_epoch`` and every ``epochs_between_checkpoints`` after.
        One difference from dlio_benchmark 2.0.0, kept on purpose: 2.0.0 restarts its step
        count each epoch, so an interval longer than an epoch never checkpoints there."""
        if not self.checkpoint:
            return False
        if self.steps_between_checkpoints > 0:
            return step % self.steps_between_checkpoints == 0
        return (last_step_of_epoch and epoch >= self.checkpoint_after_epoch and
                (epoch - self.checkpoint_after_epoch) % self.epochs_between_checkpoints == 0)

    def steps_for_saves(self, saves: int) -> list[int]:
        """The steps of each epoch to train for exactly ``saves`` checkpoints on the
        workload's schedule: whole epochs (``epoch_steps``), the last one stopped at the
        step of the last save (it is whole on a per-epoch schedule)."""
        if self.steps_between_checkpoints > 0:
            whole, rest = divmod(saves * self.steps_between_checkpoints, self.epoch_steps)
            return [self.epoch_steps] * whole + ([rest] if rest else [])
        epochs = self.checkpoint_after_epoch + (saves - 1) * self.epochs_between_checkpoints
        return [self.epoch_steps] * epochs


def _key_of(field: str) -> str:
    for key, (f, _) in EMULATED.items():
        if f == field:
            return key
    return field


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def from_mapping(tree: Mapping, *, source: str = "workload", overrides: Mapping[str, Any] = ()) -> Workload:
    """A Workload from a DLIO workload mapping (a parsed YAML file) plus ``key=value``
    overrides (strings parsed as YAML scalars, as on DLIO's command line)."""
    if not isinstance(tree, Mapping):
        raise ValueError(f"{source}: expected a mapping of DLIO sections (dataset:, reader:, "
                         f"train:, ...), got {type(tree).__name__}")
    if set(tree) == {"workload"} and isinstance(tree["workload"], Mapping):
        tree = tree["workload"]  # a file written as hydra's ++workload.* group
    if "data_reader" in tree:  # DLIO 2.0.0's other name of the reader section
        if "reader" in tree:
            raise ValueError(f"{source}: both reader: and data_reader: (dlio_benchmark reads "
                             f"data_reader: alone then); keep one")
        tree = {("reader" if k == "data_reader" else k): v for k, v in tree.items()}
    flat = _flatten(tree)
    given: set[str] = set()  # keys set on the command line: named as such in messages
    for key, value in dict(overrides).items():
        key = key.removeprefix("++").removeprefix("workload.")
        if key.startswith("data_reader."):
            key = "reader." + key.removeprefix("data_reader.")
        flat[key] = yaml.safe_load(value) if isinstance(value, str) else value
        given.add(key)

    for later, key in LATER_NAMES.items():  # a later DLIO's name: taken as 2.0.0's
        if later in flat:
            value = flat.pop(later)
            if key in flat and flat[key] != value:
                raise ValueError(f"{source}: {later} ({value!r}) and {key} ({flat[key]!r}) say "
                                 f"the same (a later dlio_benchmark's name and 2.0.0's): keep one")
            flat[key] = value
            if later in given:
                given.add(key)

    def where(key: str) -> str:
        return f"--set {key}" if key in given else f"{source}: {key}"

    fields: dict[str, Any] = {}
    skipped = []
    for key, value in flat.items():
        if key in EMULATED:
            field, convert = EMULATED[key]
            try:
                fields[field] = convert(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{where(key)}: {exc}") from None
        elif key in AS_EMULATED and str(value).lower() == AS_EMULATED[key]:
            continue
        elif key in AS_EMULATED:
            skipped.append(f"{key} ({value}: the job runs {AS_EMULATED[key]})")
        elif known(key) or any(key.startswith(k + ".") for k in NOT_EMULATED):
            skipped.append(key)
        elif key in SECTIONS and (value is None or value == {}):
            continue  # a section left empty sets nothing
        else:
            raise ValueError(f"{where(key).removesuffix(': ' + key)}: unknown key {key!r}: "
                             f"{unknown_key_hint(key)}")
    if skipped:
        by_set = sorted(s for s in skipped if s.split(" ")[0] in given)
        in_file = sorted(s for s in skipped if s.split(" ")[0] not in given)
        said = ([f"{source}: {', '.join(in_file)}"] if in_file else []) + (
            [f"given with --set: {', '.join(by_set)}"] if by_set else [])
        warnings.warn(f"DLIO keys the job does not emulate, ignored: {'; '.join(said)}",
                      UserWarning, stacklevel=2)
    try:
        return Workload(**fields, not_emulated=tuple(sorted(skipped)))
    except ValueError as exc:
        raise ValueError(_blamed(str(exc), source, given)) from None


_KEY = re.compile(r"(?<![\w.])([a-z_]+(?:\.[a-z_]+)+)(?![\w.])")


def _blamed(message: str, source: str, given: set) -> str:
    """A bad value's message, said of whoever set the keys it names: the workload file,
    ``--set``, or the file with some ``--set`` (a dataset too small for the batch)."""
    named = [k for k in dict.fromkeys(_KEY.findall(message)) if k in EMULATED]
    by_set = [k for k in named if k in given]
    if not by_set:
        return f"{source}: {message}"
    if len(by_set) == len(named):
        return f"--set {message}"
    return f"{source} with --set {', '.join(by_set)}: {message}"


def load(name_or_path: str, overrides: Mapping[str, Any] = ()) -> Workload:
    """A shipped workload by name, or a DLIO workload file by path."""
    path = name_or_path
    if not os.path.exists(path):
        path = os.path.join(WORKLOAD_DIR, f"{name_or_path}.yaml")
        if not os.path.exists(path):
            raise ValueError(f"workload {name_or_path!r}: no such file, nor one of the "
                             f"shipped workloads ({', '.join(shipped())})")
    with open(path) as f:
        try:
            tree = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
    return from_mapping(tree or {}, source=path, overrides=overrides)
