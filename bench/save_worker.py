"""One rank of the save benchmark (started by bench/save_bench.py through tinytrain.launch).

Trains one step, then, with extra["loop"] (save_bench's default), times saves inside a
training loop (`loop_cases`). Without it (save_bench --isolated), times side by side and
repeated a full `engine.save_checkpoint` and `save_layers` under the parity and filter
policies on the same engine, synchronous and asynchronous, each save alone (the time
training is blocked; the background write is timed apart, joined before the next save).
With extra["stats"], LayerwiseCheckpointer's partial saves with and without `stats=` instead
(`stats_cases`). Rank 0 writes JSON.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch.distributed as dist

from mpitailor.publish.staging import fsync_tree
from dev.tinytrain.spec import TrainSpec
from dev.tinytrain.model import task_batch
from dev.tinytrain.worker import build_engine, shutdown, train
from mpitailor.training.partial_save import all_slices_elements, save_layers, take
from mpitailor.training.policies import Filter, Parity
from mpitailor.training.recorded_save import gathered_records, recording
from mpitailor.training.stats import model_layer_keys
from mpitailor.training.writer import BackgroundWriter


def fsync_tree_files(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_tree(root)


def cpu_seconds() -> dict[str, float]:
    """CPU counters, to subtract: this process's CPU seconds, all its threads ("cpu_rank0"),
    the kernel's part of them ("sys_rank0") and its page faults ("faults_rank0"); the
    machine's busy CPU seconds, all cores, the kernel's own threads included ("cpu_machine":
    /proc/stat's user, nice, system, irq and softirq), and its steal ("steal": seconds a
    virtual machine's cores waited for the host's, the noise of a shared machine). A loop's
    figures minus those of the loop without saves are what its saves cost in CPU: on a
    machine whose cores training keeps busy, the overhead's cause."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return {"cpu_rank0": own.ru_utime + own.ru_stime, "sys_rank0": own.ru_stime,
            "faults_rank0": own.ru_minflt + own.ru_majflt,
            "cpu_machine": sum(ticks[i] for i in (0, 1, 2, 5, 6)) / hz,  # not iowait (4)
            "steal": ticks[7] / hz}


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def stats_cases(engine, save_dir: Path, reps: int) -> list[dict]:
    """What `stats=` costs: LayerwiseCheckpointer's partial saves with and without a stats
    log, side by side on the same engine (parity and adaptive, synchronous and asynchronous).
    Each checkpointer makes its (untimed) full save first; "seconds" is what save() blocks
    training, after the previous save was waited for (untimed), so waits are not counted."""
    from mpitailor.training.checkpointer import LayerwiseCheckpointer
    from mpitailor.training.policies import Adaptive

    policies = {"parity": Parity(), "adaptive": Adaptive(top_fraction=0.5, max_staleness=2)}
    rows = []
    for name, policy in policies.items():
        for asynchronous in (False, True):
            for stats in (False, True):
                case = f"{name}{'-async' if asynchronous else ''}{'+stats' if stats else ''}"
                out = save_dir / case
                ckpt = LayerwiseCheckpointer(engine, out, policy, asynchronous=asynchronous,
                                             stats=out / "stats.h5" if stats else None)
                ckpt.save(tag="full")
                for i in range(2 * reps):  # a parity cycle per repetition
                    ckpt.wait()
                    dist.barrier()
                    t = time.perf_counter()
                    ckpt.save(tag=f"partial-{i}")
                    seconds = time.perf_counter() - t
                    ckpt.wait()
                    dist.barrier()
                    if engine.global_rank == 0:
                        rows.append({"case": case, "rep": i // 2, "save_index": i + 1,
                                     "seconds": seconds, "background": None,
                                     "bytes": du(out / f"partial-{i}")})
                        shutil.rmtree(out / f"partial-{i}")
                    dist.barrier()
                if engine.global_rank == 0:
                    shutil.rmtree(out)
                dist.barrier()
    return rows


