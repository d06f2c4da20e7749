"""One rank's part of a partial checkpoint, a `Shard` (shard_protocol.py) like `RankShard`.

A partial checkpoint stores, per rank, each saved parameter's slice (stage 3: padding
included; stages 1/2: the part of the flat partition the rank holds, if any) as safetensors
records `{kind}/{name}` (fp32). `byte_ranges` (and `read_into`) serve a run of a
sub-group's flat buffer by walking the parameters that overlap it; asking for a parameter the
checkpoint does not hold is a bug in the plan, and says so. The safetensors header is parsed
here (8-byte length, JSON): the copy program needs each record's byte offset in the file.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats.io import FileIdentity, open_regular, require_same, shown
from mpitailor.formats.manifest import Manifest, brief
from mpitailor.formats.safetensors_header import parse_header, tensor_records
from mpitailor.formats.torch import load, materialize
from mpitailor.formats.zero.files import PARTIAL_MANIFEST, CheckpointFiles, partial_files
from mpitailor.formats.zero.frozen import check_frozen_fragments
from mpitailor.formats.zero.layout import ELEMENT, KINDS, Slot
from mpitailor.formats.zero.meta import CheckpointMeta
from mpitailor.formats.zero.names import check_model_names
from mpitailor.formats.zero.recorded import check_recorded
from mpitailor.formats.zero.shard_protocol import Shard


@dataclass
class PartialShard(Shard):
    """A partial checkpoint's rank: each saved parameter's slice is a record of the rank's
    layers file (`data_path`), so a run of a sub-group's buffer may span several records, and
    no buffer is a record of its own (`whole_record` is always None)."""

    records: dict[str, tuple[int, int]]  # "{kind}/{name}" -> (byte offset, byte count)
    _by_subgroup: dict[int, list[Slot]] = field(repr=False, default_factory=dict)

    @property
    def data_path(self) -> Path:
        return self.meta.files.layers_path(self.rank)

    def byte_ranges(self, kind: str, g: int, start: int, n: int) -> list[tuple[int, int, int]]:
        end, out = start + n, []
        for slot in self._by_subgroup[g]:
            first, length = self.meta.layout.span(slot, self.rank)
            lo, hi = max(start, first), min(end, first + length)
            if lo >= hi:
                continue
            key = f"{kind}/{slot.name}"
            if key not in self.records:
                raise CheckpointError(
                    f"{self.data_path}: no record {key!r}, though its manifest lists that "
                    f"parameter's layer as saved; the manifest claims a layer its files do "
                    f"not hold")
            offset, size = self.records[key]
            if (hi - first) * ELEMENT > size:
                raise CheckpointError(f"{self.data_path}: record {key!r} is shorter than the "
                                      f"parameter's slice; the file is damaged")
            out.append((self.fd, offset + (lo - first) * ELEMENT, (hi - lo) * ELEMENT))
        return out

    def verify(self, used: set[tuple[str, int]]) -> None:
        """Nothing left to check: open_partial_shard checked every file of the rank against
        the CRC-32 its manifest recorded before anything was read."""


def check_partial_rank(meta: CheckpointMeta, rank: int, crc: bool,
                       classifier=None) -> None:
    """Rank `rank`'s files of a partial checkpoint against the sizes (and, with crc, the
    CRC-32s) its manifest recorded when they were written, and its layers file's records
    against the layout and, given a classifier (LayerClassifier: built from the layer
    patterns the save recorded, it gives each parameter's layer key), against the layers
    the manifest claims: CheckpointError if one differs. One small read (the header)."""
    _check_sizes(meta, rank, crc)
    path = meta.files.layers_path(rank)
    fd = open_regular(path, "a partial save's layers file", follow=True)
    try:
        check_records(meta, rank, _safetensors_records(path, fd), classifier)
    finally:
        os.close(fd)


def _check_sizes(meta: CheckpointMeta, rank: int, crc: bool) -> dict[str, FileIdentity]:
    """The checks of check_partial_rank; with crc, {file name: its identity as CRC-checked}
    (what a later open must find again)."""
    files, checked = meta.files, {}
    manifest = files.tag_dir / PARTIAL_MANIFEST
    records = dict(meta.file_records)
    for name in partial_files(rank).values():
        want = records.get(name)
        if not isinstance(want, dict):
            raise CheckpointError(f"{manifest}: no record of {name}; the partial save is "
                                  f"damaged")
        ident = check_recorded(files.tag_dir / name, want, "partial save", crc)
        if ident is not None:
            checked[name] = ident
    return checked


def open_partial_shard(meta: CheckpointMeta, rank: int) -> PartialShard:
    """Rank `rank`'s part, checked whole against its manifest first (what is read must be
    what was written: a partial save records a CRC-32 for every file)."""
    files = meta.files
    checked = _check_sizes(meta, rank, crc=True)
    model = load(files.model_path(rank), opaque_ok=True)
    check_model_names(files.model_path(rank), model)
    check_frozen_fragments(meta, model, files.model_path(rank), only_present=True)
    optim = materialize(load(files.optim_path(rank)))  # small: steps, groups
    if int(model.get("global_steps", -1)) != meta.global_steps:
        raise CheckpointError(f"{files.model_path(rank)}: disagrees with rank 0 (global_steps); "
                              f"files from different saves?")
    path = files.layers_path(rank)
    fd = open_regular(path, "a partial save's layers file", follow=True)
    try:
        require_same(fd, path, checked[path.name])  # the file whose CRC-32 was checked
        records = _safetensors_records(path, fd)
        check_records(meta, rank, records)
    except BaseException:
        os.close(fd)
        raise
    groups: dict[int, list[Slot]] = {}
    for slot in meta.layout.slots:
        groups.setdefault(slot.subgroup, []).append(slot)
    return PartialShard(meta, rank, model, optim, fd, records, groups)


def _safetensors_records(path, fd: int) -> dict[str, tuple[int, int]]:
    """{record name: (byte offset in the file, byte count)} of an fp32 safetensors file."""
    try:
        header, data_start = parse_header(fd)
        out = {}
        for key, (dtype, _, at, n) in tensor_records(header, data_start,
                                                      os.fstat(fd).st_size).items():
            if dtype != "F32":
                raise ValueError(f"record {key!r}: {dtype}")
            out[key] = (at, n)
    except (OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable fp32 safetensors file ({e}); the partial "
                              f"checkpoint is damaged") from None
    return out


def check_records(meta: CheckpointMeta, rank: int, records: dict[str, tuple[int, int]],
                  classifier=None) -> None:
    """A layers file's records (`{kind}/{name}` -> (offset, bytes)) against the layout: each
    one the rank's exact slice of a parameter of the model, in all three kinds; with a
    classifier, every parameter of every layer the manifest claims held (see
    check_partial_rank). CheckpointError naming the file, or the manifest, otherwise."""
    path, layout = shown(meta.files.layers_path(rank)), meta.layout
    slots, held = layout.by_name(), {}
    for key, (_, size) in records.items():
        kind, _, name = key.partition("/")
        slot = slots.get(name)
        if kind not in KINDS or slot is None:
            raise CheckpointError(f"{path}: record {brief(key)} is no parameter of this model "
                                  f"({meta.files.model_path(0).name}); files from another run?")
        if size != ELEMENT * layout.span(slot, rank)[1]:
            raise CheckpointError(f"{path}: record {key!r} holds {size} bytes, but rank {rank}'s "
                                  f"slice of {name} is {ELEMENT * layout.span(slot, rank)[1]}; the "
                                  f"partial save is damaged")
        held.setdefault(name, set()).add(kind)
    for name, kinds in held.items():
        if len(kinds) != len(KINDS):
            lack = next(k for k in KINDS if k not in kinds)
            raise CheckpointError(f"{path}: no record '{lack}/{name}' beside its "
                                  f"{sorted(kinds)[0]}; the partial save is damaged")
    if classifier is not None:
        _check_claims(meta, rank, held, classifier)


def _check_claims(meta: CheckpointMeta, rank: int, held: dict, classifier) -> None:
    """Every parameter of every layer the manifest claims is in rank's layers file (where the
    rank holds a part of it), and every claimed layer is one of the model's."""
    where = shown(meta.files.tag_dir / PARTIAL_MANIFEST)
    try:
        layer_of = classifier(dict(meta.layer_patterns))
        keys = {s.name: layer_of(s.name) for s in meta.layout.slots}
        every = {*keys.values(), *(layer_of(n) for n, _ in meta.frozen_shapes)}
    except UserError as e:  # the patterns come from the manifest too
        raise CheckpointError(f"{where}: {e}; the manifest is damaged") from None
    unknown = sorted(meta.held_layers - every)
    if unknown:
        raise CheckpointError(f"{where}: layers lists {brief(unknown[0])}, a layer this model "
                              f"does not have; the manifest is damaged")
    for slot in meta.layout.slots:
        if keys[slot.name] in meta.held_layers and slot.name not in held and \
                meta.layout.span(slot, rank)[1] > 0:
            raise CheckpointError(
                f"{shown(meta.files.layers_path(rank))}: no record of {slot.name}, though "
                f"{PARTIAL_MANIFEST} lists its layer {keys[slot.name]} as saved; the manifest "
                f"claims a layer its files do not hold")


