"""DLIO workload files -> the main job's settings (cachemw/job/workload.py), the AU
arithmetic on synthetic timelines (timeline.py) and the targets/verdict of a run
(results.py). No torch, no processes."""
from __future__ import annotations

import math

import pytest
import yaml

from cachemw.job import results
from cachemw.job.settings import shipped
from cachemw.job.timeline import Epoch, Step, accelerator_utilisation
from cachemw.job.workload import from_mapping, load

# dlio_benchmark's own configs/workload/unet3d_a100.yaml, as it ships
UNET3D_A100 = """
model:
  name: unet3d
  type: cnn
  model_size: 499153191

framework: pytorch

workflow:
  generate_data: False
  train: True
  checkpoint: True

dataset:
  data_folder: data/unet3d/
  format: npz
  num_files_train: 168
  num_samples_per_file: 1
  record_length_bytes: 146600628
  record_length_bytes_stdev: 68341808
  record_length_bytes_resize: 2097152

reader:
  data_loader: pytorch
  batch_size: 7
  read_threads: 4
  file_shuffle: seed
  sample_shuffle: seed

train:
  epochs: 5
  computation_time: 0.636

checkpoint:
  checkpoint_folder: checkpoints/unet3d
  checkpoint_after_epoch: 5
  epochs_between_checkpoints: 2

metric:
  au: 0.90
"""


def test_a_dlio_workload_file_sets_the_jobs_settings_and_names_what_it_does_not_emulate():
    with pytest.warns(UserWarning) as caught:
        wl = from_mapping(yaml.safe_load(UNET3D_A100), source="unet3d_a100.yaml")
    assert (wl.name, wl.num_files_train, wl.num_samples_per_file) == ("unet3d", 168, 1)
    assert (wl.record_length_bytes, wl.record_length_bytes_stdev) == (146600628, 68341808)
    assert (wl.batch_size, wl.read_threads, wl.sample_shuffle) == (7, 4, "seed")
    assert (wl.epochs, wl.computation_time, wl.au) == (5, 0.636, 0.90)
    assert wl.checkpoint and (wl.checkpoint_after_epoch, wl.epochs_between_checkpoints) == (5, 2)
    assert wl.steps_between_checkpoints == -1 and wl.steps_per_epoch == 24
    # DLIO itself reads model.model_size_bytes; model.model_size is ignored there too
    assert wl.model_size_bytes == 10240
    message = str(caught[0].message)
    for key in ("dataset.format", "dataset.data_folder", "dataset.record_length_bytes_resize",
                "reader.file_shuffle", "checkpoint.checkpoint_folder", "model.model_size",
                "model.type"):
        assert key in message and key in wl.not_emulated
    # what the job does anyway is no warning: the torch loader
    assert "framework" not in message and "reader.data_loader" not in message


def test_an_unknown_key_is_an_error_naming_it_and_the_nearest_known_one():
    with pytest.raises(ValueError, match=r"dataset\.num_file_train.*did you mean "
                                         r"dataset\.num_files_train"):
        from_mapping({"dataset": {"num_file_train": 4}})
    with pytest.raises(ValueError, match="unknown key 'trian.epochs'"):
        from_mapping({"trian": {"epochs": 2}})


def test_values_are_checked_and_named():
    with pytest.raises(ValueError, match=r"reader\.batch_size: must be >= 1"):
        from_mapping({"reader": {"batch_size": 0}})
    with pytest.raises(ValueError, match=r"train\.epochs: expected an integer"):
        from_mapping({"train": {"epochs": [1]}})
    with pytest.raises(ValueError, match=r"reader\.sample_shuffle: expected one of"):
        from_mapping({"reader": {"sample_shuffle": "sometimes"}})
    with pytest.raises(ValueError, match="workflow.train"):
        from_mapping({"workflow": {"train": False}})
    with pytest.warns(UserWarning, match=r"framework \(tensorflow: the job runs pytorch\)"):
        from_mapping({"framework": "tensorflow"})


def test_timings_as_dlio_dicts_hydra_groups_and_command_line_overrides():
    wl = from_mapping({"workload": {"train": {"computation_time": {"mean": 0.2, "stdev": 0.05},
                                              "epochs": 3}}},
                      overrides={"train.epochs": "2", "++workload.reader.batch_size": "8",
                                 "checkpoint.steps_between_checkpoints": "5",
                                 "workflow.checkpoint": "true"})
    assert (wl.computation_time, wl.computation_time_stdev) == (0.2, 0.05)
    assert (wl.epochs, wl.batch_size) == (2, 8)
    assert [s for s in range(1, 16) if wl.checkpoint_due(s, 1, False)] == [5, 10, 15]
    with pytest.raises(ValueError, match="normal distribution"):
        from_mapping({"train": {"computation_time": {"type": "gamma", "shape": 1}}})


