"""The text: the Python standard library's own sources, as bytes, split by file name.

Every `.py` file under the running interpreter's stdlib dir (site-packages and test dirs
left out), sorted by relative path; a file is held out when the first byte of the SHA-256
of its relative path is below HELD_OUT_BELOW (about 1 in 10), so training never sees a
held-out file. Files are joined with a NUL byte between them. The corpus is built once per
interpreter and cached under bench/out/; its SHA-256 is recorded with the results (another
Python version ships other sources, hence other numbers).

Batches are pure functions of (data seed, step): a resumed run sees exactly the batches the
uninterrupted run saw. Held-out batches are fixed windows, the same for every run and seed.
"""
from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

CACHE = Path(__file__).resolve().parents[1] / "out" / "quality-corpus"
HELD_OUT_BELOW = 26  # of 256: ~10% of files
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray      # uint8
    held_out: np.ndarray   # uint8
    info: dict             # files, bytes, sha256, python version, stdlib dir


def stdlib_files(root: Path) -> list[Path]:
    """Relative paths of the stdlib's .py files, sorted."""
    return sorted(p.relative_to(root) for p in root.rglob("*.py")
                  if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))


def is_held_out(rel: Path) -> bool:
    return hashlib.sha256(str(rel).encode()).digest()[0] < HELD_OUT_BELOW


def build(root: Path) -> Corpus:
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    counts = {False: 0, True: 0}
    for rel in stdlib_files(root):
        held = is_held_out(rel)
        parts[held].append((root / rel).read_bytes())
        counts[held] += 1
    train, held = (np.frombuffer(b"\0".join(parts[k]), dtype=np.uint8) for k in (False, True))
    digest = hashlib.sha256(train.tobytes() + b"\1" + held.tobytes()).hexdigest()
    info = {"stdlib": str(root), "train_files": counts[False], "held_out_files": counts[True],
            "train_bytes": int(train.size), "held_out_bytes": int(held.size),
            "sha256": digest}
    return Corpus(train, held, info)


def load() -> Corpus:
    """The corpus of this interpreter's stdlib, from the cache when it is there."""
    import sys
    root = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha256(f"{root}|{sys.version}|{HELD_OUT_BELOW}".encode()).hexdigest()[:12]
    d = CACHE / key
    if (d / "info.json").exists():
        info = json.loads((d / "info.json").read_text())
        return Corpus(np.fromfile(d / "train.bin", dtype=np.uint8),
                      np.fromfile(d / "held_out.bin", dtype=np.uint8), info)
    corpus = build(root)
    corpus.info["python"] = sys.version.split()[0]
    tmp = d.with_name(f".{key}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    corpus.train.tofile(tmp / "train.bin")
    corpus.held_out.tofile(tmp / "held_out.bin")
    (tmp / "info.json").write_text(json.dumps(corpus.info, indent=2))
    try:
        tmp.rename(d)
    except OSError:  # another process built it first: theirs is the same bytes
        pass
    return corpus


def windows(data: np.ndarray, starts: np.ndarray, length: int) -> torch.Tensor:
    idx = starts[:, None] + np.arange(length)[None, :]
    return torch.from_numpy(data[idx].astype(np.int64))


def train_batch(corpus: Corpus, data_seed: int, step: int, batch: int,
                seq_len: int) -> torch.Tensor:
    """Token ids (batch, seq_len) for training step `step`: a pure function of its inputs."""
    rng = np.random.default_rng([data_seed, step])
    starts = rng.integers(0, corpus.train.size - seq_len, size=batch)
    return windows(corpus.train, starts, seq_len)


def held_out_batches(corpus: Corpus, n_batches: int, batch: int,
                     seq_len: int) -> list[torch.Tensor]:
    """Fixed held-out windows, evenly spaced over the held-out text (seed-independent)."""
    n = n_batches * batch
    starts = np.linspace(0, corpus.held_out.size - seq_len - 1, n).astype(np.int64)
    return [windows(corpus.held_out, starts[i * batch:(i + 1) * batch], seq_len)
            for i in range(n_batches)]
