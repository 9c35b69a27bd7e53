"""How slurm/cachemw-job.sh starts Ray, without Slurm: the job's Ray ports (every port Ray's
head opens is inside the job's own block of 100, for any job id: a base of 10000 once put
the node manager on Ray's default client-server port, 10001, and Ray refused to start), and
the wait for Ray's nodes (bounded: one ray.init against an address where nothing answers
blocked ~14 minutes, past the job's timeout and past its end). The same on a real Slurm:
tests/test_slurm_jobs.py."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

JOB_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "slurm", "cachemw-job.sh")
BIN = os.path.dirname(sys.executable)  # python and ray of this venv, as on a job's PATH
ENV = dict({k: v for k, v in os.environ.items()
            if not k.startswith(("CACHEMW_", "RAY_", "AUTOSCALER_"))},
           PATH=f"{BIN}:{os.environ['PATH']}")


def _bash(script: str, *args: str, timeout: float, env: dict | None = None):
    """``script`` in bash with the job script's functions; (rc, stdout, stderr, seconds).
    Its whole process group is killed on the timeout (a probe the script left running)."""
    began = time.monotonic()
    p = subprocess.Popen(["bash", "-c", f'source "$1"\nshift\n{script}', "bash", JOB_SCRIPT, *args],
                         env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"still running after {timeout} s: {err[-2000:]}")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # anything it left behind
        except ProcessLookupError:
            pass
    return p.returncode, out, err, time.monotonic() - began


def _ray_port_options() -> set[str]:
    """Every port option of this Ray's `ray start`."""
    out = subprocess.run([os.path.join(BIN, "ray"), "start", "--help"], capture_output=True,
                         text=True, check=True, env=ENV).stdout
    return set(re.findall(r"^\s+(--[a-z-]*port[a-z-]*)\b", out, re.M))


def _ports(job: str, **env) -> tuple[int, dict, dict, list[int]]:
    """The base, the head's options, a worker's options and the environment's ports."""
    rc, out, err, _ = _bash('cachemw_job_layout "$1" && echo "$CACHEMW_RAY_PORT_BASE" && '
                            'cachemw_ray_ports head && cachemw_ray_ports && cachemw_ray_env',
                            job, timeout=30, env=dict(ENV, **env))
    assert rc == 0, err
    base, head, worker, extra = out.strip().split("\n")

    def options(line):
        return {k: int(v) for k, v in (o.split("=") for o in line.split())}
    return int(base), options(head), options(worker), [int(v.split("=")[1]) for v in extra.split()]


def _in_use(options: dict, extra: list[int]) -> list[int]:
    """Every port a node's Ray may listen on: its options, the workers' range, the env's."""
    ports = [v for k, v in options.items() if k not in ("--min-worker-port", "--max-worker-port")]
    return ports + list(range(options["--min-worker-port"], options["--max-worker-port"] + 1)) \
        + extra


@pytest.mark.parametrize("job", ["0", "219", "220", "440", "4242"])
def test_every_ray_port_is_inside_the_jobs_block(job):
    base, head, worker, extra = _ports(job)
    assert base == 10000 + int(job) % 220 * 100
    for options in (head, worker):
        ports = _in_use(options, extra)
        assert len(ports) == len(set(ports)), (job, sorted(ports))  # no two on one port
        assert all(base <= p < base + 100 for p in ports), (job, options, extra)
    # each port option of the installed Ray is the job's (Ray's default otherwise: 10001 for
    # the client server, the very port a base of 10000 gives the node manager); the
    # autoscaler's metrics port is an environment variable only
    expected = _ray_port_options() - {"--worker-port-list"}
    assert set(head) == expected, expected ^ set(head)
    # a worker's too (`ray start` refuses a clash there as well: its client-server port is
    # set, 10001, though only a head opens it)
    assert head["--port"] == base and set(worker) == expected - {"--port"}
    assert len(extra) == 1


def test_a_port_base_set_by_the_user_is_the_block():
    base, head, worker, extra = _ports("220", CACHEMW_RAY_PORT_BASE="20000")
    assert base == 20000 and all(20000 <= p < 20100 for p in _in_use(head, extra))
    assert _ports("7", CACHEMW_RAY_PORT_BASE="")[0] == 10700  # empty: the job's default
    for bad in ("80", "65500", "1e4", "10000; rm -rf /"):
        rc, _, err, _ = _bash('cachemw_job_layout 7', timeout=30,
                              env=dict(ENV, CACHEMW_RAY_PORT_BASE=bad))
        assert rc == 1 and "CACHEMW_RAY_PORT_BASE must be a port" in err, (bad, err)


