"""The crash-point study (issue 44, part 3): a job killed (SIGKILL) before every step of the
I/O seam in turn, and what it left judged.

    python -m bench.crash_points [--jobs merge,export,recover,prune,save,save1]
        [--stride 1] [--json bench/out/crash_points.json]

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
- save / save1: a layer-wise training run (2 ranks: a full save at step 2, partial saves at
  4, 6, 8) with rank 0 / rank 1 killed before the N-th step of its own saves' I/O; then
  `recover` of its save dir must give exactly what it gives for the clean run's saves up to
  one of them (its manifest aside), verified clean: never a failure, never a mix.
Processes are killed, not machines: what an fsync has not yet made durable is not dropped
here (ALICE's torn and dropped writes are a step further; docs/durability.md says what the
fsyncs promise). Per job: {"points": N, "crashed": N, "visible_incomplete": 0, "lost": 0}.
Prints a table; writes JSON.
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

    def __init__(self, job: Job, work: Path) -> None:
        self.job, self.work = job, work
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
            shutil.copytree(ckpt_fixtures.build("w2_parity"), self.saves, symlinks=True)

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
        what = [line.split()[2] for line in log.read_text().splitlines()
                if line.split()[0] == "0"]
        return len(what), self.result(), what

    def point(self, n: int, want: str) -> dict:
        """Kill before step n; judge what is left, then the rerun."""
        self.fresh()
        r = run(self.argv(), self.env, crash_at=n)
        got = {"step": n, "rc": r.returncode}
        if r.returncode not in KILLED:
            got["outcome"] = "no crash" if r.returncode == 0 else f"failed rc {r.returncode}"
            return got
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


def train(save_dir: Path, env: dict) -> bool:
    """The run (a full save at step 2, partial ones at 4, 6, 8); False if a rank died."""
    from dev.tinytrain import TrainSpec, launch
    from dev.tinytrain.launch import TrainFailed
    try:
        launch(TrainSpec(save_dir=str(save_dir), **SAVE_RUN, extra={"env": env}), timeout=600)
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


def save_study(work: Path, stride: int = 1, offset: int = 1, rank: int = 0) -> dict:
    """Kill training rank `rank` before every stride-th step of the I/O seam of its saves;
    then `recover` must give what it gives for the clean run's saves up to one of them
    (never a failure, never a mix of two)."""
    clean, out = work / "clean", work / "recovered"
    log = work / "steps.log"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if not train(clean, {"MPITAILOR_CRASH_LOG": str(log)}):
        raise SystemExit("save: the clean run failed")
    what = [line.split()[2] for line in log.read_text().splitlines()
            if line.split()[0] == str(rank)]
    refs = {}  # digest -> the newest save it comes from
    tags = sorted((p for p in clean.glob("global_step*")), key=lambda p: int(p.name[11:]))
    for j in range(len(tags), 0, -1):
        rc, got = recovered(clean, out)
        if rc != 0 or got is None or got == "verify differs":
            raise SystemExit(f"save: recover of the clean saves up to {tags[j - 1].name} "
                             f"failed (rc {rc})")
        refs[got] = tags[j - 1].name
        shutil.rmtree(tags[j - 1])
    points = []
    for n in range(offset, len(what) + 1, stride):
        saves = work / "run"
        shutil.rmtree(saves, ignore_errors=True)
        died = not train(saves, {"MPITAILOR_CRASH_AT": f"{n}:{rank}"})
        rc, got = recovered(saves, out)
        p = {"step": n, "what": what[n - 1], "killed": died, "recover_rc": rc,
             "recovered": refs.get(got)}
        # every kill comes after DeepSpeed's first full save is complete (its files are not
        # the seam's): there is always something to recover
        p["lost"] = rc != 0 or got not in refs
        points.append(p)
    crashed = [p for p in points if p["killed"]]
    return {"job": f"save (rank {rank} killed)", "steps": len(what), "points": len(points), "crashed": len(crashed),
            "visible_incomplete": 0, "lost": sum(p["lost"] for p in crashed),
            "kinds": sorted({p["what"] for p in crashed}),
            "recovered_to": {t: sum(p["recovered"] == t for p in crashed)
                             for t in sorted(set(refs.values()))},
            "nothing_to_recover": sum(p["recover_rc"] == 3 for p in crashed),
            "bad": [p for p in crashed if p["lost"]]}


def study(name: str, work: Path, stride: int = 1, offset: int = 1) -> dict:
    if name.startswith("save"):  # save: rank 0 killed; save1: rank 1
        return save_study(work / name, stride, offset, int(name[4:] or 0))
    s = Study(jobs()[name], work / name)
    count, want, what = s.steps()
    points = [s.point(n, want) for n in range(offset, count + 1, stride)]
    for p in points:
        p["what"] = what[p["step"] - 1] if p["step"] <= len(what) else "?"
    crashed = [p for p in points if p["rc"] in KILLED]
    return {"job": name, "steps": count, "points": len(points), "crashed": len(crashed),
            "visible_incomplete": sum(p.get("visible_incomplete", False) for p in crashed),
            "lost": sum(p.get("lost", False) for p in crashed),
            "kinds": sorted({p["what"] for p in crashed}),
            "bad": [p for p in crashed if p.get("lost") or p.get("visible_incomplete")]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", default="merge,export,recover,prune,save,save1")
    ap.add_argument("--stride", type=int, default=1, help="every STRIDE-th step only")
    ap.add_argument("--json", default=str(REPO / "bench" / "out" / "crash_points.json"))
    a = ap.parse_args()
    rows, t0 = [], time.time()
    with tempfile.TemporaryDirectory(prefix="crash-points-") as tmp:
        for name in a.jobs.split(","):
            t = time.time()
            rows.append({**study(name, Path(tmp), a.stride), "seconds": round(time.time() - t)})
            r = rows[-1]
            print(f"{r['job']:<22} steps {r['steps']:>4}  crashed {r['crashed']:>4}  visible "
                  f"incomplete {r['visible_incomplete']}  lost {r['lost']}  "
                  f"({r['seconds']} s; {', '.join(r['kinds'])})", flush=True)
    total = {"points": sum(r["crashed"] for r in rows),
             "visible_incomplete": sum(r["visible_incomplete"] for r in rows),
             "lost": sum(r["lost"] for r in rows), "seconds": round(time.time() - t0),
             "date": time.strftime("%Y-%m-%d"), "jobs": rows}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(total, indent=2))
    print(f"total: {total['points']} crash points, {total['visible_incomplete']} visible "
          f"incomplete, {total['lost']} lost; {a.json}")
    return 1 if total["lost"] or total["visible_incomplete"] else 0


if __name__ == "__main__":
    sys.exit(main())
