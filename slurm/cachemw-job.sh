#!/usr/bin/env bash
#SBATCH --job-name=cachemw
#SBATCH --ntasks-per-node=1
# cachemw on a Slurm allocation: Ray on every node, one cache daemon per node, your
# training command, then everything stopped and removed (on exit, failure or scancel).
#
#   sbatch -N 4 [sbatch options] slurm/cachemw-job.sh python train.py --epochs 2
#
# The command runs on the first node with RAY_ADDRESS and CACHEMW_RUNTIME_DIR set; start
# one task per node from it with `srun --overlap ...`. Tiers: CACHEMW_DRAM_CAPACITY,
# CACHEMW_NVME_DIR, CACHEMW_NVME_CAPACITY (see slurm/README.md). `ray` and `cachemw` must
# be on PATH on every node (activate the venv before sbatch: the environment is exported).
#
# Everything of the job is its own, derived from SLURM_JOB_ID, so jobs side by side on a
# node never meet: the runtime dir (daemon socket, DRAM tier), Ray's temp dir and ports,
# and a Ray auth token made here (in the environment of the job's steps only).

# The job's names and ports, from its id (a function so it can be checked without Slurm).
# Ray ports: a block of 100 per job below Linux's ephemeral range (32768+); 220 blocks, so
# two jobs whose ids differ by a multiple of 220 on one node would clash: set
# CACHEMW_RAY_PORT_BASE to pick another block. A CACHEMW_RUNTIME_DIR or CACHEMW_RAY_TMP
# in the submitting environment (sbatch exports it) is a base the job's id is added to,
# so that jobs side by side still never share a runtime dir (nor remove each other's);
# a base that is itself a job's (a job submitted from a job) loses that job's id first.
cachemw_job_layout() {
    local job=$1 uid runtime tmp
    uid=$(id -u)
    if ! [[ $job =~ ^[0-9]+$ ]]; then
        echo "cachemw-job: SLURM_JOB_ID must be a number, got '$job'" >&2
        return 1
    fi
    CACHEMW_RAY_PORT_BASE=${CACHEMW_RAY_PORT_BASE:-$((10000 + (job % 220) * 100))}
    if ! [[ $CACHEMW_RAY_PORT_BASE =~ ^[1-9][0-9]{3,4}$ ]] || (( CACHEMW_RAY_PORT_BASE < 1024 ||
            CACHEMW_RAY_PORT_BASE > 65436 )); then
        echo "cachemw-job: CACHEMW_RAY_PORT_BASE must be a port from 1024 to 65436 (its" \
             "block of 100 below 32768 is best: 10000-32668), got '$CACHEMW_RAY_PORT_BASE'" >&2
        return 1
    fi
    runtime=${CACHEMW_RUNTIME_DIR:-/dev/shm/cachemw-$uid}
    tmp=${CACHEMW_RAY_TMP:-/tmp/cachemw-ray-$uid}
    while [[ $runtime == */ && $runtime != / ]]; do runtime=${runtime%/}; done
    while [[ $tmp == */ && $tmp != / ]]; do tmp=${tmp%/}; done
    if [[ $runtime != /?* || $tmp != /?* ]]; then
        echo "cachemw-job: CACHEMW_RUNTIME_DIR and CACHEMW_RAY_TMP must be absolute paths" \
             "below /, got '$runtime' and '$tmp'" >&2
        return 1
    fi
    if [[ $runtime =~ ^(.+)-job[0-9]+$ ]]; then runtime=${BASH_REMATCH[1]}; fi
    if [[ $tmp =~ ^(.+)-job[0-9]+$ ]]; then tmp=${BASH_REMATCH[1]}; fi
    CACHEMW_RUNTIME_DIR=$runtime-job$job
    CACHEMW_RAY_TMP=$tmp-job$job
    export CACHEMW_RAY_PORT_BASE CACHEMW_RUNTIME_DIR CACHEMW_RAY_TMP
}

