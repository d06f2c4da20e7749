"""The manifest: the commit marker mpitailor writes last into every output it publishes (a
merge, an export, a partial save), and what readers learn from it.

One record for all three: what kind of output it is, the record (size, CRC-32) of every file
it published, and the fields of its kind. `format_version` is "major.minor": a reader accepts
any minor version of the major it knows (new fields are ignored) and refuses another major
with one line. Manifests written before the version existed read as "1.0".
It lives with the formats (not in publish/) because the readers of saves, at the bottom of
the house, read it too.
"""
from __future__ import annotations

import datetime
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpitailor.errors import CheckpointError
from mpitailor.formats.boundedio import MAX_MANIFEST_BYTES, loads, read_small, shown
from mpitailor.version import __version__

MANIFEST = "mpitailor_manifest.json"          # of a merge or an export
PARTIAL_MANIFEST = "mpitailor_partial.json"   # of a partial (layer-wise) save
FORMAT_VERSION = "1.1"  # 1.1: `format_version` and `kind` recorded
KINDS = ("merge", "export", "partial")
PARTIAL_FORMAT = "mpitailor-partial"  # partial saves' `format` key since version 1.0
_HEAD = ("format_version", "kind", "mpitailor_version", "created")
MAJOR = int(FORMAT_VERSION.split(".")[0])  # any minor of it is read; another major is not
_VERSION = re.compile(r"(\d{1,6})\.(\d{1,6})")


@dataclass(frozen=True, slots=True)
class Manifest:
    kind: str                          # one of KINDS
    files: Mapping[str, Mapping]       # path in the output -> {"bytes": n, "crc32": c}
    fields: Mapping[str, Any]          # what this kind records (sources, layers, recipe, ...)
    format_version: str = FORMAT_VERSION
    mpitailor_version: str = __version__
    created: str = field(default_factory=lambda: datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"))

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"manifest kind {self.kind!r}: one of {KINDS}")
        clash = set(self.fields) & {*_HEAD, "files"}
        if clash:
            raise ValueError(f"manifest fields {sorted(clash)} are the manifest's own")

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

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
               **self.fields, "files": dict(sorted(self.files.items()))}
        return json.dumps(doc, indent=2).encode()

    @classmethod
    def from_json(cls, data: bytes | str, where: Path | str) -> Manifest:
        """Parse a manifest; CheckpointError (one line, naming `where`) if it is not one this
        version of mpitailor can read."""
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
        try:
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
