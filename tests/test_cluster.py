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
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import ckpt_fixtures
import pytest
from cluster_util import (
    ENDED,
    REPO,
    Cluster,
    job_state,
    kill_node,
    node_state,
    scontrol,
    start_cluster,
    stop_cluster,
    wait_for,
)

from mpitailor.formats.manifest import MANIFEST
from dev.tinytrain import TrainSpec

NODES = 3
PY = sys.executable  # the venv: on the shared file system, so every node runs the same one

# MPICH's netmods: the cluster's environment picks OFI (tests/cluster_util.py says why);
# MPITAILOR_ALL_NETMODS=1 runs the tests that name a netmod on MPICH's default, UCX, too.
# They fail differently when a peer dies (test_node_killed_...): with OFI MPI reports the
# error and mpitailor's one-line path (comm.CommFailed) is exercised; with UCX a survivor
# segfaults inside MPICH (nothing published either; both passed in the last full run, ~40 s
# each).
NETMODS = ["ucx", "ofi"] if os.environ.get("MPITAILOR_ALL_NETMODS") == "1" else ["ofi"]


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


@pytest.fixture(autouse=True)
def nodes_up(cluster):
    """Every node in service before a test: srun on a node that is down waits for it rather
    than failing, so a node an earlier test left down would hang this one until its timeout.
    A node on its way back (restarted by the test before) gets 60 s."""
    def down() -> dict[str, str]:
        return {n: s for n in (f"n{i}" for i in range(1, NODES + 1))
                if (s := node_state(n, cluster)).startswith(("down", "drain", "fail"))}
    try:
        wait_for("every node in service", lambda: not down(), 60, 0.5)
    except TimeoutError:
        pytest.fail(f"nodes out of service before the test: {down()}\n{cluster.logs()}")


