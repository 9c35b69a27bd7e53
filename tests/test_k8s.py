"""k8s/: every Kustomize directory renders offline, every object it renders validates against
its schema, and the manifests agree with the `cachemw` CLI and with their own sizes.

- Core kinds: kubernetes-validate (strict: unknown fields fail), Kubernetes 1.32 (kubectl's).
- RayCluster/RayJob: the JSON Schema converted from KubeRay's own CRDs (k8s/schemas/), checked
  with jsonschema; the pod templates inside them also as core PodTemplates.
- Drift: every `cachemw` command in a container command/args, a lifecycle hook or a RayJob
  entrypoint is parsed by the real parser (cachemw.cli.build_parser()) and its daemon options
  built into a DaemonConfig; the DRAM emptyDir holds the DRAM capacity, and the memory limit
  holds that emptyDir, Ray's object store, Ray with the daemon, and a trainer.

Each check is also run on a broken copy of k8s/ to show it fails.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cachemw.cli import build_parser
from cachemw.config import DaemonConfig

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
SCHEMAS = K8S / "schemas"
KUBERNETES_VERSION = "1.32"  # kubectl's on these machines
CRD_SCHEMAS = {("ray.io/v1", "RayCluster"): "raycluster-v1.json",
               ("ray.io/v1", "RayJob"): "rayjob-v1.json"}
RAY_AND_DAEMON = 1 << 30  # raylet, GCS/dashboard on the head, the daemon actor's process
TRAINER_MIN = 1 << 30     # the least a pod leaves its trainer (or Ray Train worker)
SHELLS = ("sh", "bash", "/bin/sh", "/bin/bash")


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl is not on PATH: tests/test_k8s.py renders k8s/ with "
                    "`kubectl kustomize` (kubectl >= 1.27, Kustomize v5); install kubectl "
                    "(k8s/README.md, Validation)")
    return path


def kustomize_dirs(root: Path = K8S) -> list[Path]:
    return sorted(p.parent for p in root.rglob("kustomization.yaml"))


def render(directory: Path) -> list[dict]:
    proc = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=60)
    if proc.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@lru_cache(maxsize=None)
def rendered(directory: str) -> tuple:
    return tuple(render(Path(directory)))


@lru_cache(maxsize=None)
def crd_validator(name: str) -> jsonschema.protocols.Validator:
    with open(SCHEMAS / name) as f:
        schema = json.load(f)
    return jsonschema.Draft7Validator(schema)


def _where(error) -> str:
    return "/".join(str(p) for p in error.absolute_path) or "(root)"


def schema_errors(obj: dict) -> list[str]:
    """Every way ``obj`` breaks its schema (empty: valid)."""
    kind = (obj.get("apiVersion"), obj.get("kind"))
    name = f"{kind[1]}/{obj.get('metadata', {}).get('name')}"
    if kind in CRD_SCHEMAS:
        errors = [f"{name}: {_where(e)}: {e.message}"
                  for e in crd_validator(CRD_SCHEMAS[kind]).iter_errors(obj)]
        for path, template in pod_templates(obj):
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate",
                       "metadata": {"name": "t"}, "template": template}
            errors += [f"{name}: {path}: {e}" for e in core_errors(wrapped)]
        return errors
    if kind[0] and "." in kind[0].split("/")[0] and not kind[0].startswith(
            ("networking.k8s.io/", "rbac.authorization.k8s.io/", "policy/", "apps/")):
        return [f"{name}: no schema for {kind[0]} {kind[1]} (add it to k8s/schemas)"]
    return [f"{name}: {e}" for e in core_errors(obj)]


def core_errors(obj: dict) -> list[str]:
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'/'.join(map(str, exc.path)) or '(root)'}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"no schema: {exc}"]
    return []


def pod_templates(obj: dict) -> list[tuple[str, dict]]:
    """(where, pod template) of a RayCluster (head, each worker group) or a RayJob."""
    spec = obj.get("spec", {})
    out = []
    if obj["kind"] == "RayJob":
        if "submitterPodTemplate" in spec:
            out.append(("spec/submitterPodTemplate", spec["submitterPodTemplate"]))
        spec = spec.get("rayClusterSpec") or {}
    if "headGroupSpec" in spec:
        out.append(("headGroupSpec", spec["headGroupSpec"]["template"]))
    for i, group in enumerate(spec.get("workerGroupSpecs") or ()):
        out.append((f"workerGroupSpecs/{i}", group["template"]))
    return out


# ---- cachemw commands in the manifests ------------------------------------------------------

def command_lines(obj: dict) -> list[tuple[str, list[str]]]:
    """(where, argv) of everything the manifests run: container command+args, lifecycle
    exec hooks, probes' exec commands, RayJob entrypoints."""
    out = []
    if obj.get("kind") == "RayJob" and obj["spec"].get("entrypoint"):
        out.append(("entrypoint", ["/bin/sh", "-c", obj["spec"]["entrypoint"]]))

    def walk(node, where):
        if isinstance(node, dict):
            if "image" in node and "name" in node:  # a container
                argv = list(node.get("command") or []) + list(node.get("args") or [])
                if argv:
                    out.append((f"{where}/{node['name']}", argv))
            if "exec" in node and isinstance(node["exec"], dict):
                out.append((f"{where}/exec", list(node["exec"].get("command") or [])))
            for k, v in node.items():
                walk(v, f"{where}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}/{i}")

    walk(obj, obj.get("kind", "?"))
    return out


