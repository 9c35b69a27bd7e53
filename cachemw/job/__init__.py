"""The main job (``cachemw job``, ``make run``): a DLIO-style training emulation on an
emulated slow shared store, with what users pick instead side by side.

Modules: ``store`` (the emulated PFS: an HTTP server in a process of its own), ``storefs``
(the fsspec filesystem that writes checkpoints to it), ``workload`` and ``dlio_keys`` (DLIO
2.0.0 workload YAML -> ``Workload``), ``training`` (the training loop and its AU timeline),
``systems`` (the read paths compared), ``checkpoints`` (the checkpoint methods compared),
``source`` (the dataset and each run's checkpoint directory on a store), ``owners`` (the
marks of the job's leftovers), ``results`` (table, JSON, PNG, verdict), ``command`` and
``arguments`` (the CLI) and ``run`` (the job itself).

Importing this package imports neither torch nor aiohttp; ``training``, ``systems``,
``checkpoints`` and ``run`` need torch.
"""
