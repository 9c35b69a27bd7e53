"""A real Slurm on this machine with several emulated nodes, for the Slurm tests
(tests/test_slurm_jobs.py) and benchmark (benchmarks/slurm_warm.py).

Each node is a network namespace (its own address on a bridge made here, private to this
machine), a UTS namespace (its own hostname) and a mount namespace (its own tmpfs /dev/shm,
and its own "local disk" at one path on every node, ``SlurmCluster.nvme``, as /local is on
a real cluster), with its own slurmd; one slurmctld and one munged serve them all.
Everything is torn down after use whatever happens. Needs root and Debian's slurmctld,
slurmd, slurm-client and munge (.ci/run installs them). One emulation at a time per name
prefix: ``emulated_cluster`` waits for a lock. Two emulations side by side on one machine
(two checkouts testing at once) need their own names and network: set
CACHEMW_TEST_SLURM_PREFIX (2-6 lowercase letters, default "cmw": bridge <prefix>br0,
namespaces <prefix>-<node>, nodes <prefix>n1..) and CACHEMW_TEST_SLURM_NET (a private /24's
first three numbers, default 10.231.77).

The emulated PFS: ``counting_source(dir)`` installs an fsspec filesystem ``countfile://``
(local files, plus one logged line per data read and an optional delay per read) where
every node's cachemw processes and daemons find it, so source reads are counted at the
source, by an observer that is not cachemw.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB_SCRIPT = os.path.join(REPO, "slurm", "cachemw-job.sh")
NODES = 3
PREFIX = os.environ.get("CACHEMW_TEST_SLURM_PREFIX", "cmw")
NET = os.environ.get("CACHEMW_TEST_SLURM_NET", "10.231.77")  # private, only on this machine
if not re.fullmatch(r"[a-z]{2,6}", PREFIX):  # network interface names have 15 characters
    raise ValueError(f"CACHEMW_TEST_SLURM_PREFIX: 2-6 lowercase letters, got {PREFIX!r}")
if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", NET):
    raise ValueError(f"CACHEMW_TEST_SLURM_NET: three numbers of a /24 (10.231.77), got {NET!r}")
BRIDGE = f"{PREFIX}br0"
HOST_ADDR = f"{NET}.1"
LOCK = "/tmp/cachemw-slurm-emulation" + ("" if PREFIX == "cmw" else f"-{PREFIX}") + ".lock"


def missing() -> str | None:
    """Why the emulated cluster cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "the emulated Slurm cluster needs root (network namespaces, slurmd)"
    absent = [b for b in ("slurmctld", "slurmd", "sbatch", "munged", "ip", "unshare", "nsenter")
              if shutil.which(b) is None]
    if absent:
        return f"not installed: {' '.join(absent)} (.ci/run installs Slurm and munge)"
    return None


