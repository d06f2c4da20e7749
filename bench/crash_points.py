"""The crash-point study (issue 44, part 3): a job killed (SIGKILL) before every step of the
I/O seam in turn, and what it left judged; with --power-loss, the machine lost there too.

    python -m bench.crash_points [--jobs merge,export,recover,prune,save,save1,saveall,
        saveasync,savereplace] [--stride 1] [--strides JOB=STRIDE[+OFFSET],...]
        [--also rename,fsync-dir] [--power-loss | --modes kill,drop,torn]
        [--json bench/out/crash_points.json]

Every file creation, write, kernel copy, fsync, directory fsync, rename and removal of the
package goes through formats/io or calls failpoints.io_step beside it (publish/staging.py,
jobs/prune.py): a clean run with MPITAILOR_CRASH_LOG enumerates them; a run with
MPITAILOR_CRASH_AT=N is killed just before the N-th. After each kill:
- visible incomplete: the output's name exists but `verify` finds it not as recorded, or
  its bytes are not the clean run's (prune: the save dir no longer recovers to the clean
  recover's bytes);
- lost: the rerun of the same command (no kill) fails, or its output is not the clean run's
  bytes, or `verify` of it is not clean, or a staging dir or lock of the killed run is still
  there after it (the rerun reclaims what the killed run left). An output published whole
  before the kill (the last steps: the parent's fsync) is the job done: no rerun.
- save, save1, saveall, saveasync, savereplace: a layer-wise training run (2 ranks: a full
  save at step 2, partial saves at 4, 6, 8) with rank 0 (save), rank 1 (save1), every rank
  (saveall: MPITAILOR_CRASH_AT=N:all, each rank at its own N-th step) killed before the
  N-th step of its own saves' I/O; saveasync: the same with asynchronous partial saves (the
  writer thread's steps count); savereplace: resumed from the clean run's step 2 in a copy
  of its save dir, so that its partial saves publish over the old ones (staging._replace).
  Then `recover` of its save dir must give exactly what it gives for the clean run's saves
  up to one of them (its manifest aside; savereplace: or the replaced ones), verified
  clean: never a failure, never a mix.
Modes: "kill" (the process only); "drop" and "torn" (--power-loss): after the kill,
bench/power_loss.py rewrites the disk as a machine's crash there may leave it (unsynced
bytes dropped or torn, names not made durable by their dir's fsync undone; its doc says
what cannot be emulated). Then also lost: an output whose publication (the rename, then
its parent's fsync) was durable is not there, or a training run recovers to a save older
than the newest one made durable. Per job: {"points": N, "crashed": N,
"visible_incomplete": 0, "lost": 0, ...}. Prints a table; writes JSON.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))  # dev/ (the tiny trainer) is the repo's, not installed

import ckpt_fixtures  # noqa: E402 - tests/ is put on the path just above

from bench.power_loss import newest_save, power_loss  # noqa: E402
from mpitailor.publish.leftovers import SUFFIXES  # noqa: E402

PY = REPO / ".venv" / "bin" / "python"
KILLED = (-9, 137)


@dataclass
class Job:
    """A command to crash: argv (OUT: its output path; SAVES: a private copy of the save
    dir, made anew for every point of a job that changes it) and what it produces."""

    name: str
    argv: list[str]
    env: dict = field(default_factory=dict)
    changes_input: bool = False   # prune: judged by what the save dir recovers to
    saves: str = "w2_parity"      # the fixture {SAVES} copies


def jobs() -> dict[str, Job]:
    w2 = ckpt_fixtures.build("w2_fp32_one")
    parity = ckpt_fixtures.build("w2_parity")
    hf_parity = ckpt_fixtures.build("hf_w2_parity")  # an HF run: it has a config to export
    recipe = str(REPO / "recipes" / "parity.yml")
    return {
        "merge": Job("merge", [recipe, "--export", "hf", "--no-progress", "-q"],
                     {"NEW": str(w2 / "global_step10"), "OLD": str(w2 / "global_step5")}),
        "recover": Job("recover", ["recover", str(parity), "-o", "{OUT}", "--no-progress",
                                   "-q"]),
        "export": Job("export", ["export", str(hf_parity), "-o", "{OUT}", "--format", "hf",
                                 "--no-progress", "-q"]),
        "prune": Job("prune", ["prune", "{SAVES}", "--keep-last", "0"], changes_input=True),
        # DCP saves (DcpCheckpointer, Parity): the same prune through the DCP survey
        "prune-dcp": Job("prune-dcp", ["prune", "{SAVES}", "--keep-last", "0"],
                         changes_input=True, saves="dcp_w2_parity"),
    }


def run(argv: list[str], env: dict, crash_at: int | None = None, log: Path | None = None
        ) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(REPO), **env)
    full.pop("MPITAILOR_CRASH_AT", None)
    if crash_at is not None:
        full["MPITAILOR_CRASH_AT"] = str(crash_at)
    if log is not None:
        full["MPITAILOR_CRASH_LOG"] = str(log)
    return subprocess.run([str(PY), "-m", "mpitailor", *argv], env=full, capture_output=True,
                          text=True, timeout=300)


def sampled(what: list[str], stride: int, offset: int, also: tuple[str, ...]) -> list[int]:
    """The steps to kill at: every stride-th from offset, and every one of a kind in also
    (rename, fsync-dir: where a publication becomes durable, a sparse sample's must)."""
    return sorted(set(range(offset, len(what) + 1, stride)) |
                  {n for n, w in enumerate(what, 1) if w in also})


def steps_of(log: Path, rank: int) -> list[str]:
    """What each step of rank `rank` was, in order (its crash log's lines, io_done's aside)."""
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    return [f[2] for f in lines if f[0] == str(rank) and f[1] != "-"]


def digest(root: Path) -> str:
    """sha256 over every file under root (names and bytes), manifests' `created` blanked."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name in ("mpitailor_manifest.json", "mpitailor_partial.json"):
                data = re.sub(rb'"created": "[^"]*"', b'"created": ""', data)
            h.update(str(p.relative_to(root)).encode() + b"\0" + data)
    return h.hexdigest()


def leftovers(folder: Path) -> list[str]:
    """What a killed run may leave in folder: staging dirs, locks, dirs being removed
    (publish/leftovers.py's SUFFIXES); anywhere below it, a single file's temporary copy
    (staging.write_replacing)."""
    return sorted([p.name for p in folder.iterdir() if p.name.endswith(SUFFIXES)] +
                  [str(p.relative_to(folder)) for p in folder.rglob(".mpitailor-*.tmp")])


class Study:
    """One job's points, in a scratch dir: OUT at a fixed path (a manifest records it)."""

    def __init__(self, job: Job, work: Path, mode: str = "kill") -> None:
        self.job, self.work, self.mode = job, work, mode
        self.out, self.saves = work / "out" / "merged", work / "saves"
        self.env = {**job.env, "OUT": str(self.out)}

    def argv(self) -> list[str]:
        return [a.replace("{OUT}", str(self.out)).replace("{SAVES}", str(self.saves))
                for a in self.job.argv]

    def fresh(self) -> None:
        shutil.rmtree(self.work / "out", ignore_errors=True)
        (self.work / "out").mkdir(parents=True)
        if self.job.changes_input:
            shutil.rmtree(self.saves, ignore_errors=True)
            shutil.copytree(ckpt_fixtures.build(self.job.saves), self.saves, symlinks=True)

    def result(self) -> str | None:
        """The digest that judges a run: of its output, or (prune) of the checkpoint the
        save dir recovers to (its manifest aside: it names the saves taken, and a pruned
        save's tombstone stands in for it); None if that cannot be made."""
        if not self.job.changes_input:
            if not self.out.exists():
                return None
            return digest(self.out) if run(["verify", str(self.out)], {}).returncode == 0 \
                else "verify differs"
        check = self.work / "out" / "recovered"
        shutil.rmtree(check, ignore_errors=True)
        r = run(["recover", str(self.saves), "-o", str(check), "--no-progress", "-q"], {})
        if r.returncode != 0:
            return None
        (check / "mpitailor_manifest.json").unlink()
        got = digest(check)
        shutil.rmtree(check)
        return got

    def steps(self) -> tuple[int, str, list[str]]:
        """The clean run: (its step count, its result, what each step was)."""
        self.fresh()
        log = self.work / "steps.log"
        log.unlink(missing_ok=True)
        before = self.result() if self.job.changes_input else None
        r = run(self.argv(), self.env, log=log)
        if r.returncode != 0:
            raise SystemExit(f"{self.job.name}: the clean run failed: {r.stderr[-2000:]}")
        if self.job.changes_input and self.result() != before:
            raise SystemExit(f"{self.job.name}: the save dir recovers to other bytes after a "
                             f"clean run")
        return len(what := steps_of(log, 0)), self.result(), what

    def point(self, n: int, want: str) -> dict:
        """Kill before step n (and lose the machine: mode drop / torn); judge what is left,
        then the rerun."""
        self.fresh()
        log = self.work / "point.log"
        fresh_log(log)
        r = run(self.argv(), self.env, crash_at=n, log=log)
        got = {"step": n, "rc": r.returncode}
        if r.returncode not in KILLED:
            got["outcome"] = "no crash" if r.returncode == 0 else f"failed rc {r.returncode}"
            return got
        durable = False
        if self.mode != "kill":
            loss = power_loss(log, {0: n}, torn=self.mode == "torn")
            durable = str(self.out) in loss.pop("published")
            got.update(loss)
        if self.job.changes_input:
            seen = self.result()
            got["visible_incomplete"] = seen != want
        else:
            seen = self.result() if self.out.exists() else None
            got["visible_incomplete"] = seen is not None and seen != want
            if seen == want:  # published before the kill: done (a rerun refuses to overwrite)
                got["outcome"] = "published"
                got["lost"] = False
                return got
            if durable:  # its publication was made durable, yet it is not there
                got["lost"], got["why"] = True, f"published durably, then {seen}"
                return got
        again = run(self.argv(), self.env)
        left = leftovers(self.out.parent) + (leftovers(self.saves) if self.saves.exists()
                                             else [])
        seen = self.result() if again.returncode == 0 else None
        got["lost"] = again.returncode != 0 or seen != want or bool(left)
        if got["lost"]:
            got["why"] = f"rerun rc {again.returncode}; left {left}; " + again.stderr[-300:]
        return got


# -- a layer-wise training run killed while it saves --------------------------------------

SAVE_RUN = dict(world_size=2, grouping="per_layer", steps=8, save_at=(2, 4, 6, 8),
                policy={"name": "parity"})


@dataclass(frozen=True)
class TrainJob:
    """Which ranks die (a rank, or "all": each at its own N-th step) in which run: `resume`
    resumes from the clean run's full save at step 2 in a copy of its save dir, so that
    its partial saves at 4, 6 and 8 publish over the clean run's (staging.py's _replace)."""

    kill: int | str = 0
    asynchronous: bool = False
    resume: bool = False


TRAIN_JOBS = {"save": TrainJob(), "save1": TrainJob(1), "saveall": TrainJob("all"),
              "saveasync": TrainJob(asynchronous=True), "savereplace": TrainJob(resume=True)}


def train(save_dir: Path, env: dict, job: TrainJob = TrainJob(), base: Path | None = None
          ) -> bool:
    """The run (a full save at step 2, partial ones at 4, 6, 8; resumed: from base's step 2,
    into a copy of base); False if a rank died."""
    from dev.tinytrain import TrainSpec, launch
    from dev.tinytrain.launch import TrainFailed
    extra = {}
    if job.resume:
        shutil.rmtree(save_dir, ignore_errors=True)
        shutil.copytree(base, save_dir, symlinks=True)
        # other data from step 3 on: the saves it replaces differ from its own, so that a
        # mix of the two would show
        extra = dict(load_dir=str(save_dir), load_tag="global_step2", save_at=(4, 6, 8),
                     data_seed=1)
    try:
        launch(TrainSpec(save_dir=str(save_dir), **{**SAVE_RUN, **extra},
                         async_save=job.asynchronous, extra={"env": env}), timeout=600)
        return True
    except TrainFailed:
        return False


def recovered(save_dir: Path, out: Path) -> tuple[int, str | None]:
    """recover's exit code and the checkpoint it wrote (its manifest aside: it names the
    saves by path and id)."""
    shutil.rmtree(out, ignore_errors=True)
    r = run(["recover", str(save_dir), "-o", str(out), "--no-progress", "-q"], {})
    if r.returncode != 0:
        return r.returncode, None
    if run(["verify", str(out)], {}).returncode != 0:
        return 1, "verify differs"
    (out / "mpitailor_manifest.json").unlink()
    got = digest(out)
    shutil.rmtree(out)
    return 0, got


def clean_refs(clean: Path, out: Path) -> dict[str, str]:
    """digest -> the newest save it comes from, for the clean saves up to each one (the
    newest removed in turn)."""
    refs = {}
    tags = sorted((p for p in clean.glob("global_step*")), key=lambda p: int(p.name[11:]))
    for j in range(len(tags), 0, -1):
        rc, got = recovered(clean, out)
        if rc != 0 or got is None or got == "verify differs":
            raise SystemExit(f"save: recover of the clean saves up to {tags[j - 1].name} "
                             f"failed (rc {rc})")
        refs[got] = tags[j - 1].name
        shutil.rmtree(tags[j - 1])
    return refs


def save_study(work: Path, stride: int = 1, offset: int = 1, job: TrainJob = TrainJob(),
               mode: str = "kill", also: tuple[str, ...] = ()) -> dict:
    """Kill training rank `job.kill` (or every rank) before every stride-th step of the I/O
    seam of its saves (mode drop / torn: then lose the machine too, power_loss.py); then
    `recover` must give what it gives for the clean run's saves up to one of them (never a
    failure, never a mix of two), and (power loss) at least the newest save whose
    publication was made durable before the kill."""
    clean, out, log = work / "clean", work / "recovered", work / "steps.log"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    base = work / "base"
    if job.resume and not train(base, {}):
        raise SystemExit("savereplace: the run to resume from failed")
    if not train(clean, {"MPITAILOR_CRASH_LOG": str(log)}, job, base):
        raise SystemExit("save: the clean run failed")
    rank = 0 if job.kill == "all" else job.kill
    what = steps_of(log, rank)
    refs = clean_refs(clean, out)
    if job.resume:  # the saves it replaces are saves too, until replaced
        shutil.copytree(base, work / "before", symlinks=True)
        refs = {**{d: f"{t} (before)" for d, t in clean_refs(work / "before", out).items()},
                **refs}
    points = [train_point(work, n, job, mode, what, refs)
              for n in sampled(what, stride, offset, also)]
    crashed = [p for p in points if p["killed"]]
    who = "every rank" if job.kill == "all" else f"rank {job.kill}"
    label = f"save ({who} killed{', async' if job.asynchronous else ''}" \
            f"{', resumed: replaces' if job.resume else ''})"
    return {"job": label, "mode": mode, "steps": len(what), "points": len(points),
            "crashed": len(crashed), "visible_incomplete": 0,
            "lost": sum(p["lost"] for p in crashed),
            "kinds": sorted({p["what"] for p in crashed}),
            "recovered_to": {t: sum(p["recovered"] == t for p in crashed)
                             for t in sorted(set(refs.values()))},
            "nothing_to_recover": sum(p["recover_rc"] == 3 for p in crashed),
            **power_totals(crashed), "bad": [p for p in crashed if p["lost"]]}


def train_point(work: Path, n: int, job: TrainJob, mode: str, what: list[str],
                refs: dict[str, str]) -> dict:
    saves, out, log = work / "run", work / "recovered", work / "point.log"
    shutil.rmtree(saves, ignore_errors=True)
    fresh_log(log)
    died = not train(saves, {"MPITAILOR_CRASH_AT": f"{n}:{job.kill}",
                             "MPITAILOR_CRASH_LOG": str(log)}, job, work / "base")
    p = {"step": n, "what": what[n - 1], "killed": died}
    need = 0
    if died and mode != "kill":
        killed = {0: n, 1: n} if job.kill == "all" else {job.kill: n}
        loss = power_loss(log, killed, torn=mode == "torn")
        need = newest_save(loss.pop("published"))
        p.update(loss, durable=need)
    rc, got = recovered(saves, out)
    p.update(recover_rc=rc, recovered=refs.get(got))
    # every kill comes after DeepSpeed's first full save is complete (its files are not
    # the seam's): there is always something to recover
    p["lost"] = rc != 0 or got not in refs or int(re.search(r"\d+", refs[got])[0]) < need
    return p


def fresh_log(log: Path) -> None:
    log.unlink(missing_ok=True)
    shutil.rmtree(f"{log}.kept", ignore_errors=True)


def power_totals(crashed: list[dict]) -> dict:
    """What the power-loss emulation did over the points (absent for kills alone)."""
    keys = ("files_cut", "names_undone", "names_not_undone", "removals_kept")
    if not any(k in p for p in crashed for k in keys):
        return {}
    return {k: sum(p.get(k, 0) for p in crashed) for k in keys}


def study(name: str, work: Path, stride: int = 1, offset: int = 1, mode: str = "kill",
          also: tuple[str, ...] = ()) -> dict:
    """One job's points: every stride-th step from offset, and every step of a kind in
    `also`; mode: "kill" (the process), "drop" or "torn" (the machine too: power_loss.py)."""
    if name in TRAIN_JOBS:
        return save_study(work / name, stride, offset, TRAIN_JOBS[name], mode, also)
    s = Study(jobs()[name], work / name, mode)
    count, want, what = s.steps()
    points = [s.point(n, want) for n in sampled(what, stride, offset, also)]
    for p in points:
        p["what"] = what[p["step"] - 1] if p["step"] <= len(what) else "?"
    crashed = [p for p in points if p["rc"] in KILLED]
    return {"job": name, "mode": mode, "steps": count, "points": len(points),
            "crashed": len(crashed),
            "visible_incomplete": sum(p.get("visible_incomplete", False) for p in crashed),
            "lost": sum(p.get("lost", False) for p in crashed),
            "kinds": sorted({p["what"] for p in crashed}), **power_totals(crashed),
            "bad": [p for p in crashed if p.get("lost") or p.get("visible_incomplete")]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", default=",".join(["merge", "export", "recover", "prune",
                                                "prune-dcp", *TRAIN_JOBS]))
    ap.add_argument("--stride", type=int, default=1, help="every STRIDE-th step only")
    ap.add_argument("--strides", default="",
                    help="per job, JOB=STRIDE[+OFFSET],... (over --stride)")
    ap.add_argument("--also", default="", help="kinds of step always killed at, whatever "
                    "the stride: e.g. rename,fsync-dir")
    ap.add_argument("--modes", default="", help="kill, drop, torn (over --power-loss)")
    ap.add_argument("--power-loss", action="store_true",
                    help="lose the machine too: modes drop and torn (power_loss.py)")
    ap.add_argument("--json", default=str(REPO / "bench" / "out" / "crash_points.json"))
    a = ap.parse_args()
    modes = a.modes.split(",") if a.modes else ("drop", "torn") if a.power_loss else ("kill",)
    also = tuple(k for k in a.also.split(",") if k)
    strides = dict(kv.split("=") for kv in a.strides.split(",") if kv)
    rows, t0 = [], time.time()
    with tempfile.TemporaryDirectory(prefix="crash-points-") as tmp:
        for name in a.jobs.split(","):
            stride, _, offset = strides.get(name, str(a.stride)).partition("+")
            for mode in modes:
                t = time.time()
                rows.append({**study(name, Path(tmp), int(stride), int(offset or 1), mode,
                                     also), "stride": int(stride), "also": list(also),
                             "seconds": round(time.time() - t)})
                say(rows[-1])
                total = write(Path(a.json), rows, t0)  # after each job: a long run killed
                # keeps what it measured
    print(f"total: {total['points']} crash points, {total['visible_incomplete']} visible "
          f"incomplete, {total['lost']} lost; {a.json}")
    return 1 if total["lost"] or total["visible_incomplete"] else 0


def write(path: Path, rows: list[dict], t0: float) -> dict:
    total = {"points": sum(r["crashed"] for r in rows),
             "visible_incomplete": sum(r["visible_incomplete"] for r in rows),
             "lost": sum(r["lost"] for r in rows), "seconds": round(time.time() - t0),
             "date": time.strftime("%Y-%m-%d"), "jobs": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(total, indent=2))
    return total


def say(r: dict) -> None:
    print(f"{r['job']:<22} {r['mode']:<4} steps {r['steps']:>4}  crashed {r['crashed']:>4}  "
          f"visible incomplete {r['visible_incomplete']}  lost {r['lost']}  ({r['seconds']} s; "
          f"{', '.join(r['kinds'])})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
