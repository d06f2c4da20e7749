"""On a real Slurm cluster of 3 nodes on this host: one MPI world across nodes, node-local
dirs that other nodes cannot see, a merge across nodes, DeepSpeed saving to node-local dirs.

`make test-cluster` (part of `make test`) starts the cluster with
`slurm/start-cluster.sh --nodes 3` (root; ~1 s once Slurm is installed) and sets
MPITAILOR_CLUSTER_TESTS=1; the plain `pytest tests` run skips this module. The module is
skipped only when the cluster cannot be set up here (start-cluster.sh exits 3: not root, no
namespaces, bridge or veth, apt fails). See tests/cluster_util.py for the cluster's layout.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

import ckpt_fixtures
from cluster_util import REPO, Cluster, start_cluster, stop_cluster
from mpitailor.extras import MANIFEST
from mpitailor.tinytrain import TrainSpec

NODES = 3
PY = sys.executable  # the venv: on the shared file system, so every node runs the same one

pytestmark = pytest.mark.skipif(
    os.environ.get("MPITAILOR_CLUSTER_TESTS") != "1",
    reason="runs in `make test-cluster` (part of `make test`), which starts a 3-node Slurm "
           "on this host as root; MPITAILOR_CLUSTER_TESTS=1 runs it here")


@pytest.fixture(scope="module")
def cluster():
    """The running cluster (a dict: the environment for Slurm commands, plus helpers);
    stopped at the end if started here."""
    found, start = start_cluster(NODES)
    if found is None:
        pytest.skip(f"a {NODES}-node Slurm cannot be set up here: "
                    f"{start.stderr.strip().splitlines()[-1]}")
    yield found
    if found.started_here:  # else `make test-cluster` (or you) stops it
        stop_cluster(found)


def ok(r: subprocess.CompletedProcess, cluster: Cluster) -> str:
    """r's stdout; if r failed, fail with its output and the daemons' logs."""
    if r.returncode != 0:
        pytest.fail(f"{r.args} exited {r.returncode}:\n{r.stdout}\n{r.stderr}\n{cluster.logs()}")
    return r.stdout


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_one_mpi_world_across_three_nodes(cluster):
    code = ("import json, socket; from mpi4py import MPI; c = MPI.COMM_WORLD; "
            "print('rank', json.dumps([c.rank, c.size, c.allgather(socket.gethostname())]))")
    r = cluster.srun(["-N", NODES, "-n", NODES, PY, "-c", code], {"UCX_LOG_LEVEL": "info"})
    out = ok(r, cluster)
    ranks = sorted(json.loads(line[5:]) for line in out.splitlines() if line.startswith("rank "))
    # A wrong PMI would give 3 worlds of size 1, each rank 0: not one world of 3.
    assert ranks == [[i, 3, ["n1", "n2", "n3"]] for i in range(3)], out
    ucx = [line for line in out.splitlines() if "ucp_context_0 " in line and "-node cfg" in line]
    if ucx:  # MPICH's UCX netmod: the nodes talk TCP over the bridge, not through shared
        # memory (each node has its own IPC namespace and /dev/shm)
        assert all("inter-node" in line and "tcp/eth0" in line for line in ucx), out


def test_node_local_dir_is_invisible_to_the_other_nodes(cluster):
    name = f"visible-{uuid.uuid4().hex[:8]}"
    path = f"{cluster.node_local}/{name}"
    ok(cluster.srun(["-N", 1, "-w", "n1", "sh", "-c", f"hostname > {path}"]), cluster)
    # A later step on n1 still sees it (the node's dir, not the step's); n2 and n3 do not.
    show = f'echo "$(hostname) $(cat {path} 2>/dev/null || echo absent)"'
    out = ok(cluster.srun(["-N", NODES, "-n", NODES, "sh", "-c", show]), cluster)
    assert sorted(out.splitlines()) == ["n1 n1", "n2 absent", "n3 absent"], out
    assert (cluster.node_dir(1) / name).read_text() == "n1\n"
    assert not (cluster.node_dir(2) / name).exists()
    assert not (cluster.node_dir(3) / name).exists()
    assert not Path(path).exists()  # the host's own dir at that path stays empty
    (cluster.node_dir(1) / name).unlink()


def test_merge_across_nodes_matches_a_one_process_merge(cluster, tmp_path):
    """4 ranks on 2 nodes write into one shared dir: the same bytes as 1 process does."""
    name = "w4_fp32_per_layer"  # one param group per layer: parity mixes sources in each file
    env = {"NEW": str(ckpt_fixtures.tag_dir(name, 10)), "OLD": str(ckpt_fixtures.tag_dir(name, 5))}
    recipe = REPO / "recipes" / "parity.yml"
    out = ok(cluster.srun(["-N", 2, "-n", 4, "--ntasks-per-node", 2, PY, "-m", "mpitailor",
                           recipe, "--no-progress"], {**env, "OUT": str(tmp_path / "nodes")},
                          timeout=300), cluster)
    assert "written by 4 rank(s)" in out
    host = subprocess.run([PY, "-m", "mpitailor", recipe, "--no-progress"],
                          env={**cluster, **env, "OUT": str(tmp_path / "host")},
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert "written by 1 rank(s)" in ok(host, cluster)
    files = tree(tmp_path / "host")
    assert files == tree(tmp_path / "nodes") and MANIFEST in files
    for f in files:
        a, b = (tmp_path / "host" / f).read_bytes(), (tmp_path / "nodes" / f).read_bytes()
        if f == MANIFEST:
            a, b = (json.loads(x) for x in (a, b))
            assert (a.pop("mpi_ranks"), b.pop("mpi_ranks")) == (1, 4)
            a.pop("created"), b.pop("created")
        assert a == b, f


@dataclass(frozen=True)
class NodeLocalRun:
    """A DeepSpeed ZeRO-3 run of 4 ranks on n1 (ranks 0, 1) and n2 (ranks 2, 3) that saved
    with use_node_local_storage into save_dir, a path under MPITAILOR_NODE_LOCAL."""

    save_dir: str             # as the nodes see it
    tag: str
    node_dirs: dict[int, Path]  # node i -> its save_dir as the host sees it
    spec: TrainSpec
    result: dict              # rank 0's record: losses, global_steps, world_size


@pytest.fixture(scope="module")
def node_local_run(cluster, tmp_path_factory) -> NodeLocalRun:
    name = f"train-{uuid.uuid4().hex[:8]}"
    spec = TrainSpec(save_dir=f"{cluster.node_local}/{name}", world_size=4, steps=2,
                     save_at=(2,), node_local_storage=True)
    shared = tmp_path_factory.mktemp("node-local-run")  # /tmp: every node sees it
    spec.write(shared / "spec.json")
    r = cluster.srun(["-N", 2, "-n", 4, "--ntasks-per-node", 2, PY, "-m",
                      "mpitailor.tinytrain.slurm_worker", shared / "spec.json",
                      shared / "result.json"], timeout=300)
    ok(r, cluster)
    run = NodeLocalRun(save_dir=spec.save_dir, tag="global_step2",
                       node_dirs={i: cluster.node_dir(i) / name for i in (1, 2)}, spec=spec,
                       result=json.loads((shared / "result.json").read_text()))
    yield run
    for d in run.node_dirs.values():
        shutil.rmtree(d, ignore_errors=True)


def zero_files(ranks, tag: str) -> list[str]:
    return [f"{tag}/zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"
            for r in ranks for kind in ("model", "optim")]


def test_deepspeed_node_local_saves_hold_each_nodes_own_ranks(cluster, node_local_run):
    run, tag = node_local_run, node_local_run.tag
    assert run.result["world_size"] == 4 and run.result["global_steps"] == 2
    assert len(run.result["losses"]) == 2 and all(map(math.isfinite, run.result["losses"]))
    # What DeepSpeed 0.19 writes with use_node_local_storage: every rank its own ZeRO-3
    # files on its node; each node's local rank 0 makes the dirs; global rank 0 alone
    # writes `latest` and copies the recovery scripts. n2 has no `latest`.
    assert tree(run.node_dirs[1]) == sorted(
        ["latest", "zero_to_fp32.py", "zero_to_torch.py", *zero_files((0, 1), tag)])
    assert tree(run.node_dirs[2]) == sorted(zero_files((2, 3), tag))
    assert (run.node_dirs[1] / "latest").read_text() == tag
    name = Path(run.save_dir).name
    assert not (cluster.node_dir(3) / name).exists()  # n3 took no part
    assert not Path(run.save_dir).exists()  # nor did the host's own dir at that path
