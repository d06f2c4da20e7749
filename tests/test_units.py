"""Small pure pieces, on made-up inputs: the Adam-step rule, layer ranges, the dtype table,
the manifest's versioning. (The rest of the planner is proven on real checkpoints.)"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from mpitailor.errors import CheckpointError
from mpitailor.formats.dtypes import DTYPES, canonical, from_safetensors, name_of
from mpitailor.formats.manifest import FORMAT_VERSION, Manifest
from mpitailor.planning.layers import layer_runs
from mpitailor.planning.plan import step_source


@dataclass
class FakeMeta:
    global_steps: int


METAS = {"a": FakeMeta(10), "b": FakeMeta(5), "c": FakeMeta(10), "base": FakeMeta(7)}


@pytest.mark.parametrize("rule,want", [("newest", "c"), ("oldest", "b"), ("base", "base")])
def test_step_source_by_rule_ties_broken_by_name(rule, want):
    # a and c are equally new: the name decides, never the order they are given in
    for order in (["a", "b", "c"], ["c", "b", "a"]):
        assert step_source(set(order), METAS, rule, "base") == want


def test_layer_runs_joins_consecutive_layers_of_one_value():
    items = [(3, "x"), (0, "x"), (1, "x"), (2, "y"), (5, "y"), (6, "y")]
    assert layer_runs(items) == [("0-1", "x"), ("2", "y"), ("3", "x"), ("5-6", "y")]
    assert layer_runs([]) == []
    assert layer_runs([(4, None)]) == [("4", None)]


def test_dtype_table_names():
    assert canonical("bfloat16") == canonical("torch.bfloat16") == canonical("bf16") == "bf16"
    assert canonical("float8") is None
    assert from_safetensors("F16") == "fp16" and from_safetensors("F8_E4M3") is None
    assert DTYPES["fp32"].itemsize == 4 and DTYPES["bf16"].safetensors == "BF16"
    import torch
    assert name_of(torch.float16) == "fp16" and name_of(torch.complex64) == "torch.complex64"


def test_manifest_round_trip_and_version():
    m = Manifest("merge", {"b/x.pt": {"bytes": 3, "crc32": 1}, "a": {"bytes": 4, "crc32": 2}},
                 {"base": "new", "sources": {}})
    back = Manifest.from_json(m.to_json(), "out/mpitailor_manifest.json")
    assert back == m and back["base"] == "new" and back.bytes_written == 7
    assert list(back.files) == ["a", "b/x.pt"]  # sorted in the file
    assert back.format_version == FORMAT_VERSION


def test_manifest_refuses_another_major_version_in_one_line():
    newer = str(int(FORMAT_VERSION.split(".")[0]) + 1) + ".0"
    data = Manifest("export", {}, {"format": "hf"}, format_version=newer).to_json()
    with pytest.raises(CheckpointError, match=r"^out/m\.json: manifest format_version "
                                              rf"{newer} was written by a newer mpitailor"):
        Manifest.from_json(data, "out/m.json")
    minor = FORMAT_VERSION.split(".")[0] + ".99"
    assert Manifest.from_json(Manifest("export", {}, {"new_field": 1}, format_version=minor)
                              .to_json(), "x")["new_field"] == 1


def test_manifest_without_a_version_is_read_as_1_0_with_its_kind():
    partial = b'{"format": "mpitailor-partial", "version": 1, "layers": [], "files": {}}'
    merge = b'{"mpitailor_version": "0.1.0", "recipe": "", "files": {}}'
    assert Manifest.from_json(partial, "p").kind == "partial"
    assert Manifest.from_json(merge, "m").kind == "merge"
    assert Manifest.from_json(merge, "m").format_version == "1.0"
    with pytest.raises(CheckpointError, match="^m: unreadable mpitailor manifest"):
        Manifest.from_json(b"[1, 2]", "m")


@pytest.mark.parametrize("output,message", [
    ("{path: /x, world_size: 0}", "line 3: output.world_size: Input should be greater than or "
                                  "equal to 1"),
    ("{pth: /x}", "line 3: output.pth: unknown key"),
    ("[1]", "line 3: output: Input should be a valid string"),
])
def test_recipe_output_errors_name_the_key_that_is_wrong(tmp_path, output, message):
    from mpitailor.errors import UserError
    from mpitailor.planning.recipe import parse_recipe
    text = f"sources: {{a: /tmp}}\nlayers: {{rest: a}}\noutput: {output}\n"
    with pytest.raises(UserError, match=f"^r.yml {message}"):
        parse_recipe(text, origin="r.yml", base_dir=tmp_path)


def test_inspect_table_shows_sub_group_sets_as_ranges():
    from mpitailor.cli.reports import format_table
    row = {"params": 1, "frozen": 0, "elements": 8, "bytes_per_rank": 96}
    rep = {"kind": "full", "path": "x", "world_size": 2, "zero_stage": 3, "dtype": "fp32",
           "global_steps": 1, "global_samples": 2, "ds_version": "0", "param_groups": [0],
           "subgroups": 7, "optimizer_bytes_per_rank": 96, "tied": {},
           "layers": {"embed": {**row, "subgroups": [1, 6]},
                      "norm": {**row, "subgroups": [2, 3, 4, 6]},
                      "lm_head": {**row, "subgroups": []}}}
    lines = format_table(rep).splitlines()
    assert lines[-3].split()[-1] == "1,6"      # not 1-6: sub-groups 2-5 are not embed's
    assert lines[-2].split()[-1] == "2-4,6"
    assert lines[-1].split()[-1] == "-"


def test_a_layer_selector_may_be_an_unquoted_number(tmp_path):
    """D4 of issue 41: `layers: {3: a}` is natural YAML (an int key); it selects layer 3 as
    "3" does, not a pydantic message."""
    from mpitailor.planning.recipe import parse_recipe
    quoted, bare = (parse_recipe(f"sources: {{a: /tmp, b: /x}}\nlayers: {{{k}: a, rest: b}}\n"
                                 f"output: {tmp_path / 'o'}\n", origin="r.yml",
                                 base_dir=tmp_path) for k in ("'3'", "3"))
    assert bare.layer_rules == quoted.layer_rules == (('3', 'a'), ('rest', 'b'))


def test_make_dirs_under_makes_folders_under_its_root_and_no_others(tmp_path):
    """Its guard against names with '..' (da436b5) refused the root itself once (a CI run:
    every node-local export called it with the staging dir as both)."""
    from mpitailor.errors import MergeFailed
    from mpitailor.publish.staging import make_dirs_under
    make_dirs_under(tmp_path, tmp_path)
    make_dirs_under(tmp_path, tmp_path / "zero" / "a.weight")
    assert (tmp_path / "zero" / "a.weight").is_dir()
    with pytest.raises(MergeFailed, match="not a folder under"):
        make_dirs_under(tmp_path / "zero", tmp_path / "zero" / ".." / ".." / "x")
    assert not (tmp_path.parent / "x").exists()


def test_write_replacing_removes_what_a_killed_write_of_this_host_left(tmp_path):
    """A write killed between its temporary file and the rename leaves `.mpitailor-HOST-PID.tmp`
    (bench/crash_points.py found them, left for ever): the next write in that folder removes
    those of this host whose process is gone, never a live one's or another host's."""
    import os
    import socket
    import subprocess

    from mpitailor.publish.staging import write_replacing
    host = socket.gethostname()
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = tmp_path / f".mpitailor-{host}-{gone.pid}.tmp"
    live = tmp_path / f".mpitailor-{host}-{os.getppid()}.tmp"  # pytest's parent: alive
    other = tmp_path / f".mpitailor-otherhost-{gone.pid}.tmp"
    for f in (dead, live, other):
        f.write_bytes(b"half")
    write_replacing(tmp_path / "latest", b"global_step8")
    assert (tmp_path / "latest").read_bytes() == b"global_step8"
    assert not dead.exists() and live.exists() and other.exists()