def check_partial_claims(manifest: Manifest, files: CheckpointFiles, *, dtype: str,
                         global_steps: int, shapes: list[dict], keys_at_most: int) -> None:
    """What a partial save's manifest claims that rank 0's model states say too (dtype, step,
    layout; a layer count no larger than the model's parameters allow): CheckpointError
    naming the manifest where they differ. A bf16 claim on an fp32 run once named a merge's
    optimizer files bf16_*, which DeepSpeed's fp32 resume cannot find."""
    where, model = shown(files.tag_dir / PARTIAL_MANIFEST), files.model_path(0).name

    def differ(field: str, says: str) -> CheckpointError:
        return CheckpointError(f"{where}: {field} {brief(manifest.get(field))}, but {model} "
                               f"{says}; the manifest is damaged")
    if manifest["dtype"] != dtype:
        raise differ("dtype", f"holds {dtype} weights")
    if manifest.get("global_steps", global_steps) != global_steps:
        raise differ("global_steps", f"is of step {global_steps}")
    if "layout_sha256" in manifest.fields and manifest["layout_sha256"] != layout_sha256(shapes):
        raise differ("layout_sha256", "has other parameters or shapes (param_shapes)")
    if len(manifest["layers"]) > keys_at_most:
        raise CheckpointError(f"{where}: layers lists {len(manifest['layers'])} layers, more "
                              f"than the {keys_at_most} parameters of {model} can make; the "
                              f"manifest is damaged")


def layout_sha256(shapes: list[dict]) -> str:
    """The digest of param_shapes a partial save records (training/partial_save.py)."""
    text = json.dumps([[(n, list(s)) for n, s in g.items()] for g in shapes])
    return hashlib.sha256(text.encode()).hexdigest()
