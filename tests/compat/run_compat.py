"""`make test-compat` (issue 26): mpitailor against older DeepSpeed releases, each in its own
venv (.compat/ds-<version>/, built by make_venv.sh), checked by check_version.py with that
version only. Prints a version x stage x check table, writes bench/results/compat.json, exits
1 if any check did not pass. Not part of `make test` (tens of minutes: about 25 real
DeepSpeed runs per version); run before each release.

    python tests/compat/run_compat.py [VERSION ...]     (default: VERSIONS)
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# The oldest release that works with torch 2.13 (pyproject's floor) and one in the middle;
# the main .venv's release (the Makefile's DS) is what `make test` checks. Older ones fail
# here for DeepSpeed's own reasons (docs/testing.md): 0.14.0 wants intel_extension_for_pytorch
# on CPU, 0.14.1-0.14.3 import a torch private removed in torch 2.4, 0.14.4-0.15.x cannot
# load their own checkpoints under torch >= 2.6 (torch.load without weights_only=False).
VERSIONS = ("0.16.0", "0.17.6")
RESULT = REPO / "bench" / "results" / "compat.json"


def run_version(version: str) -> dict:
    venv = REPO / ".compat" / f"ds-{version}"
    t = time.monotonic()
    built = subprocess.run(["bash", str(HERE / "make_venv.sh"), version], check=False)
    if built.returncode != 0:
        return {"deepspeed": version, "error": f"make_venv.sh {version} exited "
                                               f"{built.returncode}", "stages": {}}
    work = Path(tempfile.mkdtemp(prefix=f"mpitailor-compat-{version}-"))
    out = work / "report.json"
    try:
        r = subprocess.run([str(venv / "bin" / "python"), str(HERE / "check_version.py"),
                            version, str(out), str(work)],
                           check=False, cwd=REPO,
                           # dev/ (the tiny trainer) is the repo's, not installed
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        if r.returncode != 0 or not out.exists():
            return {"deepspeed": version, "error": f"check_version.py exited {r.returncode}",
                    "stages": {}}
        report = json.loads(out.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["total_seconds"] = round(time.monotonic() - t)
    return report


def table(reports: list[dict]) -> str:
    # the columns: the checks in the order check_version.py ran them
    checks = next((list(c) for rep in reports for c in rep["stages"].values()), [])
    rows = [["deepspeed", "stage", *checks]]
    for rep in reports:
        if rep.get("error"):
            rows.append([rep["deepspeed"], "-", rep["error"]])
        for stage, got in rep["stages"].items():
            rows.append([rep["deepspeed"], stage,
                         *(got.get(c, "-").split(":")[0] for c in checks)])
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def passed(rep: dict) -> bool:
    return not rep.get("error") and len(rep["stages"]) == 3 and all(
        v == "pass" for checks in rep["stages"].values() for v in checks.values())


def main(versions: list[str]) -> int:
    reports = [run_version(v) for v in versions]
    print(table(reports))
    for rep in reports:  # the reasons, which the table leaves out
        for stage, checks in rep["stages"].items():
            for check, verdict in checks.items():
                if verdict != "pass":
                    print(f"{rep['deepspeed']} stage {stage} {check}: {verdict}")
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({"date": time.strftime("%Y-%m-%d", time.gmtime()),
                                  "passed": all(map(passed, reports)),
                                  "versions": reports}, indent=1) + "\n")
    print(f"wrote {RESULT.relative_to(REPO)}")
    return 0 if all(map(passed, reports)) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(VERSIONS)))
