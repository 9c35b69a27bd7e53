"""The YAML keys of a DLIO workload file as dlio_benchmark 2.0.0 reads them (the version
cachemw pins: pyproject's ``dlio`` extra, ``cachemw.dlio``), and how the job takes each.

Taken from dlio_benchmark 2.0.0's ``utils/config.py`` (``LoadConfig``: every key it looks
up) and checked against the 14 workload files it ships (``configs/workload/*.yaml``).
2.0.0's names differ from later releases' (``dataset.record_length``, not
``record_length_bytes``; ``model`` is the workload's name, not a section;
``checkpoint.model_size`` is the checkpointed state's size in bytes): the job takes a
later release's name as the 2.0.0 key that says the same (LATER_NAMES: a workload file of
MLPerf Storage's or a later DLIO's runs as written); both given with different values is an
error. (DLIO 2.0.0 itself ignores the later names: run such a file there, through
``cachemw.dlio``, with 2.0.0's.)
"""
from __future__ import annotations

import difflib
from typing import Any, Callable

from ..config_values import finite_float

SHUFFLE_VALUES = ("off", "seed", "random")


def _int(v: Any) -> int:
    """A whole number: 8, 8.0 or "8"; never 8.5 cut to 8, nor true taken as 1."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"expected an integer, got {v!r}")
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            try:
                v = float(v)
            except ValueError:
                raise ValueError(f"expected an integer, got {v!r}") from None
    if isinstance(v, float) and not v.is_integer():  # (nan and inf are not either)
        raise ValueError(f"expected an integer, got {v!r}")
    return int(v)


def _size(v: Any) -> int:
    """A record's size in bytes: a mean, which DLIO's own files give with a fraction
    (resnet50_*.yaml: 114660.07), rounded to a whole byte."""
    return round(_float(v))


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"expected a number, got {v!r}")
    return finite_float(v)


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
    if v is None or isinstance(v, (list, dict)):
        raise ValueError(f"expected a name, got {v!r}")
    return str(v)


# DLIO 2.0.0 key -> (Workload field, converter): the keys the job emulates.
EMULATED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "model": ("name", _str),
    "workflow.train": ("train", _bool),
    "workflow.checkpoint": ("checkpoint", _bool),
    "workflow.generate_data": ("generate_data", _bool),
    "dataset.num_files_train": ("num_files_train", _int),
    "dataset.num_samples_per_file": ("num_samples_per_file", _int),
    "dataset.record_length": ("record_length_bytes", _size),  # bytes a sample (record)
    "dataset.record_length_stdev": ("record_length_bytes_stdev", _size),
    "dataset.file_prefix": ("file_prefix", _str),
    "reader.batch_size": ("batch_size", _int),
    "reader.read_threads": ("read_threads", _int),
    "reader.prefetch_size": ("prefetch_size", _int),
    "reader.sample_shuffle": ("sample_shuffle", _shuffle),
    "reader.multiprocessing_context": ("multiprocessing_context", _str),
    "train.epochs": ("epochs", _int),
    "train.computation_time": ("computation_time", _float),
    "train.computation_time_stdev": ("computation_time_stdev", _float),
    "train.total_training_steps": ("total_training_steps", _int),
    "train.seed": ("seed", _int),
    "checkpoint.steps_between_checkpoints": ("steps_between_checkpoints", _int),
    "checkpoint.epochs_between_checkpoints": ("epochs_between_checkpoints", _int),
    "checkpoint.checkpoint_after_epoch": ("checkpoint_after_epoch", _int),
    "checkpoint.model_size": ("model_size_bytes", _int),  # bytes (DLIO: an int8 tensor)
    "metric.au": ("au", _float),
}

# Keys that describe what the job does anyway when they have this value (a DLIO file for
# the torch loader says so); any other value is not emulated (warned about).
AS_EMULATED = {"framework": "pytorch", "reader.data_loader": "pytorch"}

# Keys dlio_benchmark 2.0.0 reads that the job does not emulate (warned about, by name).
NOT_EMULATED = frozenset("""
storage.storage_type storage.storage_root
dataset.record_length_resize dataset.num_files_eval dataset.generation_buffer_size
dataset.data_folder dataset.num_subfolders_train dataset.num_subfolders_eval
dataset.enable_chunking dataset.chunk_size dataset.compression dataset.compression_level
dataset.format dataset.keep_files
reader.dont_use_mmap reader.reader_classname reader.data_loader_classname
reader.data_loader_sampler reader.computation_threads reader.batch_size_eval
reader.file_shuffle reader.file_access reader.shuffle_size reader.read_type
reader.transfer_size reader.preprocess_time reader.preprocess_time_stdev
train.seed_change_epoch
evaluation.eval_time evaluation.eval_time_stdev evaluation.eval_after_epoch
evaluation.epochs_between_evals
checkpoint.checkpoint_folder checkpoint.type checkpoint.checkpoint_mechanism_classname
checkpoint.optimization_groups checkpoint.num_layers checkpoint.layer_parameters
checkpoint.tensor_parallelism checkpoint.pipeline_parallelism
output.folder output.log_file
workflow.debug workflow.evaluation workflow.profiling
profiling.profiler profiling.iostat_devices
dataset.eval_num_samples_per_file evaluation.steps_between_evals train.total_eval_steps
workflow.do_eval
""".split())  # the last line: in 2.0.0's own dlrm.yaml, which 2.0.0 ignores as well

SECTIONS = frozenset(k.split(".")[0] for k in [*EMULATED, *AS_EMULATED, *NOT_EMULATED])

# A later dlio_benchmark's key -> the 2.0.0 key that says the same (taken as that key).
LATER_NAMES = {
    "model.name": "model",
    "model.model_size_bytes": "checkpoint.model_size",
    "model.model_size": "checkpoint.model_size",
    "model.optimization_groups": "checkpoint.optimization_groups",
    "model.num_layers": "checkpoint.num_layers",
    "model.layer_parameters": "checkpoint.layer_parameters",
    "model.parallelism.tensor": "checkpoint.tensor_parallelism",
    "model.parallelism.pipeline": "checkpoint.pipeline_parallelism",
    "dataset.record_length_bytes": "dataset.record_length",
    "dataset.record_length_bytes_stdev": "dataset.record_length_stdev",
    "dataset.record_length_bytes_resize": "dataset.record_length_resize",
    "train.computation_time.mean": "train.computation_time",
    "train.computation_time.stdev": "train.computation_time_stdev",
    "reader.preprocess_time.mean": "reader.preprocess_time",
    "reader.preprocess_time.stdev": "reader.preprocess_time_stdev",
    "evaluation.eval_time.mean": "evaluation.eval_time",
    "evaluation.eval_time.stdev": "evaluation.eval_time_stdev",
}


def known(key: str) -> bool:
    return key in EMULATED or key in AS_EMULATED or key in NOT_EMULATED


def unknown_key_hint(key: str) -> str:
    """Why ``key`` is refused, and what to write instead where that can be told."""
    if key in LATER_NAMES:
        return (f"a later dlio_benchmark's key, which 2.0.0 (the DLIO cachemw follows) does "
                f"not read: it reads {LATER_NAMES[key]}")
    if key.startswith("model."):
        return ("dlio_benchmark 2.0.0 (the DLIO cachemw follows) reads model as the "
                "workload's name (model: unet3d), not as a section")
    near = difflib.get_close_matches(key, [*EMULATED, *AS_EMULATED, *NOT_EMULATED], n=1,
                                     cutoff=0.6)
    hint = f" (did you mean {near[0]}?)" if near else ""
    return f"neither dlio_benchmark 2.0.0 nor the job reads it{hint}; remove or fix it"