_REDIRECT = re.compile(r"\d*(>>?|<)&?\s*\S+")


def cachemw_invocations(argv: list[str]) -> list[list[str]]:
    """The argument lists of every `cachemw` command in ``argv`` (a shell -c script is split
    into its simple commands; redirections dropped)."""
    if argv and os.path.basename(argv[0]) == "cachemw":
        return [argv[1:]]
    if len(argv) >= 3 and argv[0] in SHELLS and argv[1] in ("-c", "-lc", "-ec"):
        script = _REDIRECT.sub(" ", argv[2])
        lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        out, current = [], []
        for token in list(lexer) + [";"]:
            if token and set(token) <= set(";&|()"):
                if current and os.path.basename(current[0]) == "cachemw":
                    out.append(current[1:])
                current = []
            else:
                current.append(token)
        return out
    return []


def parse_cachemw(args: list[str]):
    """The real CLI parser on ``args``; an unknown or renamed flag raises AssertionError."""
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        raise AssertionError(f"`cachemw {' '.join(args)}` does not parse with the "
                             f"cachemw CLI (see the error above)") from None


# ---- sizes ----------------------------------------------------------------------------------

_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
_FACTOR = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50,
           "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}


def quantity(value) -> int:
    m = _QUANTITY.match(str(value))
    if not m:
        raise AssertionError(f"cannot read the quantity {value!r}")
    return int(float(m.group(1)) * _FACTOR[m.group(2)])


def mount_of(container: dict, volumes: dict, path: str):
    """The volume a path of ``container`` lies on (longest mount prefix), or None."""
    best = None
    for m in container.get("volumeMounts") or ():
        mp = m["mountPath"].rstrip("/")
        if (path == mp or path.startswith(mp + "/")) and (best is None or len(mp) > len(best[0])):
            best = (mp, volumes.get(m["name"]))
    return best[1] if best else None


def env_value(container: dict, name: str):
    for e in container.get("env") or ():
        if e["name"] == name:
            return e.get("value")
    return None


