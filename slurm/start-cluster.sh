#!/usr/bin/env bash
# A real Slurm cluster on this machine, for the tests and for trying the sbatch scripts:
# installs the Debian packages if missing, writes slurm.conf into a scratch dir, starts
# munged, slurmctld and slurmd by hand (no systemd) and waits until a job runs.
# Idempotent: a second run finds the daemons up and only checks them. Needs root.
#
#   eval "$(bash slurm/start-cluster.sh)"              # one node (this host); sets SLURM_CONF
#   bash slurm/stop-cluster.sh
#   eval "$(bash slurm/start-cluster.sh --nodes 3)"    # nodes n1..n3 on this host
#   bash slurm/stop-cluster.sh --nodes 3
#
# Exit 0: ready; 3: Slurm cannot be set up here (not root, apt fails; with --nodes: no
# network/UTS/IPC/mount namespaces, bridge or veth); 1: it would not start (see the logs in the
# state dir).
#
# One node (no --nodes, or --nodes 1), as before:
# MPITAILOR_SLURM_DIR (default /tmp/mpitailor-slurm): config, state, logs, pid files.
# MPITAILOR_SLURM_CPUS (default 8): CPUs the node advertises, more than the real cores so
# that `srun -n 4` runs on a 2-core machine (SlurmdParameters=config_overrides).
#
# Several nodes (--nodes N, N >= 2): one slurmctld in this host's namespaces, and per node nI
# one slurmd in its own network, UTS (hostname nI), IPC and mount namespace (with its own
# /dev/shm). The nodes share one bridge (mpt-br0, the controller's address .1 of a private
# /24) through one veth each (eth0 inside the node's netns mpt-nI, address .(10+I));
# /etc/hosts inside every node lists n1..nN. Every node has a node-local directory at the
# same path, MPITAILOR_NODE_LOCAL (default /var/tmp/mpitailor-node-local): in node nI it is
# $DIR/nodes/nI/local bind-mounted there, so what one node writes there the others cannot see
# (the host sees it under $DIR/nodes/nI/local); everything else (the repo, /tmp, the venv) is
# shared. A fresh start empties the node-local dirs. The cluster has its own munged (socket
# in $DIR/munge) and controller port, so it never touches the one-node cluster's; one such
# cluster runs at a time (the names mpt-br0, mpt-nI, mpt-vI are fixed: a start from another
# dir is refused). Printed on stdout: `export SLURM_CONF=...`,
# `export MPITAILOR_NODE_LOCAL=...` and `export MPITAILOR_CLUSTER_DIR=...`.
# MPITAILOR_CLUSTER_DIR (default /tmp/mpitailor-cluster): config, state, logs, pid files,
#   nodes/nI/{local,spool,slurmd.log,slurmd.pid}; stop-cluster.sh --nodes N finds it there.
# MPITAILOR_CLUSTER_NET (default 10.77.251): the /24 used inside the cluster's namespaces.
# MPITAILOR_CLUSTER_PORT (default 6827): slurmctld's port (the one-node cluster has 6817).
# MPITAILOR_SLURM_CPUS (default 8): CPUs each node advertises.
#
# Emulated node disks (--nodes N --disk-mbps M [--disk-size G], for bench/node_scaling.py):
# each node's node-local dir is then its own ext4 file system on its own loop device
# (a sparse image $DIR/nodes/nI/disk.img of G GiB, default 4; attached with direct I/O, so the
# image's bytes are not cached a second time in the host's page cache), mounted at
# $DIR/nodes/nI/local and from there bind-mounted into the node as before. The node's slurmd,
# and so every task of its job steps, runs in a cgroup mpt-nI whose block-I/O throttle limits
# reads and writes of that loop device to M MB/s (10^6 bytes) each: blkio.throttle.*_bps_device
# on cgroup v1 (this host), io.max on cgroup v2. The file system is mounted `sync`: a cgroup v1
# throttle sees only the I/O a task submits itself, and buffered writes are otherwise written
# back later by the kernel's flusher threads, outside any node's cgroup (measured with dd at
# 20 MB/s: a 200 MB buffered write took 0.57 s on a default mount, 10.0 s on the sync mount;
# a read after POSIX_FADV_DONTNEED 10.0 s inside the cgroup, 0.4 s outside). The host's own
# writes there (placing a checkpoint) are not throttled. Reads hit the device only when the
# page cache does not hold the file (drop it first: POSIX_FADV_DONTNEED). stop-cluster.sh
# unmounts, detaches and deletes the images and cgroups. Without --disk-mbps nothing changes.
#
# Emulated node CPUs (--nodes N --node-cpus C, C a decimal such as 0.5): each node's slurmd, and
# so every task of its job steps, runs in a cgroup mpt-nI whose CPU bandwidth is capped at C
# cores (cpu.cfs_quota_us on cgroup v1, cpu.max on cgroup v2). All emulated nodes share this
# host's cores: uncapped, a 4-node run gets 4x the CPU of each node of a 1-node run only when
# the host has cores to spare, and ranks of one node take CPU from the others. With C x N no
# more than the host's cores, every node has C cores of its own whatever the others do, as
# real nodes do, and a 1-node run gets what one node of a larger run gets.
set -euo pipefail

