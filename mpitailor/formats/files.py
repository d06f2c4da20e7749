"""Find the rank files of a DeepSpeed ZeRO checkpoint on disk.

ZeRO-3 writes a model-states file per rank; stages 1 and 2 write one (`mp_rank_00_model_
states.pt`, the whole model) beside the per-rank optimizer files.

A checkpoint may be named by its tag dir (`save/global_step10`), by a save dir whose
`latest` file names the tag, or by an HF Trainer `checkpoint-N/` (a save dir with extras).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.fsview import LOCAL
from mpitailor.formats.manifest import PARTIAL_MANIFEST, read_manifest

MODEL_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt")
OPTIM_RE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
STAGE12_MODEL = "mp_rank_00_model_states.pt"
# Any model-parallel rank's files: only mp_rank_00 (no tensor/pipeline parallelism) is ours.
MP_RANK_RE = re.compile(r"(?:.*_)?mp_rank_(\d+)_.*\.pt")
# A partial checkpoint (mpitailor.training.save_layers): some layers' slices per rank, plus
# DeepSpeed's own model states and the optimizer's non-tensor state. The manifest is its
# commit marker, written last (formats/manifest.py: PARTIAL_MANIFEST).
# Written by mpitailor's checkpointer beside a full save's rank files: the save's place in a
# timeline. A partial checkpoint keeps the same record in its manifest, under "lineage".
SAVE_RECORD = "mpitailor_save.json"
MAX_TAG_BYTES = 255  # a `latest` file names one directory: no longer than a file name


@dataclass(frozen=True, slots=True)
class Lineage:
    """Where a save sits in a timeline: a full save starts a chain (chain == save_id); a
    partial save names its chain and the save it builds on (parent)."""

    save_id: str
    chain: str
    parent: str | None

    @classmethod
    def from_json(cls, raw) -> "Lineage | None":
        if not isinstance(raw, dict):
            return None
        parent = raw.get("parent")
        return cls(str(raw["save_id"]), str(raw["chain"]),
                   None if parent is None else str(parent))

    def to_json(self) -> dict:
        return {"save_id": self.save_id, "chain": self.chain, "parent": self.parent}


def model_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def optim_file(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def partial_files(rank: int) -> dict[str, str]:
    """File names of one rank's part of a partial checkpoint."""
    return {"model": f"rank_{rank}_model_states.pt", "optim": f"rank_{rank}_optim_meta.pt",
            "layers": f"rank_{rank}_layers.safetensors", "rng": f"rng_state_{rank}.pth"}


@dataclass(frozen=True, slots=True)
class CheckpointFiles:
    """The tag dir of one ZeRO-3 checkpoint and what its file names say."""

    tag_dir: Path
    world_size: int
    bf16_prefix: bool
    save_dir: Path | None  # the dir holding `latest` (and HF extras), if named that way
    partial: bool = False  # an mpitailor partial checkpoint rather than a DeepSpeed one
    flat: bool = False     # ZeRO stage 1/2: one model-states file for all ranks

    @property
    def tag(self) -> str:
        return self.tag_dir.name

    def model_path(self, rank: int) -> Path:
        if self.partial:
            return self.tag_dir / partial_files(rank)["model"]
        return self.tag_dir / (STAGE12_MODEL if self.flat else model_file(rank))

    def optim_path(self, rank: int) -> Path:
        """DeepSpeed's optim states; for a partial checkpoint, its non-tensor part."""
        return self.tag_dir / (partial_files(rank)["optim"] if self.partial
                               else optim_file(rank, self.bf16_prefix))

    def layers_path(self, rank: int) -> Path:
        return self.tag_dir / partial_files(rank)["layers"]


def resolve(path: Path | str, view=LOCAL) -> CheckpointFiles:
    """Recognise a tag dir, a save dir with `latest`, or an HF `checkpoint-N/`, as `view`
    (fsview.py: this process's file system, or the union of a job's nodes) shows them."""
    path = Path(path)
    if not view.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint; check the path")
    if not view.is_dir(path):
        raise CheckpointError(f"{path}: not a directory; name a DeepSpeed save dir or tag dir")
    if view.exists(path / PARTIAL_MANIFEST):
        return _partial(path, None, view)
    if is_tag_dir(path, view):
        return _scan_tag_dir(path, None, view)
    latest = path / "latest"
    if view.is_file(latest):
        tag = read_latest(latest, view)
        if not view.is_dir(path / tag):
            raise CheckpointError(f"{latest}: names tag {tag!r} but {path / tag} is missing")
        if view.exists(path / tag / PARTIAL_MANIFEST):
            return _partial(path / tag, path, view)
        return _scan_tag_dir(path / tag, path, view)
    raise CheckpointError(
        f"{path}: neither a DeepSpeed tag dir (zero_pp_rank_*_model_states.pt) nor a save dir "
        f"with a `latest` file; name the tag dir, e.g. {path}/global_stepN")


