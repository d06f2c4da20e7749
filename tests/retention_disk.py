"""Retention's property on disk: real saves (the `w2_parity` fixture: full save 2; partial
saves 4: odd layers, 6: even layers, 8: odd layers; or `w2_parity_twin_full`: full saves
2, 4, 6, 8 with `latest` naming any of them, a rollback chosen by hand), damaged at random
as both reviews did, through the real survey, planner and deletion. What cannot be read
at prune time (a FIFO in place of a file, of `latest`) is swapped in for the prune only
(`Swap`): recovery before and after is of the save dir as it reads again.

And the helpers the regression tests share: the recipe recovery makes, save ids, forged
tombstones, the CLI as a user the kernel checks permissions for.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mpitailor.cluster.comm import Comm
from mpitailor.errors import MpitailorError
from mpitailor.jobs.readlocks import release
from mpitailor.jobs.recovery import recover_chain

PRUNED = ".mpitailor-pruned"
STRAY = ("file", "dir", "fifo")       # a merge manifest's name inside a save, as
LATEST_NOW = ("fifo", "dir", "empty", "symlink")  # `latest` while it cannot be read


def recipe_body(run: Path) -> str | None:
    """What `recover` takes from where (the recipe less its comment lines); None: it
    refuses."""
    try:
        text = recover_chain(Comm(), run, None)[0].text
    except MpitailorError:
        return None
    finally:
        release()
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def sid_of(run: Path, name: str) -> str:
    tag = run / name
    record = tag / "mpitailor_partial.json"
    if record.exists():
        return json.loads(record.read_text())["lineage"]["save_id"]
    return json.loads((tag / "mpitailor_save.json").read_text())["save_id"]


def tombstone(run: Path, sid: str, step: int, chain: str, parent: str | None) -> None:
    (run / PRUNED).mkdir(exist_ok=True)
    (run / PRUNED / sid).write_text(json.dumps({
        "format": "mpitailor-pruned", "name": f"global_step{step}", "step": step,
        "save_id": sid, "chain": chain, "parent": parent}))


def plant(path: Path, kind: str, aside: Path | None = None) -> None:
    """What cannot be read (or be told) now, where a file is: `kind` of STRAY or
    LATEST_NOW; a symlink points to aside (the real file, moved out of the save dir)."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "symlink":
        path.symlink_to(aside)
    else:
        path.write_text("{}" if kind == "file" else "")


