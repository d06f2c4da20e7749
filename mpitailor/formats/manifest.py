"""The manifest: the commit marker mpitailor writes last into every output it publishes (a
merge, an export, a partial save), and what readers learn from it.

One record for all three: what kind of output it is, the record (size, CRC-32) of every file
it published, and the fields of its kind, typed: one frozen dataclass per kind (MergeFields,
ExportFields, PartialFields), its fields in the order they are written. `format_version` is
"major.minor": a reader accepts any minor version of the major it knows (keys its kind does
not define are kept aside, in `extra`, and ignored) and refuses another major with one line.
Manifests written before the version existed read as "1.0". The schema: docs/output-format.md.

A manifest is read from files anyone could have written: parsing checks the head (version,
kind, `files` a mapping) and nothing else. A key that is missing reads as ABSENT; a value is
kept as the JSON held it, whatever its type: every reader checks the fields it uses, where it
uses them (formats/zero/files.py: partial_fields).
It lives with the formats (not in publish/) because the readers of saves, at the bottom of
the house, read it too.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from mpitailor.errors import CheckpointError
from mpitailor.formats.io import MAX_MANIFEST_BYTES, loads, read_small, shown
from mpitailor.version import __version__

MANIFEST = "mpitailor_manifest.json"          # of a merge or an export
PARTIAL_MANIFEST = "mpitailor_partial.json"   # of a partial (layer-wise) save
FORMAT_VERSION = "1.1"  # 1.1: `format_version` and `kind` recorded
PARTIAL_FORMAT = "mpitailor-partial"  # partial saves' `format` key since version 1.0
# Written by mpitailor's checkpointers beside a full save's files (a DeepSpeed tag dir), and
# into every DCP save: the save's place in a timeline (Lineage). A partial ZeRO checkpoint
# keeps the same record in its manifest, under "lineage".
SAVE_RECORD = "mpitailor_save.json"
MAX_ID_BYTES = 255  # a save id or tag: no longer than a file name
_HEAD = ("format_version", "kind", "mpitailor_version", "created")
MAJOR = int(FORMAT_VERSION.split(".")[0])  # any minor of it is read; another major is not
_VERSION = re.compile(r"(\d{1,6})\.(\d{1,6})")


class _Absent:
    """The value of a key the manifest does not hold (an optional key left out, or a key
    missing from a damaged or older manifest). Never written."""

    _it: ClassVar[_Absent | None] = None

    def __new__(cls) -> _Absent:
        if cls._it is None:
            cls._it = super().__new__(cls)
        return cls._it

    def __repr__(self) -> str:
        return "ABSENT"

    def __reduce__(self):
        return (_Absent, ())  # one of it, across pickling (a Snapshot goes to its writer)


ABSENT: Any = _Absent()


class _Fields:
    """What the fields of every kind share: the keys present, in the order written, and
    access by key (the name a key has in the file is its field's name)."""

    __slots__ = ()

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]):
        """The fields of a manifest's JSON object, as they are: a missing key is ABSENT,
        nothing is checked (the readers check what they use); keys of no field are not
        looked at (`extra_of` gives them)."""
        return cls(**{name: doc.get(name, ABSENT) for name in cls.names()})

    @classmethod
    def extra_of(cls, doc: Mapping[str, Any]) -> dict[str, Any]:
        """The keys of `doc` that this kind does not define (a newer minor version's)."""
        known = cls.names()
        return {k: v for k, v in doc.items() if k not in known}

    def items(self) -> Iterator[tuple[str, Any]]:
        """(key, value) of every key present, in the order they are written."""
        for name in self.names():
            value = getattr(self, name)
            if value is not ABSENT:
                yield name, value

    def to_doc(self) -> dict[str, Any]:
        return dict(self.items())

    def __contains__(self, key: object) -> bool:
        return key in self.names() and getattr(self, key) is not ABSENT

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default


@dataclass(frozen=True, slots=True)
class MergeFields(_Fields):
    """A merge's (and a recover's) fields, in the order written."""

    recipe: str                    # the recipe's text as read (recover: the one it wrote)
    tag: str                       # the output's tag dir (the base's tag)
    world_size: int                # the ranks the output is written for
    source_world_size: int         # the ranks the sources were saved by
    base: str                      # the base source's name
    sources: Mapping[str, Mapping[str, Any]]  # name -> {path, global_steps, save_id}
    layers: Mapping[str, Mapping[str, Any]]   # layer key -> {source, global_steps}
    subgroups: list[Mapping[str, Any]]  # per sub-group: {step, step_source, rule, sources}
    mpi_ranks: int                 # the MPI ranks that wrote it
    left_out: list[str] = ABSENT   # files of the base's save dir not carried over
    node_local: Mapping[str, Any] = ABSENT  # node-local output only: {node, files_of_node}