def read_latest(latest: Path, view=LOCAL) -> str:
    """The tag a `latest` file names; CheckpointError unless it is one plain dir name."""
    try:
        raw = view.read_bytes(latest, MAX_TAG_BYTES + 2)
        tag = raw.decode().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{latest}: unreadable ({e})") from None
    if len(raw) > MAX_TAG_BYTES + 1:
        raise CheckpointError(f"{latest}: longer than any tag name ({MAX_TAG_BYTES} bytes); "
                              f"it should hold one tag such as global_step10")
    if not tag or "/" in tag or "\0" in tag or tag in (".", ".."):
        raise CheckpointError(f"{latest}: does not name a tag dir (got {tag!r})")
    return tag


def read_save_record(tag_dir: Path, partial: bool,
                     view=LOCAL) -> tuple[Lineage | None, dict[str, str]]:
    """(lineage, layer patterns) that mpitailor recorded for a save; (None, {}) for plain
    DeepSpeed saves."""
    path = tag_dir / (PARTIAL_MANIFEST if partial else SAVE_RECORD)
    if not view.is_file(path):
        return None, {}
    try:
        raw = json.loads(view.read_bytes(path))
        lineage = Lineage.from_json(raw.get("lineage") if partial else raw)
        patterns = raw.get("layer_patterns") or {}
        if not isinstance(patterns, dict):
            raise TypeError("layer_patterns is not a mapping")
        return lineage, {str(k): str(v) for k, v in patterns.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: unreadable save record ({e})") from None


def _partial(tag_dir: Path, save_dir: Path | None, view=LOCAL) -> CheckpointFiles:
    try:
        manifest = read_manifest(tag_dir / PARTIAL_MANIFEST, view)
        world, dtype = int(manifest["world_size"]), manifest["dtype"]
        flat = int(manifest.get("zero_stage", 3)) in (1, 2)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; the partial save did not complete") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{tag_dir / PARTIAL_MANIFEST}: unreadable partial-checkpoint "
                              f"manifest ({e}); the partial save did not complete") from None
    missing = [n for r in range(world) for n in partial_files(r).values()
               if not view.exists(tag_dir / n)]
    if missing:
        raise CheckpointError(f"{tag_dir}: missing {missing[0]}; the partial checkpoint is "
                              f"incomplete")
    return CheckpointFiles(tag_dir=tag_dir, world_size=world, bf16_prefix=dtype == "bf16",
                           save_dir=save_dir, partial=True, flat=flat)


def is_tag_dir(path: Path, view=LOCAL) -> bool:
    """Does `path` hold a checkpoint's rank files itself (a tag dir, not a save dir)?"""
    return view.is_dir(path) and (any(MODEL_RE.fullmatch(n) for n in view.names(path))
                                  or view.exists(path / STAGE12_MODEL))


def _scan_tag_dir(tag_dir: Path, save_dir: Path | None, view=LOCAL) -> CheckpointFiles:
    names = view.names(tag_dir)
    model_parallel = sorted(n for n in names if (m := MP_RANK_RE.fullmatch(n))
                            and int(m.group(1)) != 0)
    if model_parallel:
        raise CheckpointError(
            f"{tag_dir}: {model_parallel[0]} is a tensor/pipeline-parallel rank's file; "
            f"mpitailor merges data-parallel ZeRO-3 checkpoints only (mp_world_size 1)")
    model_ranks = sorted(int(m.group(1)) for n in names if (m := MODEL_RE.fullmatch(n)))
    optim = [(bool(m.group(1)), int(m.group(2))) for n in names if (m := OPTIM_RE.fullmatch(n))]
    flat = not model_ranks and STAGE12_MODEL in names
    if flat and not optim:
        raise CheckpointError(
            f"{tag_dir}: {STAGE12_MODEL} without zero_pp_rank_*_optim_states.pt files: a "
            f"checkpoint saved without ZeRO; mpitailor merges ZeRO stage 1, 2 and 3 checkpoints")
    if flat:
        model_ranks = sorted(r for _, r in optim)
    if not model_ranks:
        raise CheckpointError(f"{tag_dir}: no zero_pp_rank_*_model_states.pt files")
    world = max(model_ranks) + 1
    missing = sorted(set(range(world)) - set(model_ranks))
    if missing and not flat:
        raise CheckpointError(f"{tag_dir}: missing {model_file(missing[0])} "
                              f"(have ranks {model_ranks}); the checkpoint is incomplete")
    prefixes = {bf16 for bf16, _ in optim}
    if len(prefixes) > 1:
        raise CheckpointError(f"{tag_dir}: both bf16_ and plain optim_states files; "
                              f"remove the stale ones")
    bf16 = prefixes.pop() if prefixes else False
    optim_ranks = sorted(r for _, r in optim)
    missing = sorted(set(range(world)) - set(optim_ranks))
    if missing:
        raise CheckpointError(f"{tag_dir}: missing {optim_file(missing[0], bf16)}; "
                              f"the checkpoint is incomplete")
    if optim_ranks != list(range(world)) and not flat:
        extra = [r for r in optim_ranks if r >= world]  # the last ranks' model states missing
        raise CheckpointError(f"{tag_dir}: missing {model_file(extra[0])} (optim states for "
                              f"ranks 0..{optim_ranks[-1]}, model states for 0..{world - 1}); "
                              f"the checkpoint is incomplete")
    return CheckpointFiles(tag_dir=tag_dir, world_size=world, bf16_prefix=bf16,
                           save_dir=save_dir, flat=flat)
