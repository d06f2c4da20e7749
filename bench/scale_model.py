"""A model of node-local merge time, calibrated on bench/node_scaling.py's runs, projected to 64 nodes.

    python -m bench.scale_model [--runs bench/results/node_scaling.json] [--ranks-per-node 8]
        [--nvme-read 6.0] [--nvme-write 3.0] [--net 25] [--cores 64] [--rank-gbps 0.4]

The time of a run inside mpitailor (--stats `seconds`) is

    T = t0 + max over nodes (read_i + written_i) / D_case + max over nodes mpi_i / B
          + c_ranks * ranks + c_rpn * ranks_per_node

where read_i, written_i and mpi_i are node i's bytes as the run itself reported them (the copy
program's bytes_read_files of the node's ranks, the output files on its disk, bytes_mpi_received
of its ranks: measured, not estimated), D the per-node disk bandwidth and B the per-node network
bandwidth (read and write are throttled to the same figure here; fitted per case: merge and
recover drive the disks differently), and c the CPU each rank costs inside (planning, MPI
collectives, the survey of the nodes): on this host all ranks of all nodes share 2 cores, so it
grows with the total rank count, and a node's ranks also share its MPI shared-memory setup. The
srun wall time adds the start-up, s0 + s1 * ranks + s2 * ranks_per_node (Python and torch
imports, CPU-bound on the shared cores; MPI initialisation within a node). Calibration: t0, D per case
and the c by least squares on the `seconds` of every run; s0, s1, s2 on `wall - seconds` (5 and 3
parameters from 12 runs: a fit, not a derivation). B is not calibrated: these in-place merges
send no bulk bytes over MPI, and the bridge between the emulated nodes is memory. Validation:
each run's modelled time against its measured one (the goal: within 20%).

The 70B table: a ZeRO-3 checkpoint of 70e9 parameters at 12 B/parameter (fp32 master weights
and two Adam moments: the 11.97 B/parameter of bench/merge_bench.py's inputs) = 840 GB per save,
parity merge of 2 saves and recover of the newest, with each node's bytes scaled from the runs'
measured bytes per byte of a save (read and written per node = that ratio x 840 GB / N), stated
NVMe and network figures per node, a per-rank copy throughput (--rank-gbps, the warm CPU-bound
merge rate measured by bench/merge_bench.py) as a floor, and start-up on nodes of --cores cores
(the per-rank terms, paid here on 2 cores shared by all ranks, scaled to a node's ranks on
its own cores; the per-node terms as measured). Against: zero_to_fp32's published 70B figure
(DeepSpeed PR #6658: 159 GB peak memory, 20 min 45 s, one process; it consolidates fp32 weights,
a smaller output than a full ZeRO-3 checkpoint) and LLMTailor's re-read cost (it loads each
source checkpoint whole on one node and writes the merge: 2 x 840 GB read + 840 GB written at
one node's NVMe speed; our arithmetic, not their measurement). Writes
bench/results/scale_model.json and bench/results/scale_model.png (time vs nodes, measured and
modelled).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PARAMS_70B = 70e9
BYTES_PER_PARAM = 12
SAVE_70B = PARAMS_70B * BYTES_PER_PARAM
ZERO_TO_FP32_70B_S = 20 * 60 + 45  # DeepSpeed PR #6658, one process
ZERO_TO_FP32_70B_GB = 159
NODES_70B = (8, 16, 32, 64)
GOAL = 0.20  # modelled within 20% of measured


def lstsq(columns: list[list[float]], ys: list[float]) -> list[float]:
    """The coefficients c minimising sum (sum_j c_j x_j - y)^2 (a column of ones: a constant)."""
    import numpy as np

    return list(np.linalg.lstsq(np.array(columns).T, np.array(ys), rcond=None)[0])


def disk_bytes(row: dict) -> float:
    """The busiest node's bytes through its disk (read + written): read and write share one
    throttled figure here, so the disk term is max_i (read_i + written_i) / D."""
    return max(r + w for r, w in zip(row["node_bytes_read"], row["node_bytes_written"]))


def calibrate(rows: list[dict]) -> dict:
    """t0, one disk bandwidth per case, c_ranks, c_rpn (inside); s0, s1, s2 (start-up)."""
    cases = sorted({r["case"] for r in rows})
    ones = [1.0] * len(rows)
    disk = [[disk_bytes(r) if r["case"] == c else 0.0 for r in rows] for c in cases]
    ranks = [float(r["ranks"]) for r in rows]
    rpn = [float(r["ranks_per_node"]) for r in rows]
    t0, *inv_d, c_ranks, c_rpn = lstsq([ones, *disk, ranks, rpn], [r["seconds"] for r in rows])
    s0, s1, s2 = lstsq([ones, ranks, rpn], [r["wall"] - r["seconds"] for r in rows])
    return {"t0_s": t0, "disk_MBps": {c: 1e-6 / v for c, v in zip(cases, inv_d)},
            "cpu_s_per_rank": c_ranks, "cpu_s_per_rank_per_node": c_rpn, "startup_s0": s0,
            "startup_s_per_rank": s1, "startup_s_per_rank_per_node": s2}


def modelled(row: dict, m: dict) -> tuple[float, float]:
    inside = (m["t0_s"] + disk_bytes(row) / (m["disk_MBps"][row["case"]] * 1e6)
              + m["cpu_s_per_rank"] * row["ranks"]
              + m["cpu_s_per_rank_per_node"] * row["ranks_per_node"])
    startup = (m["startup_s0"] + m["startup_s_per_rank"] * row["ranks"]
               + m["startup_s_per_rank_per_node"] * row["ranks_per_node"])
    return inside, inside + startup


def validate(rows: list[dict], m: dict) -> list[dict]:
    out = []
    for r in rows:
        inside, wall = modelled(r, m)
        out.append({"case": r["case"], "nodes": r["nodes"], "ranks_per_node": r["ranks_per_node"],
                    "seconds": r["seconds"], "model_seconds": inside,
                    "err_seconds": inside / r["seconds"] - 1, "wall": r["wall"],
                    "model_wall": wall, "err_wall": wall / r["wall"] - 1})
    return out


def ratios(rows: list[dict], save_bytes: float) -> dict:
    """Per case: bytes read and written over all nodes per byte of one save, from the runs."""
    out = {}
    for case in sorted({r["case"] for r in rows}):
        mine = [r for r in rows if r["case"] == case]
        out[case] = {"read": max(sum(r["node_bytes_read"]) for r in mine) / save_bytes,
                     "written": max(sum(r["node_bytes_written"]) for r in mine) / save_bytes,
                     "mpi": max(r["bytes_mpi_sent"] for r in mine) / save_bytes}
    return out


def table_70b(m: dict, per_byte: dict, a: argparse.Namespace) -> list[dict]:
    # The per-rank terms were paid on 2 cores shared by every rank of every node: on nodes
    # of their own, a node's ranks share its `cores` cores instead.
    share = 2 * math.ceil(a.ranks_per_node / a.cores)
    startup = (m["startup_s0"] + m["startup_s_per_rank"] * share
               + m["startup_s_per_rank_per_node"] * a.ranks_per_node)
    cpu_ranks = (m["cpu_s_per_rank"] * share
                 + m["cpu_s_per_rank_per_node"] * a.ranks_per_node)
    rows = []
    for case, k in per_byte.items():
        for n in NODES_70B:
            read, written = k["read"] * SAVE_70B / n, k["written"] * SAVE_70B / n
            disk = read / (a.nvme_read * 1e9) + written / (a.nvme_write * 1e9)
            cpu = (read + written) / 2 / (a.ranks_per_node * a.rank_gbps * 1e9)
            net = k["mpi"] * SAVE_70B / n / (a.net * 1e9)
            inside = max(m["t0_s"], 0) + max(disk, cpu) + net + cpu_ranks
            rows.append({"case": case, "nodes": n, "ranks": n * a.ranks_per_node,
                         "gb_read_per_node": read / 1e9, "gb_written_per_node": written / 1e9,
                         "disk_s": disk, "cpu_floor_s": cpu, "net_s": net,
                         "startup_s": startup, "total_s": inside + startup})
    return rows


def llmtailor_s(a: argparse.Namespace) -> float:
    return 2 * SAVE_70B / (a.nvme_read * 1e9) + SAVE_70B / (a.nvme_write * 1e9)


def plot(val: list[dict], table: list[dict], refs: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, big) = plt.subplots(1, 2, figsize=(12, 4.5))
    for case, mark in (("merge", "o"), ("recover", "s")):
        for rpn in sorted({r["ranks_per_node"] for r in val if r["case"] == case}):
            mine = sorted((v for v in val if v["case"] == case and v["ranks_per_node"] == rpn),
                          key=lambda v: v["nodes"])
            if not mine:
                continue
            ns = [v["nodes"] for v in mine]
            line, = ax.plot(ns, [v["seconds"] for v in mine], mark, label=f"{case} {rpn}/node")
            ax.plot(ns, [v["model_seconds"] for v in mine], "--", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4], ["1", "2", "4"])
    ax.set_xlabel("nodes (emulated, own throttled disk each)")
    ax.set_ylabel("seconds inside mpitailor")
    ax.set_title("node-local merge/recover: measured (points) vs model (dashed)")
    ax.legend(fontsize=8)
    merge = [t for t in table if t["case"] == "merge"]
    big.plot([t["nodes"] for t in merge], [t["total_s"] for t in merge], "o--",
             label="mpitailor merge, modelled (start-up included)")
    for (label, secs), style in zip(refs.items(), (":", "-.")):
        big.axhline(secs, linestyle=style, color="grey")
        big.text(8, secs * 1.08, label, fontsize=8)
    big.set_xscale("log", base=2)
    big.set_yscale("log")
    big.set_xticks(list(NODES_70B), [str(n) for n in NODES_70B])
    big.set_xlabel("nodes")
    big.set_ylabel("seconds")
    big.set_title(f"70B ZeRO-3 ({SAVE_70B / 1e9:.0f} GB per save), modelled")
    big.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=str(RESULTS / "node_scaling.json"))
    ap.add_argument("--ranks-per-node", type=int, default=8, help="70B table: one per GPU")
    ap.add_argument("--nvme-read", type=float, default=6.0, help="GB/s per node")
    ap.add_argument("--nvme-write", type=float, default=3.0, help="GB/s per node")
    ap.add_argument("--net", type=float, default=25.0, help="GB/s per node (200 Gb/s)")
    ap.add_argument("--cores", type=int, default=64, help="CPU cores per node")
    ap.add_argument("--rank-gbps", type=float, default=0.4,
                    help="GB/s one rank copies, CPU-bound (bench/merge_bench.py, warm)")
    return ap.parse_args()


def main() -> None:
    a = parse_args()
    runs = json.loads(Path(a.runs).read_text())
    rows = runs["rows"]
    save_bytes = runs["input_bytes"] / 2  # two saves of the same size
    m = calibrate(rows)
    val = validate(rows, m)
    disks = ", ".join(f"{c} {v:.1f}" for c, v in m["disk_MBps"].items())
    print(f"calibrated on {len(rows)} runs of {a.runs}: t0 {m['t0_s']:.2f} s; disk per node "
          f"(MB/s, throttle {runs['disk_mbps']}): {disks}; CPU {m['cpu_s_per_rank']:.3f} s x "
          f"ranks + {m['cpu_s_per_rank_per_node']:.3f} s x ranks/node; start-up "
          f"{m['startup_s0']:.2f} s + {m['startup_s_per_rank']:.3f} s x ranks + "
          f"{m['startup_s_per_rank_per_node']:.3f} s x ranks/node")
    print(f"{'case':<8}{'N':>2}{'R/N':>4}{'s':>8}{'model':>8}{'err':>7}{'wall':>8}{'model':>8}"
          f"{'err':>7}")
    for v in val:
        print(f"{v['case']:<8}{v['nodes']:>2}{v['ranks_per_node']:>4}{v['seconds']:>8.2f}"
              f"{v['model_seconds']:>8.2f}{v['err_seconds']:>+7.0%}{v['wall']:>8.2f}"
              f"{v['model_wall']:>8.2f}{v['err_wall']:>+7.0%}")
    worst = max(abs(v["err_seconds"]) for v in val)
    worst_wall = max(abs(v["err_wall"]) for v in val)
    verdict = (f"validation: worst error {worst:.0%} inside mpitailor, {worst_wall:.0%} srun wall "
               f"(goal within {GOAL:.0%}: {'met' if worst <= GOAL else 'NOT met'} inside, "
               f"{'met' if worst_wall <= GOAL else 'NOT met'} wall)")
    print(verdict)
    per_byte = ratios(rows, save_bytes)
    table = table_70b(m, per_byte, a)
    print(f"\n70B ZeRO-3 ({SAVE_70B / 1e9:.0f} GB per save), {a.ranks_per_node} ranks/node, NVMe "
          f"{a.nvme_read}/{a.nvme_write} GB/s read/write, network {a.net} GB/s per node:")
    print(f"{'case':<8}{'nodes':>6}{'GB r/node':>10}{'GB w/node':>10}{'disk s':>8}{'cpu s':>7}"
          f"{'net s':>7}{'start s':>8}{'total s':>8}")
    for t in table:
        print(f"{t['case']:<8}{t['nodes']:>6}{t['gb_read_per_node']:>10.1f}"
              f"{t['gb_written_per_node']:>10.1f}{t['disk_s']:>8.1f}{t['cpu_floor_s']:>7.1f}"
              f"{t['net_s']:>7.1f}{t['startup_s']:>8.1f}{t['total_s']:>8.1f}")
    lt = llmtailor_s(a)
    print(f"zero_to_fp32, published (one process, fp32 weights only): "
          f"{ZERO_TO_FP32_70B_S} s, {ZERO_TO_FP32_70B_GB} GB peak memory")
    print(f"LLMTailor-style re-read of both saves on one node (our arithmetic): {lt:.0f} s")
    RESULTS.mkdir(exist_ok=True)
    plot(val, table, {f"zero_to_fp32, published ({ZERO_TO_FP32_70B_S} s, 1 process)":
                      ZERO_TO_FP32_70B_S, f"re-read both saves on 1 node ({lt:.0f} s)": lt},
         RESULTS / "scale_model.png")
    (RESULTS / "scale_model.json").write_text(json.dumps({
        "command": "python -m bench.scale_model " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "runs"),
        "runs": a.runs, "calibration": m, "validation": val, "verdict": verdict,
        "bytes_per_save_byte": per_byte, "table_70b": table,
        "zero_to_fp32_70b_published_s": ZERO_TO_FP32_70B_S, "llmtailor_reread_s": lt},
        indent=2))
    print(f"wrote {RESULTS / 'scale_model.json'} and scale_model.png")


if __name__ == "__main__":
    main()
