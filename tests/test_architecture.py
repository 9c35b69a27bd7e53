"""The architecture as tests: the import-linter contracts of pyproject.toml hold, and no
module of the package imports another of its modules inside a function (the way an import
loop is usually dodged). See README "Layout"."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The three Python folders install as one package (setuptools package-dir): cachemw/,
# placement/ as cachemw.placement, checkpoint/ as cachemw.checkpoint (linked in cachemw/).
FOLDERS = {"cachemw": "cachemw", "placement": "cachemw.placement",
           "checkpoint": "cachemw.checkpoint"}

# Imports of the package's own modules that stay inside a function, each for its reason.
DEFERRED = {
    # `import cachemw` (which every fsspec read through cachemw does) must not load the
    # cluster layer: cachemw.start()/stop() load it when called.
    ("cachemw", "cachemw.cluster.actor"),
    # a reader process must not pay for importing the placement engine (~50 ms) to check
    # a daemon setting it rarely gives: config loads the engine's policy list when it does
    ("cachemw.config", "cachemw.placement.registry"),
    # `cachemw stats` and the other commands must not import torch (seconds): the main job's
    # command loads the job, which needs torch, when it runs
    ("cachemw.job.command", "cachemw.job.run"),
}


@pytest.mark.timeout(120)
def test_import_contracts_hold():
    lint = shutil.which("lint-imports", path=os.path.dirname(sys.executable))
    if lint is None:
        pytest.fail("lint-imports (import-linter) is not installed: it is a dev dependency")
    # cachemw/placement and cachemw/checkpoint are links to the top-level folders, so the
    # import graph sees the package as it installs
    run = subprocess.run([lint, "--config", str(REPO / "pyproject.toml"), "--no-cache"],
                         cwd=REPO, capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def _module_name(path: Path, folder: str) -> str:
    rel = path.relative_to(REPO / folder).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([FOLDERS[folder], *parts])


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        return [node.module] if node.module else []
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    target = ".".join(base + ([node.module] if node.module else []))
    return [target] if node.module else [f"{target}.{a.name}" for a in node.names]


def _deferred_imports():
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            module = _module_name(path, folder)
            tree = ast.parse(path.read_text(), str(path))
            for func in ast.walk(tree):
                if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(func):
                    if isinstance(node, ast.Import):
                        targets = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom):
                        targets = _resolve(module, path.name == "__init__.py", node)
                    else:
                        continue
                    for target in targets:
                        if target == "cachemw" or target.startswith("cachemw."):
                            yield module, target, f"{path.relative_to(REPO)}:{node.lineno}"


def test_no_module_imports_another_of_the_package_inside_a_function():
    found = [f"{where}: {module} imports {target}"
             for module, target, where in _deferred_imports()
             if not any(module == m and (target == t or target.startswith(t + "."))
                        for m, t in DEFERRED)]
    assert not found, "imports inside functions (move them to the top, or move the code " \
                      "to where its data lives):\n" + "\n".join(found)


def test_the_daemon_serves_every_op_of_the_protocol_table_and_no_other(tmp_path):
    from cachemw import ops
    from cachemw.config import DaemonConfig
    from cachemw.node.cache import NodeCache
    from cachemw.node.server import SocketServer

    node = NodeCache(DaemonConfig.build(runtime_dir=str(tmp_path / "rt"),
                                        dram_dir=str(tmp_path / "dram"), dram_capacity="1MiB"))
    server = SocketServer(node, str(tmp_path / "sock"), b"k" * 32)
    assert set(server._dispatch) == set(ops.OPS)
    assert ops.ANSWERED <= set(ops.OPS) and ops.BUSY not in ops.OPS