def ok(r: subprocess.CompletedProcess, cluster: Cluster) -> str:
    """r's stdout; if r failed, fail with its output and the daemons' logs."""
    if r.returncode != 0:
        pytest.fail(f"{r.args} exited {r.returncode}:\n{r.stdout}\n{r.stderr}\n{cluster.logs()}")
    return r.stdout


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("netmod", NETMODS)
def test_one_mpi_world_across_three_nodes(cluster, netmod):
    code = ("import json, socket; from mpi4py import MPI; c = MPI.COMM_WORLD; "
            "print('rank', json.dumps([c.rank, c.size, c.allgather(socket.gethostname())]))")
    r = cluster.srun(["-N", NODES, "-n", NODES, PY, "-c", code],
                     {"UCX_LOG_LEVEL": "info", "MPIR_CVAR_CH4_NETMOD": netmod})
    out = ok(r, cluster)
    ranks = sorted(json.loads(line[5:]) for line in out.splitlines() if line.startswith("rank "))
    # A wrong PMI would give 3 worlds of size 1, each rank 0: not one world of 3.
    assert ranks == [[i, 3, ["n1", "n2", "n3"]] for i in range(3)], out
    ucx = [line for line in out.splitlines() if "ucp_context_0 " in line and "-node cfg" in line]
    assert bool(ucx) == (netmod == "ucx"), out
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
                     save_at=(1, 2), node_local_storage=True)
    shared = tmp_path_factory.mktemp("node-local-run")  # /tmp: every node sees it
    spec.write(shared / "spec.json")
    r = cluster.srun(["-N", 2, "-w", "n1,n2", "-n", 4, "--ntasks-per-node", 2, PY, "-m",
                      "dev.tinytrain.slurm_worker", shared / "spec.json",
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
        ["latest", "zero_to_fp32.py", "zero_to_torch.py", *zero_files((0, 1), tag),
         *zero_files((0, 1), "global_step1")])
    assert tree(run.node_dirs[2]) == sorted([*zero_files((2, 3), tag),
                                             *zero_files((2, 3), "global_step1")])
    assert (run.node_dirs[1] / "latest").read_text() == tag
    name = Path(run.save_dir).name
    assert not (cluster.node_dir(3) / name).exists()  # n3 took no part
    assert not Path(run.save_dir).exists()  # nor did the host's own dir at that path


# -- node-local checkpoints merged, resharded and resumed in place ----------------------------

PARITY = """sources:
  new: {save}/global_step2
  old: {save}/global_step1
layers:
  even: new
  odd: old
embed: new
norm: new
lm_head: new
base: new
adam_step: newest
output: {out}
"""


def shared_copy(run: NodeLocalRun, dest: Path) -> Path:
    """Every node's files of the run in one shared dir: the same checkpoint, not node-local."""
    for d in run.node_dirs.values():
        shutil.copytree(d, dest, dirs_exist_ok=True)
    return dest


def merge_cmd(recipe: Path, *args) -> list[str]:
    return [str(a) for a in (PY, "-m", "mpitailor", "merge", recipe, "--no-progress", *args)]


def same_files(a: Path, b: Path, names: list[str]) -> None:
    """Byte for byte; the manifests only up to when, by how many ranks and on which node."""
    for f in names:
        x, y = (a / f).read_bytes(), (b / f).read_bytes()
        if f == MANIFEST:
            x, y = (json.loads(v) for v in (x, y))
            for m in (x, y):
                for key in ("created", "mpi_ranks", "node_local", "sources", "recipe"):
                    m.pop(key, None)
        assert x == y, f"{a / f} differs from {b / f}"


def read_stats(path: Path) -> list[dict]:
    return json.loads(path.read_text())["ranks"]


def assert_reads_on_own_node(ranks: list[dict], holder_of) -> None:
    """Each rank ran on the node srun's block layout puts it on (2 a node), as its --stats
    record names it, and read no source rank's files that its node does not hold."""
    for r, st in enumerate(ranks):
        assert st["node"] == f"n{r // 2 + 1}", (r, st["node"])
        for item in st["shards_read"]:
            source, src_rank = item.split(":")
            assert f"n{holder_of(int(src_rank)) + 1}" == st["node"], (r, item)


@pytest.fixture(scope="module")
def merged_in_place(cluster, node_local_run, tmp_path_factory):
    """The run's two saves merged (parity) by 4 ranks on the 2 nodes that hold them, into a
    node-local output; and the same merge of a shared copy by one process on the host."""
    run = node_local_run
    work = tmp_path_factory.mktemp("merged-in-place")
    name = f"merged-{uuid.uuid4().hex[:8]}"
    recipe = work / "parity.yml"
    recipe.write_text(PARITY.format(save=run.save_dir, out=f"{cluster.node_local}/{name}"))
    r = cluster.srun(["-N", 2, "-w", "n1,n2", "-n", 4, "--ntasks-per-node", 2,
                      *merge_cmd(recipe, "--stats", work / "stats.json")], timeout=300)
    ok(r, cluster)
    shared = shared_copy(run, work / "shared-save")
    (work / "shared.yml").write_text(PARITY.format(save=shared, out=work / "shared-merged"))
    host = subprocess.run(merge_cmd(work / "shared.yml"), env=dict(cluster),
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    ok(host, cluster)
    yield {"name": name, "recipe": recipe, "work": work, "shared": work / "shared-merged",
           "stats": read_stats(work / "stats.json"), "shared_save": shared}
    for i in range(1, NODES + 1):
        shutil.rmtree(cluster.node_dir(i) / name, ignore_errors=True)


def test_node_local_merge_in_place_writes_each_nodes_own_files(cluster, merged_in_place):
    m, tag = merged_in_place, "global_step2"
    common = ["latest", MANIFEST, "zero_to_fp32.py", "zero_to_torch.py"]
    n1, n2 = (cluster.node_dir(i) / m["name"] for i in (1, 2))
    assert tree(n1) == sorted([*common, *zero_files((0, 1), tag)])
    assert tree(n2) == sorted([*common, *zero_files((2, 3), tag)])
    assert not (cluster.node_dir(3) / m["name"]).exists()
    # Byte for byte what one process writes from a shared copy of the same files.
    same_files(m["shared"], n1, tree(n1))
    same_files(m["shared"], n2, tree(n2))
    manifest = json.loads((n2 / MANIFEST).read_text())
    assert manifest["node_local"]["node"] == "n2"
    assert manifest["node_local"]["files_of_node"]["n1"] == zero_files((0, 1), tag)
    # In place: every rank read only its node's files, and nothing crossed a node.
    stats = m["stats"]
    assert [st["partitions"] for st in stats] == [[0], [1], [2], [3]]
    assert_reads_on_own_node(stats, lambda src: src // 2)
    assert all(st["bytes_mpi_received"] == 0 == st["bytes_mpi_sent"] for st in stats)
    assert all(st["bytes_read_files"] > 0 for st in stats)


def test_node_local_merge_on_nine_ranks_matches_one_process(cluster, merged_in_place):
    """The merge in place again with 9 ranks on all 3 nodes (3 per node, more than the input's
    4 partitions; n3 holds none), output rank r on node r // 2 as the input: the same files on
    the same nodes, byte for byte what one process wrote; n3, a node of the job, gets only
    `latest`, the manifest and the scripts. (bench/node_scaling.py runs 64 ranks on 4 nodes;
    each rank here costs ~2 s of start-up on 2 cores.)"""
    m, tag = merged_in_place, "global_step2"
    name = m["name"] + "-r9"
    try:
        ok(cluster.srun(["-N", 3, "-n", 9, "--ntasks-per-node", 3,
                         *merge_cmd(m["recipe"], "-o", f"{cluster.node_local}/{name}",
                                    "--ranks-per-node", 2)], timeout=300), cluster)
        n1, n2 = (cluster.node_dir(i) / name for i in (1, 2))
        common = ["latest", MANIFEST, "zero_to_fp32.py", "zero_to_torch.py"]
        assert tree(n1) == sorted([*common, *zero_files((0, 1), tag)])
        assert tree(n2) == sorted([*common, *zero_files((2, 3), tag)])
        n3 = cluster.node_dir(3) / name
        assert tree(n3) == sorted(common)
        for n in (n1, n2, n3):
            same_files(m["shared"], n, tree(n))
    finally:
        for i in range(1, NODES + 1):
            shutil.rmtree(cluster.node_dir(i) / name, ignore_errors=True)


def test_node_local_reshard_to_three_nodes_resumes_like_a_shared_copy(
        cluster, node_local_run, merged_in_place):
    """4 ranks on 2 nodes -> 6 ranks on 3 nodes (n3 holds nothing: its bytes come over MPI),
    with both exports on every node; DeepSpeed resumes from it on the 3 nodes, loss for loss
    as from a shared copy."""
    m, tag = merged_in_place, "global_step2"
    name, work = m["name"] + "-w6", m["work"]
    exports = ["--export", "universal", "--export", "hf"]
    r = cluster.srun(["-N", 3, "-n", 6, "--ntasks-per-node", 2,
                      *merge_cmd(m["recipe"], "--world-size", 6, "-o",
                                 f"{cluster.node_local}/{name}", "--stats",
                                 work / "stats6.json", *exports)], timeout=300)
    ok(r, cluster)
    host = subprocess.run(merge_cmd(work / "shared.yml", "--world-size", 6, "-o",
                                    work / "shared-w6", *exports),
                          env=dict(cluster), capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    ok(host, cluster)
    try:
        exported = [f for f in tree(work / "shared-w6") if f.startswith("hf/")
                    or f.startswith(f"{tag}/zero/") or f == "latest_universal"]
        assert "hf/model.safetensors" in exported and "latest_universal" in exported
        for i in (1, 2, 3):
            d = cluster.node_dir(i) / name
            assert tree(d) == sorted(["latest", MANIFEST, "zero_to_fp32.py", "zero_to_torch.py",
                                      *zero_files((2 * i - 2, 2 * i - 1), tag), *exported])
            same_files(work / "shared-w6", d, tree(d))
        stats = read_stats(work / "stats6.json")
        assert_reads_on_own_node(stats, lambda src: src // 2)
        assert [st["shards_read"] for st in stats[4:]] == [[], []]  # n3 holds no source
        assert all(st["bytes_mpi_received"] > 0 for st in stats[4:])
        assert sum(st["bytes_mpi_sent"] for st in stats) == \
            sum(st["bytes_mpi_received"] for st in stats)
        # Resume with real DeepSpeed on the 3 nodes: from the node-local output, and from
        # the shared copy's; the same losses, bit for bit.
        losses = {}
        for where, load_dir, local in (("node-local", f"{cluster.node_local}/{name}", True),
                                       ("shared", str(work / "shared-w6"), False)):
            spec = TrainSpec(save_dir=str(work / f"unused-{where}"), world_size=6, steps=4,
                             save_at=(), load_dir=load_dir, node_local_storage=local)
            spec.write(work / f"resume-{where}.json")
            ok(cluster.srun(["-N", 3, "-n", 6, "--ntasks-per-node", 2, PY, "-m",
                             "dev.tinytrain.slurm_worker", work / f"resume-{where}.json",
                             work / f"resume-{where}-result.json"], timeout=300), cluster)
            result = json.loads((work / f"resume-{where}-result.json").read_text())
            assert result["first_step"] == 2 and result["world_size"] == 6
            losses[where] = result["losses"]
        assert len(losses["shared"]) == 2 and losses["node-local"] == losses["shared"]
    finally:
        for i in range(1, NODES + 1):
            shutil.rmtree(cluster.node_dir(i) / name, ignore_errors=True)


def test_node_local_output_of_shared_sources_exports_from_the_sources(cluster, merged_in_place):
    """Shared sources merged by 4 ranks on 2 nodes into a node-local output, with the
    safetensors export: the first node reads the weights from the sources, so no partition
    of the other node is copied to it (it receives nothing over MPI); every node gets the
    export and its own partitions, byte for byte what one process writes."""
    m, tag = merged_in_place, "global_step2"
    name, work = m["name"] + "-st", m["work"]
    recipe = work / "shared-to-local.yml"
    recipe.write_text(PARITY.format(save=m["shared_save"], out=f"{cluster.node_local}/{name}"))
    try:
        ok(cluster.srun(["-N", 2, "-w", "n1,n2", "-n", 4, "--ntasks-per-node", 2,
                         *merge_cmd(recipe, "--stats", work / "stats-st.json",
                                    "--export", "hf")], timeout=300), cluster)
        ok(subprocess.run(merge_cmd(work / "shared.yml", "-o", work / "shared-st", "--export",
                                    "hf"), env=dict(cluster), capture_output=True,
                          text=True, timeout=300, cwd=REPO), cluster)
        exported = [f for f in tree(work / "shared-st") if f.startswith("hf/")]
        assert "hf/model.safetensors" in exported
        for i in (1, 2):
            d = cluster.node_dir(i) / name
            assert tree(d) == sorted(["latest", MANIFEST, "zero_to_fp32.py", "zero_to_torch.py",
                                      *zero_files((2 * i - 2, 2 * i - 1), tag), *exported])
            same_files(work / "shared-st", d, tree(d))
        stats = read_stats(work / "stats-st.json")
        assert [st["bytes_mpi_received"] for st in stats[:2]] == [0, 0]
        assert sum(st["bytes_mpi_received"] for st in stats[2:]) > 0  # the export, from n1
    finally:
        for i in range(1, NODES + 1):
            shutil.rmtree(cluster.node_dir(i) / name, ignore_errors=True)


def test_node_local_recover_across_nodes(cluster, node_local_run, merged_in_place, tmp_path):
    """`recover` of the node-local save dir on its 2 nodes: the newest full save, each
    node's part written on it, as a recover of the shared copy writes it."""
    name = f"recovered-{uuid.uuid4().hex[:8]}"
    r = cluster.srun(["-N", 2, "-w", "n1,n2", "-n", 4, "--ntasks-per-node", 2, PY, "-m",
                      "mpitailor",
                      "recover", node_local_run.save_dir, "-o", f"{cluster.node_local}/{name}",
                      "--no-progress"], timeout=300)
    ok(r, cluster)
    host = subprocess.run([PY, "-m", "mpitailor", "recover", merged_in_place["shared_save"],
                           "-o", tmp_path / "shared", "--no-progress"], env=dict(cluster),
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    ok(host, cluster)
    try:
        for i, ranks in ((1, (0, 1)), (2, (2, 3))):
            d = cluster.node_dir(i) / name
            assert set(zero_files(ranks, "global_step2")) <= set(tree(d))
            same_files(tmp_path / "shared", d, tree(d))
    finally:
        for i in range(1, NODES + 1):
            shutil.rmtree(cluster.node_dir(i) / name, ignore_errors=True)


def one_line_for_the_job(r: subprocess.CompletedProcess, text: str) -> None:
    """Every rank failed alike: rank 0 says it once, with no rank prefix."""
    lines = [line for line in r.stderr.splitlines() if "mpitailor: error:" in line]
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr)
    assert lines[0].startswith("mpitailor: error: ") and text in lines[0], r.stderr


def test_node_local_bad_input(cluster, node_local_run, merged_in_place):
    """Files of ranks on no node of the job, and two nodes holding different copies of one
    file: one line for the job, exit 2, nothing written anywhere."""
    run, m = node_local_run, merged_in_place
    out = f"{cluster.node_local}/bad-{uuid.uuid4().hex[:8]}"
    # Only n1's ranks: ranks 2 and 3 of the checkpoint are on no node of this job.
    r = cluster.srun(["-N", 1, "-n", 2, "-w", "n1", *merge_cmd(m["recipe"], "-o", out)])
    one_line_for_the_job(r, "zero_pp_rank_2_mp_rank_00_model_states.pt")
    # n2 gets a `latest` of its own that names another tag than n1's.
    stale = run.node_dirs[2] / "latest"
    stale.write_text("global_step1")
    try:
        recipe = m["work"] / "save-dir.yml"
        recipe.write_text(f"sources:\n  a: {run.save_dir}\nlayers:\n  rest: a\n"
                          f"output: {out}\n")
        r = cluster.srun(["-N", 2, "-w", "n1,n2", "-n", 4, "--ntasks-per-node", 2,
                          *merge_cmd(recipe)])
        one_line_for_the_job(r, "nodes n1 and n2 hold different copies")
    finally:
        stale.unlink()
    name = Path(out).name
    for i in range(1, NODES + 1):
        assert not [p for p in cluster.node_dir(i).iterdir() if name in p.name]


def test_node_local_copies_that_differ_early_are_refused(cluster, node_local_run,
                                                         merged_in_place):
    """A file both nodes hold, larger than what travels whole in the listings (64 KiB), one
    byte flipped at its start on one node (the same size, the same last bytes): the
    documented error, one line for the job, exit 2, nothing written; the same bytes on both,
    the merge carries it."""
    run, m = node_local_run, merged_in_place
    data = os.urandom(200_000)
    copies = [run.node_dirs[i] / "tokenizer.json" for i in (1, 2)]
    copies[0].write_bytes(data)
    copies[1].write_bytes(bytes([data[0] ^ 1]) + data[1:])
    name = f"flipped-{uuid.uuid4().hex[:8]}"
    recipe = m["work"] / f"{name}.yml"
    recipe.write_text(f"sources:\n  a: {run.save_dir}\nlayers:\n  rest: a\n"
                      f"output: {cluster.node_local}/{name}\n")
    try:
        r = cluster.srun(["-N", 2, "-w", "n1,n2", "-n", 4, "--ntasks-per-node", 2,
                          *merge_cmd(recipe)])
        one_line_for_the_job(r, f"{run.save_dir}/tokenizer.json: nodes n1 and n2 hold "
                                f"different copies (same size, different bytes)")
        assert not [p for i in (1, 2, 3) for p in cluster.node_dir(i).iterdir()
                    if name in p.name]
        copies[1].write_bytes(data)
        ok(cluster.srun(["-N", 2, "-w", "n1,n2", "-n", 4, "--ntasks-per-node", 2,
                         *merge_cmd(recipe)]), cluster)
        for i in (1, 2):
            assert (cluster.node_dir(i) / name / "tokenizer.json").read_bytes() == data
    finally:
        for p in copies:
            p.unlink(missing_ok=True)
        for i in range(1, NODES + 1):
            shutil.rmtree(cluster.node_dir(i) / name, ignore_errors=True)


# -- a requeued 2-node training with node-local saves ------------------------------------------

def test_requeued_two_node_training_resumes_on_both_nodes_from_node_local_saves(cluster,
                                                                                 tmp_path):
    """slurm/train.sbatch on n1+n2 (4 ranks, parity layer-wise saves on each node's own
    disk) is requeued after its first partial save: the prologue recovers across both nodes
    (one MPI job of the job's 4 tasks), each node gets its ranks' part of the composite, and
    all 4 ranks resume from their own node's part."""
    name = f"requeue-{uuid.uuid4().hex[:8]}"
    root = f"{cluster.node_local}/{name}"
    out = tmp_path / "train.out"
    # Saves at 1 (full) and 2 (partial); 2 s after each step leaves ~4 s to requeue between
    # the partial save and the end of the run.
    env = {**cluster, "MPITAILOR_SAVE_DIR": f"{root}/save", "MPITAILOR_PYTHON": PY,
           "MPITAILOR_TRAIN_ARGS": "--node-local-storage --steps 4 --save-at 1,2 "
                                   "--step-sleep 2"}
    sub = subprocess.run(["sbatch", "--parsable", "-N", "2", "-n", "4", "--ntasks-per-node=2",
                          "--nodelist=n1,n2", f"--output={out}", REPO / "slurm/train.sbatch"],
                         env=env, capture_output=True, text=True, timeout=30, cwd=REPO)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    host = {i: cluster.node_dir(i) / name for i in (1, 2, 3)}
    try:
        wait_for("partial save on both nodes", lambda: all(
            (host[i] / "save/global_step2/mpitailor_partial.json").exists() for i in (1, 2)), 120)
        requeue = scontrol(["requeue", job], cluster)
        assert requeue.returncode == 0, requeue.stderr
        state = wait_for("end of the job", lambda: (s := job_state(job, cluster)) in ENDED and s,
                         180, interval=0.5)
        text = out.read_text()
        assert state == "COMPLETED", text
        assert "restart 1" in text and "DUE TO JOB REQUEUE" in text, text
        recovered = f"{root}/recovered-step2-w4"  # for the job's 4 training ranks
        assert (host[1] / "resume-from").read_text() == f"{recovered}\n", text
        assert f"recovered {recovered} (tag global_step2, world size 4)" in text, text
        assert "planning on 2 nodes" in text and "written by 4 rank(s)" in text, text
        # The composite: each node holds its own ranks' part, n3 nothing.
        for i, ranks in ((1, (0, 1)), (2, (2, 3))):
            part = host[i] / "recovered-step2-w4"
            files = [f for f in tree(part) if f.startswith("global_step2/zero_pp_rank_")]
            assert files == zero_files(ranks, "global_step2"), (i, tree(part))
            assert {"latest", MANIFEST} <= set(tree(part)), (i, tree(part))
            manifest = json.loads((part / MANIFEST).read_text())
            steps = {layer["global_steps"] for layer in manifest["layers"].values()}
            assert steps == {1, 2}, manifest["layers"]  # a composite of the full and partial
            assert manifest["node_local"]["node"] == f"n{i}"
        assert not host[3].exists()
        results = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        assert len(results) == 1, text  # the first run was killed before it printed one
        result = results[0]
        assert (result["first_step"], result["global_steps"], result["world_size"]) == (2, 4, 4)
        assert len(result["losses"]) == 2 and all(map(math.isfinite, result["losses"])), result
        # Every rank loaded its own files, from its own node's part of the composite.
        assert result["loaded"] == [
            [f"n{r // 2 + 1}",
             f"{recovered}/global_step2/zero_pp_rank_{r}_mp_rank_00_model_states.pt"]
            for r in range(4)], result["loaded"]
    except (AssertionError, TimeoutError) as e:
        show = scontrol(["show", "job", job], cluster)
        pytest.fail(f"{e}\n--- {out}:\n{out.read_text() if out.exists() else '(none)'}\n"
                    f"--- scontrol show job:\n{show.stdout}{show.stderr}\n{cluster.logs()}")
    finally:
        subprocess.run(["scancel", job], env=cluster, capture_output=True, timeout=30)
        for d in host.values():
            shutil.rmtree(d, ignore_errors=True)


# -- a node dies during a merge ----------------------------------------------------------------

def srun_task_ends(stderr: str) -> dict[int, str]:
    """srun's report of how each task ended ("n1: tasks 0-1: Exited with exit code 143",
    "n1: task 1: Segmentation fault"): task -> what srun said."""
    ends = {}
    for m in re.finditer(r"srun: error: \S+: tasks? (\d+)(?:-(\d+))?: (.+)", stderr):
        for t in range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1):
            ends[t] = m.group(3).strip()
    return ends


@pytest.mark.parametrize("netmod", NETMODS)
def test_node_killed_during_a_merge_publishes_nothing_and_a_rerun_succeeds(
        cluster, node_local_run, tmp_path, netmod):
    """n2 dies (its slurmd and the merge's ranks 2 and 3 killed) while rank 0 on n1 waits
    just before publishing (failpoint commit:0:pause: held there until n2's processes are
    gone, so that every rank has finished the step before and rank 0's next collective
    must reach the dead ranks; a kill that came while ranks 2 and 3 had yet to send their part
    of that step left both survivors waiting to receive, which no MPI reports, until Slurm
    found n2 down, as one CI run did). The survivors on n1 must end, each
    with at most one line, no traceback; nothing is published on any node; srun returns once
    Slurm finds n2 down (SlurmdTimeout=10 in the cluster's slurm.conf) or sooner. With
    --kill-on-bad-exit=1 the first survivor that fails ends the other at once.

    What the survivors do is up to MPI (NETMODS: which of MPICH's netmods run): with the
    default, UCX, rank 1, waiting in the collective, dies by SIGSEGV inside MPICH/UCX when rank 0 goes on
    and the collective reaches the dead ranks (no line from it; srun says "Segmentation
    fault"); srun then ends rank 0, which removes its staging dir and prints one line. With
    OFI (MPIR_CVAR_CH4_NETMOD=ofi) MPI returns an error instead, which mpitailor turns into
    one line and exit 1 (comm.CommFailed) rather than a traceback and MPI's error stack, on
    whichever survivor meets the dead ranks first. n2 is brought back even when an assertion
    fails, so the tests after this one find it in service.
    Then n2's slurmd comes back (start-cluster.sh), n2 returns to idle, and the same merge
    run again succeeds, reclaiming the staging dir the dead node left."""
    run = node_local_run
    name = f"killed-{uuid.uuid4().hex[:8]}"
    recipe = tmp_path / "parity.yml"
    recipe.write_text(PARITY.format(save=run.save_dir, out=f"{cluster.node_local}/{name}"))
    host = {i: cluster.node_dir(i) for i in (1, 2, 3)}
    staged = [host[i] / f".{name}.mpitailor-staging" / MANIFEST for i in (1, 2)]
    mpi = {"MPIR_CVAR_CH4_NETMOD": netmod}
    hold = tmp_path / "hold"  # shared /tmp: rank 0 on n1 sees it
    hold.mkdir()
    merge = subprocess.Popen(
        ["srun", "--kill-on-bad-exit=1", "-N", "2", "-w", "n1,n2", "-n", "4", "--ntasks-per-node=2",
         *merge_cmd(recipe)],
        env={**cluster, **mpi, "MPITAILOR_FAILPOINT": f"commit:0:pause={hold}"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    killed: list[int] = []
    try:
        try:
            # Both nodes staged their part and rank 0 holds before publishing; n2 dies, then
            # rank 0 goes on into the collective that meets the dead ranks.
            wait_for("rank 0 at the commit", lambda: (hold / "reached").exists()
                     or merge.poll() is not None, 120, 0.05)
            assert (hold / "reached").exists(), merge.communicate()
            assert all(p.exists() for p in staged), staged
            killed = kill_node(2)
            (hold / "go").touch()
            t_kill = time.monotonic()
            out, err = merge.communicate(timeout=120)
            after_kill = time.monotonic() - t_kill
        finally:
            if merge.poll() is None:
                merge.kill()
                merge.communicate()
        ends = srun_task_ends(err)
        print(f"killed n2 ({len(killed)} processes); srun exited {merge.returncode} "
              f"{after_kill:.1f} s later; srun on the tasks: {ends}\n{err}")
        assert len(killed) >= 4, killed  # slurmd, slurmstepd, ranks 2 and 3
        assert merge.returncode != 0 and after_kill < 90, (merge.returncode, after_kill, err)
        assert {0, 1} <= ends.keys(), err  # both survivors ended, and srun saw them end
        lines = re.findall(r"^\[rank (\d+)\] mpitailor: .*$", err, re.M)
        assert all(lines.count(r) <= 1 for r in ("0", "1")), err
        assert not {"2", "3"} & set(lines), err  # the dead ranks said nothing
        assert "Traceback" not in err and "error stack" not in err, err
        if netmod == "ofi":  # MPI's error, as one line of mpitailor's, and exit 1
            # from whichever survivor's collective reached a dead rank first (a race: rank
            # 1's allgather with rank 3, or rank 0's once it goes on); srun ends the other
            failed = [r for r in (0, 1) if ends[r] == "Exited with exit code 1" and re.search(
                rf"^\[rank {r}\] mpitailor: error: MPI communication failed on rank {r} ",
                err, re.M)]
            assert failed, err
        assert "merged" not in out, out
        # Nothing published anywhere: no output on any node (n2's staging dir may be left).
        for i in (1, 2, 3):
            assert not (host[i] / name).exists(), i
        assert not (host[1] / f".{name}.mpitailor-staging").exists()  # rank 0 removed its own
    finally:
        # n2 comes back (as after a reboot, its disk as it was) and returns to service, also
        # when an assertion above failed: a node left down would hang the tests after this one.
        if killed:
            restarted, start = start_cluster(NODES)
            assert restarted is not None and start.returncode == 0, start.stderr
            assert "started slurmd of n2" in start.stderr, start.stderr
            wait_for("n2 idle", lambda: node_state("n2", cluster) == "idle", 120, 0.5)
    # The same merge again: published on both nodes, the stale staging dir reclaimed.
    ok(cluster.srun(["--kill-on-bad-exit=1", "-N", 2, "-w", "n1,n2", "-n", 4,
                     "--ntasks-per-node", 2,
                     *merge_cmd(recipe)], mpi, timeout=300), cluster)
    try:
        for i, ranks in ((1, (0, 1)), (2, (2, 3))):
            files = tree(host[i] / name)
            assert [f for f in files if "zero_pp_rank_" in f] == zero_files(ranks, run.tag)
            assert {"latest", MANIFEST} <= set(files)
            assert not [p.name for p in host[i].iterdir() if p.name.startswith(f".{name}.")]
        assert not (host[3] / name).exists()
    finally:
        for i in (1, 2, 3):
            shutil.rmtree(host[i] / name, ignore_errors=True)


def test_prologue_on_two_nodes_reuses_only_a_recovery_complete_on_both(
        cluster, node_local_run, tmp_path):
    """In a 2-node job, slurm/resume-prologue.sh plans and recovers across both nodes; run
    again it reuses the recovery; with the recovery's part on n1 gone (published on n2 only)
    it is no longer reused, and a fresh one takes the next name."""
    run = node_local_run
    name = f"prologue-{uuid.uuid4().hex[:8]}"
    parent = f"{cluster.node_local}/{name}"
    prologue = f'bash {REPO}/slurm/resume-prologue.sh {run.save_dir} {parent}'
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\nset -e\n{prologue}\n{prologue}\n"
                      f"rm -r {parent}/recovered-step2-w4  # on the batch host, n1, only\n"
                      f"{prologue}\n")
    out = tmp_path / "job.out"
    r = subprocess.run(["sbatch", "--parsable", "-N", "2", "-n", "4", "--ntasks-per-node=2",
                        "--nodelist=n1,n2", f"--output={out}", script],
                       env={**cluster, "MPITAILOR_PYTHON": PY}, capture_output=True,
                       text=True, timeout=30, cwd=REPO)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    host = {i: cluster.node_dir(i) / name for i in (1, 2, 3)}
    try:
        # Polled: `sbatch --wait` notices the end up to ~10 s late.
        state = wait_for("end of the job", lambda: (s := job_state(job, cluster)) in ENDED
                         and s, 240, interval=0.5)
        text = out.read_text() if out.exists() else ""
        assert state == "COMPLETED", text
        first, again, fresh = re.findall(r"^MPITAILOR_RESUME_FROM=(.*)$", text, re.M)
        assert first == again == f"{parent}/recovered-step2-w4", text  # the job's 4 ranks
        assert f"reusing {first}" in text and text.count("written by 4 rank(s)") == 2, text
        assert fresh == f"{parent}/recovered-step2-w4.1", text
        for i, ranks in ((1, (0, 1)), (2, (2, 3))):
            files = tree(host[i] / "recovered-step2-w4.1")
            assert [f for f in files if "zero_pp_rank_" in f] == zero_files(ranks, run.tag)
        assert (host[2] / "recovered-step2-w4").exists()  # n2's part of the first is left alone
        assert not host[3].exists()
    finally:
        subprocess.run(["scancel", job], env=cluster, capture_output=True, timeout=30)
        for d in host.values():
            shutil.rmtree(d, ignore_errors=True)


# -- exports of node-local layer-wise saves ----------------------------------------------------

@pytest.fixture(scope="module")
def node_local_layerwise_run(cluster, tmp_path_factory):
    """A DeepSpeed run of 4 ranks on n1 and n2 saving layer-wise (parity: a full save at step
    1, a partial one at 2) with use_node_local_storage; and a shared copy of its files."""
    name = f"layerwise-{uuid.uuid4().hex[:8]}"
    spec = TrainSpec(save_dir=f"{cluster.node_local}/{name}", world_size=4, steps=2,
                     save_at=(1, 2), node_local_storage=True, policy={"name": "parity"})
    work = tmp_path_factory.mktemp("node-local-layerwise")
    spec.write(work / "spec.json")
    ok(cluster.srun(["-N", 2, "-w", "n1,n2", "-n", 4, "--ntasks-per-node", 2, PY, "-m",
                     "dev.tinytrain.slurm_worker", work / "spec.json",
                     work / "result.json"], timeout=300), cluster)
    node_dirs = {i: cluster.node_dir(i) / name for i in (1, 2)}
    assert (node_dirs[2] / "global_step2" / "rank_2_layers.safetensors").exists()
    assert not (node_dirs[2] / "global_step2" / "rank_0_layers.safetensors").exists()
    for d in node_dirs.values():
        shutil.copytree(d, work / "shared-save", dirs_exist_ok=True)
    (work / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    yield {"save_dir": spec.save_dir, "name": name, "node_dirs": node_dirs, "work": work,
           "shared": work / "shared-save"}
    for d in node_dirs.values():
        shutil.rmtree(d, ignore_errors=True)


def export_cmd(source, out, fmt: str, *args) -> list[str]:
    return [str(a) for a in (PY, "-m", "mpitailor", "export", source, "-o", out, "--format",
                             fmt, "--no-progress", *args)]


@pytest.mark.parametrize("fmt", ["fp32", "hf"])
def test_node_local_export_of_layerwise_saves_matches_a_shared_copy(
        cluster, node_local_layerwise_run, fmt):
    """`export --format fp32|hf` of the node-local save dir on its 2 nodes, into a shared dir
    and into a node-local one (every node gets the whole export): byte for byte the export of
    the shared copy by one process on the host."""
    run = node_local_layerwise_run
    work, extra = run["work"], (["--config", run["work"] / "config.json"] if fmt == "hf" else [])
    host = subprocess.run(export_cmd(run["shared"], work / f"host-{fmt}", fmt, *extra),
                          env=dict(cluster), capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    ok(host, cluster)
    expected = tree(work / f"host-{fmt}")
    assert "model.safetensors" in expected
    ok(cluster.srun(["-N", 2, "-w", "n1,n2", "-n", 4, "--ntasks-per-node", 2,
                     *export_cmd(run["save_dir"], work / f"shared-{fmt}", fmt, *extra)],
                    timeout=300), cluster)
    assert tree(work / f"shared-{fmt}") == expected
    same_files(work / f"host-{fmt}", work / f"shared-{fmt}", expected)
    name = f"{run['name']}-{fmt}"
    try:
        ok(cluster.srun(["-N", 2, "-w", "n1,n2", "-n", 4, "--ntasks-per-node", 2,
                         *export_cmd(run["save_dir"], f"{cluster.node_local}/{name}", fmt,
                                     *extra)], timeout=300), cluster)
        for i in (1, 2):
            d = cluster.node_dir(i) / name
            assert tree(d) == expected, i
            same_files(work / f"host-{fmt}", d, expected)
        assert not (cluster.node_dir(3) / name).exists()
        # nothing of the export's work left beside it, on any node
        for i in (1, 2, 3):
            assert not [p for p in cluster.node_dir(i).iterdir() if p.name.startswith(f".{name}")]
    finally:
        for i in range(1, NODES + 1):
            shutil.rmtree(cluster.node_dir(i) / name, ignore_errors=True)
