"""Plug-ins for DLIO (dlio_benchmark 2.0.0), the field's I/O benchmark for DL training.

- ``cachemw.dlio.reader.CachemwReader``: ``reader.reader_classname``. Reads the workload's
  files through ``cachemw::`` (DLIO's own readers open POSIX paths with ``np.load``,
  ``h5py``, PIL; no fsspec), so epoch 2 on reads the node's cache, not the store.
- ``cachemw.dlio.checkpointing.CachemwCheckpointing``:
  ``checkpoint.checkpoint_mechanism_classname``. DLIO's checkpoint state written by a
  ``cachemw.checkpoint.Checkpointer``: the training step waits for the snapshot only.

This module imports neither DLIO nor torch: ``python -m cachemw.dlio`` prints ``CONFIG_DIR``,
the Hydra config dir holding the ready workloads (``dlio_benchmark --config-dir DIR
workload=cachemw_unet3d``).
"""
from __future__ import annotations

import os

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