def cluster_problems(cluster: dict) -> list[str]:
    """What is wrong with a RayCluster as a cachemw cluster (empty: nothing)."""
    name = cluster["metadata"]["name"]
    problems = []
    starts = []
    for where, argv in command_lines(cluster):
        for args in cachemw_invocations(argv):
            parsed = parse_cachemw(args)
            if parsed.command == "start":
                starts.append((where, parsed))
    if len(starts) != 1:
        return [f"RayCluster/{name}: {len(starts)} `cachemw start` commands (want exactly one, "
                f"on the head: {[w for w, _ in starts]})"]
    where, start = starts[0]
    if "headGroupSpec" not in where:
        problems.append(f"RayCluster/{name}: `cachemw start` runs in {where}, not on the head")
    if start.address is None:
        problems.append(f"RayCluster/{name}: `cachemw start` without --address would start a "
                        f"private Ray cluster instead of using KubeRay's")
    auth = cluster["spec"].get("authOptions") or {}
    if auth.get("mode", "token") != "token" or not auth.get("secretName"):
        problems.append(f"RayCluster/{name}: Ray token auth from a Secret is off "
                        f"(authOptions {auth})")
    for group, template in pod_templates(cluster):
        spec = template["spec"]
        label = f"RayCluster/{name} {group}"
        pod_sc = spec.get("securityContext") or {}
        if not pod_sc.get("runAsNonRoot") or not pod_sc.get("runAsUser"):
            problems.append(f"{label}: pods must run as non-root (runAsNonRoot, runAsUser)")
        ray = spec["containers"][0]
        volumes = {v["name"]: v for v in spec.get("volumes") or ()}
        runtime_dir = start.runtime_dir or env_value(ray, "CACHEMW_RUNTIME_DIR")
        if not runtime_dir:
            problems.append(f"{label}: CACHEMW_RUNTIME_DIR unset: readers would look in "
                            f"/dev/shm/cachemw-$UID (Ray's object store, a 64 MiB default)")
            continue
        try:
            config = DaemonConfig.build(dram_dir=start.dram_dir, dram_capacity=start.dram_capacity,
                                        nvme_dir=start.nvme_dir, nvme_capacity=start.nvme_capacity,
                                        runtime_dir=runtime_dir, env={})
        except ValueError as exc:
            problems.append(f"{label}: the daemon's options do not build: {exc}")
            continue
        if mount_of(ray, volumes, runtime_dir) is None:
            problems.append(f"{label}: the runtime dir {runtime_dir} is on no volume")
        memory_dirs = 0
        for v in volumes.values():
            if (v.get("emptyDir") or {}).get("medium") == "Memory":
                if "sizeLimit" not in v["emptyDir"]:
                    problems.append(f"{label}: emptyDir {v['name']} (medium: Memory) has no "
                                    f"sizeLimit")
                    continue
                memory_dirs += quantity(v["emptyDir"]["sizeLimit"])
        for tier in config.tiers:
            volume = mount_of(ray, volumes, tier.path)
            if volume is None:
                problems.append(f"{label}: the {tier.name} tier {tier.path} is on no volume")
            elif tier.name == "dram":
                empty = volume.get("emptyDir") or {}
                if empty.get("medium") != "Memory":
                    problems.append(f"{label}: the DRAM tier's volume {volume['name']} is not "
                                    f"an emptyDir with medium: Memory")
                elif quantity(empty.get("sizeLimit", 0)) < tier.capacity:
                    problems.append(f"{label}: emptyDir {volume['name']} sizeLimit "
                                    f"{empty.get('sizeLimit')} < --dram-capacity "
                                    f"({tier.capacity} bytes)")
            elif tier.name == "nvme" and not (volume.get("hostPath")
                                              or volume.get("persistentVolumeClaim")
                                              or volume.get("ephemeral")):
                problems.append(f"{label}: the NVMe tier's volume {volume['name']} is neither a "
                                f"hostPath nor a persistent volume")
        limit = (ray.get("resources") or {}).get("limits", {}).get("memory")
        if limit is None:
            problems.append(f"{label}: no memory limit")
            continue
        group_spec = (cluster["spec"]["headGroupSpec"] if group == "headGroupSpec" else
                      cluster["spec"]["workerGroupSpecs"][int(group.split("/")[1])])
        store = (group_spec.get("rayStartParams") or {}).get("object-store-memory")
        if store is None:
            problems.append(f"{label}: no object-store-memory in rayStartParams (Ray would "
                            f"take 30% of the limit for it)")
            continue
        need = memory_dirs + int(store) + RAY_AND_DAEMON + TRAINER_MIN
        if quantity(limit) < need:
            problems.append(f"{label}: memory limit {limit} < {need} bytes: memory emptyDirs "
                            f"{memory_dirs} + object store {store} + Ray and daemon "
                            f"{RAY_AND_DAEMON} + trainer {TRAINER_MIN}")
    return problems


