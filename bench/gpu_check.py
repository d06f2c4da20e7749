"""The GPU check (issue 24, part 4): `make gpu-check`, or `python -m bench.gpu_check`.

On a machine with one CUDA GPU, in a few minutes:

1. zero3-bf16: DeepSpeed ZeRO-3, bf16, NCCL (world size 1), a tiny random-init Llama with
   one param group per layer, layer-wise saves every 2 steps through
   `mpitailor.training.LayerwiseCheckpointer` with `Parity(full_every=3)`: full at steps 2
   and 8, partial at 4, 6, 10, 12 (odd / even layers + embed, norm, lm_head in turn).
   The saves are asynchronous (partial slices copied to host buffers on a side stream
   while the next step runs, written in the background); S, a short run beside them, makes
   the same saves synchronously (steps 1-6), with an update-statistics log (`stats=`: its
   norms are all-reduced over the training group, on NCCL through the GPU). U's copies
   start a second late (failpoint `snapshot-copy:0:sleep=1`), so its optimizer steps must
   wait for them: its partial saves of steps 4 and 6 must equal S's (slices byte for byte,
   small states value for value), and the steps after them must have been held.
   U: 12 steps, uninterrupted. C: the same run "crashes" after the save of step 10 (the
   process dies with os._exit: no barrier, no shutdown). Then, each from a fresh process:
   - full only: `python -m mpitailor recover` of C's saves as they stood after step 8
     (a hard-linked view of global_step2..8: the newest save is the full one, so the
     composite is made of FULL saves only, an identity recover of step 8), resumed with a
     plain `engine.load_checkpoint(OUT)` to step 12. Compared with U, steps 9-12: every
     loss bit for bit, the lr, the loss scaler, and a digest of the final fp32 master
     weights and both Adam moments. R0, DeepSpeed's own resume from C's `global_step8`
     with no mpitailor in between, is the reference for what DeepSpeed itself reproduces:
     the recovered resume must equal R0 bit for bit, and equal U bit for bit where R0 does
     (else within 1e-2 relative, and the row says so).
   - partial: `recover` of all of C's saves (composite: even layers and the auxiliary ones
     from step 10, odd layers from step 8), resumed to step 12. Compared: it loads, the step
     counter is 10, the lr and the loss scaler equal U's after step 10 exactly, the losses
     of steps 11-12 are finite; their difference from U is reported (stale odd layers: it
     is not expected to be zero).
2. zero2-fp16: the same with ZeRO-2 and fp16 (dynamic loss scale, initial 2^8, window 3:
   the scale moves during the run). The optimizer files hold DeepSpeed's DynamicLossScaler.
3. lightning: Lightning's `DeepSpeedStrategy(stage=3)`, bf16-mixed, saves twice
   (`trainer.save_checkpoint` at steps 3 and 6: each a DeepSpeed save dir whose tag is
   `checkpoint`), `python -m mpitailor RECIPE` merges them by parity (even layers and the
   auxiliary ones from step 6, odd from step 3), `inspect` shows the origin of every layer,
   `export --format fp32` of the merge is compared tensor for tensor with DeepSpeed's
   `zero_to_fp32` of the source each layer came from; then Lightning resumes from the merged
   checkpoint (`trainer.fit(ckpt_path=MERGED)`) and trains 3 more steps.

Without a CUDA GPU it prints one line, skipped and why, and exits 0. Every training and every
CLI call is a subprocess with a timeout. A table on stdout, JSON at --out (default
bench/out/gpu_check.json); exit 1 if a check failed.
`--device cpu` runs checks 1 and 2 on the CPU with gloo (both bf16: fp16 cannot run on a
CPU; no Lightning), to develop this script on a machine without a GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.gpu.common import REPO, RunSpec, child_env, free_port, write_json
from mpitailor import failpoints

PER_RUN_TIMEOUT = 180.0  # seconds, one training or one CLI call
TOTAL_BUDGET = 450.0     # seconds for the whole check (the goal is under 8 minutes)


@dataclass
class Row:
    check: str
    what: str
    ok: bool
    numbers: str
    seconds: float
    data: dict = field(default_factory=dict)


class Budget:
    def __init__(self, total: float) -> None:
        self.end = time.monotonic() + total

    def left(self) -> float:
        return self.end - time.monotonic()


# -- subprocesses ----------------------------------------------------------------------

@dataclass
class Job:
    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] | None = None
    rc: int | None = None
    seconds: float = 0.0
    timed_out: bool = False

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def run_jobs(jobs: list[Job], budget: Budget, timeout: float = PER_RUN_TIMEOUT) -> bool:
    """Start every job at once (they share the GPU), wait for all; a job past its timeout
    (or the budget) is killed with its process group. True if all exited 0."""
    limit = max(1.0, min(timeout, budget.left()))
    procs = []
    for job in jobs:
        job.log.parent.mkdir(parents=True, exist_ok=True)
        fh = open(job.log, "w")  # noqa: SIM115 - closed when the job ends
        t0 = time.monotonic()
        p = subprocess.Popen(job.argv, cwd=REPO, env=job.env or child_env("cpu"),
                             stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append((job, p, fh, t0))
    for job, p, fh, t0 in procs:
        try:
            job.rc = p.wait(timeout=max(0.1, limit - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            job.timed_out = True
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            job.rc = p.wait()
        job.seconds = time.monotonic() - t0
        fh.close()
    return all(j.rc == 0 for j in jobs)


def job_error(job: Job) -> str:
    why = f"timed out after {job.seconds:.0f}s" if job.timed_out else f"exit {job.rc}"
    return f"{job.name}: {why}\n{job.tail()}"


def train_job(spec: RunSpec, work: Path) -> tuple[Job, Path]:
    spec_path, result = work / f"{spec.name}.spec.json", work / f"{spec.name}.result.json"
    spec.write(spec_path)
    module = "bench.gpu.lightning_worker" if spec.extra.get("lightning") else \
        "bench.gpu.ds_worker"
    return Job(spec.name, [sys.executable, "-m", module, str(spec_path), str(result)],
               work / f"{spec.name}.log", child_env(spec.device, free_port())), result


def cli_job(name: str, args: list[str], work: Path, device: str) -> Job:
    return Job(name, [sys.executable, "-m", "mpitailor", *args], work / f"{name}.log",
               child_env(device))


def inspect(path: Path, work: Path, device: str, budget: Budget) -> dict:
    job = cli_job(f"inspect-{path.name}", ["inspect", "--json", str(path)], work, device)
    if not run_jobs([job], budget, 60):
        raise CheckError(job_error(job))
    text = job.log.read_text()
    return json.loads(text[text.index("{"):])


class CheckError(RuntimeError):
    pass


def dir_bytes(path: Path) -> int:
    seen, total = set(), 0
    for root, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(root, f))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


# -- comparisons -----------------------------------------------------------------------

def losses(result: dict, steps) -> list[float]:
    by = {s["step"]: s["loss"] for s in result["steps"]}
    return [by[s] for s in steps]


def step_row(result: dict, step: int) -> dict:
    return next(s for s in result["steps"] if s["step"] == step)


def compare(a: dict, b: dict, steps) -> dict:
    la, lb = losses(a, steps), losses(b, steps)
    rel = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(la, lb)]
    return {"steps": list(steps), "a": la, "b": lb,
            "bit_exact": all(x == y for x, y in zip(la, lb)),
            "max_rel_diff": max(rel) if rel else 0.0,
            "lr_equal": all(step_row(a, s)["lr"] == step_row(b, s)["lr"] for s in steps),
            "scaler_equal": all(step_row(a, s)["loss_scaler"] == step_row(b, s)["loss_scaler"]
                                for s in steps),
            "final_equal": a.get("final") == b.get("final") if "final" in a else None}


def finite(values) -> bool:
    return all(math.isfinite(v) for v in values)


# -- 1 and 2: DeepSpeed ZeRO with layer-wise saves, crash, recover, resume -------------------

def deepspeed_check(label: str, stage: int, dtype: str, device: str, root: Path,
                    budget: Budget) -> list[Row]:
    work = root / label
    work.mkdir(parents=True)
    base = RunSpec(name="", device=device, stage=stage, dtype=dtype, steps=12, save_every=2,
                   full_every=3)
    rows: list[Row] = []

    # U (uninterrupted) and C (crashes after step 10) side by side on the one GPU
    t0 = time.monotonic()
    u_spec = replace(base, name="U", save_dir=str(work / "U-saves"))
    c_spec = replace(base, name="C", save_dir=str(work / "C-saves"), crash_after=10)
    # S: the same saves made synchronously (steps 1-6: a full save at 2, partial at 4 and 6)
    s_spec = replace(base, name="S-sync", save_dir=str(work / "S-saves"), steps=6,
                     asynchronous=False, extra={"stats": str(work / "S-stats.h5")})
    (u_job, u_res), (c_job, c_res) = train_job(u_spec, work), train_job(c_spec, work)
    # U's overlapped copies start a second late, long after the next step's forward and
    # backward: its optimizer step must wait for them (else the copy reads a later state)
    u_job.env[failpoints.ENV] = "snapshot-copy:0:sleep=1"
    s_job, s_res = train_job(s_spec, work)
    ok = run_jobs([u_job, c_job, s_job], budget)
    rows.append(sync_row(label, s_job, s_res, work / "S-saves", time.monotonic() - t0))
    ok = u_job.rc == 0 and c_job.rc == 0
    if not ok:
        bad = [j for j in (u_job, c_job) if j.rc != 0]
        rows.append(Row(label, "train U (12 steps) + C (crash after 10), async saves", False,
                        "; ".join(job_error(j).splitlines()[0] for j in bad),
                        time.monotonic() - t0, {"error": "\n".join(map(job_error, bad))}))
        return rows
    U, C = json.loads(u_res.read_text()), json.loads(c_res.read_text())
    full_steps = [s["step"] for s in C["saves"] if s["full"]]
    part_steps = [s["step"] for s in C["saves"] if not s["full"]]
    same_start = compare(C, U, range(1, 11))
    good = (C["crashed"] and full_steps == [2, 8] and part_steps == [4, 6, 10]
            and finite(losses(U, range(1, 13))) and (work / "C-saves/global_step10").is_dir())
    skipped = U["steps"][-1]["skipped_steps"]
    scaler = U["steps"][-1]["loss_scaler"]
    rows.append(Row(label, "train U (12 steps) + C (crash after 10), async saves", good,
                    f"{U['optimizer']}, {U['param_groups']} param groups, {U['params']} params; "
                    f"C saves full {full_steps} partial {part_steps}, "
                    f"{mb(dir_bytes(work / 'C-saves'))}"
                    f"; U vs C steps 1-10 bit-exact: {same_start['bit_exact']}"
                    f"; skipped steps {skipped}"
                    + (f"; loss scale {scaler['cur_scale']}" if scaler and scaler.get("dynamic")
                       else ""),
                    time.monotonic() - t0,
                    {"U": U, "C": C, "U_vs_C_steps_1_10": same_start,
                     "seconds": {"U": u_job.seconds, "C": c_job.seconds}}))

    try:
        rows.append(overlap_row(label, U, work / "U-saves", work / "S-saves"))
    except Exception as e:  # noqa: BLE001 - S failed (its own row says why): a FAIL row
        rows.append(Row(label, "overlapped async saves == synchronous (steps 4, 6)", False,
                        f"{type(e).__name__}: {e}", 0.0))

    # the save dir as it stood after step 8 (hard links: saves are written once), and all of it
    view = work / "C-saves-after-step8"
    view.mkdir()
    for item in (work / "C-saves").iterdir():
        if item.is_dir() and item.name.startswith("global_step") and \
                int(item.name[len("global_step"):]) <= 8:
            shutil.copytree(item, view / item.name, copy_function=os.link)
        elif item.is_file() and item.name != "latest":
            os.link(item, view / item.name)
    (view / "latest").write_text("global_step8")

    t0 = time.monotonic()
    rec_full, rec_part = work / "recovered-full-only", work / "recovered-partial"
    jobs = [cli_job("recover-full-only", ["recover", str(view), "-o", str(rec_full),
                                          "--no-progress"], work, device),
            cli_job("recover-partial", ["recover", str(work / "C-saves"), "-o", str(rec_part),
                                        "--no-progress"], work, device)]
    ok = run_jobs(jobs, budget)
    info = {}
    try:
        if ok:
            info = {"full_only": inspect(rec_full, work, device, budget),
                    "partial": inspect(rec_part, work, device, budget)}
    except CheckError as e:
        ok, jobs = False, jobs + [Job("inspect", [], work / "none", rc=1)]
        info = {"error": str(e)}
    if not ok:
        bad = [j for j in jobs if j.rc != 0]
        rows.append(Row(label, "recover (full-only view, all saves)", False,
                        "; ".join(job_error(j).splitlines()[0] for j in bad)
                        or info.get("error", ""),
                        time.monotonic() - t0,
                        {"error": "\n".join(map(job_error, bad)) or info.get("error")}))
        return rows
    # inspect: every layer's origin ("from_step" of a composite; a plain save's own step)
    origin = {k: {key: row.get("from_step", info[k]["global_steps"])
                  for key, row in info[k]["layers"].items()} for k in info}
    want_partial = {key: (10 if key.startswith("layers.") and int(key.split(".")[1]) % 2 == 0
                          or not key.startswith("layers.") else 8)
                    for key in origin["partial"]}
    good = (set(origin["full_only"].values()) == {8} and origin["partial"] == want_partial
            and info["partial"]["kind"] == "composite" and info["partial"]["global_steps"] == 10)
    rows.append(Row(label, "recover: full-only view -> step 8; all saves -> composite", good,
                    f"full-only: {info['full_only']['kind']}, every layer from step 8, "
                    f"{mb(dir_bytes(rec_full))} in {jobs[0].seconds:.1f}s; partial: "
                    f"{info['partial']['kind']}, layers from steps "
                    f"{sorted(set(origin['partial'].values()))} "
                    f"(odd 8, even+aux 10: {origin['partial'] == want_partial}), "
                    f"{mb(dir_bytes(rec_part))} in {jobs[1].seconds:.1f}s",
                    time.monotonic() - t0,
                    {"origin": origin, "inspect_kinds": {k: info[k]["kind"] for k in info},
                     "dtype": {k: info[k]["dtype"] for k in info},
                     "seconds": {j.name: j.seconds for j in jobs}}))

    # three resumes side by side: DeepSpeed's own (R0), full-only composite (R1), partial (Rp)
    t0 = time.monotonic()
    r0 = replace(base, name="R0-native", save_dir=None, save_every=0,
                 load_dir=str(work / "C-saves"), load_tag="global_step8")
    r1 = replace(base, name="R1-full-only", save_dir=None, save_every=0, load_dir=str(rec_full))
    rp = replace(base, name="Rp-partial", save_dir=None, save_every=0, load_dir=str(rec_part))
    specs = [r0, r1, rp]
    pairs = [train_job(s, work) for s in specs]
    ok = run_jobs([j for j, _ in pairs], budget)
    if not ok:
        bad = [j for j, _ in pairs if j.rc != 0]
        rows.append(Row(label, "resume (native, full-only, partial)", False,
                        "; ".join(job_error(j).splitlines()[0] for j in bad),
                        time.monotonic() - t0, {"error": "\n".join(map(job_error, bad))}))
        return rows
    R0, R1, Rp = (json.loads(res.read_text()) for _, res in pairs)
    secs = time.monotonic() - t0
    tail = range(9, 13)
    ds_exact = compare(R0, U, tail)
    r1_vs_r0 = compare(R1, R0, tail)
    r1_vs_u = compare(R1, U, tail)
    u8 = step_row(U, 8)
    loaded_ok = (R1["loaded"]["global_steps"] == 8 and R1["loaded"]["lr"] == u8["lr"]
                 and R1["loaded"]["loss_scaler"] == u8["loss_scaler"])
    exact_needed = ds_exact["bit_exact"] and ds_exact["final_equal"]
    good = (loaded_ok and r1_vs_r0["bit_exact"] and r1_vs_r0["final_equal"]
            and (r1_vs_u["bit_exact"] and r1_vs_u["final_equal"] if exact_needed
                 else r1_vs_u["max_rel_diff"] < 1e-2))
    rows.append(Row(label, "resume full-only composite vs uninterrupted (steps 9-12)", good,
                    f"4 losses: recovered==U bit-exact {r1_vs_u['bit_exact']} (max rel "
                    f"{r1_vs_u['max_rel_diff']:.1e}), final fp32+Adam digest equal "
                    f"{r1_vs_u['final_equal']}; recovered==native resume {r1_vs_r0['bit_exact']}"
                    f"/{r1_vs_r0['final_equal']}; native==U {ds_exact['bit_exact']}/"
                    f"{ds_exact['final_equal']}; lr, loss scaler after load == U@8 {loaded_ok}",
                    secs, {"R1_vs_U": r1_vs_u, "R1_vs_R0": r1_vs_r0, "R0_vs_U": ds_exact,
                           "R0": R0, "R1": R1, "deepspeed_resume_bit_exact": exact_needed}))
    u10 = step_row(U, 10)
    after = losses(Rp, range(11, 13))
    diff = compare(Rp, U, range(11, 13))
    good = (Rp["loaded"]["global_steps"] == 10 and Rp["steps"][-1]["global_steps"] == 12
            and Rp["loaded"]["lr"] == u10["lr"]
            and Rp["loaded"]["loss_scaler"] == u10["loss_scaler"] and finite(after))
    rows.append(Row(label, "resume partial composite (steps 11-12)", good,
                    f"loaded at step {Rp['loaded']['global_steps']} (want 10), ends at "
                    f"{Rp['steps'][-1]['global_steps']}; lr == U@10 "
                    f"{Rp['loaded']['lr'] == u10['lr']}; loss scaler == U@10 "
                    f"{Rp['loaded']['loss_scaler'] == u10['loss_scaler']}; losses "
                    f"{', '.join(f'{x:.4f}' for x in after)} finite (U: "
                    f"{', '.join(f'{x:.4f}' for x in losses(U, range(11, 13)))}, max rel diff "
                    f"{diff['max_rel_diff']:.1e}: odd layers are 2 steps stale)",
                    secs, {"Rp": Rp, "Rp_vs_U": diff,
                           "seconds": {j.name: j.seconds for j, _ in pairs}}))
    return rows


def sync_row(label: str, job: Job, res: Path, saves: Path, seconds: float) -> Row:
    what = "synchronous partial save (asynchronous=False)"
    if job.rc != 0:
        err = job.tail(6000)
        last = [ln for ln in err.splitlines() if "Error" in ln or "Failed" in ln]
        return Row(label, what, False, f"{job.name}: exit {job.rc}: "
                   f"{(last[-1] if last else '').replace('[rank0]: ', '')[:200]}", seconds,
                   {"error": job_error(job)})
    S = json.loads(res.read_text())
    kinds = [(s["step"], s["full"]) for s in S["saves"]]
    stats = stats_rows(saves.parent / "S-stats.h5")
    good = kinds == [(2, True), (4, False), (6, False)] and (saves / "global_step4").is_dir() \
        and stats["steps"] == [2, 4, 6] and stats["finite_update_norms"]
    return Row(label, what + " + stats log", good, f"saves {kinds} (step, full), partial "
               f"{mb(dir_bytes(saves / 'global_step4'))} in {S['saves'][-1]['seconds']:.2f}s; "
               f"stats log rows {stats['steps']}, update norms finite after the first: "
               f"{stats['finite_update_norms']}", seconds, {"S": S, "stats": stats})


def stats_rows(path: Path) -> dict:
    """The steps of an update-statistics log, and whether the rows after the first (the full
    save, before which no layer was saved) hold finite update norms: measured with an
    all-reduce over the training group (NCCL on a GPU)."""
    import h5py
    import numpy as np
    with h5py.File(path) as f:
        steps = [int(s) for s in f["step"][:]]
        norms = f["update_norm"][1:]
    return {"steps": steps, "finite_update_norms": len(norms) > 0
            and bool(np.isfinite(norms).all())}


def overlap_row(label: str, U: dict, u_saves: Path, s_saves: Path) -> Row:
    """U's asynchronous partial saves of steps 4 and 6 (copied on a side stream while the next
    step ran, that step's optimizer step held) hold what S's synchronous ones hold: the
    layers' slices byte for byte, the small states value for value."""
    from dev.compare import same
    from mpitailor.formats.manifest import PARTIAL_MANIFEST, read_manifest
    from mpitailor.formats.torch.opaque import Opaque
    from mpitailor.formats.torch.safeload import load
    t0 = time.monotonic()
    differ, compared = [], 0
    for step in (4, 6):
        a, b = s_saves / f"global_step{step}", u_saves / f"global_step{step}"
        ma, mb_ = read_manifest(a / PARTIAL_MANIFEST), read_manifest(b / PARTIAL_MANIFEST)
        if sorted(ma.files) != sorted(mb_.files) or ma["layers"] != mb_["layers"]:
            differ.append(f"step {step}: files or layers differ")
            continue
        for name in ma.files:
            compared += 1
            if name.endswith(".safetensors"):
                same_file = (a / name).read_bytes() == (b / name).read_bytes()
            else:
                va, vb = (load(d / name, opaque_ok=True, allow=("numpy", "deepspeed"))
                          for d in (a, b))
                if isinstance(va, Opaque) and isinstance(vb, Opaque):
                    # the guard that refuses DeepSpeed a partial save names its own dir
                    va, vb = va.__dict__["_args"], vb.__dict__["_args"]
                    va, vb = va == (str(a),), vb == (str(b),)
                same_file = same(va, vb)
            if not same_file:
                differ.append(f"step {step}: {name}")
    held = {t["step"]: t.get("step_held") for t in U.get("save_timings", []) if not t["full"]}
    good = not differ and compared > 0 and all((held.get(s) or 0) > 0 for s in (4, 6))
    return Row(label, "overlapped async saves == synchronous (steps 4, 6), step held", good,
               f"{compared} files compared, {len(differ)} differ{': ' if differ else ''}"
               f"{'; '.join(differ[:4])}; optimizer step held for the late copy (s): "
               + ", ".join(f"{s}: {h:.2f}" if h is not None else f"{s}: -"
                           for s, h in sorted(held.items())),
               time.monotonic() - t0, {"differ": differ, "step_held": held})