@dataclass(frozen=True, slots=True)
class ExportFields(_Fields):
    """An export's fields, in the order written."""

    format: str                    # hf, fp32 or universal
    dtype: str                     # of the weights written
    sources: Mapping[str, Mapping[str, Any]]  # name -> {path, global_steps}
    layers: Mapping[str, str]      # layer key -> its source's name
    mpi_ranks: int                 # the MPI ranks that wrote it


@dataclass(frozen=True, slots=True)
class PartialFields(_Fields):
    """A partial save's fields, in the order written. Saves of format 1.0 may lack the
    ones from `global_steps` on but `world_size`, `dtype` and `layers`."""

    format: str                    # PARTIAL_FORMAT
    version: int                   # the partial layout's version (training/partial_save.py)
    tag: str                       # the tag dir's name
    global_steps: int
    world_size: int                # the ranks that saved it
    dtype: str                     # fp32, bf16 or fp16
    layers: list[str]              # the layer keys it holds
    zero_stage: int                # 1, 2 or 3
    layout_sha256: str             # of the parameters' names and shapes
    lineage: Mapping[str, Any] | None  # Lineage.to_json() (formats/zero/files.py), or null
    layer_patterns: Mapping[str, str]  # the patterns the run saved with


ManifestFields = MergeFields | ExportFields | PartialFields
FIELDS_OF: dict[str, type] = {"merge": MergeFields, "export": ExportFields,
                              "partial": PartialFields}
MANIFEST_KINDS = tuple(FIELDS_OF)