def all_problems(directory: Path) -> list[str]:
    objs = render(directory)
    problems = [p for obj in objs for p in schema_errors(obj)]
    for obj in objs:
        if obj["kind"] == "RayCluster":
            problems += cluster_problems(obj)
        for _, argv in command_lines(obj):
            for args in cachemw_invocations(argv):
                parse_cachemw(args)
    return problems


# ---- the tests -------------------------------------------------------------------------------

DIRS = kustomize_dirs()


def test_every_directory_is_found():
    names = {str(d.relative_to(K8S)) for d in DIRS}
    assert {"base", "overlays/small", "overlays/nvme", "job"} <= names, names


@pytest.mark.parametrize("directory", DIRS, ids=lambda d: str(d.relative_to(K8S)))
def test_renders_and_validates(directory):
    objs = rendered(str(directory))
    assert objs, f"{directory} renders nothing"
    problems = [p for obj in objs for p in schema_errors(obj)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("directory", DIRS, ids=lambda d: str(d.relative_to(K8S)))
def test_commands_parse_and_sizes_agree(directory):
    objs = rendered(str(directory))
    problems = []
    for obj in objs:
        for _, argv in command_lines(obj):
            for args in cachemw_invocations(argv):
                parse_cachemw(args)
        if obj["kind"] == "RayCluster":
            problems += cluster_problems(obj)
    assert not problems, "\n".join(problems)


def test_clusters_are_fenced_and_daemons_started():
    """Each cluster-bearing directory has a NetworkPolicy on its Ray pods and one start."""
    for directory in ("base", "overlays/small", "overlays/nvme"):
        objs = rendered(str(K8S / directory))
        clusters = [o["metadata"]["name"] for o in objs if o["kind"] == "RayCluster"]
        fenced = {o["spec"]["podSelector"].get("matchLabels", {}).get("ray.io/cluster")
                  for o in objs if o["kind"] == "NetworkPolicy"}
        assert clusters and set(clusters) <= fenced, (directory, clusters, fenced)
    nvme = [o for o in rendered(str(K8S / "overlays/nvme")) if o["kind"] == "RayCluster"][0]
    starts = [parse_cachemw(a) for _, argv in command_lines(nvme)
              for a in cachemw_invocations(argv)]
    assert starts[0].nvme_dir and starts[0].nvme_capacity, starts


def test_schemas_say_where_they_come_from():
    source = (SCHEMAS / "SOURCE.md").read_text()
    for name in CRD_SCHEMAS.values():
        assert name in source
        schema = json.loads((SCHEMAS / name).read_text())
        assert schema["properties"]["spec"]["additionalProperties"] is False  # converted


def test_shell_scripts_are_split_into_commands():
    argv = ["/bin/sh", "-c", "until ray status; do sleep 1; done; cachemw start --address auto "
            "--dram-capacity 1GiB >/x.log 2>&1 && cachemw status --address auto | tee y"]
    assert cachemw_invocations(argv) == [["start", "--address", "auto", "--dram-capacity", "1GiB"],
                                         ["status", "--address", "auto"]]
    assert cachemw_invocations(["cachemw", "stats", "--json"]) == [["stats", "--json"]]


# ---- broken copies: each check fails on what it is there to catch ----------------------------

@pytest.fixture
def broken(tmp_path):
    """A copy of k8s/ to break; returns (root, edit) with edit(file, old, new)."""
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root, ignore=shutil.ignore_patterns("schemas", "*.py", "Dockerfile"))

    def edit(rel: str, old: str, new: str) -> None:
        path = root / rel
        text = path.read_text()
        assert old in text, (rel, old)
        path.write_text(text.replace(old, new, 1))

    return root, edit


