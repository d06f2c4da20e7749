"""Start a tiny training run as W real processes (one per ZeRO rank) and wait for it."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dev.tinytrain.spec import TrainSpec

# Variables that would make a child believe it is part of an outer MPI job (pytest under
# mpiexec): the training ranks find each other through RANK/WORLD_SIZE instead.
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "SLURM_")
# dev/ is no installed package: a worker finds it through the repo root on its path,
# wherever it is started from.
REPO = Path(__file__).resolve().parents[2]


class TrainFailed(RuntimeError):
    """A training rank exited non-zero or the run timed out."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH")))),
    )
    return env


def launch(spec: TrainSpec, *, module: str = "dev.tinytrain.worker",
           timeout: float = 300.0, log_dir: Path | None = None) -> dict:
    """Run `spec` on spec.world_size processes; return rank 0's result record.
    log_dir: keep each rank's output there (rank{N}.log), for a test to read.

    Raises TrainFailed with the tail of the failing rank's log.
    """
    for attempt in range(_PORT_TRIES):
        try:
            return _launch(spec, module, timeout, log_dir)
        except TrainFailed as e:
            # free_port's port is free when asked, not when rank 0 binds it: another test's
            # process (pytest -n 2) took it once in CI. Nothing was trained yet: again.
            if "EADDRINUSE" not in str(e) or attempt == _PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


_PORT_TRIES = 3


def _launch(spec: TrainSpec, module: str, timeout: float, log_dir: Path | None) -> dict:
    Path(spec.save_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mpitailor-train-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        result_path = Path(tmp) / "result.json"
        spec.write(spec_path)
        port = free_port()
        # extra["env"]: variables of the ranks' own (a failpoint, the GPU); the quality
        # study's Job, launched too, has no extra
        env = getattr(spec, "extra", {}).get("env", {})
        procs, logs = [], []
        for rank in range(spec.world_size):
            log = open(Path(log_dir or tmp) / f"rank{rank}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", module, str(spec_path), str(result_path)],
                env={**worker_env(rank, spec.world_size, port), **env},
                stdout=log,
                stderr=subprocess.STDOUT))
        try:
            _wait_all(procs, logs, timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()
        return json.loads(result_path.read_text())


def _wait_all(procs, logs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            # The others usually follow within moments (their peer is gone, or they raise the
            # same collective error): wait a while for them, then say them all.
            settle = time.monotonic() + 30
            while time.monotonic() < settle and any(p.poll() is None for p in procs):
                time.sleep(0.05)
            codes = [p.poll() for p in procs]
            raise TrainFailed("\n".join(
                f"training rank {r} exited {c}:\n{_tail(logs[r])}"
                for r, c in enumerate(codes) if c not in (None, 0)))
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise TrainFailed(f"training timed out after {timeout:.0f}s:\n" + _tail(logs[0]))
        time.sleep(0.05)


def _tail(log, chars: int = 4000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-chars:]
