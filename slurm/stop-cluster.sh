#!/usr/bin/env bash
# Stop the cluster of start-cluster.sh: cancel its jobs, then stop slurmd and slurmctld by
# their pid files (never by name: other daemons of the same name may be someone else's),
# and munged only if start-cluster.sh started it. Safe to run when nothing is running.
#
#   bash slurm/stop-cluster.sh [--keep-munge]             # the one-node cluster
#   bash slurm/stop-cluster.sh --nodes N [--keep-munge]   # that of start-cluster.sh --nodes N
#
# One node: MPITAILOR_SLURM_DIR (default /tmp/mpitailor-slurm), as start-cluster.sh.
# --nodes N (N >= 2; the node list is read from the cluster's dir, so any N >= 2 will do):
# MPITAILOR_CLUSTER_DIR (default /tmp/mpitailor-cluster). Besides the daemons (one slurmd per
# node, and the cluster's own munged), it ends what is left in the nodes' network namespaces
# (their pids, from `ip netns pids`), deletes the namespaces mpt-nI (their mounts go with the
# last process in them), the veths mpt-vI and the bridge, unless the bridge names another
# dir as its owner. The node-local dirs stay for inspection until the next fresh start, except
# the emulated disks of --disk-mbps: unmounted, their loop devices detached, their images and
# cgroups deleted (images of several GiB must not fill the host's disk).
set -euo pipefail

usage() { echo "usage: bash $0 [--nodes N] [--keep-munge]" >&2; exit 2; }
NODES=1 KEEP_MUNGE=0
while (($#)); do
    case $1 in
        --nodes) (($# >= 2)) || usage; NODES=$2; shift 2 ;;
        --nodes=*) NODES=${1#*=}; shift ;;
        --keep-munge) KEEP_MUNGE=1; shift ;;
        *) usage ;;
    esac
done
[[ $NODES =~ ^[1-9][0-9]?$ ]] || usage

if ((NODES == 1)); then
    DIR=${MPITAILOR_SLURM_DIR:-/tmp/mpitailor-slurm}
else
    DIR=${MPITAILOR_CLUSTER_DIR:-/tmp/mpitailor-cluster}
fi
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

# The processes still in netns $1 (slurmstepd, tasks): TERM, then KILL after 5 s.
end_netns_pids() {
    local pids i
    mapfile -t pids < <(ip netns pids "$1" 2>/dev/null)
    ((${#pids[@]})) || return 0
    log "ending processes left in $1: ${pids[*]}"
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        mapfile -t pids < <(ip netns pids "$1" 2>/dev/null)
        ((${#pids[@]})) || return 0
        sleep 0.1
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
}

# Several nodes: the node list and network names are in cluster.env (start-cluster.sh).
stop_nodes() {
    local nodes=0 bridge="" key value i
    if [[ -r $DIR/cluster.env ]]; then
        while IFS='=' read -r key value; do
            case $key in
                NODES) nodes=$value ;;
                BRIDGE) bridge=$value ;;
            esac
        done <"$DIR/cluster.env"
    fi
    [[ $nodes =~ ^[0-9]+$ ]] || nodes=0
    cancel_jobs
    # In parallel: each daemon takes ~2 s to exit after TERM.
    for ((i = 1; i <= nodes; i++)); do stop "$DIR/nodes/n$i/slurmd.pid" slurmd & done
    wait
    stop "$DIR/slurmctld.pid" slurmctld &
    ((KEEP_MUNGE)) || stop "$DIR/munge/munged.pid" munged &
    wait
    command -v ip >/dev/null || return 0
    if [[ -n $bridge ]] && ip link show "$bridge" >/dev/null 2>&1 \
            && [[ $(cat "/sys/class/net/$bridge/ifalias" 2>/dev/null) != "$DIR" ]]; then
        log "leaving the network alone: $bridge belongs to another cluster's dir"
        return 0
    fi
    for ((i = 1; i <= nodes; i++)); do
        if [[ -e /var/run/netns/mpt-n$i ]]; then
            end_netns_pids "mpt-n$i"
            ip netns del "mpt-n$i" && log "deleted netns mpt-n$i"
        fi
        if ip link show "mpt-v$i" >/dev/null 2>&1; then ip link del "mpt-v$i" || true; fi
    done
    if [[ -n $bridge ]] && ip link show "$bridge" >/dev/null 2>&1; then
        ip link del "$bridge" && log "deleted bridge $bridge"
    fi
    for ((i = 1; i <= nodes; i++)); do drop_disk "$i"; done
}

# Node $1's emulated disk (start-cluster.sh --disk-mbps), after its processes have ended.
drop_disk() {
    local d=$DIR/nodes/n$1 cg
    if mountpoint -q "$d/local"; then umount "$d/local" || log "cannot unmount $d/local"; fi
    if [[ -s $d/loop ]]; then
        losetup -d "$(cat "$d/loop")" 2>/dev/null && log "detached $(cat "$d/loop") of n$1"
    fi
    rm -f "$d/loop" "$d/disk.img"
    for cg in "/sys/fs/cgroup/blkio/mpt-n$1" "/sys/fs/cgroup/cpu/mpt-n$1" "/sys/fs/cgroup/mpt-n$1"; do
        if [[ -d $cg ]]; then rmdir "$cg" 2>/dev/null || true; fi
    done
}

if ((NODES > 1)); then
    stop_nodes
    exit 0
fi
cancel_jobs
stop "$DIR/slurmd.pid" slurmd
stop "$DIR/slurmctld.pid" slurmctld
if ((KEEP_MUNGE == 0)) && [[ -s $DIR/munged.started ]]; then
    stop "$DIR/munged.started" munged
    rm -f "$DIR/munged.started"
fi
