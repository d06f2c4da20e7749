"""Find the rank files of a DeepSpeed ZeRO checkpoint on disk.

ZeRO-3 writes a model-states file per rank; stages 1 and 2 write one (`mp_rank_00_model_
states.pt`, the whole model) beside the per-rank optimizer files.

A checkpoint may be named by its tag dir (`save/global_step10`), by a save dir whose
`latest` file names the tag, or by an HF Trainer `checkpoint-N/` (a save dir with extras).
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.dcp import METADATA as DCP_METADATA
from mpitailor.formats.io import (
    LOCAL,
    MAX_MANIFEST_BYTES,
    TooLarge,
    loads,
    shown,
)
from mpitailor.formats.manifest import (
    MANIFEST,
    MAX_ID_BYTES,
    PARTIAL_FORMAT,
    PARTIAL_MANIFEST,
    SAVE_RECORD,
    Lineage,
    Manifest,
    PartialFields,
    brief,
    is_file_name,
    is_file_record,
    is_id,
    read_manifest,
)

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
SAVE_FORMAT = "mpitailor-save"  # the save record's `format` key
# In a save dir: the file that names its tag dir to resume from (DeepSpeed's `latest`), and
# the one that names a Universal checkpoint's tag (ds_to_universal's, and `--export universal`).
LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
MAX_TAG_BYTES = MAX_ID_BYTES  # a `latest` file names one directory: no longer than a file name


@dataclass(frozen=True, slots=True)
class SaveRecord:
    """What SAVE_RECORD holds, in the order written: the lineage's keys sit at the top level
    of the file, between `format` and `global_steps`. Not a Manifest (no head), but it
    records the save's files as a manifest does: `files`, each DeepSpeed
    file of the tag dir -> {"bytes": n, "crc32": c}, taken once DeepSpeed had written it and
    fsynced (training/recorded_save.py). A record without `files` was written before they
    were recorded."""

    format: str = field(default=SAVE_FORMAT, kw_only=True)
    lineage: Lineage
    global_steps: int
    layer_patterns: Mapping[str, str]  # the patterns the run saves with
    files: Mapping[str, Mapping] | None = None  # None: not recorded (an older save)

    def to_json(self) -> bytes:
        doc = {"format": self.format, **self.lineage.to_json(),
               "global_steps": self.global_steps, "layer_patterns": self.layer_patterns}
        if self.files is not None:
            doc["files"] = dict(sorted(self.files.items()))
        return json.dumps(doc, indent=2).encode()

    @classmethod
    def from_doc(cls, raw) -> SaveRecord:
        """The record of a parsed SAVE_RECORD; TypeError or AttributeError if it is not one.
        Only what readers use is checked (the lineage, the patterns and files mappings; each
        file's record is checked where it is used)."""
        lineage = Lineage.from_json(raw)
        files = raw.get("files")
        if files is not None and not isinstance(files, dict):
            raise TypeError("files is not a mapping")
        return cls(lineage, raw.get("global_steps"), _patterns_of(raw), files,
                   format=raw.get("format", SAVE_FORMAT))


def _patterns_of(doc) -> dict:
    """A save record's or partial manifest's layer patterns, unchecked but for being a
    mapping (TypeError if not)."""
    patterns = doc.get("layer_patterns") or {}
    if not isinstance(patterns, dict):
        raise TypeError("layer_patterns is not a mapping")
    return patterns


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
    (fsview.py: this process's file system, or the union of a job's nodes) shows them.
    A checkpoint mpitailor assembled has its merge's manifest beside it: one of a major
    version this mpitailor does not read is refused (its files may be laid out otherwise)."""
    files = _find(Path(path), view)
    for folder in dict.fromkeys((files.save_dir, files.tag_dir.parent)):
        if folder is not None and view.exists(folder / MANIFEST):
            read_manifest(folder / MANIFEST, view)
    return files


def _find(path: Path, view) -> CheckpointFiles:
    if not view.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint; check the path")
    if not view.is_dir(path):
        raise CheckpointError(f"{path}: not a directory; name a DeepSpeed save dir or tag dir")
    if view.exists(path / PARTIAL_MANIFEST):
        return _partial(path, None, view)
    if is_tag_dir(path, view):
        return _scan_tag_dir(path, None, view)
    latest = path / LATEST
    if view.exists(latest):  # a FIFO or device there is refused by name, never opened
        tag = read_latest(latest, view)
        if not view.is_dir(path / tag):
            raise CheckpointError(f"{latest}: names tag {tag!r} but {path / tag} is missing")
        if view.exists(path / tag / PARTIAL_MANIFEST):
            return _partial(path / tag, path, view)
        return _scan_tag_dir(path / tag, path, view)
    if _HF_CHECKPOINT.fullmatch(path.name):
        raise CheckpointError(
            f"{path}: an incomplete save (no `latest` file: killed while it was saved, or still "
            f"being written); `mpitailor recover {path.parent}` assembles the run's newest "
            f"complete state, or name an earlier checkpoint-N")
    if view.exists(path / DCP_METADATA):
        raise CheckpointError(
            f"{path}: a PyTorch Distributed Checkpoint (DCP: FSDP2, torchtitan), read where a "
            f"DeepSpeed checkpoint is expected: a recipe's sources must all be DCP "
            f"checkpoints or all DeepSpeed ones (the first decides); `mpitailor recover` "
            f"takes a save dir of DCP saves, `export` a DCP checkpoint")
    raise CheckpointError(
        f"{path}: neither a DeepSpeed tag dir (zero_pp_rank_*_model_states.pt) nor a save dir "
        f"with a `latest` file; name the tag dir, e.g. {path}/global_stepN")


def read_latest(latest: Path, view=LOCAL) -> str:
    """The tag a `latest` file names; CheckpointError unless it is one plain dir name."""
    try:
        tag = view.read_bytes(latest, MAX_TAG_BYTES + 1, "a `latest` file").decode().strip()
    except TooLarge:
        raise CheckpointError(f"{shown(latest)}: longer than any tag name ({MAX_TAG_BYTES} "
                              f"bytes); it should hold one tag such as global_step10") from None
    except UnicodeDecodeError:
        tag = ""  # not a tag: said below, without echoing what the file holds
    if not tag or "/" in tag or "\0" in tag or tag in (".", "..") or not tag.isprintable():
        raise CheckpointError(f"{shown(latest)}: does not name a tag dir (it should hold one "
                              f"tag such as global_step10)")
    return tag


def read_save_record(tag_dir: Path, partial: bool,
                     view=LOCAL) -> tuple[Lineage | None, dict[str, str]]:
    """(lineage, layer patterns) that mpitailor recorded for a save; (None, {}) for plain
    DeepSpeed saves."""
    path = tag_dir / (PARTIAL_MANIFEST if partial else SAVE_RECORD)
    if not view.exists(path) and not (view is LOCAL and path.is_symlink()):
        return None, {}  # a FIFO, a device, a dangling link: a record there, unreadable
    try:
        raw = loads(view.read_bytes(path, MAX_MANIFEST_BYTES, "a save record"))
        if partial:  # its manifest's fields, unchecked: resolve's partial_fields checks them
            lineage, patterns = Lineage.from_json(raw.get("lineage")), _patterns_of(raw)
        else:
            record = SaveRecord.from_doc(raw)
            lineage, patterns = record.lineage, record.layer_patterns
        return lineage, {str(k): str(v) for k, v in patterns.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{shown(path)}: unreadable save record ({e})") from None


def read_file_records(tag_dir: Path, view=LOCAL) -> dict[str, object] | None:
    """The files a full save's SAVE_RECORD records ({name in the tag dir: its record, as
    the JSON held it}); None where there is no record or it records no files (a save by
    DeepSpeed itself, or one recorded before `files` was). CheckpointError if it is unreadable."""
    path = tag_dir / SAVE_RECORD
    if not view.exists(path) and not (view is LOCAL and path.is_symlink()):
        return None
    try:
        files = SaveRecord.from_doc(loads(view.read_bytes(path, MAX_MANIFEST_BYTES,
                                                          "a save record"))).files
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{shown(path)}: unreadable save record ({e})") from None
    return None if files is None else dict(files)


def _partial(tag_dir: Path, save_dir: Path | None, view=LOCAL) -> CheckpointFiles:
    manifest = read_manifest(tag_dir / PARTIAL_MANIFEST, view)
    world, dtype, stage = partial_fields(manifest, shown(tag_dir / PARTIAL_MANIFEST),
                                         view.names(tag_dir))
    # world is at most the number of rank files present: this loop is bounded by the dir
    missing = next((n for r in range(world) for n in partial_files(r).values()
                    if not view.exists(tag_dir / n)), None)
    if missing:
        raise CheckpointError(f"{tag_dir}: missing {missing}; the partial checkpoint is "
                              f"incomplete")
    return CheckpointFiles(tag_dir=tag_dir, world_size=world, bf16_prefix=dtype == "bf16",
                           save_dir=save_dir, partial=True, flat=stage in (1, 2))


_HF_CHECKPOINT = re.compile(r"checkpoint-(\d+)")  # an HF Trainer's or Accelerate's save


def hf_checkpoint_step(name: str) -> int | None:
    """N of an HF Trainer's or Accelerate's `checkpoint-N` save dir name, else None."""
    m = _HF_CHECKPOINT.fullmatch(name)
    return int(m.group(1)) if m else None
PARTIAL_MODEL_RE = re.compile(r"rank_(\d+)_model_states\.pt")
PARTIAL_DTYPES = ("fp32", "bf16", "fp16")


def partial_fields(m: Manifest, where: str, names: list[str]) -> tuple[int, str, int]:
    """(world size, dtype, ZeRO stage) of a partial save's manifest, every field checked
    against bounds, and the world size against the rank files present (`names`: the tag
    dir's), before anything is sized from them: a forged world_size of 10^9 once grew a list
    of missing files until memory ran out. CheckpointError naming the manifest and the field.
    The claims that need the files' contents are checked where those are read (read.py:
    rank 0's model states; partial_shard.py: every rank's layers file)."""
    def bad(field: str, why: str) -> CheckpointError:
        return CheckpointError(f"{where}: {field} {brief(f.get(field))} "
                               f"{why}; the manifest is damaged")
    if m.kind != "partial":
        raise CheckpointError(f"{where}: kind {brief(m.kind)}, not a partial save's manifest; "
                              f"the manifest is damaged")
    f: PartialFields = m.fields
    if f.get("format", PARTIAL_FORMAT) != PARTIAL_FORMAT:
        raise bad("format", f"is not {PARTIAL_FORMAT!r}")
    for key in ("version", "global_steps"):
        if key in f and not _whole(f[key], 0):
            raise bad(key, "is not a whole number >= 0")
    for key in ("tag", "layout_sha256"):
        if key in f and not is_id(f[key]):
            raise bad(key, "is not a name")
    world = f.world_size
    ranks = sum(bool(PARTIAL_MODEL_RE.fullmatch(n)) for n in names)
    if not _whole(world, 1):
        raise bad("world_size", "is not a number of ranks")
    if world != ranks:
        raise CheckpointError(f"{where}: world_size {world}, but the dir holds the files of "
                              f"{ranks} rank(s) (rank_N_model_states.pt); the manifest is "
                              f"damaged")
    dtype, stage = f.dtype, f.get("zero_stage", 3)
    if not isinstance(dtype, str) or dtype not in PARTIAL_DTYPES:
        raise bad("dtype", f"is not one of {', '.join(PARTIAL_DTYPES)}")
    if not _whole(stage, 1) or stage > 3:
        raise bad("zero_stage", "is not a ZeRO stage (1, 2 or 3)")
    layers = f.layers
    if not isinstance(layers, list) or not all(is_id(k) for k in layers) \
            or len(set(layers)) != len(layers):
        raise bad("layers", "is not a list of distinct layer keys")
    _check_records(m, where, names)
    try:
        Lineage.from_json(f.get("lineage"))
    except TypeError as e:
        raise CheckpointError(f"{where}: {e}; the manifest is damaged") from None
    patterns = f.get("layer_patterns") or {}
    if not isinstance(patterns, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in patterns.items()):
        raise bad("layer_patterns", "is not a mapping of patterns to layer keys")
    return world, dtype, stage


def _check_records(m: Manifest, where: str, names: list[str]) -> None:
    """The manifest's file records: one per file of the dir at most, each a plain file name
    with a size and a CRC-32 (what check_partial_rank compares the files with)."""
    if len(m.files) > len(names):
        raise CheckpointError(f"{where}: files records {len(m.files)} files, but the dir holds "
                              f"{len(names)}; the manifest is damaged")
    for name, rec in m.files.items():
        if not is_file_name(name):
            raise CheckpointError(f"{where}: files: {brief(name)} is not the name of a file in "
                                  f"the save's dir; the manifest is damaged")
        if not is_file_record(rec):
            raise CheckpointError(f"{where}: files: the record of {brief(name)} is "
                                  f"{brief(rec)}, not a file's size and CRC-32; the manifest "
                                  f"is damaged")


def _whole(x, least: int) -> bool:
    """Is x a JSON whole number (not a bool, not a float) of at least `least`?"""
    return isinstance(x, int) and not isinstance(x, bool) and x >= least


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