def run(*cmd, check=True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST_ADDR, 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return predicate()


class SlurmCluster:
    """The emulated cluster: ``sbatch``, ``on_node`` (a command in a node's namespaces)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.names = [f"{PREFIX}n{i}" for i in range(1, NODES + 1)]
        self.nvme = os.path.join(root, "nvme")  # each node's own disk, mounted here
        self.procs: list[subprocess.Popen] = []
        self.slurmd: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, SLURM_CONF=os.path.join(root, "slurm.conf"),
                        PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
        for var in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "CACHEMW_RUNTIME_DIR",
                    "CACHEMW_NVME_DIR", "CACHEMW_NVME_CAPACITY", "CACHEMW_DRAM_CAPACITY"):
            self.env.pop(var, None)

    # -- set-up ----------------------------------------------------------------------------
    def start(self) -> None:
        self._remove_network()  # an earlier run's, killed before its tear-down
        for d in os.listdir("/tmp"):  # an earlier run's, killed before its tear-down
            if d.startswith("cachemw-ray-") and any(d.endswith(f"-{n}") for n in self.names):
                shutil.rmtree(os.path.join("/tmp", d), ignore_errors=True)
        run("ip", "link", "add", BRIDGE, "type", "bridge")
        run("ip", "addr", "add", f"{HOST_ADDR}/24", "dev", BRIDGE)
        run("ip", "link", "set", BRIDGE, "up")
        for i, name in enumerate(self.names, start=1):
            ns, veth = f"{PREFIX}-{name}", f"{PREFIX}v{i}"
            run("ip", "netns", "add", ns)
            run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            run("ip", "link", "set", veth, "master", BRIDGE, "up")
            run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{NET}.{10 + i}/24",
                "dev", "eth0")
            run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        self._munge()
        self._config()
        self.procs.append(subprocess.Popen(
            ["slurmctld", "-D", "-f", self.env["SLURM_CONF"]], env=self.env,
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.root, "ctld.err"), "w")))
        os.makedirs(self.nvme, mode=0o755)
        for i, name in enumerate(self.names, start=1):
            # a hostname, a /dev/shm and a local disk of its own; slurmd in the foreground,
            # ours to end
            disk = os.path.join(self.root, "disks", name)
            os.makedirs(disk, mode=0o755)
            script = (f"hostname {name} && mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm"
                      f" && mount --bind {disk} {self.nvme}"
                      f" && exec slurmd -D -N {name} -f {self.env['SLURM_CONF']}")
            p = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{PREFIX}-{name}", "unshare", "--uts", "--mount",
                 "--propagation", "private", "sh", "-c", script], env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(self.root, f"slurmd-{name}.err"), "w"))
            self.procs.append(p)
            self.slurmd[name] = p
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = run("sinfo", "-h", "-N", "-p", "test", "-o", "%N %T", env=self.env,
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
        run("munged", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
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
    def sbatch(self, *args, timeout=600, env=None) -> subprocess.CompletedProcess:
        return run("sbatch", "--wait", *args, env=env or self.env, check=False,
                   timeout=timeout, cwd=self.root)

    def on_node(self, name: str, *cmd) -> str:
        """A command in a node's namespaces (its /dev/shm, its disk, its network)."""
        pid = str(self.slurmd[name].pid)
        return run("nsenter", "-t", pid, "-m", "-u", "-n", *cmd, check=False).stdout

    def leftovers(self) -> dict:
        """What a job may have left: cachemw dirs in each node's /dev/shm, Ray processes."""
        out = {n: self.on_node(n, "sh", "-c", "ls -A /dev/shm | grep cachemw || true").split()
               for n in self.names}
        for name, slurmd in self.slurmd.items():  # every process of a node but its slurmd
            pids = run("ip", "netns", "pids", f"{PREFIX}-{name}", check=False).stdout.split()
            out[f"{name} processes"] = [
                run("ps", "-o", "args=", "-p", p, check=False).stdout.strip()[:200]
                for p in pids if int(p) != slurmd.pid]
        out["ray temp dirs"] = [d for d in os.listdir("/tmp") if d.startswith("cachemw-ray-")
                                and any(d.endswith(n) for n in self.names)]
        return {k: v for k, v in out.items() if v}

    def logs(self) -> str:
        text = []
        for dirpath, _, files in os.walk(self.root):
            if os.path.join(self.root, "disks") in dirpath:
                continue
            for f in files:
                if f.endswith((".log", ".err", ".out")):
                    with open(os.path.join(dirpath, f), errors="replace") as fh:
                        text.append(f"== {f}\n{fh.read()[-3000:]}")
        return "\n".join(text)

    # -- tear-down -------------------------------------------------------------------------
    def stop(self) -> None:
        for partition in ("test", "site"):
            run("scancel", "--full", f"--partition={partition}", env=self.env, check=False)
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
            ns = f"{PREFIX}-{name}"
            for pid in run("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            run("ip", "netns", "del", ns, check=False)
            run("ip", "link", "del", f"{PREFIX}v{i}", check=False)
        run("ip", "link", "del", BRIDGE, check=False)


@contextlib.contextmanager
def emulated_cluster():
    """A started SlurmCluster, stopped and removed on exit whatever happens. Waits for any
    other emulation on this machine to end first (they would share names and addresses)."""
    why = missing()
    if why:
        raise RuntimeError(why)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
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


COUNTING_SOURCE = '''\
"""countfile://: local files, with one line appended to $CMW_COUNT_LOG per data read
(``cat_file``: the node's hostname, the path, the range) and $CMW_COUNT_LATENCY_MS of
delay per read. The emulated PFS of the Slurm tests and benchmark."""
import os
import socket
import time

from fsspec.implementations.local import LocalFileSystem


class CountingFileSystem(LocalFileSystem):
    protocol = ("countfile",)

    def cat_file(self, path, start=None, end=None, **kwargs):
        latency = float(os.environ.get("CMW_COUNT_LATENCY_MS") or 0) / 1000
        if latency:
            time.sleep(latency)
        data = super().cat_file(path, start=start, end=end, **kwargs)
        log = os.environ.get("CMW_COUNT_LOG")
        if log:
            line = f"{socket.gethostname()} {self._strip_protocol(path)} {start} {end} {len(data)}\\n"
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                os.write(fd, line.encode())  # one write with O_APPEND: lines never interleave
            finally:
                os.close(fd)
        return data
'''


def counting_source(where: str, log: str, latency_ms: float = 0.0) -> dict:
    """Install ``countfile://`` (see COUNTING_SOURCE) in ``where``, a directory every node
    sees, as an fsspec plug-in (an entry point, as a package would declare one); returns the
    environment a job needs to use it (exported by sbatch to every step and Ray worker)."""
    os.makedirs(os.path.join(where, "countsrc-1.0.dist-info"), exist_ok=True)
    with open(os.path.join(where, "countsrc.py"), "w") as f:
        f.write(COUNTING_SOURCE)
    info = os.path.join(where, "countsrc-1.0.dist-info")
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: countsrc\nVersion: 1.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[fsspec.specs]\ncountfile = countsrc:CountingFileSystem\n")
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": f"{where}:{path}" if path else where, "CMW_COUNT_LOG": log,
            "CMW_COUNT_LATENCY_MS": str(latency_ms)}


def source_reads(log: str) -> list[tuple[str, str, str, str, int]]:
    """The data reads the counting source logged: (node, path, start, end, bytes) each."""
    try:
        with open(log) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        node, rest = line.split(" ", 1)
        path, start, end, n = rest.rsplit(" ", 3)
        out.append((node, path, start, end, int(n)))
    return out
