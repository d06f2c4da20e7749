"""A model of node-local merge time, calibrated on bench/node_scaling.py's runs, projected to 64 nodes.

    python -m bench.scale_model [--runs bench/results/node_scaling.json] [--ranks-per-node 8]
        [--nvme-read 6.0] [--nvme-write 3.0] [--net 25] [--cores 64]
        [--check bench/results/node_scaling_2mbps.json ...]

The time of a run inside mpitailor (--stats `seconds`) is

    T = t0 + max over nodes [ max(r_i / R, w_i / W) + (beta / ranks_per_node) min(r_i / R, w_i / W) ]
          + max over nodes mpi_i / B + q * ranks_per_node / C

r_i: what node i's disk device read during the run (/sys/block: every read its tasks made,
metadata and readahead included), w_i: the bytes of the output files on its disk (the
throttled writes: the ranks write their files themselves on the `sync` mount, while ext4's
journal, written by the kernel's jbd2 thread outside the node's cgroup, is not throttled; the
device's written bytes are in the runs' JSON too), mpi_i: the bytes its ranks received over MPI
(--stats); all measured by the run, not estimated. R and W: the node disk's read and write
rates as node_scaling's dd probe measured them on n1 (not fitted): the throttle gives reads
and writes a budget each, so the busier of the two sets the pace, and the other adds only
where it cannot overlap; beta (fitted) is the share that does not, for one rank (a rank's
copier overlaps one read with one write; several ranks keep both budgets busy). B: the
network per node; not calibrated, as these in-place merges send no bulk bytes over MPI and the
bridge between the emulated nodes is memory. q: the CPU seconds each rank spends inside beyond
the copy (planning, reading the sources' metadata, collectives), fitted; each node's ranks
share its C cores (--node-cpus: every emulated node has C cores of its own). The srun wall time
adds the start-up, s0 + s * ranks_per_node / C (Python and torch imports, MPI initialisation:
CPU on the node's own cores; s fitted in CPU seconds per rank). srun's own cost per node is not
modelled: on this host every node's daemons share 2 cores, which says nothing of a real
cluster's launch tree. Least squares: t0, beta, q on the 12 runs' `seconds`; s0, s on their
`wall - seconds`. Validation: each run's modelled time against its measured one (the goal:
within 20%); --check: runs it was not calibrated on (another throttle: that file's probe rates,
the calibrated beta, q and start-up), predicted.

The 70B table: a ZeRO-3 checkpoint of 70e9 parameters at 12 B/parameter (fp32 master weights
and two Adam moments: the 11.97 B/parameter of bench/merge_bench.py's inputs) = 840 GB per save,
parity merge of 2 saves and recover of the newest, with each node's device bytes scaled from
the runs' measured device bytes per byte of a save (read and written per node = that ratio x
840 GB / N; the bench's small layers make that ratio pessimistic), stated NVMe and network
figures per node, and the per-rank CPU terms on nodes of --cores cores (a rank a core, up to
--cores ranks). Against: zero_to_fp32's published 70B figure (DeepSpeed PR #6658: 159 GB peak
memory, 20 min 45 s, one process; it consolidates fp32 weights, a smaller output than a full
ZeRO-3 checkpoint) and LLMTailor's re-read cost (it loads each source checkpoint whole on one
node and writes the merge: 2 x 840 GB read + 840 GB written at one node's NVMe speed; our
arithmetic, not their measurement). Writes bench/results/scale_model.json and
bench/results/scale_model.png (time vs nodes, measured and modelled).
"""
from __future__ import annotations

import argparse
import json
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


def disk_terms(read: float, written: float, read_bps: float, write_bps: float
               ) -> tuple[float, float]:
    """(the busier budget's seconds, the other's)."""
    a, b = read / read_bps, written / write_bps
    return max(a, b), min(a, b)


def busiest(row: dict, m: dict) -> tuple[float, float]:
    """The disk terms of the node whose disk is busiest."""
    return max(disk_terms(r, w, m["disk_read_MBps"] * 1e6, m["disk_write_MBps"] * 1e6)
               for r, w in zip(row["node_device_read"], row["node_bytes_written"]))


def calibrate(runs: dict) -> dict:
    """t0, beta, q (inside); s0, s (start-up); R and W are the probe's."""
    rows, probe, cpus = runs["rows"], runs["disk_probe"], runs["node_cpus"]
    m = {"disk_read_MBps": probe["read_MBps"], "disk_write_MBps": probe["write_MBps"],
         "node_cpus": cpus}
    ones = [1.0] * len(rows)
    disks = [busiest(r, m) for r in rows]
    alone = [lo / r["ranks_per_node"] for r, (_, lo) in zip(rows, disks)]
    per_core = [r["ranks_per_node"] / cpus for r in rows]
    t0, beta, q = lstsq([ones, alone, per_core],
                        [r["seconds"] - hi for r, (hi, _) in zip(rows, disks)])
    s0, s = lstsq([ones, per_core], [r["wall"] - r["seconds"] for r in rows])
    return {**m, "t0_s": t0, "disk_serial_beta": beta, "cpu_s_per_rank": q, "startup_s0": s0,
            "startup_cpu_s_per_rank": s}