# -- 3: Lightning DeepSpeedStrategy ---------------------------------------------------------

def lightning_check(root: Path, budget: Budget) -> list[Row]:
    label = "lightning"
    work = root / label
    work.mkdir(parents=True)
    rows: list[Row] = []
    t0 = time.monotonic()
    spec = RunSpec(name="L", device="cuda", stage=3, dtype="bf16", steps=6, save_every=0,
                   extra={"lightning": True, "save_at": [3, 6], "root": str(work)})
    job, res = train_job(spec, work)
    if not run_jobs([job], budget):
        rows.append(Row(label, "DeepSpeedStrategy(stage=3) trains, saves at 3 and 6", False,
                        job_error(job).splitlines()[0], time.monotonic() - t0,
                        {"error": job_error(job)}))
        return rows
    L = json.loads(res.read_text())
    a, b = work / "save3", work / "save6"
    layout = {p.name: {"latest": (p / "latest").read_text().strip() if (p / "latest").exists()
                       else None,
                       "files": sorted(str(f.relative_to(p)) for f in p.rglob("*") if f.is_file())}
              for p in (a, b)}
    good = (len(L["saves"]) == 2 and all(v["latest"] == "checkpoint" for v in layout.values())
            and finite([s["loss"] for s in L["steps"]]) and L["zero_stage"] == 3)
    rows.append(Row(label, "DeepSpeedStrategy(stage=3) trains, saves at 3 and 6", good,
                    f"lightning {L['lightning']}, {len(L['steps'])} steps, saves "
                    f"{mb(dir_bytes(a))} + {mb(dir_bytes(b))}; layout: saveN/latest="
                    f"'{layout['save3']['latest']}', saveN/checkpoint/*.pt (a DeepSpeed save dir "
                    f"with tag 'checkpoint')", time.monotonic() - t0,
                    {"L": L, "layout": layout}))

    # merge by parity: even layers + auxiliary from step 6, odd layers from step 3
    t0 = time.monotonic()
    merged, recipe = work / "merged", work / "parity.yml"
    recipe.write_text(f"# gpu_check: Lightning saves merged by parity\nsources:\n"
                      f"  new: {b}\n  old: {a}\nlayers:\n  even: new\n  odd: old\n"
                      f"embed: new\nnorm: new\nlm_head: new\nbase: new\nadam_step: newest\n"
                      f"output: {merged}\n")
    job = cli_job("merge", [str(recipe), "--no-progress"], work, "cuda")
    try:
        if not run_jobs([job], budget):
            raise CheckError(job_error(job))
        info = inspect(merged, work, "cuda", budget)
    except CheckError as e:
        rows.append(Row(label, "mpitailor merge (parity recipe) + inspect", False,
                        str(e).splitlines()[0], time.monotonic() - t0, {"error": str(e)}))
        return rows
    origin = {key: row.get("from_step") for key, row in info["layers"].items()}
    want = {key: (3 if key.startswith("layers.") and int(key.split(".")[1]) % 2 else 6)
            for key in origin}
    good = info["kind"] == "composite" and origin == want
    rows.append(Row(label, "mpitailor merge (parity recipe) + inspect", good,
                    f"{info['kind']}, tag {info['tag']}, layers from steps "
                    f"{sorted({v for v in origin.values() if v is not None})} as the "
                    f"recipe says: {origin == want}; {mb(dir_bytes(merged))} in "
                    f"{job.seconds:.1f}s", time.monotonic() - t0,
                    {"origin": origin, "tag": info["tag"], "merge_seconds": job.seconds}))

    # export --format fp32 of the merge vs zero_to_fp32 of the sources
    t0 = time.monotonic()
    exported = work / "merged-fp32"
    job = cli_job("export", ["export", str(merged), "-o", str(exported), "--format", "fp32",
                             "--no-progress"], work, "cuda")
    if not run_jobs([job], budget):
        rows.append(Row(label, "export --format fp32 == zero_to_fp32 of each layer's source",
                        False, job_error(job).splitlines()[0], time.monotonic() - t0,
                        {"error": job_error(job)}))
    else:
        cmp = compare_export(exported, a, b)
        rows.append(Row(label, "export --format fp32 == zero_to_fp32 of each layer's source",
                        cmp["ok"], f"{cmp['tensors']} tensors, {cmp['equal']} equal to their "
                        f"source ({cmp['from_old']} from step 3, {cmp['from_new']} from step 6), "
                        f"all finite {cmp['finite']}; {mb(dir_bytes(exported))} in "
                        f"{job.seconds:.1f}s", time.monotonic() - t0, cmp))

    # Lightning resumes from the merged checkpoint
    t0 = time.monotonic()
    spec = RunSpec(name="L-resume", device="cuda", stage=3, dtype="bf16", steps=9,
                   save_every=0, load_dir=str(merged),
                   extra={"lightning": True, "save_at": [], "root": str(work)})
    job, res = train_job(spec, work)
    if not run_jobs([job], budget):
        rows.append(Row(label, "trainer.fit(ckpt_path=merged) trains on", False,
                        job_error(job).splitlines()[0], time.monotonic() - t0,
                        {"error": job_error(job)}))
        return rows
    LR = json.loads(res.read_text())
    steps = [s["step"] for s in LR["steps"]]
    good = steps == [7, 8, 9] and finite([s["loss"] for s in LR["steps"]]) \
        and LR["global_step"] == 9
    rows.append(Row(label, "trainer.fit(ckpt_path=merged) trains on", good,
                    f"resumed at step {steps[0] - 1 if steps else '?'}, trained steps {steps}, "
                    "losses " + ", ".join(f"{s['loss']:.4f}" for s in LR["steps"]) + " (before the "
                    f"save of step 6: {L['steps'][-1]['loss']:.4f})", time.monotonic() - t0,
                    {"L_resume": LR}))
    return rows