def _listener():
    """A TCP port that accepts connections and never answers (a hung Ray head)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_wait_for_nodes_fails_within_its_timeout_and_says_why():
    env = dict(ENV, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64)
    step = subprocess.Popen(["sleep", "300"])  # the Ray step: still running
    hung = _listener()
    free = _listener()
    closed_port = free.getsockname()[1]
    free.close()  # nothing listens there any more
    try:
        # nothing listens at RAY_ADDRESS (Ray's head did not start): one ray.init there blocked
        # ~14 minutes; now each look is a TCP connect first
        rc, _, err, took = _bash(f'cachemw_wait_nodes 1 6 {step.pid}', timeout=120,
                                 env=dict(env, RAY_ADDRESS=f"127.0.0.1:{closed_port}"))
        assert rc == 1 and "did not come up within 6s: nothing listens" in err, err
        assert took < 6 + 20, took  # the stated timeout, plus a few seconds (generous: load)
        # something accepts but never answers: each ray.init is cut off, and never runs past
        # the timeout
        rc, _, err, took = _bash(f'cachemw_wait_nodes 1 8 {step.pid}', timeout=120,
                                 env=dict(env, RAY_ADDRESS=f"127.0.0.1:{hung.getsockname()[1]}"))
        assert rc == 1 and "did not answer within 8s" in err, err
        assert took < 8 + 20, took
    finally:
        step.kill()
        step.wait()
        hung.close()
    # the Ray step has ended: at once, whatever the timeout
    rc, _, err, took = _bash(f'cachemw_wait_nodes 1 600 {step.pid}', timeout=60,
                             env=dict(env, RAY_ADDRESS=f"127.0.0.1:{closed_port}"))
    assert rc == 1 and "its step ended" in err, err


@pytest.mark.timeout(120)
def test_a_last_look_cut_short_does_not_hide_what_the_wait_saw(tmp_path):
    """One node of two answered; the last look, bounded by the time left, got no answer:
    the job said the head did not answer rather than that one node of two came up."""
    step = subprocess.Popen(["sleep", "300"])
    looks = tmp_path / "looks"
    try:  # a look: "1" (Ray answers: one node up) the first time, then no answer
        rc, _, err, _ = _bash(f'''
cachemw_ray_nodes_up() {{ if [[ -e {looks} ]]; then sleep "$1"; else touch {looks}; echo 1; fi; }}
cachemw_wait_nodes 2 3 {step.pid}''', timeout=60, env=dict(ENV, RAY_ADDRESS="127.0.0.1:1"))
        # nothing listened, then a head that does not answer: a whole look says so
        looks.unlink()
        rc2, _, err2, _ = _bash(f'''
cachemw_ray_nodes_up() {{ if [[ -e {looks} ]]; then sleep "$1"; else touch {looks}; echo closed; fi; }}
cachemw_wait_nodes 2 9 {step.pid}''', timeout=60, env=dict(ENV, RAY_ADDRESS="127.0.0.1:1"))
    finally:
        step.kill()
        step.wait()
    assert rc == 1 and "only 1 of 2 Ray nodes came up within 3s" in err, err
    assert rc2 == 1 and "did not answer within 9s" in err2, err2


HEAD_IN_A_NAMESPACE = r'''
ip link set lo up
cachemw_node_addr() { echo 127.0.0.1; }  # no scontrol here: the node's address
cachemw_job_layout "$1"
export SLURMD_NODENAME=h CACHEMW_HEAD=h RAY_ADDRESS=127.0.0.1:$CACHEMW_RAY_PORT_BASE
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))')
cachemw_node_ray > "$CACHEMW_RAY_TMP.log" 2>&1 &
node=$!
cachemw_wait_nodes 1 150 "$node" || { tail -20 "$CACHEMW_RAY_TMP.log"; exit 3; }
# a few tasks (worker processes), then every listening socket of this network
python - <<'EOF'
import ray
ray.init(logging_level="ERROR", log_to_driver=False)
@ray.remote
def f(i):
    return i
assert sum(ray.get([f.remote(i) for i in range(8)])) == 28
EOF
sleep 5  # the agents' late listeners
ss -Htlnp; ss -Hulnp
kill -TERM "$node"
wait "$node"
echo "left: [$(ls -d "$CACHEMW_RAY_TMP"-h "$CACHEMW_RUNTIME_DIR" 2>/dev/null)]"
'''


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_ray_head_of_a_job_whose_port_base_is_10000_starts_and_stays_inside_its_block():
    """Job 220: the head as cachemw_node_ray starts it, in a network and pid namespace of its
    own (its ports are nobody else's; everything in it ends with it)."""
    if os.geteuid() != 0 or not all(shutil.which(b) for b in ("unshare", "ip", "ss")):
        pytest.skip("needs root, unshare, ip and ss (a private network namespace)")
    short = tempfile.mkdtemp(prefix="cmw-rs-", dir="/tmp")  # Ray's socket paths are short
    try:
        env = dict(ENV, CACHEMW_RUNTIME_DIR=os.path.join(short, "run"),
                   CACHEMW_RAY_TMP=os.path.join(short, "ray"))
        began = time.monotonic()
        p = subprocess.Popen(
            ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "bash", "-c",
             f'source "$1"\nshift\n{HEAD_IN_A_NAMESPACE}', "bash", JOB_SCRIPT, "220"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        try:
            out, err = p.communicate(timeout=240)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
        assert p.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
        listening = {}
        for line in out.splitlines():
            m = re.search(r"\s(\S+):(\d+)\s+\S+:\*\s*(.*)$", line)
            if m and line.split()[0] in ("LISTEN", "UNCONN"):
                listening[int(m.group(2))] = m.group(3)[:80]
        assert 10000 in listening and 10003 in listening, out  # GCS, Ray client server
        outside = {port: who for port, who in listening.items() if not 10000 <= port < 10100}
        assert not outside, (outside, out)
        assert "left: []" in out, out[-2000:]  # the node's Ray temp dir and runtime dir
        assert time.monotonic() - began < 240
    finally:
        shutil.rmtree(short, ignore_errors=True)
