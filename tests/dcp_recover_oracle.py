"""The DCP recovery fuzzer's oracle and loop (tests/dcp_recover_fuzzing.py damages the
inputs): what each recovered composite must hold, by torch's own DCP reader, and the run of
many seeded inputs with every outcome sorted."""
from __future__ import annotations

import random
import shutil
import traceback
from pathlib import Path

import dcp_recover_fuzzing as fz
from dcp_oracle import layer_of, torch_state


class Oracle:
    """The composite a recovery must write, given the saves it says it skipped: each entry
    from the newest used save that holds its layer (the clean saves' records say which),
    entries outside the layers from the newest used save. Verified outputs are remembered
    by their bytes (the same inputs give the same bytes), so most inputs cost no torch."""

    def __init__(self, base: Path, tmp: Path) -> None:
        from mpitailor.formats.dcp import read_dcp_save_record
        self.base, self.tmp = base, tmp
        self.names = fz.saves_of(base)
        self.layers = {n: read_dcp_save_record(base / n).layers for n in self.names}
        self.clean = {n: torch_state(base / n, tmp) for n in self.names}
        self.known: dict[bytes, frozenset] = {}  # verified output -> the saves skipped

    def wrong(self, run: Path, out: Path, skipped: set[str], damaged: str) -> str | None:
        """Why the output at out is not the composite (None: it is)."""
        got_bytes = fz.output_bytes(out)
        if self.known.get(got_bytes) == frozenset(skipped):
            return None
        used = [n for n in self.names if n not in skipped]
        try:
            saves = {n: (torch_state(run / n, self.tmp) if n == damaged else self.clean[n])
                     for n in used}
        except BaseException as e:  # noqa: BLE001 - torch cannot read a save used (its
            # CheckpointException is a BaseException)
            return f"used {damaged}, which torch's reader cannot read ({type(e).__name__})"
        got = torch_state(out, self.tmp)
        want = {}
        for key in self.clean[self.names[0]]:
            layer = layer_of(key)
            holders = [n for n in used if layer is None or self.layers[n] is None
                       or layer in self.layers[n]]
            want[key] = saves[holders[-1]].get(key)
        if set(got) != set(want):
            return f"entries differ: {sorted(set(got) ^ set(want))[:3]}"
        import torch
        for k, v in want.items():
            same = torch.equal(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k]
            if not same:
                return f"entry {k} is not from the save its layer's newest copy is in"
        self.known[got_bytes] = frozenset(skipped)
        return None


def one(oracle: Oracle, work: Path, rng: random.Random, kind: str, stats: fz.Stats,
        seed: int) -> None:
    """One damaged input, recovered and judged (a violation goes into stats)."""
    if work.exists():
        shutil.rmtree(work)
    run, out = work / "run", work / "out"
    shutil.copytree(oracle.base, run)
    damaged, detail = fz.mutate(run, rng, kind)
    before = fz.tree_hash(work)

    def bad(why: str) -> None:
        stats.violations.append((seed, kind, detail, why))
        stats.add(kind, "VIOLATION")
    try:
        outcome, line = fz.recover(run, out)
    except Exception as e:  # noqa: BLE001 - a traceback or a hang is the finding
        return bad(f"{type(e).__name__}: {e} {traceback.format_exc(limit=-2)[-400:]}")
    if out.exists() and outcome == "error":
        return bad(f"an error, yet {out} exists: {line}")
    if outcome == "ok":
        shutil.move(out, work / "done")
    if fz.tree_hash(work) != before:
        return bad("an input was modified")
    if outcome == "error":
        if "\n" in line.strip() or not line.strip():
            return bad(f"not one line: {line!r:.300}")
        return stats.add(kind, "error")
    skipped = fz.skipped_names(line)
    if kind in fz.UNREADABLE and damaged in skipped:
        return bad(f"a save that cannot be read now was skipped: {line}")
    why = oracle.wrong(run, work / "done", skipped, damaged)
    if why is not None:
        return bad(f"{why}; {line}")
    stats.add(kind, "skipped" if damaged in skipped else "composite")


def run_many(base: Path, tmp: Path, count: int, seed: int, kinds=fz.KINDS) -> fz.Stats:
    """count inputs, input i damaged by kind kinds[i % len] with random.Random(seed + i)."""
    oracle, stats = Oracle(base, tmp), fz.Stats()
    for i in range(count):
        kind = kinds[i % len(kinds)]
        one(oracle, tmp / "work", random.Random(seed + i), kind, stats, seed + i)
    return stats
