#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine, for the tests and for trying the sbatch
# scripts: installs the Debian packages if missing, writes slurm.conf into a scratch dir,
# starts munged, slurmctld and slurmd by hand (no systemd) and waits until a job runs.
# Idempotent: a second run finds the daemons up and only checks them. Needs root.
#
#   eval "$(bash slurm/start-cluster.sh)"     # sets SLURM_CONF
#   bash slurm/stop-cluster.sh
#
# Exit 0: ready; 3: Slurm cannot be set up here (not root, apt fails); 1: it would not
# start (see the logs in MPITAILOR_SLURM_DIR).
#
# MPITAILOR_SLURM_DIR (default /tmp/mpitailor-slurm): config, state, logs, pid files.
# MPITAILOR_SLURM_CPUS (default 8): CPUs the node advertises, more than the real cores so
# that `srun -n 4` runs on a 2-core machine (SlurmdParameters=config_overrides).
set -euo pipefail

DIR=${MPITAILOR_SLURM_DIR:-/tmp/mpitailor-slurm}
CPUS=${MPITAILOR_SLURM_CPUS:-8}
CONF=$DIR/slurm.conf
HOST=$(hostname -s)
PACKAGES=(slurmctld slurmd slurm-client munge libpmix2)

log() { printf '%s start-cluster: %s\n' "$(date '+%F %T')" "$*" >&2; }
die() { log "error: $*"; exit 1; }
unavailable() { log "error: $*"; exit 3; }

# pid from a pid file, if that process is alive and is the named program (pids are reused).
alive_pid() {
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ -n $pid && $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] && echo "$pid"
}

install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return
    command -v apt-get >/dev/null || unavailable "${missing[*]} missing and no apt-get to install them"
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update >"$DIR/apt.log" 2>&1 || unavailable "apt-get update failed; see $DIR/apt.log"
    apt-get install -y --no-install-recommends "${missing[@]}" >>"$DIR/apt.log" 2>&1 \
        || unavailable "apt-get install ${missing[*]} failed; see $DIR/apt.log"
}

write_conf() {
    local mem
    # Advertise a little less than the real memory: slurmd drains a node that has less.
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    mkdir -p "$DIR/state" "$DIR/spool"
    cat >"$CONF.new" <<EOF
# Written by slurm/start-cluster.sh: a one-node cluster for mpitailor's tests.
ClusterName=mpitailor
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Credentials expire after 10 s instead of 120: a requeued job restarts in ~18 s, not ~3 min.
AuthInfo=cred_expire=10
MpiDefault=pmi2
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Lets the node advertise more CPUs than it has; without it the node goes INVAL.
SlurmdParameters=config_overrides
# The main scheduler every second (default 60): a requeued job starts once it is eligible.
SchedulerParameters=batch_sched_delay=0,sched_interval=1
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 NodeHostname=$HOST CPUs=$CPUS RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    if cmp -s "$CONF.new" "$CONF"; then
        rm "$CONF.new"
    else
        mv "$CONF.new" "$CONF"
        CONF_CHANGED=1
    fi
}

start_munge() {
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        return  # already running (ours from an earlier call, or the machine's)
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged || die "munged did not start"
    alive_pid /run/munge/munged.pid munged >"$DIR/munged.started" \
        || die "munged started but /run/munge/munged.pid names no munged"
    log "started munged (pid $(cat "$DIR/munged.started"))"
}

start_daemons() {
    if [[ ${CONF_CHANGED:-0} == 1 ]] && alive_pid "$DIR/slurmctld.pid" slurmctld >/dev/null; then
        log "slurm.conf changed: restarting the daemons"
        MPITAILOR_SLURM_DIR=$DIR bash "$(dirname "$0")/stop-cluster.sh" --keep-munge
    fi
    if ! alive_pid "$DIR/slurmctld.pid" slurmctld >/dev/null; then
        # -c: a fresh queue; jobs of an earlier cluster in this dir are gone with it.
        slurmctld -c -f "$CONF" || die "slurmctld did not start; see $DIR/slurmctld.log"
        log "started slurmctld"
    fi
    if ! alive_pid "$DIR/slurmd.pid" slurmd >/dev/null; then
        slurmd -f "$CONF" -N "$HOST" || die "slurmd did not start; see $DIR/slurmd.log"
        log "started slurmd"
    fi
}

wait_ready() {
    local state="" i
    for ((i = 0; i < 120; i++)); do
        state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null || true)
        [[ $state =~ ^(idle|mixed|allocated|completing)$ ]] && break
        sleep 0.5
    done
    [[ $state =~ ^(idle|mixed|allocated|completing)$ ]] \
        || die "node $HOST is '${state:-unreachable}' after 60 s (drained: scontrol update nodename=$HOST state=resume); see $DIR/slurmctld.log and $DIR/slurmd.log"
    timeout 60 srun -n1 true || die "smoke job 'srun -n1 true' failed; see $DIR/slurmd.log"
    log "ready: node $HOST $state, $CPUS CPUs, srun works"
}

[[ $(id -u) == 0 ]] || unavailable "needs root: it installs packages and runs the daemons as root"
mkdir -p "$DIR"
install_packages
write_conf
export SLURM_CONF=$CONF
start_munge
start_daemons
wait_ready
echo "export SLURM_CONF=$CONF"