# `ray start` options of this job's ports: every port Ray opens by default is given its
# place in the job's block (Ray's defaults, 6379, 8265, 10001, 44217, 52365 and random ones,
# would be shared by jobs side by side, or fall inside a block: `ray start` refuses a port
# given twice, on workers too, whose client-server port is set though only the head opens it):
#   +0 GCS (head: "head" adds it)  +4 dashboard agent gRPC   +8 dashboard (head; it runs
#   +1 node manager                +5 dashboard agent HTTP      with the GUI off too)
#   +2 object manager              +6 metrics export         +9 autoscaler metrics (head;
#   +3 Ray client server (head)    +7 runtime-env agent         AUTOSCALER_METRIC_PORT)
#   +20..+99 worker processes (one port each)
# The autoscaler's port is an environment variable only (cachemw_ray_env). A Ray client
# (ray://) connection, which the script never makes, would open Ray's own 23000-24000.
cachemw_ray_ports() {
    local b=$CACHEMW_RAY_PORT_BASE head=
    if [[ ${1:-} == head ]]; then head=" --port=$b"; fi
    echo "--node-manager-port=$((b + 1)) --object-manager-port=$((b + 2))" \
         "--ray-client-server-port=$((b + 3)) --dashboard-agent-grpc-port=$((b + 4))" \
         "--dashboard-agent-listen-port=$((b + 5)) --metrics-export-port=$((b + 6))" \
         "--runtime-env-agent-port=$((b + 7)) --dashboard-port=$((b + 8))" \
         "--min-worker-port=$((b + 20)) --max-worker-port=$((b + 99))$head"
}

# The environment `ray start` needs for the rest of the block (see cachemw_ray_ports).
cachemw_ray_env() {
    echo "AUTOSCALER_METRIC_PORT=$((CACHEMW_RAY_PORT_BASE + 9))"
}