def test_epoch_checkpoint_schedule_as_dlio():
    wl = from_mapping({"workflow": {"checkpoint": True},
                       "checkpoint": {"checkpoint_after_epoch": 2, "epochs_between_checkpoints": 2}})
    assert [e for e in range(1, 8) if wl.checkpoint_due(99, e, True)] == [2, 4, 6]
    assert not wl.checkpoint_due(99, 2, False)
    assert not from_mapping({}).checkpoint_due(1, 1, True)  # workflow.checkpoint off


def test_shipped_workloads_load_without_warnings(recwarn):
    assert {"image_classification", "unet3d", "records"} <= set(shipped())
    for name in shipped():
        wl = load(name)
        assert wl.checkpoint and wl.steps_per_epoch >= 8, name
    assert not [w for w in recwarn.list if issubclass(w.category, UserWarning)]
    with pytest.raises(ValueError, match="no such file"):
        load("no-such-workload")


def _steps(rows):
    """rows: (load, compute, checkpoint) per step; ends accumulate from 0."""
    out, t = [], 0.0
    for load_s, compute_s, ckpt_s in rows:
        t += load_s + compute_s + ckpt_s
        out.append(Step(load_s, compute_s, ckpt_s, t, samples=4, nbytes=400))
    return out


def test_au_leaves_out_the_first_step_and_counts_stalls_as_idle():
    steps = _steps([(1.0, 0.1, 0), (0.1, 0.1, 0), (0.0, 0.1, 0), (0.3, 0.1, 0)])
    assert accelerator_utilisation(steps) == pytest.approx(0.3 / 0.7)
    assert accelerator_utilisation(steps, exclude_start=0) == pytest.approx(0.4 / 1.8)
    assert accelerator_utilisation(steps, exclude_start=1, exclude_end=1) == pytest.approx(0.2 / 0.3)
    assert math.isnan(accelerator_utilisation(steps[:1]))
    # a checkpoint's stall is time the accelerator does not compute
    with_ckpt = _steps([(1.0, 0.1, 0), (0.0, 0.1, 0.5), (0.0, 0.1, 0)])
    assert accelerator_utilisation(with_ckpt) == pytest.approx(0.2 / 0.7)
    # time between steps (the loop's own work) counts too: span from step ends
    gap = [Step(0.5, 0.1, 0, 0.6, 4, 400), Step(0.0, 0.1, 0, 0.9, 4, 400)]
    assert accelerator_utilisation(gap) == pytest.approx(0.1 / 0.3)


def test_epoch_summary():
    ep = Epoch(2, tuple(_steps([(1.0, 0.1, 0), (0.1, 0.1, 0.2)])), wall=1.5)
    s = ep.summary()
    assert (s["epoch"], s["steps"], s["samples"], s["bytes"]) == (2, 2, 8, 800)
    assert s["samples_per_s"] == pytest.approx(8 / 1.5)
    assert s["io_wait_s"] == pytest.approx(1.1) and s["checkpoint_stall_s"] == pytest.approx(0.2)
    assert s["au"] == pytest.approx(0.1 / 0.4)


def _system(label, walls_aus_rates):
    return {"label": label, "epochs": [
        {"epoch": i + 1, "wall_s": w, "au": a, "samples_per_s": r, "mib_per_s": 1.0,
         "io_wait_s": 0.1} for i, (w, a, r) in enumerate(walls_aus_rates)]}


