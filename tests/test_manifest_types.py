"""The manifest's typed fields (formats/manifest.py) and the save record (formats/zero/files.py):
every kind reads back as it was written, and writes the bytes the untyped writers wrote."""
from __future__ import annotations

import json
import pickle

import pytest

from mpitailor.errors import CheckpointError
from mpitailor.formats.manifest import (
    ABSENT,
    FORMAT_VERSION,
    MANIFEST_KINDS,
    ExportFields,
    Manifest,
    MergeFields,
    PartialFields,
)
from mpitailor.formats.zero.files import Lineage, SaveRecord, read_save_record

HEAD = {"format_version": FORMAT_VERSION, "mpitailor_version": "9.9.9",
        "created": "2026-01-02T03:04:05+00:00"}
FILES = {"b/x.pt": {"bytes": 3, "crc32": "0000000a"}, "a": {"bytes": 4, "crc32": "0000000b"}}
SORTED_FILES = dict(sorted(FILES.items()))

MERGE = {
    "recipe": "base: new\n", "tag": "global_step10", "world_size": 2, "source_world_size": 4,
    "base": "new",
    "sources": {"new": {"path": "/s/new", "global_steps": 10, "save_id": None},
                "old": {"path": "/s/old", "global_steps": 5, "save_id": "abc"}},
    "layers": {"embed": {"source": "new", "global_steps": 10},
               "layers.0": {"source": "old", "global_steps": 5}},
    "subgroups": [{"step": 10, "step_source": "new", "rule": "single source",
                   "sources": ["new"]}],
    "mpi_ranks": 2,
}
MERGE_OPTIONAL = {"left_out": ["core.1"],
                  "node_local": {"node": "n0", "files_of_node": {"n0": ["t/a"]}}}
EXPORT = {"format": "hf", "dtype": "bf16",
          "sources": {"new": {"path": "/s/new", "global_steps": 10}},
          "layers": {"embed": "new", "layers.0": "new"}, "mpi_ranks": 1}
PARTIAL = {"format": "mpitailor-partial", "version": 1, "tag": "global_step8",
           "global_steps": 8, "world_size": 2, "dtype": "fp32", "layers": ["layers.1"],
           "zero_stage": 3, "layout_sha256": "f" * 64,
           "lineage": {"save_id": "s8", "chain": "c", "parent": "s4"},
           "layer_patterns": {r"h\.(\d+)\.": "layers.{i}"}}

CASES = [("merge", MergeFields, MERGE), ("merge", MergeFields, {**MERGE, **MERGE_OPTIONAL}),
         ("merge", MergeFields, {**MERGE, "left_out": []}),
         ("export", ExportFields, EXPORT), ("partial", PartialFields, PARTIAL),
         ("partial", PartialFields, {**PARTIAL, "lineage": None})]


def old_bytes(kind: str, fields: dict) -> bytes:
    """What Manifest.to_json wrote before the fields were typed: the keys in the order given."""
    doc = {"format_version": HEAD["format_version"], "kind": kind,
           "mpitailor_version": HEAD["mpitailor_version"], "created": HEAD["created"],
           **fields, "files": SORTED_FILES}
    return json.dumps(doc, indent=2).encode()


@pytest.mark.parametrize("kind,cls,doc", CASES)
def test_each_kind_writes_the_old_bytes_and_reads_back_the_same_fields(kind, cls, doc):
    typed = cls(**doc)
    m = Manifest(kind, FILES, typed, **HEAD)
    assert m.to_json() == old_bytes(kind, doc)
    back = Manifest.from_json(m.to_json(), "out/m.json")
    assert back == m and back.fields == typed and type(back.fields) is cls
    assert back.extra == {} and back.kind == kind
    assert back.fields.to_doc() == doc and list(back.fields.to_doc()) == list(doc)


def test_the_field_order_is_the_key_order_written():
    assert MergeFields.names() == (*MERGE, *MERGE_OPTIONAL)
    assert ExportFields.names() == tuple(EXPORT)
    assert PartialFields.names() == tuple(PARTIAL)
    assert MANIFEST_KINDS == ("merge", "export", "partial")


def test_an_optional_key_left_out_stays_out():
    m = Manifest("merge", FILES, MergeFields(**MERGE), **HEAD)
    assert m.fields.left_out is ABSENT and m.fields.node_local is ABSENT
    text = m.to_json().decode()
    assert '"left_out"' not in text and '"node_local"' not in text
    back = Manifest.from_json(text, "m")
    assert back.fields.left_out is ABSENT and "left_out" not in back.fields
    assert back.get("left_out", "none") == "none"
    with pytest.raises(KeyError):
        back["node_local"]