def test_a_misspelt_raycluster_field_fails(broken):
    root, edit = broken
    edit("base/raycluster.yaml", "sizeLimit: 6Gi   # 4 GiB", "sizelimit: 6Gi   # 4 GiB")
    edit("base/raycluster.yaml", "workerGroupSpecs:", "workerGroupSpec:")
    problems = [p for o in render(root / "base") for p in schema_errors(o)]
    assert any("'sizelimit' was unexpected" in p for p in problems), problems
    assert any("'workerGroupSpec' was unexpected" in p for p in problems), problems


def test_a_misspelt_rayjob_field_fails(broken):
    root, edit = broken
    edit("job/rayjob.yaml", "  entrypoint: >-", "  entryPoint: >-")
    problems = [p for o in render(root / "job") for p in schema_errors(o)]
    assert any("'entryPoint' was unexpected" in p for p in problems), problems


def test_a_misspelt_core_field_fails(broken):
    root, edit = broken
    edit("base/networkpolicy.yaml", "policyTypes:", "policyType:")
    problems = [p for o in render(root / "base") for p in schema_errors(o)]
    assert any("NetworkPolicy/cachemw-ray" in p and "policyType" in p for p in problems), problems


def test_a_renamed_cli_flag_fails(broken):
    root, edit = broken
    edit("overlays/small/kustomization.yaml", "--dram-capacity 512MiB", "--dram-size 512MiB")
    with pytest.raises(AssertionError, match="does not parse with the cachemw CLI"):
        all_problems(root / "overlays/small")


def test_a_dram_tier_over_its_emptydir_fails(broken):
    root, edit = broken
    edit("overlays/small/kustomization.yaml", "--dram-capacity 512MiB", "--dram-capacity 2GiB")
    problems = all_problems(root / "overlays/small")
    assert any("sizeLimit 1Gi < --dram-capacity" in p for p in problems), problems


def test_a_memory_limit_without_room_for_the_trainer_fails(broken):
    root, edit = broken
    edit("overlays/nvme/nvme.yaml", "limits: {cpu: \"16\", memory: 128Gi}",
         "limits: {cpu: \"16\", memory: 52Gi}")
    problems = all_problems(root / "overlays/nvme")
    assert any("workerGroupSpecs/0: memory limit 52Gi" in p for p in problems), problems


# ---- the example job's script, for real: S3 (moto) through the cache, checkpoints to S3 ------

@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(180)
def test_example_job_trains_through_the_cache_and_resumes(s3_server, runtime_dir, spawn_daemon):
    import numpy as np

    from cachemw.launch import stop_local

    # the node's daemon outlives the job, as the Ray actor does in a pod
    spawn_daemon(runtime_dir, dram_capacity="256MiB")
    s3, bucket = s3_server["boto3"](), s3_server["bucket"]
    rng = np.random.default_rng(0)
    for i in range(48):
        row = rng.standard_normal(17).astype(np.float32)
        s3.put_object(Bucket=bucket, Key=f"k8s-train/{i:04d}.bin", Body=row.tobytes())
    env = dict(os.environ, CACHEMW_RUNTIME_DIR=runtime_dir,
               AWS_ENDPOINT_URL=s3_server["endpoint"], AWS_ACCESS_KEY_ID="testing",
               AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    script = K8S / "examples" / "train.py"

    def run(epochs: int) -> str:
        proc = subprocess.run(
            [os.sys.executable, str(script), "--data", f"cachemw::s3://{bucket}/k8s-train/",
             "--checkpoints", f"s3://{bucket}/k8s-ckpt", "--workers", "0",
             "--loader-workers", "0", "--epochs", str(epochs)],
            env=env, capture_output=True, text=True, timeout=150)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    try:
        first = run(2)
        assert "epoch 0:" in first and "epoch 1:" in first, first
        stats = subprocess.run([os.sys.executable, "-m", "cachemw.cli", "stats", "--json"],
                               env=env, capture_output=True, text=True, timeout=60)
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["tiers"]["dram"]["used_bytes"] > 0  # read through it
        again = run(3)  # resumes from the newest committed step (1): trains epoch 2 only
        assert "epoch 2:" in again and "epoch 0:" not in again, again
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="k8s-ckpt/")
                .get("Contents", [])]
        assert keys, "no checkpoint written to S3"
    finally:
        stop_local(runtime_dir)