def test_targets_and_verdict_from_a_run():
    run = {"systems": {
        "direct": _system("direct", [(10, 0.3, 100), (10, 0.3, 100)]),
        "simplecache": _system("simplecache", [(20, 0.2, 50), (4, 0.9, 300)]),
        "cachemw": _system("cachemw", [(10.5, 0.3, 95), (3.5, 0.95, 330)]),
        "cachemw+announce": _system("announce", [(6, 0.6, 160), (3.5, 0.95, 330)]),
    }, "checkpoints": {"state_mib": 64, "schedule": "every 8 steps", "reader": "cachemw",
                       "methods": {
        "none": {"epochs": [{"au": 0.950}], "saves": []},
        "torch.save": {"epochs": [{"au": 0.6}], "saves": [{"stall_s": 1.0, "durable_s": 1.0}] * 2},
        "Checkpointer": {"epochs": [{"au": 0.945}],
                         "saves": [{"stall_s": 0.05, "durable_s": 0.9}, {"stall_s": 0.07, "durable_s": 1.1}]},
    }}}
    # the caches' flat-out epochs (no compute): the cache-vs-cache target is taken there
    # (medians: one epoch of a fraction of a second that swings does not move the ratio)
    run["systems"]["simplecache"]["io_epochs"] = _system(
        "s", [(1, 0, 1000), (1, 0, 1200), (1, 0, 5000)])["epochs"]
    run["systems"]["cachemw"]["io_epochs"] = _system(
        "c", [(1, 0, 1400), (1, 0, 1800), (1, 0, 1600)])["epochs"]
    checked = {t["key"]: t for t in results.targets(run)}
    assert checked["cachemw_au"]["met"] and checked["direct_au"]["met"]
    assert checked["vs_simplecache"]["value"] == pytest.approx(1600 / 1200)
    assert checked["vs_simplecache"]["met"] is False
    assert checked["announce_epoch1"]["value"] == pytest.approx(0.6) and checked["announce_epoch1"]["met"]
    assert checked["cold_epoch1"]["value"] == pytest.approx(1.05) and checked["cold_epoch1"]["met"]
    assert checked["stall_ratio"]["value"] == pytest.approx(0.06) and checked["stall_ratio"]["met"]
    assert checked["au_lost"]["value"] == pytest.approx(0.5) and checked["au_lost"]["met"]
    line = results.verdict(list(checked.values()))
    assert line.startswith("targets met: 6 of 7 measured; NOT met: cachemw / simplecache")
    text = results.table({**run, "targets": list(checked.values())})
    assert "NOT met" in text and "Checkpointer" in text
    assert "cachemw / simplecache samples/s: 1.33 with no compute; 1.10 in training" in text
    assert results.over_floor(run) is None and "own floor" not in text  # no floor measured
    # the DataLoader's floor (samples in memory): what each cache adds per sample (medians)
    run["floor"] = {"label": "floor", "io_epochs": _system(
        "f", [(1, 0, 2500), (1, 0, 2000), (1, 0, 900)])["epochs"]}
    beyond = results.over_floor(run)
    assert beyond == pytest.approx({"floor_us": 500.0, "cachemw_added_us": 1e6 / 1600 - 500,
                                    "simplecache_added_us": 1e6 / 1200 - 500})
    text = results.table({**run, "targets": list(checked.values())})
    assert ("per sample over the DataLoader's own floor (500 us, samples in memory): "
            "cachemw adds 125 us, simplecache 333 us") in text
    assert [t["value"] for t in results.targets(run)] == [t["value"] for t in checked.values()]
    # on the user's own store (--source) direct reads being fast is no failure of the cache
    own = {t["key"]: t for t in results.targets({**run, "job": {"profile": None}})}
    assert own["direct_au"]["met"] is None and "--source" in own["direct_au"]["note"]
    assert own["direct_au"]["value"] == checked["direct_au"]["value"]
    assert "(--source)" in results.table({**run, "targets": list(own.values())})
    assert results.verdict(list(own.values())).startswith("targets met: 5 of 6 measured")
    emulated = {t["key"]: t for t in results.targets({**run, "job": {"profile": {"x": 1}}})}
    assert emulated["direct_au"]["met"] is True
    # nothing measured: said so, not "all met"
    empty = results.targets({"systems": {}})
    assert all(t["met"] is None for t in empty)
    assert results.verdict(empty).startswith("no target could be measured")


def test_keys_given_with_set_are_named_as_such():
    """A key given with --set was reported as a key of the workload file, which the user
    never edited (found by a black-box check)."""
    with pytest.raises(ValueError, match=r"^--set dataset\.num_file_train: unknown key"):
        from_mapping({"dataset": {"num_files_train": 4}}, source="wl.yaml",
                     overrides={"dataset.num_file_train": "3"})
    with pytest.raises(ValueError, match=r"^--set train\.epochs: "):
        from_mapping({}, source="wl.yaml", overrides={"train.epochs": "[1]"})
    with pytest.warns(UserWarning) as caught:
        from_mapping({"dataset": {"format": "npz"}}, source="wl.yaml",
                     overrides={"reader.transfer_size": "262144"})
    message = str(caught[0].message)
    assert "wl.yaml: dataset.format" in message and "given with --set: reader.transfer_size" in message


def test_a_dataset_smaller_than_a_batch_is_an_error():
    """It ran epochs of no step, and reported targets from them (found by a black-box check)."""
    with pytest.raises(ValueError, match=r"reader\.batch_size: 64 is more than the dataset's 32 samples"):
        from_mapping({"dataset": {"num_files_train": 32}, "reader": {"batch_size": 64}})