def test_unknown_keys_are_kept_aside_not_refused():
    doc = json.loads(old_bytes("export", EXPORT))
    doc["format_version"] = f"{FORMAT_VERSION.split('.')[0]}.99"
    doc = {**doc, "shiny": {"new": 1}}
    back = Manifest.from_json(json.dumps(doc), "m")
    assert back.fields == ExportFields(**EXPORT)
    assert back.extra == {"shiny": {"new": 1}} and back["shiny"] == {"new": 1}
    assert json.loads(back.to_json()) == doc  # read as written, the extra key included


def test_fields_are_not_validated_when_read():
    """Readers check what they use, where they use it (formats/zero/files.py: partial_fields):
    the typed parse refuses nothing that the untyped one took."""
    odd = {"world_size": "two", "layers": 3, "dtype": None}
    back = Manifest.from_json(json.dumps({"kind": "partial", **odd, "files": {}}), "p")
    assert back.fields.world_size == "two" and back.fields.layers == 3
    assert back.fields.dtype is None and back.fields.tag is ABSENT
    assert back.format_version == "1.0" and back.mpitailor_version == "" and back.created == ""
    assert Manifest.from_json(b"{}", "m").fields == MergeFields.from_doc({})


def test_the_refusals_are_as_before():
    with pytest.raises(CheckpointError, match=r"^m: unreadable mpitailor manifest \(manifest "
                                              r"kind 'other': one of \('merge', 'export', "
                                              r"'partial'\)\)$"):
        Manifest.from_json(b'{"kind": "other"}', "m")
    with pytest.raises(CheckpointError, match=r"^m: unreadable mpitailor manifest \(manifest "
                                              r"kind \[1\]: one of"):
        Manifest.from_json(b'{"kind": [1]}', "m")
    with pytest.raises(CheckpointError, match=r"\(files is not a mapping\)$"):
        Manifest.from_json(b'{"kind": "merge", "files": []}', "m")
    with pytest.raises(ValueError, match="manifest kind 'merge' with ExportFields"):
        Manifest("merge", {}, ExportFields(**EXPORT))


def test_a_mapping_of_fields_is_typed_by_kind():
    m = Manifest("partial", FILES, dict(PARTIAL), **HEAD)
    assert m.fields == PartialFields(**PARTIAL) and m.to_json() == old_bytes("partial", PARTIAL)
    with pytest.raises(ValueError, match=r"manifest fields \['files'\] are the manifest's own"):
        Manifest("export", {}, {"files": 1})


def test_typed_fields_pickle_and_absent_stays_one():
    m = Manifest("merge", FILES, MergeFields(**MERGE), **HEAD)
    back = pickle.loads(pickle.dumps(m))
    assert back == m and back.fields.left_out is ABSENT


RECORD = {"format": "mpitailor-save", "save_id": "s1", "chain": "s1", "parent": None,
          "global_steps": 2, "layer_patterns": {}}


def test_the_save_record_writes_the_old_bytes_and_reads_back(tmp_path):
    record = SaveRecord(Lineage("s1", "s1", None), 2, {})
    assert record.to_json() == json.dumps(RECORD, indent=2).encode()
    assert SaveRecord.from_doc(json.loads(record.to_json())) == record
    (tmp_path / "mpitailor_save.json").write_bytes(record.to_json())
    assert read_save_record(tmp_path, False) == (Lineage("s1", "s1", None), {})
    patterns = {"a": "layers.{i}"}
    later = SaveRecord(Lineage("s2", "s1", "s1"), 4, patterns)
    assert SaveRecord.from_doc({**json.loads(later.to_json()), "new": 1}) == later


@pytest.mark.parametrize("partial,text,why", [
    (False, "[]", r"lineage \[\]: save_id and chain must be ids \(strings\), parent an id or "
                  r"null"),
    (False, "null", "'NoneType' object has no attribute 'get'"),
    (False, '{"save_id": "s", "chain": "c", "layer_patterns": [1]}',
     "layer_patterns is not a mapping"),
    (True, "[]", "'list' object has no attribute 'get'"),
    (True, '{"lineage": 3}', r"lineage 3: save_id and chain must be ids \(strings\), parent an "
                             r"id or null"),
    (True, '{"layer_patterns": "x"}', "layer_patterns is not a mapping"),
])
def test_a_damaged_save_record_or_partial_manifest_is_refused_as_before(tmp_path, partial,
                                                                        text, why):
    name = "mpitailor_partial.json" if partial else "mpitailor_save.json"
    (tmp_path / name).write_text(text)
    with pytest.raises(CheckpointError, match=rf"{name}: unreadable save record \({why}\)$"):
        read_save_record(tmp_path, partial)


def test_a_partial_manifest_gives_its_lineage_and_patterns(tmp_path):
    m = Manifest("partial", FILES, PartialFields(**PARTIAL), **HEAD)
    (tmp_path / "mpitailor_partial.json").write_bytes(m.to_json())
    assert read_save_record(tmp_path, True) == (Lineage("s8", "c", "s4"),
                                                PARTIAL["layer_patterns"])
