#!/usr/bin/env bash
# Site mode, Slurm Prolog (slurm.conf: Prolog=/path/prolog.sh, PrologFlags=Alloc): starts
# the job's cache daemon on this node, as the job's user, before the job's first step.
# Runs as root with SLURM_JOB_ID, SLURM_JOB_USER set. Site settings (tier sizes, NVMe dir,
# which cachemw, which partitions) in /etc/cachemw/site.env (or CACHEMW_SITE_ENV): CACHEMW_BIN,
# CACHEMW_DRAM_CAPACITY, CACHEMW_NVME_DIR, CACHEMW_NVME_CAPACITY, CACHEMW_PARTITIONS.
# The daemon is node-local (its own private Ray on 127.0.0.1, token auth); its runtime dir
# is the job's default, /dev/shm/cachemw-$UID-job$SLURM_JOB_ID, which every process of the
# job finds by itself. A failure here is logged and never fails the job: reads then
# autostart a daemon, or fall back to the source.
set -uo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin  # slurmd gives none
site=${CACHEMW_SITE_ENV:-/etc/cachemw/site.env}
if [[ -r $site ]]; then
    # shellcheck disable=SC1090
    source "$site"
fi
: "${SLURM_JOB_ID:?}" "${SLURM_JOB_USER:?}"
# CACHEMW_PARTITIONS (site.env): the partitions whose jobs get a daemon; unset: all
if [[ -n ${CACHEMW_PARTITIONS:-} && " $CACHEMW_PARTITIONS " != *" ${SLURM_JOB_PARTITION:-} "* ]]; then
    exit 0
fi
bin=${CACHEMW_BIN:-cachemw}
uid=$(id -u "$SLURM_JOB_USER") || exit 0
runtime=/dev/shm/cachemw-$uid-job$SLURM_JOB_ID
options=()
[[ -n ${CACHEMW_DRAM_CAPACITY:-} ]] && options+=(--dram-capacity "$CACHEMW_DRAM_CAPACITY")
if [[ -n ${CACHEMW_NVME_DIR:-} ]]; then
    nvme=${CACHEMW_NVME_DIR//%u/$SLURM_JOB_USER}  # e.g. /local/nvme/cachemw-%u (kept)
    while [[ $nvme == */ && $nvme != / ]]; do  # (through "link/" chown -h follows a link)
        nvme=${nvme%/}
    done
    # Root never acts on a path the job's user may have made: in a scratch dir users can
    # write, a symlink at that name made its target the user's (install -d -o did), and a
    # symlink for a parent (/local/nvme/%u/cachemw) made root create the directory wherever
    # it pointed. Root makes the directory only in a parent reached through no symlink,
    # root's own and writable by no one else (no one can race it there); anywhere else the
    # user makes it, with the user's rights. What is there then must be a directory the
    # user owns, else the job runs without an NVMe tier.
    parent=$(dirname -- "$nvme")
    if [[ ! -e $nvme && ! -L $nvme ]]; then
        if [[ $(realpath -e -- "$parent" 2>/dev/null) == "$parent" \
              && $(stat -c '%u %A' -- "$parent") =~ ^0\ d....-..-.$ ]]; then
            mkdir -m 0700 -- "$nvme" 2>/dev/null && chown -h -- "$SLURM_JOB_USER" "$nvme"
        else
            runuser -u "$SLURM_JOB_USER" -- mkdir -p -m 0700 -- "$nvme" 2>/dev/null
        fi
    fi
    if [[ -d $nvme && ! -L $nvme && $(stat -c %u -- "$nvme") == "$uid" ]]; then
        options+=(--nvme-dir "$nvme" --nvme-capacity "${CACHEMW_NVME_CAPACITY:?}")
    else
        echo "cachemw-prolog: job $SLURM_JOB_ID: $nvme is not a directory of $SLURM_JOB_USER's: no NVMe tier" >&2
        logger -t cachemw-prolog "job $SLURM_JOB_ID: $nvme is not a directory of the job user's: no NVMe tier" 2>/dev/null
    fi
fi
# a clean environment: only what the daemon needs, never root's
if ! out=$(timeout "${CACHEMW_PROLOG_TIMEOUT:-120}" runuser -u "$SLURM_JOB_USER" -- env -i \
        PATH=/usr/local/bin:/usr/bin:/bin HOME="$(getent passwd "$SLURM_JOB_USER" | cut -d: -f6)" \
        SLURM_JOB_ID="$SLURM_JOB_ID" "$bin" --runtime-dir "$runtime" start "${options[@]}" 2>&1)
then
    echo "cachemw-prolog: job $SLURM_JOB_ID: the cache daemon did not start: $(tail -c 2000 <<<"$out")" >&2
    logger -t cachemw-prolog "job $SLURM_JOB_ID: the cache daemon did not start" 2>/dev/null
fi
exit 0
