"""DLIO workload files -> the main job's settings (cachemw/job/workload.py), the AU
arithmetic on synthetic timelines (timeline.py) and the targets/verdict of a run
(results.py). No torch, no processes."""
from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import pytest
import yaml

from cachemw.job import results
from cachemw.job.dlio_keys import known
from cachemw.job.settings import shipped
from cachemw.job.timeline import Epoch, Step, accelerator_utilisation
from cachemw.job.workload import from_mapping, load

# dlio_benchmark 2.0.0's own configs/workload/unet3d_a100.yaml, as it ships
UNET3D_A100 = """
model: unet3d

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
  record_length: 146600628
  record_length_stdev: 68341808
  record_length_resize: 2097152

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
  model_size: 499153191

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
    assert wl.model_size_bytes == 499153191  # DLIO 2.0.0's checkpoint.model_size: bytes
    message = str(caught[0].message)
    for key in ("dataset.format", "dataset.data_folder", "dataset.record_length_resize",
                "reader.file_shuffle", "checkpoint.checkpoint_folder"):
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


def test_hydra_groups_and_command_line_overrides():
    wl = from_mapping({"workload": {"train": {"computation_time": 0.2,
                                              "computation_time_stdev": 0.05, "epochs": 3}}},
                      overrides={"train.epochs": "2", "++workload.reader.batch_size": "8",
                                 "checkpoint.steps_between_checkpoints": "5",
                                 "workflow.checkpoint": "true"})
    assert (wl.computation_time, wl.computation_time_stdev) == (0.2, 0.05)
    assert (wl.epochs, wl.batch_size) == (2, 8)
    assert [s for s in range(1, 16) if wl.checkpoint_due(s, 1, False)] == [5, 10, 15]
    # DLIO 2.0.0's other name of the reader section
    assert from_mapping({"data_reader": {"batch_size": 4}}).batch_size == 4
    assert from_mapping({}, overrides={"data_reader.read_threads": "3"}).read_threads == 3
    with pytest.raises(ValueError, match="both reader: and data_reader:"):
        from_mapping({"reader": {"batch_size": 2}, "data_reader": {"batch_size": 4}})
    assert from_mapping({"evaluation": None, "profiling": {}}).name == "default"  # empty sections


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


REPO = Path(__file__).resolve().parent.parent


def test_the_keys_of_dlio_2_0_0_are_read_as_it_reads_them():
    """The job followed a later DLIO's names (record_length_bytes, model.name,
    model.model_size_bytes) and refused every workload file DLIO 2.0.0 (the version cachemw
    pins) ships, cachemw's own cachemw_unet3d.yaml too, saying DLIO does not read keys it
    does (found by a black-box check)."""
    wl = from_mapping({"model": "bert", "dataset": {"record_length": 2500,
                                                    "record_length_stdev": 10},
                       "checkpoint": {"model_size": 4034713312},
                       "train": {"total_training_steps": 1000}})
    assert (wl.name, wl.record_length_bytes, wl.record_length_bytes_stdev) == ("bert", 2500, 10)
    assert (wl.model_size_bytes, wl.total_training_steps) == (4034713312, 1000)
    # DLIO's resnet50_*.yaml give the mean record size with a fraction: a whole byte here
    assert from_mapping({"dataset": {"record_length": 114660.07}}).record_length_bytes == 114660
    # a later release's name (MLPerf Storage's files, the record_length_bytes): taken
    # as 2.0.0's key; both, differing: an error
    for key, value, field, want in (("model.name", "x", "name", "x"),
                                    ("model.model_size_bytes", "1024", "model_size_bytes", 1024),
                                    ("dataset.record_length_bytes", "4096", "record_length_bytes", 4096),
                                    ("train.computation_time.mean", "0.2", "computation_time", 0.2)):
        assert getattr(from_mapping({}, overrides={key: value}), field) == want, key
    later = from_mapping({"dataset": {"record_length_bytes": 8192, "num_files_train": 8}})
    assert later.record_length_bytes == 8192
    with pytest.raises(ValueError, match="record_length_bytes .* and dataset.record_length .*keep one"):
        from_mapping({"dataset": {"record_length_bytes": 8192, "record_length": 4096}})
    with pytest.raises(ValueError, match=r"wl\.yaml: unknown key 'model\.type': .*model as the "
                                         r"workload's name"):
        from_mapping({"model": {"type": "cnn"}}, source="wl.yaml")


def test_cachemws_own_dlio_workload_loads_with_what_it_does_not_emulate_named():
    path = REPO / "cachemw" / "dlio" / "configs" / "workload" / "cachemw_unet3d.yaml"
    with pytest.warns(UserWarning) as caught:
        wl = load(str(path))
    assert (wl.name, wl.num_files_train, wl.record_length_bytes) == ("cachemw_unet3d", 64, 4194304)
    assert (wl.record_length_bytes_stdev, wl.model_size_bytes) == (1048576, 67108864)
    assert wl.checkpoint and (wl.checkpoint_after_epoch, wl.epochs_between_checkpoints) == (1, 1)
    message = str(caught[0].message)
    for key in ("dataset.record_length_resize", "reader.reader_classname", "dataset.format",
                "checkpoint.checkpoint_mechanism_classname", "checkpoint.checkpoint_folder"):
        assert key in message, message


def _dlio_package() -> Path | None:
    found = sorted(REPO.glob("build/dlio-venv/lib/python3*/site-packages/dlio_benchmark"))
    return found[0] if found else None


@pytest.mark.skipif(_dlio_package() is None, reason="no build/dlio-venv (tests/test_dlio.py makes it)")
def test_every_key_dlio_reads_and_every_workload_it_ships_are_known():
    """Against the installed dlio_benchmark 2.0.0 itself: each key its LoadConfig looks up
    is known here, and each of its workload files loads (its keys the job does not emulate
    named in a warning)."""
    package = _dlio_package()
    config = (package / "utils" / "config.py").read_text()
    looked_up = set(re.findall(r"'(\w+)' in config\['(\w+)'\]", config))
    keys = {f"{section}.{key}" for key, section in looked_up}
    keys |= {f"reader.{k}" for k in re.findall(r"'(\w+)' in reader:", config)}
    sections = {section for _, section in looked_up} | {"reader", "data_reader"}
    keys |= set(re.findall(r"'(\w+)' in config:", config)) - sections  # model, framework
    assert {"model", "framework", "dataset.record_length", "checkpoint.model_size"} <= keys
    assert len(keys) > 60, keys  # the pattern still finds DLIO's lookups
    assert {k for k in keys if not known(k)} == set()
    files = sorted((package / "configs" / "workload").glob("*.yaml"))
    assert len(files) >= 14
    for path in files:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load(str(path))


def test_integer_keys_take_whole_numbers_only_and_bad_values_name_their_key():
    """8.5 was cut to 8 without a word, "abc" said "could not convert string to float", and
    a bad --set value was blamed on the workload file (found by a black-box check)."""
    with pytest.raises(ValueError, match=r"^--set dataset\.num_files_train: expected an integer, got 8\.5$"):
        from_mapping({}, source="wl.yaml", overrides={"dataset.num_files_train": "8.5"})
    with pytest.raises(ValueError, match=r"^--set dataset\.num_files_train: expected an integer, got 'abc'$"):
        from_mapping({}, source="wl.yaml", overrides={"dataset.num_files_train": "abc"})
    with pytest.raises(ValueError, match=r"^--set train\.computation_time: expected a number, got 'x'$"):
        from_mapping({}, source="wl.yaml", overrides={"train.computation_time": "x"})
    assert from_mapping({"dataset": {"num_files_train": 8.0}}).num_files_train == 8
    with pytest.raises(ValueError, match=r"^wl\.yaml: dataset\.num_files_train: expected an integer"):
        from_mapping({"dataset": {"num_files_train": 8.5}}, source="wl.yaml")
    # a bad value is said of whoever set it: --set, the file, or the file with --set
    with pytest.raises(ValueError, match=r"^--set dataset\.num_files_train: must be >= 1, got 0$"):
        from_mapping({"dataset": {"num_files_train": 8}}, source="wl.yaml",
                     overrides={"dataset.num_files_train": "0"})
    with pytest.raises(ValueError, match=r"^wl\.yaml: dataset\.num_files_train: must be >= 1"):
        from_mapping({"dataset": {"num_files_train": 0}}, source="wl.yaml",
                     overrides={"train.epochs": "2"})
    with pytest.raises(ValueError, match=r"^wl\.yaml with --set dataset\.num_files_train: "
                                         r"reader\.batch_size: 64 is more"):
        from_mapping({"reader": {"batch_size": 64}}, source="wl.yaml",
                     overrides={"dataset.num_files_train": "32"})


def test_total_training_steps_stops_each_epoch_as_dlio_2_0_0_does():
    wl = from_mapping({"dataset": {"num_files_train": 32}, "reader": {"batch_size": 4},
                       "train": {"total_training_steps": 3}})
    assert (wl.steps_per_epoch, wl.epoch_steps) == (8, 3)
    assert from_mapping({"train": {"total_training_steps": 100}}).epoch_steps == 8


def test_the_checkpoint_phase_trains_for_exactly_the_saves_asked():
    """--checkpoint-saves 1 made 4 saves: the job trained whole epochs and counted every
    save in them (found by a black-box check). Exactly N now: the last epoch stops at its
    last save."""
    def saves_made(wl, plan):
        step, made = 0, []
        for epoch, steps in enumerate(plan, start=1):
            for i in range(steps):
                step += 1
                made += [step] if wl.checkpoint_due(step, epoch, i == steps - 1) else []
        return made

    every2 = from_mapping({"workflow": {"checkpoint": True}, "reader": {"batch_size": 1},
                           "checkpoint": {"steps_between_checkpoints": 2}})  # 8 steps an epoch
    assert every2.steps_for_saves(1) == [2] and saves_made(every2, [2]) == [2]
    assert every2.steps_for_saves(5) == [8, 2] and len(saves_made(every2, [8, 2])) == 5
    capped = from_mapping({"workflow": {"checkpoint": True}, "train": {"total_training_steps": 3},
                           "checkpoint": {"steps_between_checkpoints": 4}})
    assert capped.steps_for_saves(2) == [3, 3, 2] and saves_made(capped, [3, 3, 2]) == [4, 8]
    by_epoch = from_mapping({"workflow": {"checkpoint": True},
                             "checkpoint": {"checkpoint_after_epoch": 2,
                                            "epochs_between_checkpoints": 3}})
    plan = by_epoch.steps_for_saves(2)
    assert plan == [8] * 5 and saves_made(by_epoch, plan) == [16, 40]


def _checkpoints(saves: dict) -> dict:
    return {"state_mib": 1, "schedule": "every 2 steps", "reader": "cachemw", "methods": {
        "none": {"epochs": [{"au": 0.95}], "saves": []},
        **{key: {"epochs": [{"au": 0.95}], "saves": s} for key, s in saves.items()}}}


def test_a_checkpoint_target_without_saves_or_with_failed_ones_is_not_measured():
    """A Checkpointer that made no save was reported "AU lost ... met", and failed saves
    counted as cheap ones (found by a black-box check)."""
    ok = [{"step": 2, "stall_s": 0.01, "durable_s": 0.1, "error": None}]
    slow = [{"step": 2, "stall_s": 1.0, "durable_s": 1.0, "error": None}]
    checked = {t["key"]: t for t in results.targets(
        {"systems": {}, "checkpoints": _checkpoints({"torch.save": slow, "Checkpointer": []})})}
    assert checked["au_lost"]["value"] is None and checked["au_lost"]["met"] is None
    assert checked["stall_ratio"]["met"] is None
    failed = [{"step": 2, "stall_s": 0.01, "durable_s": None, "error": "OSError: gone"}]
    checked = {t["key"]: t for t in results.targets(
        {"systems": {}, "checkpoints": _checkpoints({"torch.save": slow, "Checkpointer": failed})})}
    for key in ("au_lost", "stall_ratio"):
        assert checked[key]["met"] is None and "Checkpointer failed" in checked[key]["note"]
    checked = {t["key"]: t for t in results.targets(
        {"systems": {}, "checkpoints": _checkpoints({"torch.save": slow, "Checkpointer": ok})})}
    assert checked["au_lost"]["met"] is True and checked["stall_ratio"]["met"] is True
