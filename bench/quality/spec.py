"""What one training process of the study does: plain records, JSON both ways."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

# The layer-wise policies compared (mpitailor.training.make_policy options). Save 0 of each
# is full (recovery needs one); after it, only the policy's layers (full_every=0).
POLICIES = {
    "parity": {"name": "parity"},
    "filter": {"name": "filter", "always": [0, -1], "every": 4},
    "adaptive": {"name": "adaptive", "top_fraction": 0.5, "max_staleness": 3},
}


@dataclass(frozen=True)
class Model:
    """A byte-level Llama and how it is trained and scored."""

    layers: int = 6
    hidden: int = 128
    intermediate: int = 344
    heads: int = 4
    seq_len: int = 128
    micro_batch: int = 8
    lr: float = 2e-3
    warmup: int = 100
    total_steps: int = 2000   # the cosine schedule's length (the uninterrupted run's)
    eval_every: int = 10
    eval_batches: int = 3
    eval_batch: int = 16


@dataclass(frozen=True)
class Saver:
    """One checkpointing policy of the uninterrupted run. `full`: engine.save_checkpoint
    every `every` steps. A layer-wise policy of POLICIES (LayerwiseCheckpointer) is paced by
    bytes instead: it saves at a step when what it has written, plus the expected size of
    its next save, stays within `bytes_per_step` times the step, where the expected size is
    the mean of its partial saves so far (before the first: `first_estimate`); its save 0 is
    full, `full_bytes`. All sizes are measured (du of each tag dir)."""

    name: str
    policy: str
    dir: str
    every: int = 0
    bytes_per_step: float = 0.0
    full_bytes: float = 0.0
    first_estimate: float = 0.0
    at: tuple[int, ...] = ()     # replay (blocked.py): save at exactly these steps instead
    asynchronous: bool = False   # layer-wise: LayerwiseCheckpointer(asynchronous=True)


@dataclass(frozen=True)
class Resume:
    """Load `load_dir/tag` (DeepSpeed's load_checkpoint), train to step `until`."""

    name: str
    load_dir: str
    tag: str
    until: int


@dataclass(frozen=True)
class Job:
    """mode "train": `steps` steps from scratch with every saver; "resume": each resume in
    turn, in this one process (the engine is reloaded for each)."""

    mode: str
    save_dir: str            # scratch dir of the job (tinytrain's launch makes it)
    model: Model
    seed: int
    steps: int = 0
    savers: tuple[Saver, ...] = ()
    resumes: tuple[Resume, ...] = ()
    extra_evals: tuple[int, ...] = ()   # steps scored besides every eval_every-th
    world_size: int = 1
    threads: int = 1

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def read(cls, path: Path) -> "Job":
        raw = json.loads(path.read_text())
        raw["model"] = Model(**raw["model"])
        raw["savers"] = tuple(Saver(**{**s, "at": tuple(s.get("at", ()))})
                              for s in raw["savers"])
        raw["resumes"] = tuple(Resume(**r) for r in raw["resumes"])
        raw["extra_evals"] = tuple(raw["extra_evals"])
        return cls(**raw)


@dataclass
class SaveLog:
    """What one saver did in the uninterrupted run (filled by the worker)."""

    steps: list[int] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    layers: list[list[str]] = field(default_factory=list)   # [] for a full save
    held: float = 0.0   # asynchronous: seconds optimizer steps waited for overlapped copies