@dataclass(frozen=True, slots=True)
class Manifest:
    kind: str                          # one of MANIFEST_KINDS
    files: Mapping[str, Mapping]       # path in the output -> {"bytes": n, "crc32": c}
    fields: ManifestFields             # what this kind records; a mapping is typed by kind
    format_version: str = FORMAT_VERSION
    mpitailor_version: str = __version__
    created: str = field(default_factory=lambda: datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"))
    extra: Mapping[str, Any] = field(default_factory=dict)  # keys its kind does not define

    def __post_init__(self) -> None:
        if self.kind not in MANIFEST_KINDS:
            raise ValueError(f"manifest kind {self.kind!r}: one of {MANIFEST_KINDS}")
        kind_fields = FIELDS_OF[self.kind]
        if isinstance(self.fields, Mapping):
            clash = set(self.fields) & {*_HEAD, "files"}
            if clash:
                raise ValueError(f"manifest fields {sorted(clash)} are the manifest's own")
            object.__setattr__(self, "extra", {**kind_fields.extra_of(self.fields),
                                               **self.extra})
            object.__setattr__(self, "fields", kind_fields.from_doc(self.fields))
        elif type(self.fields) is not kind_fields:
            raise ValueError(f"manifest kind {self.kind!r} with {type(self.fields).__name__}")

    def __getitem__(self, key: str) -> Any:
        """A key of the file (its kind's field, or an extra one); KeyError if absent."""
        return self.fields[key] if key in self.fields else self.extra[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields[key] if key in self.fields else self.extra.get(key, default)

    @property
    def file_name(self) -> str:
        """The file it is written to: a partial save's has a name of its own."""
        return PARTIAL_MANIFEST if self.kind == "partial" else MANIFEST

    @property
    def bytes_written(self) -> int:
        return sum(int(r["bytes"]) for r in self.files.values())

    def to_json(self) -> bytes:
        doc = {"format_version": self.format_version, "kind": self.kind,
               "mpitailor_version": self.mpitailor_version, "created": self.created,
               **self.fields.to_doc(), **self.extra, "files": dict(sorted(self.files.items()))}
        return json.dumps(doc, indent=2).encode()

    @classmethod
    def from_json(cls, data: bytes | str, where: Path | str) -> Manifest:
        """Parse a manifest; CheckpointError (one line, naming `where`) if it is not one this
        version of mpitailor can read. Only the head is checked (see the module's doc)."""
        try:
            doc = loads(data)  # nesting bounded: a ValueError, never a RecursionError
            if not isinstance(doc, dict):
                raise TypeError("not a JSON object")
            version = doc.get("format_version", "1.0")
            files = doc.get("files", {})
            if not isinstance(files, dict):
                raise TypeError("files is not a mapping")
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{where}: unreadable mpitailor manifest ({e})") from None
        _check_version(version, where)
        kind = doc["kind"] if "kind" in doc else _legacy_kind(doc)
        fields = {k: v for k, v in doc.items() if k not in (*_HEAD, "files")}
        try:  # the fields are typed by kind in __post_init__
            return cls(kind, files, fields, version, str(doc.get("mpitailor_version", "")),
                       str(doc.get("created", "")))
        except ValueError as e:
            raise CheckpointError(f"{where}: unreadable mpitailor manifest ({e})") from None


def read_manifest(path: Path, view=None) -> Manifest:
    """The manifest at path (a file on the local file system, or in an fsview `view`)."""
    what = "an mpitailor manifest"
    data = view.read_bytes(path, MAX_MANIFEST_BYTES, what) if view is not None \
        else read_small(path, MAX_MANIFEST_BYTES, what)
    return Manifest.from_json(data, shown(path))


def _check_version(version, where) -> None:
    """CheckpointError unless `version` is "major.minor" of the major this mpitailor reads:
    another major is said to be newer (or never written), anything else invalid, never
    "newer" for a field that is empty or not a version at all."""
    found = _VERSION.fullmatch(version) if isinstance(version, str) else None
    if found is None:
        raise CheckpointError(f"{where}: manifest format_version {brief(version)} is not a "
                              f"version string (\"major.minor\", e.g. \"{FORMAT_VERSION}\"); the "
                              f"manifest is damaged")
    major = int(found[1])
    if major > MAJOR:
        raise CheckpointError(
            f"{where}: manifest format_version {version} was written by a newer "
            f"mpitailor (this {__version__} reads {MAJOR}.x); upgrade mpitailor to read it")
    if major < MAJOR:
        raise CheckpointError(f"{where}: manifest format_version {version!r}: no mpitailor "
                              f"writes it (this {__version__} reads {MAJOR}.x); the manifest "
                              f"is damaged")


def brief(value, limit: int = 60) -> str:
    """A value read from an untrusted manifest, as a message shows it: repr (so that nothing
    in it can forge a line), cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _legacy_kind(doc: dict) -> str:
    """The kind of a manifest written before `kind` was recorded (format 1.0)."""
    if doc.get("format") == PARTIAL_FORMAT:
        return "partial"
    return "export" if "format" in doc else "merge"


@dataclass(frozen=True, slots=True)
class Lineage:
    """Where a save sits in a timeline: a full save starts a chain (chain == save_id); a
    partial save names its chain and the save it builds on (parent)."""

    save_id: str
    chain: str
    parent: str | None

    @classmethod
    def from_json(cls, raw) -> "Lineage | None":
        """The record (None: a save made without one); TypeError if it is not one."""
        if raw is None:
            return None
        ids = (raw.get("save_id"), raw.get("chain")) if isinstance(raw, dict) else ()
        parent = raw.get("parent") if isinstance(raw, dict) else None
        if len(ids) != 2 or not all(is_id(x) for x in ids) or not (
                parent is None or is_id(parent)):
            raise TypeError(f"lineage {brief(raw)}: save_id and chain must be ids (strings), "
                            f"parent an id or null")
        return cls(ids[0], ids[1], parent)

    def to_json(self) -> dict:
        return {"save_id": self.save_id, "chain": self.chain, "parent": self.parent}


def is_id(x) -> bool:
    """A save id, tag or layer key as records hold them: a non-empty string no longer than a
    file name."""
    return isinstance(x, str) and 0 < len(x) <= MAX_ID_BYTES


_CRC32 = re.compile(r"[0-9a-f]{8}")  # a record's CRC-32 as mpitailor writes it
MAX_FILE_BYTES = (1 << 63) - 1       # no file is larger (st_size is an int64)


def is_file_name(name) -> bool:
    """A name a record may give a file of the save's own dir: no path, no `..`."""
    return is_id(name) and "/" not in name and "\0" not in name and name not in (".", "..")


def is_file_record(rec) -> bool:
    """A file's record as mpitailor writes it: {"bytes": a size, "crc32": 8 hex digits}."""
    return isinstance(rec, dict) and type(rec.get("bytes")) is int \
        and 0 <= rec["bytes"] <= MAX_FILE_BYTES and isinstance(rec.get("crc32"), str) \
        and _CRC32.fullmatch(rec["crc32"]) is not None
