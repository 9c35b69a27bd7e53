#!/usr/bin/env bash
# Site mode, Slurm Epilog (slurm.conf: Epilog=/path/epilog.sh): stops the job's cache
# daemon on this node and removes its runtime dir and DRAM tier (/dev/shm is the node's
# RAM). Runs as root with SLURM_JOB_ID and SLURM_JOB_USER set, after every job, also one
# that used the job script (slurm/cachemw-job.sh) or was cancelled. An NVMe tier is kept
# (the next job of the user on this node starts warm); the site purges it by age.
set -uo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin  # slurmd gives none
site=${CACHEMW_SITE_ENV:-/etc/cachemw/site.env}
if [[ -r $site ]]; then
    # shellcheck disable=SC1090
    source "$site"
fi
: "${SLURM_JOB_ID:?}" "${SLURM_JOB_USER:?}"
bin=${CACHEMW_BIN:-cachemw}
uid=$(id -u "$SLURM_JOB_USER") || exit 0
runtime=/dev/shm/cachemw-$uid-job$SLURM_JOB_ID
if [[ -d $runtime && ! -L $runtime ]]; then
    timeout "${CACHEMW_EPILOG_TIMEOUT:-60}" runuser -u "$SLURM_JOB_USER" -- env -i \
        PATH=/usr/local/bin:/usr/bin:/bin SLURM_JOB_ID="$SLURM_JOB_ID" \
        "$bin" --runtime-dir "$runtime" stop >/dev/null 2>&1
    # only the job user's own dir (a dir another user made there is left alone)
    if [[ $(stat -c %u "$runtime") == "$uid" ]]; then
        rm -rf --one-file-system "$runtime"
    fi
fi
# the job script's Ray temp dirs on this node
for d in /tmp/cachemw-ray-"$uid"-job"$SLURM_JOB_ID"-*; do
    [[ -d $d && ! -L $d && $(stat -c %u "$d") == "$uid" ]] && rm -rf --one-file-system "$d"
done
exit 0
