"""A real Slurm on this machine with several emulated nodes, and slurm/cachemw-job.sh on it.

Each node is a network namespace (its own address on a bridge made here, private to this
machine), a UTS namespace (its own hostname) and a mount namespace (its own tmpfs /dev/shm),
with its own slurmd; one slurmctld and one munged serve them all. Everything is torn down
after the tests whatever happens. Needs root and Debian's slurmctld, slurmd, slurm-client
and munge (.ci/run installs them).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB_SCRIPT = os.path.join(REPO, "slurm", "cachemw-job.sh")
NODES = 3
BRIDGE = "cmwbr0"
NET = "10.231.77"  # private, exists only on this machine while the tests run
HOST_ADDR = f"{NET}.1"


def _need():
    if os.geteuid() != 0:
        pytest.skip("the emulated Slurm cluster needs root (network namespaces, slurmd)")
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "munged", "ip", "unshare", "nsenter")
               if shutil.which(b) is None]
    if missing:
        pytest.skip(f"not installed: {' '.join(missing)} (.ci/run installs Slurm and munge)")


def _run(*cmd, check=True, **kw):
    return subprocess.run(cmd, check=check, capture_output=True, text=True, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST_ADDR, 0))
        return s.getsockname()[1]


class SlurmCluster:
    """The emulated cluster: ``sbatch``, ``on_node`` (a command in a node's namespaces)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.names = [f"cmwn{i}" for i in range(1, NODES + 1)]
        self.procs: list[subprocess.Popen] = []
        self.slurmd: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, SLURM_CONF=os.path.join(root, "slurm.conf"),
                        PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
        for var in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "CACHEMW_RUNTIME_DIR"):
            self.env.pop(var, None)

    # -- set-up ----------------------------------------------------------------------------
    def start(self) -> None:
        self._remove_network()  # an earlier run's, killed before its tear-down
        for d in os.listdir("/tmp"):  # an earlier run's, killed before its tear-down
            if d.startswith("cachemw-ray-") and any(d.endswith(f"-{n}") for n in self.names):
                shutil.rmtree(os.path.join("/tmp", d), ignore_errors=True)
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{HOST_ADDR}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        for i, name in enumerate(self.names, start=1):
            ns, veth = f"cmw-{name}", f"cmwv{i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", BRIDGE, "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{NET}.{10 + i}/24",
                 "dev", "eth0")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        self._munge()
        self._config()
        self.procs.append(subprocess.Popen(
            ["slurmctld", "-D", "-f", self.env["SLURM_CONF"]], env=self.env,
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.root, "ctld.err"), "w")))
        for i, name in enumerate(self.names, start=1):
            # a hostname and a /dev/shm of its own; slurmd in the foreground, ours to end
            script = (f"hostname {name} && mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm"
                      f" && exec slurmd -D -N {name} -f {self.env['SLURM_CONF']}")
            p = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/cmw-{name}", "unshare", "--uts", "--mount",
                 "--propagation", "private", "sh", "-c", script], env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(self.root, f"slurmd-{name}.err"), "w"))
            self.procs.append(p)
            self.slurmd[name] = p
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = _run("sinfo", "-h", "-N", "-p", "test", "-o", "%N %T", env=self.env,
                       check=False).stdout
            if out.count("idle") == NODES:
                return
            time.sleep(1)
        raise RuntimeError(f"the emulated Slurm did not come up: {out!r}\n" + self.logs())

    def _munge(self) -> None:
        m = os.path.join(self.root, "munge")
        os.makedirs(m, mode=0o755)
        key = os.path.join(m, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = os.path.join(m, "munge.sock")
        _run("munged", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
             f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
             f"--seed-file={m}/seed")
        with open(f"{m}/munged.pid") as f:
            self.munged_pid = int(f.read())

    def _config(self) -> None:
        r = self.root
        for d in ["state", "log"] + [f"spool/{n}" for n in self.names]:
            os.makedirs(os.path.join(r, d))
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={NET}.{10 + i} NodeHostname={n} CPUs=2 RealMemory=2000 "
            f"State=UNKNOWN" for i, n in enumerate(self.names, start=1))
        conf = textwrap.dedent(f"""\
            ClusterName=cmwtest
            SlurmctldHost={socket.gethostname()}({HOST_ADDR})
            SlurmctldPort={_free_port()}
            SlurmdPort={_free_port()}
            AuthType=auth/munge
            AuthInfo=socket={self.munge_socket}
            CredType=cred/munge
            SlurmUser=root
            SlurmdUser=root
            StateSaveLocation={r}/state
            SlurmdSpoolDir={r}/spool/%n
            SlurmctldPidFile={r}/slurmctld.pid
            SlurmdPidFile={r}/slurmd-%n.pid
            SlurmctldLogFile={r}/log/slurmctld.log
            SlurmdLogFile={r}/log/slurmd-%n.log
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            SelectType=select/cons_tres
            SelectTypeParameters=CR_Core
            ReturnToService=2
            MpiDefault=none
            JobAcctGatherType=jobacct_gather/none
            AccountingStorageType=accounting_storage/none
            PrologFlags=Alloc
            KillWait=20
            """) + nodes + "\nPartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE " \
                           "State=UP OverSubscribe=YES\n"
        # site mode on the partition "site" only: its Prolog starts each job's daemon, its
        # Epilog removes it (the job script's own clean-up is tested without an Epilog)
        site = os.path.join(r, "site.env")
        with open(site, "w") as f:
            f.write(f"CACHEMW_BIN={os.path.join(os.path.dirname(sys.executable), 'cachemw')}\n"
                    "CACHEMW_DRAM_CAPACITY=256MiB\nCACHEMW_PARTITIONS=site\n")
        for hook in ("prolog", "epilog"):
            path = os.path.join(r, hook)
            with open(path, "w") as f:
                f.write(f'#!/bin/bash\n[[ $SLURM_JOB_PARTITION == site ]] || exit 0\n'
                        f'CACHEMW_SITE_ENV={site} exec {REPO}/slurm/{hook}.sh\n')
            os.chmod(path, 0o755)
        conf += (f"Prolog={r}/prolog\nEpilog={r}/epilog\nPartitionName=site Nodes=ALL "
                 f"MaxTime=INFINITE State=UP OverSubscribe=YES\n")
        with open(os.path.join(r, "slurm.conf"), "w") as f:
            f.write(conf)

    # -- use -------------------------------------------------------------------------------
    def sbatch(self, *args, timeout=600) -> subprocess.CompletedProcess:
        return _run("sbatch", "--wait", *args, env=self.env, check=False, timeout=timeout,
                    cwd=self.root)

    def on_node(self, name: str, *cmd) -> str:
        """A command in a node's namespaces (its /dev/shm, its network)."""
        pid = str(self.slurmd[name].pid)
        return _run("nsenter", "-t", pid, "-m", "-u", "-n", *cmd, check=False).stdout

    def leftovers(self) -> dict:
        """What a job may have left: cachemw dirs in each node's /dev/shm, Ray processes."""
        out = {n: self.on_node(n, "sh", "-c", "ls -A /dev/shm | grep cachemw || true").split()
               for n in self.names}
        for name, slurmd in self.slurmd.items():  # every process of a node but its slurmd
            pids = _run("ip", "netns", "pids", f"cmw-{name}", check=False).stdout.split()
            out[f"{name} processes"] = [
                _run("ps", "-o", "args=", "-p", p, check=False).stdout.strip()[:200]
                for p in pids if int(p) != slurmd.pid]
        out["ray temp dirs"] = [d for d in os.listdir("/tmp") if d.startswith("cachemw-ray-")
                                and any(d.endswith(n) for n in self.names)]
        return {k: v for k, v in out.items() if v}

    def logs(self) -> str:
        text = []
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                if f.endswith((".log", ".err", ".out")):
                    with open(os.path.join(dirpath, f), errors="replace") as fh:
                        text.append(f"== {f}\n{fh.read()[-3000:]}")
        return "\n".join(text)

    # -- tear-down -------------------------------------------------------------------------
    def stop(self) -> None:
        for partition in ("test", "site"):
            _run("scancel", "--full", f"--partition={partition}", env=self.env, check=False)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        if getattr(self, "munged_pid", None):
            try:
                os.kill(self.munged_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self._remove_network()

    def _remove_network(self) -> None:
        """The nodes' namespaces (and any process still in one: only ours are), the bridge."""
        for i, name in enumerate(self.names, start=1):
            ns = f"cmw-{name}"
            for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _run("ip", "netns", "del", ns, check=False)
            _run("ip", "link", "del", f"cmwv{i}", check=False)
        _run("ip", "link", "del", BRIDGE, check=False)


@pytest.fixture(scope="module")
def slurm():
    _need()
    # not under pytest's 0700 base: other users' jobs reach the munge socket and their files
    root = tempfile.mkdtemp(prefix="cachemw-slurm-", dir="/tmp")
    os.chmod(root, 0o755)
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


TRAIN = textwrap.dedent('''\
    """A small training job: a DataLoader over files of a shared dir through cachemw::,
    two epochs, then a checkpoint; writes what it saw to a JSON file."""
    import json, os, sys, time
    import fsspec, torch
    from torch.utils.data import DataLoader, Dataset
    from cachemw.checkpoint import Checkpointer
    from cachemw.cluster import actor

    data, ckpt, out = sys.argv[1:4]
    meet = sys.argv[4:6]  # optional: this job's marker, the other job's marker
    began = time.time()

    class Files(Dataset):
        def __init__(self, paths):
            self.paths = paths
        def __len__(self):
            return len(self.paths)
        def __getitem__(self, i):
            data = fs.cat_file(self.paths[i])
            return torch.frombuffer(bytearray(data), dtype=torch.uint8).sum()

    paths = sorted(os.path.join(data, p) for p in os.listdir(data))
    expect = [int(sum(open(p, "rb").read())) for p in paths]
    fs = fsspec.filesystem("cachemw", block_size=65536, validate="immutable", autostart=False)
    result = {"epochs": []}
    for epoch in range(2):
        t = time.monotonic()
        got = [int(x) for batch in DataLoader(Files(paths), batch_size=8) for x in batch]
        assert got == expect, "wrong bytes"
        seconds = time.monotonic() - t
        fs.stats()
        fs.client.flush()  # the fills written behind, the tallies: into the daemons' counters
        time.sleep(1)
        nodes = actor.status(os.environ["RAY_ADDRESS"])
        result["epochs"].append({
            "seconds": seconds,
            "source_bytes": fs.stats()["bytes_from_source"] + sum(
                n["stats"]["counters"]["bytes_from_source"] for n in nodes),
            "blocks": {n["node_id"]: n["stats"]["tiers"]["dram"]["blocks"] for n in nodes},
            "client": fs.stats(),
        })
        if meet and epoch == 0:  # both jobs' daemons up on the same nodes at once
            open(meet[0], "w").close()
            deadline = time.monotonic() + 300
            while not os.path.exists(meet[1]):
                if time.monotonic() > deadline:
                    sys.exit("the other job never reached its first epoch's end")
                time.sleep(0.2)
    model = torch.nn.Linear(8, 4)
    ck = Checkpointer(ckpt)
    ck.save(1, {"model": model.state_dict()})
    ck.wait()
    result["runtime_dir"] = os.environ["CACHEMW_RUNTIME_DIR"]
    result["daemons"] = len(actor.status(os.environ["RAY_ADDRESS"]))
    result["weight"] = model.weight.sum().item()
    result["interval"] = [began, time.time()]
    with open(out, "w") as f:
        json.dump(result, f)
''')


@pytest.mark.timeout(900)
def test_job_script_on_three_nodes(slurm, tmp_path):
    os.chmod(tmp_path, 0o755)
    data = tmp_path / "data"  # the "PFS": a directory every node sees
    data.mkdir()
    for i in range(48):
        (data / f"s{i:03d}").write_bytes(os.urandom(48 * 1024 + i))
    train = tmp_path / "train.py"
    train.write_text(TRAIN)
    out, ckpt = tmp_path / "result.json", tmp_path / "ckpt"
    done = slurm.sbatch(f"-N{NODES}", f"--output={tmp_path}/job.out", JOB_SCRIPT,
                        sys.executable, str(train), str(data), str(ckpt), str(out))
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert done.returncode == 0, f"{done.stderr}\n{log[-6000:]}\n{slurm.logs()[-4000:]}"
    result = json.loads(out.read_text())
    assert result["daemons"] == NODES
    first, second = result["epochs"]
    assert len(first["blocks"]) == NODES and all(b > 0 for b in first["blocks"].values())
    # epoch 2: nothing from the source
    assert second["source_bytes"] == first["source_bytes"], result
    assert second["client"]["remote_hits"] > first["client"]["remote_hits"]
    assert second["client"]["fallbacks"] == 0
    # the checkpoint is committed and loads in a fresh process (1 rank)
    load = _run(sys.executable, "-c", textwrap.dedent(f"""\
        import torch
        from cachemw.checkpoint import Checkpointer
        m = torch.nn.Linear(8, 4)
        state = {{"model": m.state_dict()}}
        print(Checkpointer({str(ckpt)!r}).load(state), m.weight.sum().item())
        """), check=False, env=dict(slurm.env, CACHEMW_AUTOSTART="0"))
    assert load.returncode == 0, load.stderr
    step, weight = load.stdout.split()
    assert step == "1" and abs(float(weight) - result["weight"]) < 1e-5
    # nothing left on any node: no runtime dir / DRAM tier, no Ray process of the job
    deadline = time.monotonic() + 30
    while slurm.leftovers() and time.monotonic() < deadline:
        time.sleep(1)
    assert slurm.leftovers() == {}


def _squeue_empty(slurm) -> bool:
    return _run("squeue", "-h", env=slurm.env, check=False).stdout.strip() == ""


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return predicate()


@pytest.mark.timeout(600)
def test_scancel_mid_job_cleans_every_node(slurm, tmp_path):
    os.chmod(tmp_path, 0o755)
    marker = tmp_path / "running"
    # the job reads through the daemon, says so, then keeps on reading until cancelled
    reader = tmp_path / "reader.py"
    reader.write_text(textwrap.dedent(f"""\
        import os, fsspec
        open({str(tmp_path / 'sample')!r}, "wb").write(os.urandom(100_000))
        fs = fsspec.filesystem("cachemw", validate="immutable", autostart=False)
        fs.cat_file({str(tmp_path / 'sample')!r})
        open({str(marker)!r}, "w").close()
        while True:
            fs.cat_file({str(tmp_path / 'sample')!r})
        """))
    submitted = _run("sbatch", "--parsable", f"-N{NODES}", f"--output={tmp_path}/job.out",
                     JOB_SCRIPT, sys.executable, str(reader), env=slurm.env, cwd=slurm.root)
    job = submitted.stdout.strip().split(";")[0]
    try:
        assert _wait_for(marker.exists, 240), (tmp_path / "job.out").read_text()[-4000:]
        during = slurm.leftovers()  # what the job has on its nodes while it runs
        assert all(f"cachemw-0-job{job}" in " ".join(during.get(n, ())) for n in slurm.names)
        assert all(during.get(f"{n} processes") for n in slurm.names)
    finally:
        _run("scancel", job, env=slurm.env, check=False)
    assert _wait_for(lambda: _squeue_empty(slurm) and not slurm.leftovers(), 30), \
        (slurm.leftovers(), (tmp_path / "job.out").read_text()[-4000:])


@pytest.mark.timeout(600)
def test_site_mode_prolog_starts_and_epilog_removes_the_daemon(slurm, tmp_path):
    os.chmod(tmp_path, 0o755)
    data = tmp_path / "data"
    data.mkdir()
    files = {str(data / f"s{i:02d}"): os.urandom(20_000 + i) for i in range(16)}
    for path, content in files.items():
        with open(path, "wb") as f:
            f.write(content)
    # a plain job (no job script): each node's task reads through the daemon the Prolog
    # started, found at the job's default runtime dir
    task = tmp_path / "task.py"
    task.write_text(textwrap.dedent(f"""\
        import json, os, socket, fsspec
        from cachemw.node_daemon import node_daemon
        daemon = node_daemon()
        fs = fsspec.filesystem("cachemw", validate="immutable", autostart=False)
        paths = sorted(os.path.join({str(data)!r}, p) for p in os.listdir({str(data)!r}))
        ok = [fs.cat_file(p) == open(p, "rb").read() for p in paths * 2]
        print(json.dumps({{"node": socket.gethostname(), "ok": all(ok),
                          "runtime_dir": daemon and daemon.runtime_dir,
                          "kind": daemon and daemon.kind, "stats": fs.stats()}}))
        """))
    batch = tmp_path / "job.sh"
    batch.write_text(f"#!/bin/bash\nsrun --ntasks-per-node=1 {sys.executable} {task}\n")
    done = slurm.sbatch("-p", "site", f"-N{NODES}", f"--output={tmp_path}/job.out", str(batch))
    log = (tmp_path / "job.out").read_text()
    assert done.returncode == 0, log[-4000:] + slurm.logs()[-3000:]
    job = done.stdout.split()[-1]
    nodes = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert sorted(n["node"] for n in nodes) == slurm.names
    for n in nodes:
        assert n["ok"] and n["runtime_dir"] == f"/dev/shm/cachemw-0-job{job}", n
        assert n["stats"]["fallbacks"] == 0 and n["stats"]["hits"] >= len(files), n
    # the Epilog stopped each node's daemon and its Ray and removed the DRAM tier
    assert _wait_for(lambda: not slurm.leftovers(), 60), slurm.leftovers()


def _dataset(root, n: int) -> None:
    root.mkdir()
    for i in range(n):
        (root / f"s{i:03d}").write_bytes(os.urandom(32 * 1024 + i))


@pytest.mark.timeout(900)
def test_two_jobs_of_one_user_side_by_side_on_the_same_nodes(slurm, tmp_path):
    os.chmod(tmp_path, 0o755)
    train = tmp_path / "train.py"
    train.write_text(TRAIN)
    jobs = {}
    for name in ("a", "b"):
        _dataset(tmp_path / f"data-{name}", 24)
        jobs[name] = subprocess.Popen(
            ["sbatch", "--wait", f"-N{NODES}", f"--output={tmp_path}/job-{name}.out",
             JOB_SCRIPT, sys.executable, str(train), str(tmp_path / f"data-{name}"),
             str(tmp_path / f"ckpt-{name}"), str(tmp_path / f"result-{name}.json"),
             str(tmp_path / f"met-{name}"), str(tmp_path / f"met-{'b' if name == 'a' else 'a'}")],
            env=slurm.env, cwd=slurm.root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
    results = {}
    for name, proc in jobs.items():
        out, err = proc.communicate(timeout=600)
        log = (tmp_path / f"job-{name}.out").read_text()
        assert proc.returncode == 0, f"{err}\n{log[-5000:]}"
        results[name] = json.loads((tmp_path / f"result-{name}.json").read_text())
    a, b = results["a"], results["b"]
    assert a["interval"][0] < b["interval"][1] and b["interval"][0] < a["interval"][1]  # overlapped
    assert a["runtime_dir"] != b["runtime_dir"]
    for r in (a, b):  # each job: its own daemons on all nodes, its own complete cache
        assert r["daemons"] == NODES
        first, second = r["epochs"]
        assert sum(first["blocks"].values()) == 24 and all(first["blocks"].values())
        assert second["source_bytes"] == first["source_bytes"]
        assert second["client"]["fallbacks"] == 0
    assert _wait_for(lambda: not slurm.leftovers(), 30), slurm.leftovers()


OTHER_USER = "cmwtest2"


@pytest.fixture
def other_user():
    """A second OS user, made for the test and removed after it."""
    made = _run("id", OTHER_USER, check=False).returncode != 0
    if made:
        _run("useradd", "--create-home", "--shell", "/bin/bash", OTHER_USER)
    try:
        yield OTHER_USER
    finally:
        if made:
            _run("pkill", "-KILL", "-u", OTHER_USER, check=False)  # only the test's own user
            _run("userdel", "--remove", OTHER_USER, check=False)


@pytest.mark.timeout(600)
def test_another_users_job_cannot_read_the_tiers_nor_reach_the_daemon(slurm, other_user):
    work = os.path.join(slurm.root, "owner")
    os.makedirs(work, mode=0o755)
    sample = os.path.join(work, "sample")  # world-readable at the source; the cache is not
    with open(sample, "wb") as f:
        f.write(os.urandom(50_000))
    os.chmod(sample, 0o644)
    marker = os.path.join(work, "running")
    reader = os.path.join(work, "reader.py")
    with open(reader, "w") as f:
        f.write(textwrap.dedent(f"""\
            import os, time, fsspec
            fs = fsspec.filesystem("cachemw", validate="immutable", autostart=False)
            assert fs.cat_file({sample!r}) == open({sample!r}, "rb").read()
            fs.client.flush()
            time.sleep(1)
            open({marker!r}, "w").write(os.environ["CACHEMW_RUNTIME_DIR"])
            time.sleep(600)
            """))
    job = _run("sbatch", "--parsable", "-N1", f"--output={work}/job.out", JOB_SCRIPT,
               sys.executable, reader, env=slurm.env, cwd=work).stdout.strip().split(";")[0]
    try:
        assert _wait_for(lambda: os.path.exists(marker) or _squeue_empty(slurm), 240)
        assert os.path.exists(marker), open(f"{work}/job.out").read()[-4000:]
        with open(marker) as f:
            runtime = f.read()
        node = _run("squeue", "-h", "-j", job, "-o", "%N", env=slurm.env).stdout.strip()
        blocks = slurm.on_node(node, "find", f"{runtime}/dram", "-type", "f").split()
        assert blocks, slurm.on_node(node, "find", runtime)
        # the other user's job on the same node, by path: the runtime dir, the DRAM tier,
        # a block file of it, the daemon's socket
        theirs = os.path.join(slurm.root, "other")
        os.makedirs(theirs, mode=0o700)
        shutil.chown(theirs, other_user)
        probe = " ; ".join(f"ls -d {p}/. 2>&1 || true" if p != blocks[0] else
                           f"cat {p} 2>&1 >/dev/null || true"
                           for p in (runtime, f"{runtime}/dram", blocks[0]))
        probe += f" ; [ -S {runtime}/daemon.sock ] && echo SOCKET-REACHABLE ; echo DONE"
        done = _run("runuser", "-u", other_user, "--", "env",
                    f"SLURM_CONF={slurm.env['SLURM_CONF']}", "sbatch", "--wait", "-N1",
                    "-w", node, f"--output={theirs}/job.out",
                    "--wrap", probe, cwd=theirs, check=False, timeout=300)
        log = open(f"{theirs}/job.out").read()
        assert done.returncode == 0 and "DONE" in log, done.stderr + log
        assert log.count("Permission denied") == 3 and "SOCKET-REACHABLE" not in log, log
    finally:
        _run("scancel", job, env=slurm.env, check=False)
    assert _wait_for(lambda: _squeue_empty(slurm) and not slurm.leftovers(), 60), \
        slurm.leftovers()
