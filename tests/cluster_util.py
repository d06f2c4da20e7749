"""A Slurm cluster of several nodes on this host (slurm/start-cluster.sh --nodes N), for tests.

Each node nI is a slurmd in its own network, UTS and mount namespace: a job step on nI sees
the hostname nI and its own node-local dir at MPITAILOR_NODE_LOCAL (the same path on every
node); the host sees that dir at node_dir(I). Everything else (the repo, /tmp) is shared.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from child_env import child_env

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "slurm"
CANNOT_SET_UP = 3  # start-cluster.sh: no root, packages, namespaces, bridge or veth


class Cluster(dict):
    """The environment for Slurm commands on the cluster (SLURM_CONF, MPITAILOR_NODE_LOCAL,
    MPITAILOR_CLUSTER_DIR), with the paths and an srun helper."""

    nodes: int
    started_here: bool

    @property
    def dir(self) -> Path:
        return Path(self["MPITAILOR_CLUSTER_DIR"])

    @property
    def node_local(self) -> str:
        """The node-local dir as every node sees it (one path, a different dir per node)."""
        return self["MPITAILOR_NODE_LOCAL"]

    def node_dir(self, i: int) -> Path:
        """Node nI's node-local dir as the host sees it."""
        return self.dir / "nodes" / f"n{i}" / "local"

    def srun(self, args, env: dict | None = None, timeout: float = 120):
        return srun(args, {**self, **(env or {})}, timeout)

    def logs(self, lines: int = 20) -> str:
        """The tails of slurmctld's and every slurmd's log, for a failure message."""
        out = []
        for log in [self.dir / "slurmctld.log", *sorted(self.dir.glob("nodes/*/slurmd.log"))]:
            text = log.read_text(errors="replace").splitlines() if log.exists() else []
            out.append(f"--- {log} (last {lines} lines):\n" + "\n".join(text[-lines:]))
        return "\n".join(out)


def srun(args, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    """`srun ARGS` from the repo root with env; output captured as text."""
    return subprocess.run(["srun", *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def start_cluster(nodes: int) -> tuple[Cluster | None, subprocess.CompletedProcess]:
    """Start (or find running) the cluster; (None, result) when it cannot be set up here."""
    start = subprocess.run(["bash", str(SLURM / "start-cluster.sh"), "--nodes", str(nodes)],
                           capture_output=True, text=True, timeout=300)
    if start.returncode == CANNOT_SET_UP:
        return None, start
    assert start.returncode == 0, f"start-cluster.sh --nodes {nodes} failed:\n{start.stderr}"
    # An outer Slurm job's variables (pytest under sbatch) must not reach srun either: inside
    # an allocation srun would start a step of that job instead of a job of this cluster.
    env = child_env("SLURM_")
    env.update(re.findall(r"^export (\w+)=(.*)$", start.stdout, re.M))
    # MPICH's OFI netmod unless the caller chose: its default, UCX, once failed to wire up
    # across these nodes in CI ("UCX ERROR failed to unpack address, invalid bandwidth
    # 0.00", the message MPICH's own mpi4py CI met, pmodels/mpich#7417), and its abort then
    # broke Slurm's PMI2 exchange, so srun waited until the test's timeout. These tests are of
    # mpitailor, not of UCX; MPITAILOR_ALL_NETMODS=1 still runs the node-kill test on both.
    env.setdefault("MPIR_CVAR_CH4_NETMOD", "ofi")
    cluster = Cluster(env)
    cluster.nodes = nodes
    cluster.started_here = "started slurmctld" in start.stderr
    return cluster, start


def stop_cluster(cluster: Cluster) -> None:
    subprocess.run(["bash", str(SLURM / "stop-cluster.sh"), "--nodes", str(cluster.nodes)],
                   env={**os.environ, "MPITAILOR_CLUSTER_DIR": str(cluster.dir)}, timeout=120)


def wait_for(what: str, check, timeout: float, interval: float = 0.2):
    """check()'s first truthy value, polled every `interval` s; TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := check()):
            return value
        time.sleep(interval)
    raise TimeoutError(f"no {what} after {timeout:.0f} s")


def scontrol(args, env: dict, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["scontrol", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout)


def job_state(job: str, env: dict) -> str:
    show = scontrol(["show", "job", job], env).stdout
    return m.group(1) if (m := re.search(r"JobState=(\S+)", show)) else "UNKNOWN"


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def node_state(node: str, env: dict) -> str:
    """sinfo's state of one node, e.g. idle, down*, allocated, drain."""
    r = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], env=env, capture_output=True,
                       text=True, timeout=30)
    return r.stdout.strip()


def kill_node(i: int) -> list[int]:
    """Node nI dies: SIGKILL to every process in its network namespace (mpt-nI, see
    slurm/start-cluster.sh): its slurmd, slurmstepds and job tasks. Its node-local disk stays
    (the host's dir); start_cluster() starts its slurmd again, as a reboot would. Returns the
    pids once every one has died (gone, or a zombie: its sockets closed, which is what its
    peers see)."""
    found = subprocess.run(["ip", "netns", "pids", f"mpt-n{i}"], capture_output=True,
                           text=True, timeout=30)
    pids = [int(p) for p in found.stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(f"n{i}'s processes dead", lambda: not any(map(_alive, pids)), 30, 0.01)
    return pids


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
