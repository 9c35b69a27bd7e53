"""slurm/cachemw-job.sh and site mode on a real Slurm on this machine with several emulated
nodes (tests/slurm_cluster.py: a network, UTS and mount namespace per node, each with its
own slurmd). Needs root and Debian's slurmctld, slurmd, slurm-client and munge (.ci/run
installs them).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from slurm_cluster import JOB_SCRIPT, NODES, emulated_cluster, missing, wait_for
from slurm_cluster import run as _run

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def slurm():
    why = missing()
    if why:
        pytest.skip(why)
    with emulated_cluster() as cluster:
        yield cluster


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
    # a normal end: the Ray step's tasks are signalled and clean up; a TERM to its srun
    # cancelled the step, and every node logged "task N: Killed" (review ops5)
    assert "Killed" not in log and "CANCELLED" not in log, log[-3000:]
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
    # the port block of job ids 220, 440, ... (base 10000): Ray's head once refused it (its
    # client server's default port, 10001, was the node manager's)
    submitted = _run("sbatch", "--parsable", f"-N{NODES}", f"--output={tmp_path}/job.out",
                     JOB_SCRIPT, sys.executable, str(reader),
                     env=dict(slurm.env, CACHEMW_RAY_PORT_BASE="10000"), cwd=slurm.root)
    job = submitted.stdout.strip().split(";")[0]
    try:
        assert wait_for(marker.exists, 240), (tmp_path / "job.out").read_text()[-4000:]
        during = slurm.leftovers()  # what the job has on its nodes while it runs
        assert all(f"cachemw-0-job{job}" in " ".join(during.get(n, ())) for n in slurm.names)
        assert all(during.get(f"{n} processes") for n in slurm.names)
    finally:
        _run("scancel", job, env=slurm.env, check=False)
    assert wait_for(lambda: _squeue_empty(slurm) and not slurm.leftovers(), 30), \
        (slurm.leftovers(), (tmp_path / "job.out").read_text()[-4000:])


FAKE_RAY = textwrap.dedent('''\
    #!{python}
    """`ray start` of a Ray head that never answers: it accepts on the GCS port, then says
    nothing (a worker's: nothing at all), until ended."""
    import socket, sys, time
    args = dict(a.split("=", 1) for a in sys.argv if a.startswith("--") and "=" in a)
    conns = []
    if "--head" in sys.argv:
        s = socket.create_server((args["--node-ip-address"], int(args["--port"])))
        while True:
            conns.append(s.accept()[0])
    time.sleep(3600)
    ''')


@pytest.mark.timeout(600)
def test_a_ray_head_that_never_answers_fails_the_job_within_its_timeout(slurm, tmp_path):
    """Each look at Ray's nodes is bounded: one ray.init at a head that did not answer took
    ~14 minutes, past CACHEMW_RAY_TIMEOUT, and outlived the job."""
    os.chmod(tmp_path, 0o755)
    fake = tmp_path / "bin"
    fake.mkdir(mode=0o755)
    (fake / "ray").write_text(FAKE_RAY.format(python=sys.executable))
    (fake / "ray").chmod(0o755)
    ran = tmp_path / "ran"
    env = dict(slurm.env, PATH=f"{fake}:{slurm.env['PATH']}", CACHEMW_RAY_TIMEOUT="15")
    began = time.monotonic()
    job = _run("sbatch", "--parsable", "-N2", f"--output={tmp_path}/job.out", JOB_SCRIPT,
               "touch", str(ran), env=env, cwd=slurm.root).stdout.strip().split(";")[0]
    try:  # squeue, not `sbatch --wait`, whose polls back off to tens of seconds
        ended = wait_for(lambda: _squeue_empty(slurm), 300)
    finally:
        _run("scancel", job, env=slurm.env, check=False)
    took = time.monotonic() - began
    log = (tmp_path / "job.out").read_text()
    assert ended, f"job {job} still ran after 300 s (its timeout: 15 s)\n{log[-4000:]}"
    assert "did not answer within 15s" in log and "exit status 1" in log, log[-4000:]
    assert not ran.exists()
    # 15 s, then the clean-up (the Ray step's end) and Slurm's scheduling: generous bounds
    # for a loaded host; the unbounded wait took ~14 minutes
    assert took < 15 + 90, (took, log[-4000:])
    assert wait_for(lambda: not slurm.leftovers(), 30), slurm.leftovers()


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
    assert wait_for(lambda: not slurm.leftovers(), 60), slurm.leftovers()


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
    assert wait_for(lambda: not slurm.leftovers(), 30), slurm.leftovers()


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
        assert wait_for(lambda: os.path.exists(marker) or _squeue_empty(slurm), 240)
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
    assert wait_for(lambda: _squeue_empty(slurm) and not slurm.leftovers(), 60), \
        slurm.leftovers()


EPOCH = textwrap.dedent('''\
    """One epoch over a dataset through cachemw, over the counting source: are the bytes
    right, and where did they come from."""
    import json, os, sys
    import fsspec
    data, out = sys.argv[1:3]
    fs = fsspec.filesystem("cachemw", target_protocol="countfile", validate="immutable",
                           autostart=False)
    paths = sorted(os.path.join(data, p) for p in os.listdir(data))
    ok = [fs.cat_file(p) == open(p, "rb").read() for p in paths]
    with open(out, "w") as f:
        json.dump({"ok": all(ok), "client": fs.stats()}, f)
    ''')


def _blocks(data, block_size: int) -> set[tuple[str, int, int]]:
    """Every block of the files under ``data``: (path, start, end)."""
    out = set()
    for name in os.listdir(data):
        path, size = os.path.join(data, name), os.path.getsize(os.path.join(data, name))
        out |= {(path, s, min(s + block_size, size)) for s in range(0, size, block_size)}
    return out


@pytest.mark.timeout(900)
def test_warm_on_every_node_reads_each_block_once_and_the_next_job_starts_warm(slurm, tmp_path):
    from slurm_cluster import counting_source, source_reads

    os.chmod(tmp_path, 0o755)
    block = 64 * 1024
    data = tmp_path / "data"  # the "PFS", read through a source that logs every read
    data.mkdir()
    for i in range(36):
        (data / f"s{i:03d}").write_bytes(os.urandom(20_000 + 1_000 * i))
    for i in range(3):  # several blocks each
        (data / f"big{i}").write_bytes(os.urandom(5 * block + 777 * i))
    blocks = _blocks(str(data), block)
    log = tmp_path / "source.log"
    env = dict(slurm.env, **counting_source(str(tmp_path / "plugin"), str(log)),
               CACHEMW_BLOCK_SIZE=str(block), CACHEMW_DRAM_CAPACITY="64MiB",
               CACHEMW_NVME_DIR=os.path.join(slurm.nvme, "cachemw"),
               CACHEMW_NVME_CAPACITY="256MiB")
    url = f"cachemw::countfile://{data}"
    # job 1: a warm on 2 of the 3 nodes is refused (the third's share would stay cold);
    # then the warm on every node
    job = tmp_path / "warm.sh"
    job.write_text(textwrap.dedent(f"""\
        srun --overlap -N2 -n2 --ntasks-per-node=1 cachemw warm --ring-wait 5 {url} \\
            2> {tmp_path}/refused.err
        echo "refused: $?" > {tmp_path}/refused.rc
        srun --overlap -N "$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \\
            --output={tmp_path}/warm-%t.json --error={tmp_path}/warm-%t.err \\
            cachemw warm --json {url}
        """))
    done = slurm.sbatch(f"-N{NODES}", f"--output={tmp_path}/job1.out", JOB_SCRIPT, "bash",
                        str(job), env=env)
    out = (tmp_path / "job1.out").read_text() if (tmp_path / "job1.out").exists() else ""
    assert done.returncode == 0, f"{done.stderr}\n{out[-6000:]}\n{slurm.logs()[-3000:]}"
    assert (tmp_path / "refused.rc").read_text().split() == ["refused:", "2"]
    assert "the nodes warming must be the cluster's nodes" in (tmp_path / "refused.err").read_text()
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("warm-*.json"))]
    assert sorted(r["host"] for r in reports) == slurm.names, out[-4000:]
    assert all(r["ok"] and r["nodes"] == NODES and r["blocks"] > 0 for r in reports), reports
    assert sum(r["blocks"] for r in reports) == len(blocks)
    assert sum(r["bytes"] for r in reports) == sum(e - s for _, s, e in blocks)
    # at the source: each block read exactly once, by the node that owns it
    reads = source_reads(str(log))
    assert sorted((p, int(s), int(e)) for _, p, s, e, _ in reads) == sorted(blocks)
    for r in reports:
        assert sum(1 for host, *_ in reads if host == r["host"]) == r["blocks"]
    # job 2 on the same nodes, one epoch: nothing from the source (each node's daemon
    # adopted its NVMe tier, and owns the same blocks as before)
    epoch = tmp_path / "epoch.py"
    epoch.write_text(EPOCH)
    done = slurm.sbatch(f"-N{NODES}", f"--output={tmp_path}/job2.out", JOB_SCRIPT,
                        sys.executable, str(epoch), str(data), str(tmp_path / "epoch.json"),
                        env=env)
    out = (tmp_path / "job2.out").read_text() if (tmp_path / "job2.out").exists() else ""
    assert done.returncode == 0, f"{done.stderr}\n{out[-6000:]}"
    result = json.loads((tmp_path / "epoch.json").read_text())
    assert result["ok"], result
    assert source_reads(str(log)) == reads, "the second job read from the source"
    client = result["client"]
    assert client["bytes_from_source"] == 0 and client["fallbacks"] == 0, client
    # from this node's tiers and from the other nodes' (straight from their block servers,
    # or through their daemons while this reader's view of the ring is still forming)
    assert client["hits"] > 0 and client["remote_hits"] + client["remote_reads"] > 0, client
    assert wait_for(lambda: not slurm.leftovers(), 30), slurm.leftovers()
    for name in slurm.names:  # the NVMe tiers stay (they are meant to): remove them
        slurm.on_node(name, "rm", "-rf", os.path.join(slurm.nvme, "cachemw"))