def unplant(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    else:
        path.unlink()


@dataclass
class Swap:
    """A file of the save dir with something unreadable in its place for the prune."""

    path: Path
    aside: Path
    kind: str

    def swap_in(self) -> None:
        self.path.rename(self.aside)
        plant(self.path, self.kind, self.aside)

    def put_back(self) -> None:
        unplant(self.path)
        self.aside.rename(self.path)


def prune_keeps_what_recovery_takes(run: Path, swaps: list[Swap], recipe_body, prune_it,
                                    tree_digest) -> str:
    """The property, on a save dir damaged with `swaps` swapped in: recovery as it is once
    everything reads again is taken; then prune_it() runs with the swaps in place; after it,
    recovery is what it was, or prune refused and nothing changed. What happened:
    "pruned" or "refused"."""
    for swap in swaps:  # recovery as it is once everything reads again
        swap.put_back()
    before = recipe_body(run)
    digest, names = tree_digest(run), listing(run)
    for swap in swaps:
        swap.swap_in()
    try:
        prune_it()
        refused = False
    except MpitailorError:
        refused = True
    for swap in reversed(swaps):
        swap.put_back()
    if refused:
        assert listing(run) == names and tree_digest(run) == digest
    else:
        assert recipe_body(run) == before
    return "refused" if refused else "pruned"


def listing(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*"))


def saves_of(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name.startswith("global_step"))


def damage_on_disk(run: Path, rng: random.Random) -> list[Swap]:
    """Damage run at random; returns the swaps (swapped in, last: what reads the save dir
    here must not open a FIFO)."""
    names, swaps = saves_of(run), []
    if rng.random() < 0.2 and names:  # a save copied under another name, its id kept
        shutil.copytree(run / rng.choice(names), run / f"{rng.choice(names)}x")
    _tombstones(run, rng)
    if rng.random() < 0.2 and "global_step6" in names and \
            (run / "global_step6" / "mpitailor_partial.json").exists():
        (run / "global_step6" / "mpitailor_partial.json").unlink()  # killed mid-save
    if rng.random() < 0.5 and names:  # a layer file that cannot be read now
        tag = run / rng.choice(names)
        victim = rng.choice(sorted(p for p in tag.iterdir() if p.is_file()))
        swaps.append(Swap(victim, run.parent / "aside", "fifo"))  # outside the save dir
    if rng.random() < 0.4:  # `latest` mid-rewrite, or not a file
        swaps.append(Swap(run / "latest", run.parent / "latest.real",
                          rng.choice(LATEST_NOW)))
    if rng.random() < 0.2 and names:  # a merge manifest's name inside a save
        plant(run / rng.choice(names) / "mpitailor_manifest.json", rng.choice(STRAY))
    if rng.random() < 0.15:  # mpitailor's own dirs, links to another run's
        _link_away(run, rng.choice([PRUNED, ".mpitailor-resume"]))
    for swap in swaps:
        swap.swap_in()
    return swaps


def damage_dcp_on_disk(run: Path, rng: random.Random) -> list[Swap]:
    """damage_on_disk for a save dir of DCP saves (DcpCheckpointer's step-N/): a record
    lost or a `.metadata` garbled (incomplete), a data file cut short or one byte of it
    changed (fails its size, its CRC-32), a FIFO where a file should be (cannot be read
    now), a save copied under another name, tombstones, mpitailor's dirs linked away."""
    names = sorted((p.name for p in run.iterdir() if p.name.startswith("step-")),
                   key=lambda n: int(n[5:]))
    swaps = []
    if rng.random() < 0.15 and names:  # a save copied under another name, its id kept
        shutil.copytree(run / rng.choice(names), run / f"{rng.choice(names)}0")
    _tombstones(run, rng, "step-2")
    for name in names:
        save, roll = run / name, rng.random()
        data = sorted(save.glob("__*.distcp"))
        if roll < 0.05:
            (save / "mpitailor_save.json").unlink()
        elif roll < 0.10:
            (save / ".metadata").write_bytes(b"\x80\x04garbage")
        elif roll < 0.15:
            victim = rng.choice(data)
            os.truncate(victim, victim.stat().st_size // 2)
        elif roll < 0.20:
            victim = rng.choice(data)
            blob = bytearray(victim.read_bytes())
            blob[rng.randrange(len(blob))] ^= 0x40
            victim.write_bytes(bytes(blob))
    if rng.random() < 0.4 and names:  # a file that cannot be read now
        save = run / rng.choice(names)
        victim = rng.choice(sorted(p for p in save.iterdir() if p.is_file()))
        swaps.append(Swap(victim, run.parent / "aside", "fifo"))  # outside the save dir
    if rng.random() < 0.15:  # mpitailor's own dirs, links to another run's
        _link_away(run, rng.choice([PRUNED, ".mpitailor-resume"]))
    for swap in swaps:
        swap.swap_in()
    return swaps


def _tombstones(run: Path, rng: random.Random, full_save: str = "global_step2") -> None:
    """Forged, looping and garbage tombstones; the tombstone dir lost."""
    full = sid_of(run, full_save) if (run / full_save /
                                      "mpitailor_save.json").exists() else "e0" * 8
    if rng.random() < 0.3:  # forged: newer than anything, on the full save
        tombstone(run, "f0" * 8, 99, full, full)
    if rng.random() < 0.3:  # a loop nobody builds on
        tombstone(run, "c1" * 8, 98, "c1" * 8, "c2" * 8)
        tombstone(run, "c2" * 8, 97, "c2" * 8, "c1" * 8)
    if rng.random() < 0.3:  # garbage
        (run / PRUNED).mkdir(exist_ok=True)
        (run / PRUNED / ("b0" * 8)).write_bytes(b"\x00not json")
    if rng.random() < 0.2 and (run / PRUNED).is_dir():  # the tombstone dir lost
        shutil.rmtree(run / PRUNED)


def _link_away(run: Path, name: str) -> None:
    away = run.parent / f"elsewhere{name}"
    if (run / name).is_dir():
        (run / name).rename(away)
    else:
        away.mkdir()
    (run / name).symlink_to(away)


def as_user(args: list[str]) -> subprocess.CompletedProcess:
    """The CLI as a user the kernel checks permissions for: as root, under `setpriv` with
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped from its bounding set (skip where
    neither is possible)."""
    cmd = [sys.executable, "-m", "mpitailor", *args]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root, and no setpriv to drop CAP_DAC_OVERRIDE with")
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    if "setpriv:" in r.stderr:
        pytest.skip(f"setpriv cannot drop capabilities here: {r.stderr.strip()}")
    return r
