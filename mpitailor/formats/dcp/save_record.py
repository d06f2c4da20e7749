"""mpitailor's record of a DCP save: `mpitailor_save.json`, written last into every save
mpitailor's DCP checkpointer publishes (training/dcp_checkpointer.py).

It says where the save sits in a timeline (its lineage: a full save starts a chain, a
partial save names the save it builds on), the training step, the layers a partial save
holds (a full save: none named, it holds all), the layer patterns the run saves with, and
the size and CRC-32 of every file of the save (`.metadata` and the data files), taken once
the file was written and fsynced. A DCP checkpoint without the record (torchtitan's, a
plain `dcp.save`) is a full save outside any timeline.

Read from files anyone could have written: every field is checked here, and anything else
is one CheckpointError line naming the file.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.dcp.keys import split_keys
from mpitailor.formats.dcp.metadata import DcpMetadata
from mpitailor.formats.io import MAX_MANIFEST_BYTES, loads, read_small, shown
from mpitailor.formats.manifest import (
    SAVE_RECORD,
    Lineage,
    brief,
    is_file_name,
    is_file_record,
    is_id,
)

DCP_SAVE_FORMAT = "mpitailor-dcp-save"
MAX_STEP = (1 << 63) - 1  # a step beyond int64 is no value a run ever wrote


@dataclass(frozen=True, slots=True)
class DcpSaveRecord:
    lineage: Lineage
    global_steps: int
    layers: frozenset[str] | None         # a partial save's layer keys; None: a full save
    layer_patterns: Mapping[str, str]     # the patterns the run saves with
    files: Mapping[str, Mapping]          # file name -> {"bytes": n, "crc32": "8 hex digits"}

    @property
    def partial(self) -> bool:
        return self.layers is not None

    # A save's commit marker, as a manifest is an output's (publish/staging.py commits either)
    file_name = SAVE_RECORD

    @property
    def bytes_written(self) -> int:
        return sum(rec["bytes"] for rec in self.files.values())

    def to_json(self) -> bytes:
        doc = {"format": DCP_SAVE_FORMAT, **self.lineage.to_json(),
               "global_steps": self.global_steps,
               "layers": None if self.layers is None else sorted(self.layers),
               "layer_patterns": dict(self.layer_patterns),
               "files": dict(sorted(self.files.items()))}
        return json.dumps(doc, indent=2).encode()


def read_dcp_save_record(folder: Path) -> DcpSaveRecord | None:
    """The record of the DCP save in folder; None where there is none (no such file)."""
    path = folder / SAVE_RECORD
    if not os.path.lexists(path):
        return None
    try:
        raw = loads(read_small(path, MAX_MANIFEST_BYTES, "a save record"))
    except ValueError as e:
        raise CheckpointError(f"{shown(path)}: not JSON ({str(e)[:120]}); the save's record "
                              f"is damaged") from None
    try:
        return _record(raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{shown(path)}: {e}; not a record mpitailor's DCP checkpointer "
                              f"writes") from None


def _record(raw) -> DcpSaveRecord:
    if not isinstance(raw, dict) or raw.get("format") != DCP_SAVE_FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else raw
        raise ValueError(f"format {brief(got)}, not {DCP_SAVE_FORMAT!r}")
    lineage = Lineage.from_json(raw)
    step = raw.get("global_steps")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"global_steps {brief(step)} is not a step (an integer >= 0)")
    layers = raw.get("layers")
    if layers is not None and (not isinstance(layers, list) or not layers
                               or not all(is_id(k) for k in layers)):
        raise ValueError(f"layers {brief(layers)} is not a list of layer keys (or null)")
    patterns = raw.get("layer_patterns", {})
    if not isinstance(patterns, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in patterns.items()):
        raise ValueError(f"layer_patterns {brief(patterns)} is not a mapping of strings")
    files = raw.get("files")
    if not isinstance(files, dict) or not files:
        raise ValueError(f"files {brief(files)} is not a mapping of the save's files")
    for name, rec in files.items():
        if not is_file_name(name):
            raise ValueError(f"files names {brief(name)}, not a file of the save's dir")
        if not is_file_record(rec):
            raise ValueError(f"the record of {brief(name)} is {brief(rec)}, not "
                             f"{{\"bytes\": n, \"crc32\": \"8 hex digits\"}}")
    return DcpSaveRecord(lineage, step, None if layers is None else frozenset(layers),
                         patterns, files)


@dataclass(frozen=True, slots=True)
class DcpSaveMeta:
    """A DCP save as recovery reads it (planning/chain.py's `Save.meta`): its checked
    metadata and its record (None: a DCP checkpoint mpitailor did not write, a full save
    outside any timeline, its step read from its name)."""

    metadata: DcpMetadata
    record: DcpSaveRecord | None
    global_steps: int

    @property
    def partial(self) -> bool:
        return self.record is not None and self.record.partial

    @property
    def held_layers(self) -> frozenset[str] | None:
        return None if self.record is None else self.record.layers

    @property
    def lineage(self) -> Lineage | None:
        return None if self.record is None else self.record.lineage

    @property
    def layer_patterns(self) -> tuple[tuple[str, str], ...]:
        return () if self.record is None else tuple(self.record.layer_patterns.items())

    def layer_keys(self, classify: Callable[[str], str]) -> set[str]:
        """The layer keys of the parameters the save holds (its keys split as its layout
        says: torchtitan's parameters lie at the top level, get_state_dict's under
        `model.`)."""
        return {classify(k.param) for k in split_keys(self.metadata.tensors).values()
                if k.role == "model"}