def step(spec: TrainSpec, engine, i: int) -> None:
    ids, labels = task_batch(spec, i, engine.global_rank)
    ids, labels = ids.to(engine.device), labels.to(engine.device)
    engine.backward(engine(input_ids=ids, labels=labels).loss)
    engine.step()


def loop_cases(spec: TrainSpec, engine, keys: list[str], reps: int) -> list[dict]:
    """Saves inside a training loop, as a run makes them: per case and repetition (cases
    interleaved), `steps` training steps with a save after steps 1, 1 + every, 1 + 2 *
    every, ... (every: 2 unless extra["loop_every"] says; the last save is followed by
    every - 1 steps). "blocked": seconds the loop stood still because of the saves:
    inside save calls, the optimizer steps held for an overlapped copy (StepGuard), and the
    wait for the last save after the loop. "wall": the whole loop, that wait included; the
    case "none" is the same loop without saves (the overhead's baseline). And the CPU
    counters' change over the loop (cpu_seconds)."""
    from mpitailor.training.checkpointer import LayerwiseCheckpointer
    steps = int(spec.extra.get("loop_steps", 8))
    at = list(range(1, steps, int(spec.extra.get("loop_every", 2))))
    save_dir = Path(spec.save_dir)
    policies = {"parity": Parity(), "filter": Filter(always=(0, 1, -2, -1), every=4)}
    ckpts = {}
    for name, policy in policies.items():  # made once: host buffers warm after the first
        for asynchronous in (False, True):
            case = f"{name}{'-async' if asynchronous else ''}"
            ckpts[case] = LayerwiseCheckpointer(engine, save_dir / case, policy,
                                                asynchronous=asynchronous)
    cases = ("none", "full+fsync", *ckpts)
    rows, counter = [], [0]
    parts: dict[str, float] = {}  # rebound per loop: the snapshots' own seconds, summed

    def save(case: str, k: int) -> None:
        tag = f"{case}-{counter[0]}"
        counter[0] += 1
        if case == "full+fsync":
            engine.save_checkpoint(str(save_dir / case), tag=tag)
            fsync_tree_files(save_dir / case / tag)
            dist.barrier()  # a collective save ends when every rank's part is done
            return
        ckpt = ckpts[case]
        layers = ckpt.policy.decide(k + 1, keys).layers
        before = ckpt.writer._snap if ckpt.writer is not None else None
        ckpt.save_partial(tag, layers, None)
        if ckpt.writer is None:
            dist.barrier()
            return
        for key, value in ckpt.writer._snap.seconds.items():  # where the blocked time goes
            parts[key] = parts.get(key, 0.0) + value
        if before is not None:
            parts["waited"] = parts.get("waited", 0.0) + before.seconds.get("waited", 0.0)

    for rep in range(-1, reps):  # rep -1: warm-up (host buffers, page cache), not recorded
        for case in cases:
            ckpt = ckpts.get(case)
            guard = ckpt.guard if ckpt is not None else None
            held0 = guard.waited if guard is not None else 0.0
            dist.barrier()
            t0, cpu0 = time.perf_counter(), cpu_seconds()
            blocked = 0.0
            saves = 0
            parts: dict[str, float] = {}
            for i in range(1, steps + 1):
                step(spec, engine, i)
                if case != "none" and i in at:
                    t = time.perf_counter()
                    save(case, saves)
                    blocked += time.perf_counter() - t
                    saves += 1
            in_saves, last_wait = blocked, 0.0
            if ckpt is not None:
                t = time.perf_counter()
                ckpt.wait()
                last_wait = time.perf_counter() - t
            dist.barrier()
            wall = time.perf_counter() - t0
            cpu = {k: v - cpu0[k] for k, v in cpu_seconds().items()}
            held = guard.waited - held0 if guard is not None else 0.0
            blocked = in_saves + held + last_wait
            if engine.global_rank == 0 and rep >= 0:
                rows.append({"case": case, "rep": rep, "steps": steps, "saves": saves,
                             "wall": wall, "blocked": blocked, "in_saves": in_saves,
                             "steps_held": held, "last_wait": last_wait,
                             **cpu,
                             "parts": parts,
                             "bytes": du(save_dir / case) // max(saves, 1)
                             if case != "none" else 0})
                print(json.dumps(rows[-1]), flush=True)  # in the rank's log, as it goes
            if engine.global_rank == 0 and case != "none":
                for saved in (save_dir / case).iterdir():  # the checkpointer keeps its dir
                    shutil.rmtree(saved) if saved.is_dir() else saved.unlink()
            dist.barrier()
    return rows


