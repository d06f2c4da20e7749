#!/usr/bin/env bash
# Stop the cluster of start-cluster.sh: cancel its jobs, then stop slurmd and slurmctld by
# their pid files (never by name: other daemons of the same name may be someone else's),
# and munged only if start-cluster.sh started it. Safe to run when nothing is running.
#
#   bash slurm/stop-cluster.sh [--keep-munge]
set -euo pipefail

DIR=${MPITAILOR_SLURM_DIR:-/tmp/mpitailor-slurm}
export SLURM_CONF=$DIR/slurm.conf

log() { printf '%s stop-cluster: %s\n' "$(date '+%F %T')" "$*" >&2; }

alive_pid() {
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ -n $pid && $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] && echo "$pid"
}

# TERM, then KILL after 10 s; the pid file is checked against the program name first.
stop() {
    local pid i
    pid=$(alive_pid "$1" "$2") || return 0
    kill -TERM "$pid"
    for ((i = 0; i < 100; i++)); do
        kill -0 "$pid" 2>/dev/null || { log "stopped $2 (pid $pid)"; return 0; }
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    log "killed $2 (pid $pid): it ignored TERM for 10 s"
}

cancel_jobs() {
    local jobs i
    alive_pid "$DIR/slurmctld.pid" slurmctld >/dev/null || return 0
    mapfile -t jobs < <(timeout 10 squeue -h -o %i 2>/dev/null || true)
    ((${#jobs[@]})) || return 0
    # Jobs left running would leave their slurmstepd and tasks behind the stopped slurmd.
    log "cancelling jobs ${jobs[*]}"
    timeout 10 scancel "${jobs[@]}" || true
    for ((i = 0; i < 100; i++)); do
        [[ -z $(timeout 10 squeue -h -o %i 2>/dev/null) ]] && return 0
        sleep 0.2
    done
    log "jobs still listed after 20 s: stopping the daemons anyway"
}

cancel_jobs
stop "$DIR/slurmd.pid" slurmd
stop "$DIR/slurmctld.pid" slurmctld
if [[ ${1:-} != --keep-munge && -s $DIR/munged.started ]]; then
    stop "$DIR/munged.started" munged
    rm -f "$DIR/munged.started"
fi