usage() { echo "usage: bash $0 [--nodes N [--disk-mbps M [--disk-size G]] [--node-cpus C]]" >&2; exit 2; }
NODES=1 DISK_MBPS=0 DISK_SIZE=4 NODE_CPUS=0
while (($#)); do
    case $1 in
        --nodes) (($# >= 2)) || usage; NODES=$2; shift 2 ;;
        --nodes=*) NODES=${1#*=}; shift ;;
        --disk-mbps) (($# >= 2)) || usage; DISK_MBPS=$2; shift 2 ;;
        --disk-mbps=*) DISK_MBPS=${1#*=}; shift ;;
        --disk-size) (($# >= 2)) || usage; DISK_SIZE=$2; shift 2 ;;
        --disk-size=*) DISK_SIZE=${1#*=}; shift ;;
        --node-cpus) (($# >= 2)) || usage; NODE_CPUS=$2; shift 2 ;;
        --node-cpus=*) NODE_CPUS=${1#*=}; shift ;;
        *) usage ;;
    esac
done
[[ $NODES =~ ^[1-9][0-9]?$ && $DISK_MBPS =~ ^[0-9]+$ && $DISK_SIZE =~ ^[1-9][0-9]*$ ]] || usage
((DISK_MBPS == 0 || NODES > 1)) || { echo "--disk-mbps needs --nodes N with N >= 2" >&2; exit 2; }
[[ $NODE_CPUS =~ ^[0-9]+(\.[0-9]+)?$ ]] || usage
# the cap in microseconds of CPU per 100 ms period (0: none)
CPU_QUOTA=$(awk -v c="$NODE_CPUS" 'BEGIN { printf "%d", c * 100000 }')
((CPU_QUOTA == 0 || NODES > 1)) || { echo "--node-cpus needs --nodes N with N >= 2" >&2; exit 2; }
((CPU_QUOTA == 0 || CPU_QUOTA >= 1000)) || { echo "--node-cpus $NODE_CPUS: at least 0.01" >&2; exit 2; }

if ((NODES == 1)); then
    DIR=${MPITAILOR_SLURM_DIR:-/tmp/mpitailor-slurm}
else
    DIR=${MPITAILOR_CLUSTER_DIR:-/tmp/mpitailor-cluster}
fi
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

# --- Several nodes (--nodes N) --------------------------------------------------------------
BRIDGE=mpt-br0
NET=${MPITAILOR_CLUSTER_NET:-10.77.251}
PORT=${MPITAILOR_CLUSTER_PORT:-6827}
NODE_LOCAL=${MPITAILOR_NODE_LOCAL:-/var/tmp/mpitailor-node-local}
MUNGE_SOCKET=$DIR/munge/munge.socket

node_addr() { echo "$NET.$((10 + $1))"; }
node_names() { local i; for ((i = 1; i <= NODES; i++)); do echo "n$i"; done; }

check_namespaces() {
    local c
    for c in ip unshare nsenter; do
        command -v "$c" >/dev/null \
            || unavailable "no '$c' command: cannot make the nodes' namespaces"
    done
    unshare --uts --ipc --mount --propagation private true 2>/dev/null \
        || unavailable "'unshare --uts --ipc --mount' fails here: no namespaces for the nodes"
    [[ $NET =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] \
        || die "MPITAILOR_CLUSTER_NET=$NET is not the first three numbers of a /24 (e.g. 10.77.251)"
}

# slurm.conf, the nodes' /etc/hosts and cluster.env (what stop-cluster.sh reads), each
# written as FILE.new first; if any differs, the cluster of the old files is stopped first.
write_nodes_conf() {
    local mem i f changed=0
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    mkdir -p "$DIR/state"
    {
        cat <<EOF
# Written by slurm/start-cluster.sh --nodes $NODES: nodes n1..n$NODES on this host, each in its
# own network, UTS and mount namespace (see the top of slurm/start-cluster.sh).
ClusterName=mpitailor-nodes
SlurmctldHost=$HOST($NET.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# The cluster's own munged; credentials expire after 10 s instead of 120.
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
MpiDefault=pmi2
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerParameters=batch_sched_delay=0,sched_interval=1
ReturnToService=2
# A node that dies (its slurmd and job steps killed) is DOWN after ~10 s, not 300, and its
# jobs end (a --requeue batch job is requeued); once its slurmd is back it returns to service
# (ReturnToService=2). KillWait: 5 s from SIGTERM to SIGKILL (default 30), which also bounds
# how long srun waits for a dead node's step to report.
SlurmdTimeout=10
KillWait=5
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
StateSaveLocation=$DIR/state
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdSpoolDir=$DIR/nodes/%n/spool
SlurmdPidFile=$DIR/nodes/%n/slurmd.pid
SlurmdLogFile=$DIR/nodes/%n/slurmd.log
EOF
        for ((i = 1; i <= NODES; i++)); do
            echo "NodeName=n$i NodeAddr=$(node_addr "$i") CPUs=$CPUS RealMemory=$mem State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF.new"
    {
        printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n'
        printf '%s\t%s\n' "$NET.1" "$HOST"
        for ((i = 1; i <= NODES; i++)); do printf '%s\tn%s\n' "$(node_addr "$i")" "$i"; done
    } >"$DIR/hosts.new"
    printf 'NODES=%s\nNET=%s\nBRIDGE=%s\nNODE_LOCAL=%s\nDISK_MBPS=%s\nDISK_SIZE=%s\nCPU_QUOTA=%s\n' \
        "$NODES" "$NET" "$BRIDGE" "$NODE_LOCAL" "$DISK_MBPS" "$DISK_SIZE" "$CPU_QUOTA" \
        >"$DIR/cluster.env.new"
    for f in "$CONF" "$DIR/hosts" "$DIR/cluster.env"; do
        cmp -s "$f.new" "$f" || changed=1
    done
    if ((changed)); then
        if [[ -e $DIR/cluster.env ]]; then
            log "configuration changed: stopping the cluster of the old one"
            MPITAILOR_CLUSTER_DIR=$DIR bash "$(dirname "$0")/stop-cluster.sh" --nodes "$NODES"
        fi
        for f in "$CONF" "$DIR/hosts" "$DIR/cluster.env"; do mv "$f.new" "$f"; done
    else
        rm "$CONF.new" "$DIR/hosts.new" "$DIR/cluster.env.new"
    fi
}

# The bridge's alias names the dir of the cluster that made it: the names (mpt-br0, mpt-nI,
# mpt-vI) and the port are the same for every dir, so there is one such cluster at a time.
check_owner() {
    local owner
    ip link show "$BRIDGE" >/dev/null 2>&1 || return 0
    owner=$(cat "/sys/class/net/$BRIDGE/ifalias" 2>/dev/null || true)
    [[ $owner == "$DIR" ]] || die "bridge $BRIDGE belongs to the cluster in ${owner:-(unknown)};" \
        "stop it first: MPITAILOR_CLUSTER_DIR=$owner bash slurm/stop-cluster.sh --nodes 2"
}

# The bridge, and per node a netns mpt-nI with eth0 (the peer of veth mpt-vI on the bridge).
setup_network() {
    local i ns veth other
    other=$(ip -4 -o addr show to "$NET.0/24" | awk -v b="$BRIDGE" '$2 != b {print $2}')
    [[ -z $other ]] \
        || die "$NET.0/24 is in use here ($other): set MPITAILOR_CLUSTER_NET to a free /24"
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge 2>"$DIR/ip.err" \
            || unavailable "cannot make bridge $BRIDGE: $(head -1 "$DIR/ip.err")"
    fi
    ip link set "$BRIDGE" alias "$DIR"
    ip addr replace "$NET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for ((i = 1; i <= NODES; i++)); do
        ns=mpt-n$i veth=mpt-v$i
        if [[ ! -e /var/run/netns/$ns ]]; then
            ip netns add "$ns" 2>"$DIR/ip.err" \
                || unavailable "'ip netns add $ns' fails: $(head -1 "$DIR/ip.err")"
        fi
        nsenter --net="/var/run/netns/$ns" true 2>"$DIR/ip.err" \
            || unavailable "cannot enter netns $ns: $(head -1 "$DIR/ip.err")"
        if ! nsenter --net="/var/run/netns/$ns" ip link show eth0 >/dev/null 2>&1; then
            ip link del "$veth" 2>/dev/null || true
            ip link add "$veth" type veth peer name eth0 netns "$ns" 2>"$DIR/ip.err" \
                || unavailable "cannot make veth $veth: $(head -1 "$DIR/ip.err")"
        fi
        ip link set "$veth" master "$BRIDGE" up
        nsenter --net="/var/run/netns/$ns" sh -c "ip addr replace $(node_addr "$i")/24 dev eth0 \
            && ip link set eth0 up && ip link set lo up" || die "cannot set up eth0 in $ns"
    done
    rm -f "$DIR/ip.err"
}

start_private_munge() {
    if munge -S "$MUNGE_SOCKET" -n </dev/null 2>/dev/null \
            | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; then
        return
    fi
    install -d -o munge -g munge -m 0755 "$DIR/munge"
    runuser -u munge -- /usr/sbin/munged --socket="$MUNGE_SOCKET" \
        --pid-file="$DIR/munge/munged.pid" --seed-file="$DIR/munge/munged.seed" \
        --log-file="$DIR/munge/munged.log" || die "munged did not start; see $DIR/munge/munged.log"
    log "started munged (pid $(cat "$DIR/munge/munged.pid"))"
}

# The block-I/O cgroup of node $1 (see the top): its dir, made if missing.
node_cgroup() {
    if [[ -d /sys/fs/cgroup/blkio ]]; then
        echo "/sys/fs/cgroup/blkio/mpt-n$1"
    elif grep -qw io /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
        echo "/sys/fs/cgroup/mpt-n$1"
    else
        return 1
    fi
}

# The CPU cgroup of node $1 (--node-cpus), capped at CPU_QUOTA per 100 ms: its dir. Refused in
# one line when the host has no CPU controller.
node_cpu_cgroup() {
    local cg
    if [[ -d /sys/fs/cgroup/cpu ]]; then
        cg=/sys/fs/cgroup/cpu/mpt-n$1
        mkdir -p "$cg"
        echo 100000 >"$cg/cpu.cfs_period_us"
        echo "$CPU_QUOTA" >"$cg/cpu.cfs_quota_us"
    elif grep -qw cpu /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
        cg=/sys/fs/cgroup/mpt-n$1
        grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control || echo +cpu >/sys/fs/cgroup/cgroup.subtree_control
        mkdir -p "$cg"
        echo "$CPU_QUOTA 100000" >"$cg/cpu.max"
    else
        unavailable "no cpu controller (cgroup v1 or v2): cannot cap the nodes' CPUs"
    fi
    log "CPU of n$1: capped at $NODE_CPUS cores ($cg)"
    echo "$cg"
}

# Node $1's disk: a fresh loop device and ext4 of DISK_SIZE GiB mounted (sync) on its
# node-local dir, its cgroup throttled to DISK_MBPS on that device. Refused in one line when
# the host has no room for the images, no loop device or no block-I/O throttle.
setup_disk() {
    local i=$1 d=$DIR/nodes/n$1 loop majmin cg bps avail
    cg=$(node_cgroup "$i") || unavailable "no blkio (cgroup v1) or io (cgroup v2) controller:" \
        "cannot throttle the nodes' disks"
    avail=$(df -B1G --output=avail "$DIR" | tail -1 | tr -d ' ')
    ((avail >= DISK_SIZE * (NODES - i + 1) + 2)) || die "--disk-size $DISK_SIZE: $DIR has" \
        "${avail} GiB free, the $((NODES - i + 1)) node disks left need $((DISK_SIZE * (NODES - i + 1))) GiB" \
        "and 2 to spare; use a smaller --disk-size or free some space"
    truncate -s "${DISK_SIZE}G" "$d/disk.img"
    loop=$(losetup -f --show --direct-io=on "$d/disk.img" 2>"$DIR/losetup.err") \
        || unavailable "no loop device for $d/disk.img: $(head -1 "$DIR/losetup.err")"
    echo "$loop" >"$d/loop"
    mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$loop" \
        || die "mkfs.ext4 $loop failed"
    mount -o sync "$loop" "$d/local" || die "cannot mount $loop on $d/local"
    majmin=$(lsblk -dno MAJ:MIN "$loop" | tr -d ' ')
    bps=$((DISK_MBPS * 1000000))
    mkdir -p "$cg"
    if [[ -e $cg/blkio.throttle.read_bps_device ]]; then
        echo "$majmin $bps" >"$cg/blkio.throttle.read_bps_device"
        echo "$majmin $bps" >"$cg/blkio.throttle.write_bps_device"
    else
        grep -qw io /sys/fs/cgroup/cgroup.subtree_control || echo +io >/sys/fs/cgroup/cgroup.subtree_control
        echo "$majmin rbps=$bps wbps=$bps" >"$cg/io.max"
    fi
    rm -f "$DIR/losetup.err"
    log "disk of n$i: $loop (${DISK_SIZE} GiB ext4, sync) at $d/local, $DISK_MBPS MB/s read and write"
}

# What a cluster that was not stopped left of node $1's disk (stop-cluster.sh does the same).
drop_disk() {
    local d=$DIR/nodes/n$1
    if mountpoint -q "$d/local"; then umount "$d/local" || die "cannot unmount $d/local"; fi
    if [[ -s $d/loop ]]; then losetup -d "$(cat "$d/loop")" 2>/dev/null || true; fi
    rm -f "$d/loop" "$d/disk.img"
}

# slurmd of node $1 inside its netns, in new UTS, IPC and mount namespaces: hostname nI, its
# own /dev/shm, the node-local dir and the cluster's hosts file mounted there; its job steps
# inherit all of them. Without the IPC namespace and /dev/shm, MPICH's UCX sees one host and
# moves messages between nodes through shared memory instead of TCP over the bridge.
start_slurmd() {
    local n=n$1 procs=""
    if ((DISK_MBPS)); then procs=$(node_cgroup "$1")/cgroup.procs; fi
    if ((CPU_QUOTA)); then procs="$procs $(node_cpu_cgroup "$1")/cgroup.procs"; fi
    nsenter --net="/var/run/netns/mpt-$n" unshare --uts --ipc --mount --propagation private \
        sh -c 'for f in $6; do echo $$ >"$f" || exit 1; done && hostname "$1" && mount -t tmpfs -o mode=1777 shm /dev/shm \
               && mount --bind "$2" "$3" && mount --bind "$4" /etc/hosts \
               && exec slurmd -f "$5" -N "$1"' \
        sh "$n" "$DIR/nodes/$n/local" "$NODE_LOCAL" "$DIR/hosts" "$CONF" "$procs" \
        || die "slurmd of $n did not start; see $DIR/nodes/$n/slurmd.log"
    log "started slurmd of $n"
}

wait_nodes_ready() {
    local i states="" want got
    want=$(node_names | sed 's/$/ idle/' | sort)
    for ((i = 0; i < 120; i++)); do
        states=$(sinfo -h -N -o '%N %T' 2>/dev/null \
                 | sed -E 's/ (mixed|allocated|completing)$/ idle/' | sort || true)
        [[ $states == "$want" ]] && break
        sleep 0.5
    done
    [[ $states == "$want" ]] || die "nodes not ready after 60 s: '${states//$'\n'/, }';" \
        "see $DIR/slurmctld.log and $DIR/nodes/*/slurmd.log"
    # Each task prints the hostname of its node's UTS namespace.
    got=$(timeout 60 srun -N "$NODES" -n "$NODES" hostname | sort) \
        || die "smoke job 'srun -N $NODES -n $NODES hostname' failed; see $DIR/nodes/*/slurmd.log"
    [[ $got == "$(node_names | sort)" ]] \
        || die "smoke job ran on '${got//$'\n'/ }', not on n1..n$NODES"
}

start_nodes() {
    local i fresh=1
    check_namespaces
    check_owner
    write_nodes_conf
    export SLURM_CONF=$CONF
    alive_pid "$DIR/slurmctld.pid" slurmctld >/dev/null && fresh=0
    for ((i = 1; i <= NODES; i++)); do
        alive_pid "$DIR/nodes/n$i/slurmd.pid" slurmd >/dev/null && fresh=0
    done
    setup_network
    mkdir -p "$NODE_LOCAL"
    for ((i = 1; i <= NODES; i++)); do
        if ((fresh)); then  # a fresh cluster, fresh node-local disks
            drop_disk "$i"
            rm -rf "$DIR/nodes/n$i/local"
        fi
        mkdir -p "$DIR/nodes/n$i/local" "$DIR/nodes/n$i/spool"
        if ((fresh && DISK_MBPS)); then setup_disk "$i"; fi
    done
    start_private_munge
    if ! alive_pid "$DIR/slurmctld.pid" slurmctld >/dev/null; then
        # -c: a fresh queue; jobs of an earlier cluster in this dir are gone with it.
        slurmctld -c -f "$CONF" || die "slurmctld did not start; see $DIR/slurmctld.log"
        log "started slurmctld"
    fi
    for ((i = 1; i <= NODES; i++)); do
        alive_pid "$DIR/nodes/n$i/slurmd.pid" slurmd >/dev/null || start_slurmd "$i"
    done
    wait_nodes_ready
    log "ready: nodes n1..n$NODES ($NET.0/24), $CPUS CPUs each, node-local $NODE_LOCAL, srun works"
    if ((DISK_MBPS)); then echo "export MPITAILOR_DISK_MBPS=$DISK_MBPS"; fi
    if ((CPU_QUOTA)); then echo "export MPITAILOR_NODE_CPUS=$NODE_CPUS"; fi
    echo "export SLURM_CONF=$CONF"
    echo "export MPITAILOR_NODE_LOCAL=$NODE_LOCAL"
    echo "export MPITAILOR_CLUSTER_DIR=$DIR"
}

[[ $(id -u) == 0 ]] || unavailable "needs root: it installs packages and runs the daemons as root"
mkdir -p "$DIR"
install_packages
if ((NODES > 1)); then
    start_nodes
    exit 0
fi
write_conf
export SLURM_CONF=$CONF
start_munge
start_daemons
wait_ready
echo "export SLURM_CONF=$CONF"
