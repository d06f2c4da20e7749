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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpitailor.errors import CheckpointError
from mpitailor.version import __version__

MANIFEST = "mpitailor_manifest.json"          # of a merge or an export
PARTIAL_MANIFEST = "mpitailor_partial.json"   # of a partial (layer-wise) save
FORMAT_VERSION = "1.1"  # 1.1: `format_version` and `kind` recorded
KINDS = ("merge", "export", "partial")
PARTIAL_FORMAT = "mpitailor-partial"  # partial saves' `format` key since version 1.0
_HEAD = ("format_version", "kind", "mpitailor_version", "created")


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
            doc = json.loads(data)
            if not isinstance(doc, dict):
                raise TypeError("not a JSON object")
            version = str(doc.get("format_version", "1.0"))
            major = version.split(".")[0]
            files = doc.get("files") or {}
            if not isinstance(files, dict):
                raise TypeError("files is not a mapping")
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{where}: unreadable mpitailor manifest ({e})") from None
        if major != FORMAT_VERSION.split(".")[0]:
            raise CheckpointError(
                f"{where}: manifest format_version {version} was written by a newer "
                f"mpitailor (this {__version__} reads {FORMAT_VERSION.split('.')[0]}.x); "
                f"upgrade mpitailor to read it")
        kind = doc.get("kind") or _legacy_kind(doc)
        fields = {k: v for k, v in doc.items() if k not in (*_HEAD, "files")}
        try:
            return cls(kind, files, fields, version, str(doc.get("mpitailor_version", "")),
                       str(doc.get("created", "")))
        except ValueError as e:
            raise CheckpointError(f"{where}: unreadable mpitailor manifest ({e})") from None


def read_manifest(path: Path, view=None) -> Manifest:
    """The manifest at path (a file on the local file system, or in an fsview `view`)."""
    try:
        data = view.read_bytes(path) if view is not None else Path(path).read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the mpitailor manifest "
                              f"({e.strerror or e})") from None
    return Manifest.from_json(data, path)


def _legacy_kind(doc: dict) -> str:
    """The kind of a manifest written before `kind` was recorded (format 1.0)."""
    if doc.get("format") == PARTIAL_FORMAT:
        return "partial"
    return "export" if "format" in doc else "merge"