# The address Slurm reaches a node at (NodeAddr), as an IP address for Ray.
cachemw_node_addr() {
    local addr
    addr=$(scontrol show node "$1" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
    if ! [[ $addr =~ ^[0-9.]+$ ]]; then
        addr=$(getent ahostsv4 "$addr" | awk 'NR == 1 {print $1}')
    fi
    echo "$addr"
}

# One task per node (a background step): Ray's head on the first node, a worker on each
# other; blocks until the step is ended, and Ray's processes are the step's (Slurm ends
# them with it). When the step ends (the job's end, or scancel: then Slurm refuses new
# steps) the task removes its node's runtime dir and Ray temp dir itself. Each node has
# its own temp dir: /tmp may be shared by nodes.
cachemw_node_ray() {
    local me tmp ports role ray_pid
    me=$(cachemw_node_addr "$SLURMD_NODENAME")
    tmp="$CACHEMW_RAY_TMP-$SLURMD_NODENAME"
    mkdir -p "$tmp" && chmod 0700 "$tmp"
    ports=$(cachemw_ray_ports)
    role=(--address="$RAY_ADDRESS")
    if [[ $SLURMD_NODENAME == "$CACHEMW_HEAD" ]]; then
        ports=$(cachemw_ray_ports head)
        role=(--head --include-dashboard=false)
    fi
    # shellcheck disable=SC2086,SC2046  # $ports is a list of options, cachemw_ray_env of VAR=N
    env $(cachemw_ray_env) ray start --block --node-ip-address="$me" "${role[@]}" $ports \
        --disable-usage-stats --temp-dir="$tmp/r" &
    ray_pid=$!
    # shellcheck disable=SC2064  # expanded now
    trap "cachemw_node_clean $ray_pid '$tmp'; exit 0" TERM INT
    wait "$ray_pid"
    cachemw_node_clean "$ray_pid" "$tmp"
}

# End this node's Ray (its processes die with `ray start`: Ray sets their parent-death
# signal) within a few seconds, well inside Slurm's KillWait, then remove the job's dirs.
cachemw_node_clean() {
    local pid=$1 tmp=$2 _
    kill -TERM "$pid" 2>/dev/null
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null  # (reaped quietly: not a "Killed" line in the job's log)
    sleep 0.5
    # The daemon may still be stopping (Slurm sent it TERM too: it copies DRAM to NVMe for
    # up to 10 s) and would write into the dir again: it holds daemon.lock while it lives.
    flock -w 15 "$CACHEMW_RUNTIME_DIR/daemon.lock" true 2>/dev/null || true
    rm -rf "$CACHEMW_RUNTIME_DIR" "$tmp"
}

# How many Ray nodes are up, one bounded look (at most $1 seconds, then its process is
# gone): "closed" when nothing listens at RAY_ADDRESS (a TCP connect: at once), the count
# when Ray answers, nothing when it does not answer in time. ray.init alone retries an
# address that does not answer for ~14 minutes, past any timeout and past the job's end.
cachemw_ray_nodes_up() {
    timeout -k 2 "$1" python - "$1" <<'EOF' 2>/dev/null
import os, signal, socket, sys
signal.alarm(int(sys.argv[1]))  # ends this process even if `timeout` is killed first
host, _, port = os.environ["RAY_ADDRESS"].rpartition(":")
try:
    socket.create_connection((host, int(port)), timeout=2).close()
except OSError:
    print("closed")
    sys.exit(0)
import ray
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
print(sum(1 for n in ray.nodes() if n["Alive"]))
EOF
}

# Wait until ``n`` Ray nodes are up: fail after ``timeout`` seconds (plus a few), or at once
# when the Ray step ``pid`` has ended, saying why. Each look is bounded (15 s, never past the
# timeout), so neither the timeout nor a scancel's TERM waits on one longer.
cachemw_wait_nodes() {
    local n=$1 timeout=$2 pid=$3 start=$SECONDS left bound up='' seen=''
    while (( (left = timeout - (SECONDS - start)) > 0 )); do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "cachemw-job: Ray did not start (its step ended; see the job's output)" >&2
            return 1
        fi
        bound=$(( left < 15 ? left : 15 ))
        up=$(cachemw_ray_nodes_up "$bound") || up=
        up=${up##*$'\n'}  # its last line (Ray may have printed before it)
        if [[ $up =~ ^[0-9]+$ ]] && (( up >= n )); then return 0; fi
        # what a look saw; no answer within a look the time left cut to a few seconds says
        # nothing (ray.init takes some), and does not hide what an earlier look saw
        if [[ -n $up ]] || (( bound >= 5 )) || [[ -z $seen ]]; then seen=$up; fi
        left=$(( timeout - (SECONDS - start) ))
        if (( left > 0 )); then sleep $(( left < 2 ? left : 2 )); fi
    done
    up=$seen
    case $up in
        closed) echo "cachemw-job: Ray's head did not come up within ${timeout}s: nothing" \
                     "listens at $RAY_ADDRESS (see the Ray step's output above)" >&2 ;;
        "") echo "cachemw-job: Ray's head at $RAY_ADDRESS did not answer within ${timeout}s" \
                 "(see the Ray step's output above)" >&2 ;;
        *) echo "cachemw-job: only $up of $n Ray nodes came up within ${timeout}s" >&2 ;;
    esac
    return 1
}