def modelled(row: dict, m: dict) -> tuple[float, float]:
    per_core = row["ranks_per_node"] / m["node_cpus"]
    hi, lo = busiest(row, m)
    inside = (m["t0_s"] + hi + m["disk_serial_beta"] * lo / row["ranks_per_node"]
              + m["cpu_s_per_rank"] * per_core)
    startup = m["startup_s0"] + m["startup_cpu_s_per_rank"] * per_core
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
    """Per case: device bytes read and file bytes written over all nodes per byte of one
    save, and MPI bytes, from the runs (the largest of the case's runs)."""
    out = {}
    for case in sorted({r["case"] for r in rows}):
        mine = [r for r in rows if r["case"] == case]
        out[case] = {"read": max(sum(r["node_device_read"]) for r in mine) / save_bytes,
                     "written": max(sum(r["node_bytes_written"]) for r in mine) / save_bytes,
                     "mpi": max(r["bytes_mpi_sent"] for r in mine) / save_bytes}
    return out


def table_70b(m: dict, per_byte: dict, a: argparse.Namespace) -> list[dict]:
    # A rank a core (the per-rank CPU terms were paid on node_cpus cores per node here).
    per_core = max(1.0, a.ranks_per_node / a.cores)
    rows = []
    for case, k in per_byte.items():
        for n in NODES_70B:
            read, written = k["read"] * SAVE_70B / n, k["written"] * SAVE_70B / n
            hi, lo = disk_terms(read, written, a.nvme_read * 1e9, a.nvme_write * 1e9)
            disk = hi + m["disk_serial_beta"] * lo / a.ranks_per_node
            net = k["mpi"] * SAVE_70B / n / (a.net * 1e9)
            cpu = m["cpu_s_per_rank"] * per_core
            startup = m["startup_s0"] + m["startup_cpu_s_per_rank"] * per_core
            inside = max(m["t0_s"], 0) + disk + net + cpu
            rows.append({"case": case, "nodes": n, "ranks": n * a.ranks_per_node,
                         "gb_read_per_node": read / 1e9, "gb_written_per_node": written / 1e9,
                         "disk_s": disk, "cpu_s": cpu, "net_s": net,
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
             label="mpitailor merge, modelled\n(start-up: the ranks' imports; launch not modelled)")
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
    ap.add_argument("--check", nargs="*", default=[],
                    help="node_scaling JSONs to predict with the calibration (not fitted on)")
    return ap.parse_args()


def main() -> None:
    a = parse_args()
    runs = json.loads(Path(a.runs).read_text())
    rows = runs["rows"]
    save_bytes = runs["input_bytes"] / 2  # two saves of the same size
    m = calibrate(runs)
    val = validate(rows, m)
    print(f"calibrated on {len(rows)} runs of {a.runs}: t0 {m['t0_s']:.2f} s; disk per node "
          f"(probe, throttle {runs['disk_mbps']} MB/s) read {m['disk_read_MBps']:.1f}, write "
          f"{m['disk_write_MBps']:.1f} MB/s, not overlapped (1 rank) beta "
          f"{m['disk_serial_beta']:.2f}; CPU {m['cpu_s_per_rank']:.3f} s a rank on "
          f"{m['node_cpus']:g} cores a node; start-up {m['startup_s0']:.2f} s + "
          f"{m['startup_cpu_s_per_rank']:.3f} CPU s a rank")
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
    checks = []
    for path in a.check:
        other = json.loads(Path(path).read_text())
        rates = {"disk_read_MBps": other["disk_probe"]["read_MBps"],
                 "disk_write_MBps": other["disk_probe"]["write_MBps"]}
        for v in validate(other["rows"], {**m, **rates}):
            checks.append({**v, "runs": path})
            print(f"predicted {v['case']} {v['nodes']}x{v['ranks_per_node']} at "
                  f"{other['disk_mbps']} MB/s: {v['model_seconds']:.2f} s vs {v['seconds']:.2f} s "
                  f"measured ({v['err_seconds']:+.0%}), wall {v['model_wall']:.2f} vs "
                  f"{v['wall']:.2f} ({v['err_wall']:+.0%})")
    per_byte = ratios(rows, save_bytes)
    table = table_70b(m, per_byte, a)
    print(f"\n70B ZeRO-3 ({SAVE_70B / 1e9:.0f} GB per save), {a.ranks_per_node} ranks/node, NVMe "
          f"{a.nvme_read}/{a.nvme_write} GB/s read/write, network {a.net} GB/s per node "
          f"(start s: each rank's imports on a core of its own; srun's launch and MPI wire-up "
          f"across the nodes not modelled):")
    print(f"{'case':<8}{'nodes':>6}{'GB r/node':>10}{'GB w/node':>10}{'disk s':>8}{'cpu s':>7}"
          f"{'net s':>7}{'start s':>8}{'total s':>8}")
    for t in table:
        print(f"{t['case']:<8}{t['nodes']:>6}{t['gb_read_per_node']:>10.1f}"
              f"{t['gb_written_per_node']:>10.1f}{t['disk_s']:>8.1f}{t['cpu_s']:>7.1f}"
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
            f"--{k.replace('_', '-')} {v if k != 'check' else ' '.join(v)}"
            for k, v in vars(a).items() if k != "runs"),
        "runs": a.runs, "calibration": m, "validation": val, "verdict": verdict,
        "predicted": checks,
        "bytes_per_save_byte": per_byte, "table_70b": table,
        "zero_to_fp32_70b_published_s": ZERO_TO_FP32_70B_S, "llmtailor_reread_s": lt},
        indent=2))
    print(f"wrote {RESULTS / 'scale_model.json'} and scale_model.png")


if __name__ == "__main__":
    main()
