"""The training scripts of docs/training.md, run as written on CPU processes
(tests/test_deepspeed_loop.py, tests/test_readme.py, tests/test_accelerate.py)."""
from __future__ import annotations

import fcntl
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from dev.tinytrain.launch import free_port, worker_env

PAGE = Path(__file__).resolve().parents[1] / "docs" / "training.md"


def doc_script(marker: str) -> str:
    """The python block between `<!-- marker -->` and `<!-- /marker -->` in docs/training.md."""
    m = re.search(rf"<!-- {marker} -->\n```python\n(.*?)```\n<!-- /{marker} -->",
                  PAGE.read_text(), re.S)
    assert m, f"docs/training.md lost its {marker}"
    return m.group(1)


# The docs' scripts keep DeepSpeed's default buckets, as a user's would: 2.5 GB committed a
# rank (7.6 GB for a 3-rank HF Trainer job). Under strict overcommit (CI: a ~12 GB commit
# limit) two such jobs side by side fail to allocate, so one runs at a time on this machine.
ONE_AT_A_TIME = Path(tempfile.gettempdir()) / "mpitailor-tests-doc-scripts.lock"


def run_ranks(script: Path, cwd: Path, env: dict | None = None, ranks: int = 2) -> list[int]:
    """Run the script as `ranks` processes of one torch.distributed world (what torchrun
    would start); their exit codes. Logs in cwd/rank{r}.log."""
    with ONE_AT_A_TIME.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _run_ranks(script, cwd, env, ranks)


def _run_ranks(script: Path, cwd: Path, env: dict | None, ranks: int) -> list[int]:
    port = free_port()
    logs = [cwd / f"rank{r}.log" for r in range(ranks)]
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=cwd, stdout=log.open("w"),
                              stderr=subprocess.STDOUT,
                              env={**worker_env(r, ranks, port), **(env or {})})
             for r, log in enumerate(logs)]
    try:
        return [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def copy_run(killed: Path, dst: Path) -> Path:
    """A private copy of a killed run's working dir (script and saves): each resume of the
    same killed state starts from its own."""
    import shutil
    shutil.copytree(killed, dst, symlinks=True, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("rank*.log"))
    return dst


def assert_same_checkpoint(composite: Path, offline: Path) -> None:
    """The in-job composite is the offline `recover` of the same saves at the same world size:
    every file byte for byte (so the resumed model's weights and both Adam moments are the
    offline composite's), but the manifest, which names its own output."""
    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.is_file() and p.name != "mpitailor_manifest.json"}
    mine, theirs = files(composite), files(offline)
    assert sorted(mine) == sorted(theirs)
    assert [n for n in mine if mine[n] != theirs[n]] == []