# Stop the daemons, end the Ray steps, remove the job's runtime dir and Ray temp dirs on
# every node. Runs once, on exit, failure or scancel (TERM).
cachemw_cleanup() {
    local rc=$?
    trap - EXIT TERM INT
    echo "cachemw-job: cleaning up (exit status $rc)" >&2
    if [[ -n ${CACHEMW_STARTED:-} ]]; then  # not when Ray never came up: none to stop
        timeout 15 cachemw stop --address "$RAY_ADDRESS" >/dev/null 2>&1 || true
    fi
    if [[ -n ${CACHEMW_RAY_STEP:-} ]]; then
        # its tasks end their Ray and remove their dirs within ~25 s (cachemw_node_clean),
        # once signalled: scancel --signal=INT reaches the step's tasks and cancels nothing.
        # A TERM to srun itself cancels the step, whose tasks were then killed before
        # their trap ran, each logged as "Killed" at every normal end of a job.
        local step
        step=$(squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' 2>/dev/null \
               | awk '$2 == "cachemw-ray" {print $1; exit}')
        if [[ -z $step ]] || ! scancel --signal=INT "$step" 2>/dev/null; then
            kill -TERM "$CACHEMW_RAY_STEP" 2>/dev/null || true
        fi
        for _ in $(seq 90); do
            kill -0 "$CACHEMW_RAY_STEP" 2>/dev/null || break
            sleep 0.5
        done
        kill -KILL "$CACHEMW_RAY_STEP" 2>/dev/null || true
        wait "$CACHEMW_RAY_STEP" 2>/dev/null || true
    fi
    # shellcheck disable=SC2016  # expanded on each node
    timeout 60 srun --overlap --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" \
        --ntasks-per-node=1 bash -c \
        'rm -rf "$CACHEMW_RUNTIME_DIR" "$CACHEMW_RAY_TMP-$SLURMD_NODENAME"' || true
    # this node's again, after this script's own Ray clients (`cachemw stop`) are gone: after
    # a scancel Slurm refuses the step above
    rm -rf "$CACHEMW_RUNTIME_DIR" "$CACHEMW_RAY_TMP-$SLURMD_NODENAME"
    exit "$rc"
}

cachemw_job_main() {
    set -euo pipefail
    if [[ $# -eq 0 ]]; then
        echo "usage: sbatch [options] $0 COMMAND [ARGS...]" >&2
        return 2
    fi
    : "${SLURM_JOB_ID:?run this under Slurm: sbatch $0 COMMAND}"
    if ! [[ ${CACHEMW_RAY_TIMEOUT:-180} =~ ^[1-9][0-9]*$ ]]; then
        echo "cachemw-job: CACHEMW_RAY_TIMEOUT must be a whole number of seconds, got" \
             "'$CACHEMW_RAY_TIMEOUT'" >&2
        return 2
    fi
    cachemw_job_layout "$SLURM_JOB_ID"
    CACHEMW_HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    RAY_ADDRESS="$(cachemw_node_addr "$CACHEMW_HEAD"):$CACHEMW_RAY_PORT_BASE"
    # token auth with a token of this job's own, passed to its steps in their environment
    RAY_AUTH_MODE=token
    RAY_AUTH_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))')
    export CACHEMW_HEAD RAY_ADDRESS RAY_AUTH_MODE RAY_AUTH_TOKEN
    export -f cachemw_node_addr cachemw_ray_ports cachemw_ray_env cachemw_node_ray \
        cachemw_node_clean
    trap cachemw_cleanup EXIT
    trap 'exit 143' TERM
    trap 'exit 130' INT

    srun --overlap --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" \
        --ntasks-per-node=1 --kill-on-bad-exit=0 --job-name=cachemw-ray \
        bash -c cachemw_node_ray &
    CACHEMW_RAY_STEP=$!
    cachemw_wait_nodes "$SLURM_JOB_NUM_NODES" "${CACHEMW_RAY_TIMEOUT:-180}" "$CACHEMW_RAY_STEP"
    CACHEMW_STARTED=1
    cachemw start --address "$RAY_ADDRESS"
    echo "cachemw-job: Ray at $RAY_ADDRESS, a cache daemon on each of $SLURM_JOB_NUM_NODES" \
         "node(s), runtime dir $CACHEMW_RUNTIME_DIR" >&2
    "$@" &
    wait $!  # in the background so a TERM (scancel) runs the trap at once
}

# Sourced (tests, Prolog/Epilog): only the functions above.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    cachemw_job_main "$@"
fi
