"""Layer-wise merges of PyTorch Distributed Checkpoints (issue 43, part 2's first step): a
recipe over DCP saves of a real FSDP2 run gives a DCP checkpoint in which every entry is the
one of the source the recipe names (torch's own reader is the oracle: dcp_to_torch_save),
that FSDP2 loads with `dcp.load` and trains on, at the saved world size and another, and
whose bytes do not depend on the number of MPI ranks that wrote it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from ckpt_fixtures import build, spec_for
from dcp_oracle import merged, torch_state
from merging import run_cli

from mpitailor.formats.dcp import read_metadata

NAME = "dcp_w2_fsdp2"


def _recipe(tmp_path: Path, even: int, odd: int, base: int) -> Path:
    run = build(NAME)
    path = tmp_path / "recipe.yml"
    path.write_text(f"sources: {{s2: {run}/step-2, s4: {run}/step-4}}\n"
                    f"layers: {{even: s{even}, odd: s{odd}}}\nbase: s{base}\n")
    return path


def test_every_entry_comes_from_the_source_the_recipe_names(tmp_path):
    import torch
    out = merged(tmp_path, _recipe(tmp_path, even=2, odd=4, base=4))
    run = build(NAME)
    got, s2, s4 = (torch_state(p, tmp_path) for p in (out, run / "step-2", run / "step-4"))
    assert set(got) == set(s4)
    told_apart = 0
    for key, value in got.items():
        layer = re.search(r"layers\.(\d+)\.", key)
        want = s2 if layer and int(layer.group(1)) % 2 == 0 else s4
        other = s4 if want is s2 else s2
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, want[key]), key
            told_apart += not torch.equal(want[key], other[key])
        else:
            assert value == want[key], key
    assert told_apart > 50  # the two saves differ in what was checked


def test_the_same_bytes_whatever_the_number_of_ranks(tmp_path):
    recipe = _recipe(tmp_path, even=4, odd=2, base=4)
    one = merged(tmp_path, recipe, "one", ranks=1)
    two = merged(tmp_path, recipe, "two", ranks=2)
    names = sorted(p.name for p in one.iterdir() if p.name != "mpitailor_manifest.json")
    assert names == sorted(p.name for p in two.iterdir() if p.name != "mpitailor_manifest.json")
    for n in names:
        assert (one / n).read_bytes() == (two / n).read_bytes(), n
    r = run_cli(["verify", str(two)], {})
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_loads_the_composite_and_trains_as_from_the_save_it_copies(tmp_path,
                                                                         world_size):
    """A composite of every layer from step 4 holds step 4's state: FSDP2 resumed from it
    (dcp.load + set_state_dict, at the saved world size and another) takes exactly the
    steps it takes resumed from step 4 itself."""
    from dataclasses import replace

    from dev.tinytrain import launch
    out = merged(tmp_path, _recipe(tmp_path, even=4, odd=4, base=4))
    assert read_metadata(out).tensors == read_metadata(build(NAME) / "step-4").tensors
    losses = {}
    for name, source in (("composite", out), ("save", build(NAME) / "step-4")):
        spec = replace(spec_for(NAME, tmp_path / f"resume-{name}"), world_size=world_size,
                       load_dir=str(source), steps=2, save_at=(),
                       extra={"flatten_optimizer": True, "first_step": 4})
        losses[name] = launch(spec, module="dev.tinytrain.fsdp2_worker", timeout=600)["losses"]
    assert losses["composite"] == losses["save"] and len(losses["save"]) == 2


def test_sources_saved_otherwise_are_refused_in_one_line(tmp_path):
    other = build("dcp_w3_fsdp2_groups")
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(f"sources: {{a: {build(NAME)}/step-2, b: {other}/step-4}}\n"
                      f"layers: {{even: a, odd: b}}\nbase: a\n")
    r = run_cli(["merge", str(recipe), "-o", str(tmp_path / "out")], {})
    assert r.returncode == 2 and not (tmp_path / "out").exists()
    assert "merge saves of" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_payload_in_a_bytes_entry_is_never_copied_into_a_composite(tmp_path):
    """DCP loads a bytes entry with torch.load(weights_only=False): a source whose item
    would run code is refused by name, and nothing is published."""
    import io
    import os
    import shutil

    import torch

    from mpitailor.formats.dcp import metadata_bytes
    run = tmp_path / "run"
    shutil.copytree(build(NAME), run)
    src = run / "step-2"
    meta = read_metadata(src)
    fqn = meta.bytes_entries[0]
    item = meta.items[fqn, None] if (fqn, None) in meta.items else meta.items[fqn, ()]

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch /tmp/mpitailor-dcp-merge-pwned",))
    buf = io.BytesIO()
    torch.save(Payload(), buf)
    blob = buf.getvalue()
    with open(src / item.file, "ab") as f:  # appended: the item then points at it
        at = f.tell()
        f.write(blob)
    items = dict(meta.items)
    key = (fqn, item.offsets)
    items[key] = type(item)(item.fqn, item.offsets, item.file, at, len(blob), ())
    (src / ".metadata").write_bytes(metadata_bytes(type(meta)(
        meta.tensors, meta.bytes_entries, items, meta.version, meta.save_id,
        meta.planner_data)))
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(f"sources: {{s2: {src}, s4: {run}/step-4}}\n"
                      f"layers: {{even: s2, odd: s4}}\nbase: s2\n")
    r = run_cli(["merge", str(recipe), "-o", str(tmp_path / "out")], {})
    assert r.returncode == 2 and not (tmp_path / "out").exists(), r.stdout + r.stderr
    assert f"{src / item.file}" in r.stderr and "posix.system" in r.stderr, r.stderr
    assert not Path("/tmp/mpitailor-dcp-merge-pwned").exists()
