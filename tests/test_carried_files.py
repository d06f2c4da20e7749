"""Accelerate's files beside a save (`custom_checkpoint_0.pkl` holds whatever the loop
registered: it may be hundreds of MB) are copied into the output as files, a bounded chunk at
a time, by the rank that reads them: never read whole, never sent to every rank.

Checked under an address-space limit (RLIMIT_AS) a little above what a 2-rank recover of
the same save with a small file peaks at, measured first in the same test: a 300 MB file read
whole (and pickled to the other rank) does not fit in it; copied as a file, it does."""
from __future__ import annotations

import filecmp
import resource
import shutil
import subprocess
import sys
from pathlib import Path

from child_env import child_env
from merging import MPIEXEC, REPO

# Each rank runs mpitailor and, at its exit, writes its VmPeak (kB) to $PEAK_DIR/<rank>.
RANK = """import atexit, os, runpy, sys
def peak():
    kb = [l.split()[1] for l in open("/proc/self/status") if l.startswith("VmPeak:")][0]
    with open(os.path.join(os.environ["PEAK_DIR"], os.environ.get("PMI_RANK", "0")), "w") as f:
        f.write(kb)
atexit.register(peak)
sys.argv = ["mpitailor", *sys.argv[1:]]
runpy.run_module("mpitailor", run_name="__main__", alter_sys=True)
"""
BIG = 300 << 20
HEADROOM = 150 << 20  # above the measured peak: a chunked copy fits, a whole read does not


def accelerate_save(root: Path, custom: int) -> Path:
    """An `accelerator.save_state` dir: DeepSpeed tag `pytorch_model`, Accelerate's files
    beside it; custom_checkpoint_0.pkl a sparse file of `custom` bytes."""
    from ckpt_fixtures import build

    save = root / "run" / "checkpoint-10"
    shutil.copytree(build("w2_fp32_one") / "global_step10", save / "pytorch_model")
    (save / "latest").write_text("pytorch_model")
    for r in (0, 1):
        (save / f"random_states_{r}.pkl").write_bytes(f"rng {r}".encode())
    with open(save / "custom_checkpoint_0.pkl", "wb") as f:
        f.write(b"\x80\x04custom head")
        f.seek(custom - 4)
        f.write(b"tail")
    return save


def recover_2_ranks(save: Path, out: Path, peaks: Path, limit: int | None = None):
    env = child_env()
    env["PEAK_DIR"] = str(peaks)
    peaks.mkdir()

    def cap() -> None:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-c", RANK, "recover",
                           str(save.parent), "-o", str(out), "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
                          preexec_fn=cap)


def test_a_large_accelerate_file_is_copied_in_chunks_under_an_address_space_limit(tmp_path):
    small = accelerate_save(tmp_path / "small", 1 << 20)
    r = recover_2_ranks(small, tmp_path / "small-out", tmp_path / "peaks-small")
    assert r.returncode == 0, r.stderr[-3000:]
    peak = max(int(p.read_text()) * 1024 for p in (tmp_path / "peaks-small").iterdir())
    big = accelerate_save(tmp_path / "big", BIG)
    out = tmp_path / "big-out"
    r = recover_2_ranks(big, out, tmp_path / "peaks-big", limit=peak + HEADROOM)
    peaks = [int(p.read_text()) * 1024 for p in (tmp_path / "peaks-big").iterdir()]
    print(f"VmPeak per rank: small file {peak / 2**20:.0f} MiB; 300 MB file under "
          f"RLIMIT_AS {(peak + HEADROOM) / 2**20:.0f} MiB: {[p >> 20 for p in peaks]} MiB")
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl"):
        assert filecmp.cmp(big / name, out / name, shallow=False), name
    assert (out / "latest").read_text() == "pytorch_model"
