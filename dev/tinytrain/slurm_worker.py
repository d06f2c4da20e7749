"""One rank of the tiny DeepSpeed run (dev.tinytrain.worker), started by srun:

    srun -N 2 -n 4 python -m dev.tinytrain.slurm_worker spec.json result.json

The rank, world and local sizes come from the Slurm step; the rendezvous (gloo, env://) is the
first node of the step, on a port derived from the job and step ids. Rank 0 writes the result.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys


def expand_counts(text: str) -> list[int]:
    """Slurm's compressed per-node counts: "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"unexpected SLURM_STEP_TASKS_PER_NODE {text!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def step_nodes(nodelist: str) -> list[str]:
    """The step's node names in order ("n[1-2]" -> ["n1", "n2"])."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                         text=True, check=True).stdout
    return out.split()


def rank_env(environ: dict[str, str]) -> dict[str, str]:
    """torch.distributed's variables for this task, from the Slurm step's."""
    nodes = step_nodes(environ["SLURM_STEP_NODELIST"])
    per_node = expand_counts(environ["SLURM_STEP_TASKS_PER_NODE"])
    here = nodes.index(environ["SLURMD_NODENAME"])
    job, step = int(environ["SLURM_JOB_ID"]), int(environ.get("SLURM_STEP_ID", "0"))
    return {
        "RANK": environ["SLURM_PROCID"], "WORLD_SIZE": environ["SLURM_STEP_NUM_TASKS"],
        "LOCAL_RANK": environ["SLURM_LOCALID"], "LOCAL_WORLD_SIZE": str(per_node[here]),
        "MASTER_ADDR": socket.gethostbyname(nodes[0]),
        "MASTER_PORT": str(20000 + (job * 8 + step) % 20000),
        "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
    }


def main(spec_path: str, result_path: str) -> None:
    # No GLOO_SOCKET_IFNAME needed: gloo takes the address the node's hostname resolves to.
    os.environ.update(rank_env(dict(os.environ)))
    from dev.tinytrain import worker  # after OMP_NUM_THREADS: it imports torch

    worker.main(spec_path, result_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