def compare_export(exported: Path, old_dir: Path, new_dir: Path) -> dict:
    import re

    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    got = {}
    for f in sorted(exported.glob("*.safetensors")):
        got.update(load_file(str(f)))
    old = get_fp32_state_dict_from_zero_checkpoint(str(old_dir))
    new = get_fp32_state_dict_from_zero_checkpoint(str(new_dir))
    equal = from_old = from_new = 0
    bad = []
    for name, t in got.items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        src, which = (old, "old") if m and int(m.group(1)) % 2 else (new, "new")
        if name in src and t.dtype == torch.float32 and torch.equal(t, src[name].float()):
            equal += 1
            from_old += which == "old"
            from_new += which == "new"
        else:
            bad.append(name)
    # the two sources must differ where the merge takes the old one, or the test proves nothing
    odd_differs = any(not torch.equal(old[n], new[n]) for n in old
                      if re.match(r"model\.layers\.\d*[13579]\.", n))
    fin = all(bool(torch.isfinite(t).all()) for t in got.values())
    ok = bool(got) and not bad and fin and set(got) == set(new) and odd_differs
    return {"ok": ok, "tensors": len(got), "equal": equal, "from_old": from_old,
            "from_new": from_new, "finite": fin, "mismatched": bad[:20],
            "missing": sorted(set(new) - set(got))[:20], "sources_differ_in_odd": odd_differs,
            "files": sorted(f.name for f in exported.iterdir())}


