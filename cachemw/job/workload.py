"""DLIO workload files (YAML, dlio_benchmark's own keys) -> ``Workload``, the job's settings.

A user can bring a workload file written for DLIO (``configs/workload/*.yaml`` of
dlio_benchmark): every key DLIO reads is known here. Those the job emulates set a field;
those it does not (formats, TensorFlow options, evaluation, profiling, storage, ...) are
named in one warning, since a run that silently drops a setting would measure something
else than the file says. A key DLIO does not know either is an error naming it (a typo
would otherwise be a setting that never applies), with the nearest known key.

Names and defaults follow dlio_benchmark's ``utils/config.py`` (``ConfigArguments`` and
``LoadConfig``): e.g. ``model.model_size_bytes`` is the checkpointed state's size (DLIO
ignores ``model.model_size``, which some of its own files carry), AU leaves out the first
step (``output.metric.exclude_start_steps: 1``), checkpoints are off unless
``workflow.checkpoint`` is true.

``--set dataset.num_files_train=64`` (``overrides``) changes one key from the command line,
as DLIO's ``++workload.dataset.num_files_train=64`` does.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from typing import Any, Callable, Mapping

import yaml

from .settings import WORKLOAD_DIR, shipped

SHUFFLE_VALUES = ("off", "seed", "random")


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"expected an integer, got {v!r}")
    return int(float(v))


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"expected a number, got {v!r}")
    return float(v)


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise ValueError(f"expected true or false, got {v!r}")


def _shuffle(v: Any) -> str:
    s = str(v).lower() if not isinstance(v, bool) else ("seed" if v else "off")
    if s not in SHUFFLE_VALUES:
        raise ValueError(f"expected one of {', '.join(SHUFFLE_VALUES)}, got {v!r}")
    return s


def _str(v: Any) -> str:
    return str(v)


def _normal(v: Any) -> str:
    if v != "normal":
        raise ValueError(f"the job draws computation times from a normal distribution "
                         f"(mean, stdev) only, got type {v!r}")
    return v


# DLIO key -> (Workload field, converter). Timings given as {mean, stdev} dicts (DLIO's
# other form) are split by _flatten into key.mean / key.stdev.
EMULATED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "model.name": ("name", _str),
    "model.model_size_bytes": ("model_size_bytes", _int),
    "workflow.train": ("train", _bool),
    "workflow.checkpoint": ("checkpoint", _bool),
    "workflow.generate_data": ("generate_data", _bool),
    "dataset.num_files_train": ("num_files_train", _int),
    "dataset.num_samples_per_file": ("num_samples_per_file", _int),
    "dataset.record_length_bytes": ("record_length_bytes", _int),
    "dataset.record_length_bytes_stdev": ("record_length_bytes_stdev", _int),
    "dataset.file_prefix": ("file_prefix", _str),
    "reader.batch_size": ("batch_size", _int),
    "reader.read_threads": ("read_threads", _int),
    "reader.prefetch_size": ("prefetch_size", _int),
    "reader.sample_shuffle": ("sample_shuffle", _shuffle),
    "reader.multiprocessing_context": ("multiprocessing_context", _str),
    "train.epochs": ("epochs", _int),
    "train.computation_time": ("computation_time", _float),
    "train.computation_time.mean": ("computation_time", _float),
    "train.computation_time.stdev": ("computation_time_stdev", _float),
    "train.computation_time_stdev": ("computation_time_stdev", _float),
    "train.computation_time.type": ("computation_time_type", _normal),
    "train.total_training_steps": ("total_training_steps", _int),
    "train.seed": ("seed", _int),
    "checkpoint.steps_between_checkpoints": ("steps_between_checkpoints", _int),
    "checkpoint.epochs_between_checkpoints": ("epochs_between_checkpoints", _int),
    "checkpoint.checkpoint_after_epoch": ("checkpoint_after_epoch", _int),
    "metric.au": ("au", _float),
    "output.metric.exclude_start_steps": ("exclude_start_steps", _int),
    "output.metric.exclude_end_steps": ("exclude_end_steps", _int),
}

# Keys that describe what the job does anyway when they have this value (a DLIO file for
# the torch loader says so); any other value is not emulated (warned about).
AS_EMULATED = {"framework": "pytorch", "reader.data_loader": "pytorch"}

# Keys dlio_benchmark reads (utils/config.py LoadConfig) that the job does not emulate.
NOT_EMULATED = frozenset("""
storage.storage_type storage.storage_root storage.storage_options
dataset.record_length_bytes_resize dataset.num_files_eval dataset.generation_buffer_size
dataset.data_folder dataset.num_subfolders_train dataset.num_subfolders_eval
dataset.enable_chunking dataset.chunk_size dataset.compression dataset.compression_level
dataset.format dataset.keep_files dataset.record_element_bytes dataset.record_element_type
dataset.record_dims dataset.hdf5.chunk_dims dataset.hdf5.num_dset_per_record
dataset.hdf5.max_shape
reader.dont_use_mmap reader.reader_classname
reader.data_loader_classname reader.data_loader_sampler reader.computation_threads
reader.batch_size_eval reader.file_shuffle reader.file_access reader.shuffle_size
reader.read_type reader.transfer_size reader.odirect reader.preprocess_time
reader.preprocess_time.mean reader.preprocess_time.stdev reader.preprocess_time_stdev
reader.pin_memory reader.transformed_record_dims reader.transformed_record_element_type
train.seed_change_epoch
evaluation.eval_time evaluation.eval_time.mean evaluation.eval_time.stdev
evaluation.eval_time_stdev evaluation.eval_after_epoch evaluation.epochs_between_evals
checkpoint.checkpoint_folder checkpoint.type checkpoint.checkpoint_mechanism_classname
checkpoint.fsync checkpoint.time_between_checkpoints checkpoint.num_checkpoints_write
checkpoint.num_checkpoints_read checkpoint.recovery_rank_shift checkpoint.rank_sync
checkpoint.mode checkpoint.randomize_tensor checkpoint.ksm checkpoint.ksm.madv_mergeable_id
checkpoint.ksm.high_ram_trigger checkpoint.ksm.low_ram_exit checkpoint.ksm.await_time
model.type model.model_size model.optimization_groups model.num_layers
model.layer_parameters model.model_datatype model.optimizer_datatype
model.parallelism.tensor model.parallelism.pipeline model.parallelism.data
model.parallelism.zero_stage model.transformer.vocab_size model.transformer.hidden_size
model.transformer.ffn_hidden_size model.transformer.num_attention_heads
model.transformer.num_kv_heads
output.folder output.log_file
workflow.evaluation workflow.profiling workflow.debug
profiling.profiler profiling.iostat_devices
""".split())


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
    computation_time_type: str = "normal"  # DLIO's sleep(): abs(normal(mean, stdev))
    total_training_steps: int = -1
    seed: int = 123
    steps_between_checkpoints: int = -1
    epochs_between_checkpoints: int = 1
    checkpoint_after_epoch: int = 1
    model_size_bytes: int = 10240
    au: float = 0.90
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
                     "computation_time", "computation_time_stdev", "exclude_start_steps",
                     "exclude_end_steps"):
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
                             f"num_samples_per_file): an epoch would have no step")

    # -- derived ---------------------------------------------------------------------

    @property
    def samples(self) -> int:
        return self.num_files_train * self.num_samples_per_file

    @property
    def steps_per_epoch(self) -> int:
        """DLIO's: floor(samples / batch_size) (a last partial batch is dropped)."""
        return self.samples // self.batch_size

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
        of epoch ``checkpoint_after_epoch`` and every ``epochs_between_checkpoints`` after."""
        if not self.checkpoint:
            return False
        if self.steps_between_checkpoints > 0:
            return step % self.steps_between_checkpoints == 0
        return (last_step_of_epoch and epoch >= self.checkpoint_after_epoch and
                (epoch - self.checkpoint_after_epoch) % self.epochs_between_checkpoints == 0)


    def epochs_for_saves(self, saves: int) -> int:
        """Whole epochs to train for ``saves`` checkpoints on the workload's schedule."""
        if self.steps_between_checkpoints > 0:
            steps = saves * self.steps_between_checkpoints
            return max(1, -(-steps // max(1, self.steps_per_epoch)))
        return self.checkpoint_after_epoch + (saves - 1) * self.epochs_between_checkpoints


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
    flat = _flatten(tree)
    given: set[str] = set()  # keys set on the command line: named as such in messages
    for key, value in dict(overrides).items():
        key = key.removeprefix("++").removeprefix("workload.")
        flat[key] = yaml.safe_load(value) if isinstance(value, str) else value
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
        elif key in NOT_EMULATED or any(key.startswith(k + ".") for k in NOT_EMULATED):
            skipped.append(key)
        else:
            near = difflib.get_close_matches(key, [*EMULATED, *AS_EMULATED, *NOT_EMULATED],
                                             n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ValueError(f"{where(key).removesuffix(': ' + key)}: unknown key {key!r}{hint}: "
                             f"neither dlio_benchmark nor the job reads it; remove or fix it")
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
        raise ValueError(f"{source}: {exc}") from None


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