def about(engine) -> dict:
    """What ran the benchmark: versions, the device, the model's size."""
    import deepspeed
    import torch
    info = {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "device": str(engine.device), "cpus": os.cpu_count(),
            "params": sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())}
    if engine.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(engine.device)
    return info


def main(spec_path: str, result_path: str) -> None:
    spec = TrainSpec.from_json(Path(spec_path).read_text())
    reps = int(spec.extra.get("reps", 3))
    engine = build_engine(spec)
    train(spec, engine, 0)
    keys = model_layer_keys(engine)
    if spec.extra.get("stats") or spec.extra.get("loop"):
        rows = stats_cases(engine, Path(spec.save_dir), reps) if spec.extra.get("stats") \
            else loop_cases(spec, engine, keys, reps)
        if engine.global_rank == 0:
            Path(result_path).write_text(json.dumps({"rows": rows, "layers": len(keys),
                                                     "about": about(engine)}))
        shutdown()
    policies = {"parity": Parity(), "filter": Filter(always=(0, 1, -2, -1), every=4)}
    cycle = {"parity": [1, 2], "filter": [1, 2, 3, 4]}  # the partial saves of one cycle
    writer = BackgroundWriter(reserve=all_slices_elements(engine))  # as the checkpointer does
    cases = ("full", "full+fsync", "full+record", "parity", "filter", "parity-async",
             "filter-async")
    rows = []
    save_dir = Path(spec.save_dir)
    for rep in range(reps):
        for case in cases:
            policy = case.removesuffix("-async")
            for idx in ([0] if case.startswith("full") else cycle[policy]):
                tag = f"{case}-{rep}-{idx}"
                dist.barrier()
                t = time.perf_counter()
                if case == "full+record":  # as the checkpointers make a full save
                    with recording(engine) as written:
                        engine.save_checkpoint(str(save_dir), tag=tag)
                    gathered_records(engine, written, save_dir / tag)
                elif case.startswith("full"):
                    engine.save_checkpoint(str(save_dir), tag=tag)
                    if case == "full+fsync":  # durable, as save_layers always is
                        fsync_tree_files(save_dir / tag)
                elif case.endswith("-async"):
                    layers = policies[policy].decide(idx, keys).layers
                    snap = take(engine, save_dir, tag, layers, host=writer.host)
                    writer.start(snap)
                else:
                    layers = policies[policy].decide(idx, keys).layers
                    save_layers(engine, save_dir, tag, layers)
                background, parts = None, None
                if case.endswith("-async"):  # training would go on now: this rank's stall
                    parts = {k: snap.seconds[k] for k in ("gather", "copy", "serialise")}
                    seconds = time.perf_counter() - t
                    background = writer.join().seconds["background"]
                    dist.barrier()
                else:  # a collective save ends when every rank's part is done
                    dist.barrier()
                    seconds = time.perf_counter() - t
                if engine.global_rank == 0:
                    rows.append({"case": case, "rep": rep, "save_index": idx,
                                 "seconds": seconds, "background": background, "parts": parts,
                                 "host_bytes": writer.host.nbytes, "bytes": du(save_dir / tag)})
                    shutil.rmtree(save_dir / tag)
                dist.barrier()
    if engine.global_rank == 0:
        Path(result_path).write_text(json.dumps({"rows": rows, "layers": len(keys)}))
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
