"""One seed of the study: train once with every saver, fail, recover, resume.

A failure after step F is simulated exactly: the saves a policy made at steps <= F are
hard-linked into a fresh dir (with the `latest` file DeepSpeed had written by then), as if
the job had died after step F; `mpiexec -n 2 python -m mpitailor recover` builds the
composite from that dir, and DeepSpeed's load_checkpoint resumes from it (full saves:
from the newest full save <= F itself). The uninterrupted run never stops.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.quality.spec import Job, Model, Resume, Saver
from dev.tinytrain import launch

log = logging.getLogger(__name__)
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
WORKER = "bench.quality.worker"
IDENTITY = "identity"


@dataclass(frozen=True)
class Plan:
    """What every seed runs."""

    model: Model
    steps: int
    savers: tuple[tuple[str, str, int], ...]   # (name, policy, K): the budget of full@K
    failure_fractions: tuple[float, ...]
    horizon: int             # layer-wise resumes train to F + horizon
    jitter: int              # failure step = fraction * steps + a per-seed offset < jitter
    check: int = 20          # full-save resumes (exact replays) train to F + check
    full_bytes: float = 0.0  # one full save, measured
    estimates: tuple[tuple[str, float], ...] = ()  # a partial save of each policy, measured
    recover_ranks: int = 2
    timeout: float = 3600.0

    def saver(self, name: str, policy: str, k: int, save_dir: Path) -> Saver:
        if policy == "full":
            return Saver(name, policy, str(save_dir), every=k)
        return Saver(name, policy, str(save_dir), bytes_per_step=self.full_bytes / k,
                     full_bytes=self.full_bytes, first_estimate=dict(self.estimates)[policy])


def failure_steps(plan: Plan, seed: int) -> list[int]:
    """Failure points of one seed: early, middle, late, each shifted by a pseudo-random
    offset (a function of seed and point), so that over the seeds a failure falls at every
    phase of every policy's save interval."""
    out = []
    for i, frac in enumerate(plan.failure_fractions):
        offset = random.Random(f"failure-{seed}-{i}").randrange(max(1, plan.jitter))
        f = int(frac * plan.steps) + offset
        out.append(min(f, plan.steps - plan.horizon))
    return out


def run_seed(plan: Plan, seed: int, scratch: Path) -> dict:
    """Train, fail at each failure point, recover, resume; returns every record."""
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    fails = failure_steps(plan, seed)
    savers = tuple(plan.saver(n, p, k, scratch / "saves" / n) for n, p, k in plan.savers)
    wall = {}
    t0 = time.perf_counter()
    train = int_keys(launch(Job("train", str(scratch / "train"), plan.model, seed,
                                steps=plan.steps, savers=savers, extra_evals=tuple(fails)),
                            module=WORKER, timeout=plan.timeout))
    wall["train"] = time.perf_counter() - t0
    log.info("seed %d: trained %d steps in %.0f s; failures after steps %s", seed, plan.steps,
             wall["train"], fails)
    t0 = time.perf_counter()
    recover_seconds: dict[str, float] = {}
    resumes = [r for f in fails for s in savers
               for r in resumes_after(plan, s, train["saves"][s.name], f, scratch,
                                      recover_seconds)]
    wall["recover"] = time.perf_counter() - t0
    log.info("seed %d: %d composites recovered in %.0f s; resuming %d runs", seed,
             len(recover_seconds), wall["recover"], len(resumes))
    t0 = time.perf_counter()
    resumed = launch(Job("resume", str(scratch / "resume"), plan.model, seed,
                         resumes=tuple(resumes), extra_evals=tuple(fails)),
                     module=WORKER, timeout=plan.timeout)
    wall["resume"] = time.perf_counter() - t0
    shutil.rmtree(scratch, ignore_errors=True)
    return {"seed": seed, "failures": fails, "train": train,
            "resumed": {k: int_keys(v) for k, v in resumed.items()},
            "recover_seconds": recover_seconds, "wall": wall}


def resumes_after(plan: Plan, s: Saver, saves: dict, f: int, scratch: Path,
                  seconds: dict[str, float]) -> list[Resume]:
    """What to resume from after a failure after step f: a full save itself (and, for the
    first full saver, the identity control: recover's composite of that save), or the
    composite `recover` makes of a layer-wise policy's saves made by then."""
    base = newest_save(saves, f)
    if base is None:
        return []
    tag = f"global_step{base}"
    if s.policy != "full":
        out = compose(s.dir, saves, f, scratch / f"{s.name}-{f}", plan.recover_ranks,
                      seconds, f"{s.name}|{f}")
        return [Resume(f"{s.name}|{f}", str(out), tag, f + plan.horizon)]
    out = [Resume(f"{s.name}|{f}", s.dir, tag, f + plan.check)]
    if s.name == plan.savers[0][0]:
        ident = compose(s.dir, saves, f, scratch / f"{IDENTITY}-{f}", plan.recover_ranks,
                        seconds, f"{IDENTITY}|{f}")
        out.append(Resume(f"{IDENTITY}|{f}", str(ident), tag, f + plan.check))
    return out


def newest_save(saves: dict, f: int) -> int | None:
    steps = [s for s in saves["steps"] if s <= f]
    return steps[-1] if steps else None


def saves_until(save_dir: str, saves: dict, f: int, dest: Path) -> Path:
    """The save dir as a job that died after step f left it: the tags of steps <= f
    (hard links: nothing is copied) and `latest` naming the newest full save by then."""
    dest.mkdir(parents=True)
    newest_full = None
    for step, layers in zip(saves["steps"], saves["layers"]):
        if step > f:
            break
        tag = f"global_step{step}"
        shutil.copytree(Path(save_dir) / tag, dest / tag, copy_function=os.link)
        if not layers:
            newest_full = tag
    if newest_full is not None:
        (dest / "latest").write_text(newest_full)
    return dest


def compose(save_dir: str, saves: dict, f: int, work: Path, ranks: int, seconds: dict,
            key: str) -> Path:
    """`mpiexec -n ranks python -m mpitailor recover` of the saves made by step f."""
    src = saves_until(save_dir, saves, f, work / "saves")
    out = work / "composite"
    start = time.perf_counter()
    r = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, "-m", "mpitailor", "recover",
                        str(src), "-o", str(out), "-q", "--no-progress"],
                       capture_output=True, text=True, timeout=600, env=_recover_env())
    seconds[key] = time.perf_counter() - start
    if r.returncode != 0:
        raise RuntimeError(f"recover {src} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    shutil.rmtree(src)  # the composite holds copies: the links are no longer needed
    return out


def _recover_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    return env


def int_keys(record: dict) -> dict:
    """JSON turns int keys into strings: losses and evals are keyed by step."""
    out = dict(record)
    for k in ("losses", "evals"):
        if k in out:
            out[k] = {int(s): v for s, v in out[k].items()}
    return out


def save_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)