# -- the whole check ----------------------------------------------------------------------

def versions(device: str) -> dict:
    import torch
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "host": platform.node()}
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        try:
            out["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                check=False, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out["driver"] = None
    for mod in ("deepspeed", "transformers", "lightning", "mpi4py", "mpitailor"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - a version table, not a check
            out[mod] = f"not importable ({type(e).__name__}: {e})"
    return out


def print_table(rows: list[Row]) -> None:
    w1 = max(len(r.check) for r in rows)
    w2 = max(len(r.what) for r in rows)
    print(f"{'check':<{w1}}  {'what':<{w2}}  {'':4}  {'s':>6}  numbers")
    for r in rows:
        print(f"{r.check:<{w1}}  {r.what:<{w2}}  {'PASS' if r.ok else 'FAIL'}  "
              f"{r.seconds:6.1f}  {r.numbers}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "bench/out/gpu_check.json"))
    ap.add_argument("--device", choices=["auto", "cpu"], default="auto",
                    help="cpu: checks 1 and 2 on the CPU with gloo, both bf16 (development)")
    ap.add_argument("--only", nargs="+", choices=["zero3-bf16", "zero2-fp16", "lightning"])
    ap.add_argument("--workdir", help="keep the runs' files here (default: a temporary dir, "
                                      "removed at the end)")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError as e:
        print(f"gpu-check: skipped: torch is not importable ({e}); nothing checked")
        return 0
    device = "cpu" if args.device == "cpu" else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print(f"gpu-check: skipped: no CUDA GPU here (torch {torch.__version__}: "
              f"torch.cuda.is_available() is False); nothing checked")
        return 0
    budget = Budget(TOTAL_BUDGET)
    t_all = time.monotonic()
    info = versions(device)
    print("gpu-check: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="gpu-check-"))
    root.mkdir(parents=True, exist_ok=True)
    checks = [("zero3-bf16", lambda: deepspeed_check("zero3-bf16", 3, "bf16", device, root,
                                                      budget)),
              ("zero2-fp16", lambda: deepspeed_check(
                  "zero2-fp16" if device == "cuda" else "zero2-bf16(cpu)", 2,
                  "fp16" if device == "cuda" else "bf16", device, root, budget)),
              ("lightning", lambda: lightning_check(root, budget))]
    rows: list[Row] = []
    for name, fn in checks:
        if args.only and name not in args.only:
            continue
        if name == "lightning" and device == "cpu":
            print("gpu-check: lightning: skipped on --device cpu (DeepSpeedStrategy needs CUDA)")
            continue
        t0 = time.monotonic()
        try:
            got = fn()
        except Exception as e:  # noqa: BLE001 - a check that broke is a FAIL row, not a crash
            import traceback
            got = [Row(name, "(the check itself)", False, f"{type(e).__name__}: {e}",
                       time.monotonic() - t0, {"traceback": traceback.format_exc()})]
        rows.extend(got)
        for r in got:
            print(f"gpu-check: {r.check}: {r.what}: {'PASS' if r.ok else 'FAIL'} "
                  f"({r.seconds:.1f}s) {r.numbers}", flush=True)
            if not r.ok and r.data.get("error"):
                print(str(r.data["error"])[-2500:], flush=True)
    total = time.monotonic() - t_all
    print()
    print_table(rows)
    ok = bool(rows) and all(r.ok for r in rows)
    print(f"\ngpu-check: {'PASS' if ok else 'FAIL'}: {sum(r.ok for r in rows)}/{len(rows)} "
          f"checks passed in {total:.0f}s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"ok": ok, "seconds": total, "device": device, "versions": info,
                     "command": "python -m bench.gpu_check " + " ".join(argv or sys.argv[1:]),
                     "rows": [{"check": r.check, "what": r.what, "ok": r.ok,
                               "numbers": r.numbers, "seconds": r.seconds, "data": r.data}
                              for r in rows]})
    print(f"gpu-check: JSON in {out}")
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
