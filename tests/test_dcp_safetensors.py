"""DCP checkpoints whose chunks are safetensors (issue 43, part 1): what
`FileSystemWriter(serialization_format=SerializationFormat.SAFETENSORS)` writes, by a real
FSDP2 run (ckpt_fixtures: dcp_w2_fsdp2_safetensors). torch 2.13 does not read such a save
back itself (its FileSystemReader torch.loads each chunk's range, which is no torch.save):
the oracle here is torch's own metadata reader and the safetensors library on the data
files' blobs; a merge's output, written as torch.save items, is read by torch's dcp.load.
And what `HuggingFaceStorageWriter(save_distributed=True)` writes (dcp_w2_fsdp2_hf), which
torch's HuggingFaceStorageReader reads and mpitailor refuses by name."""
from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path

import dcp_fuzzing
import pytest
from ckpt_fixtures import build, spec_for
from dcp_oracle import torch_state
from merging import run_cli

from mpitailor.errors import CheckpointError
from mpitailor.formats.dcp import locate, read_metadata

NAME = "dcp_w2_fsdp2_safetensors"


def _save(step: int) -> Path:
    return build(NAME) / f"step-{step}"


def st_state(path: Path) -> dict:
    """Every entry of the save at path, assembled by torch and safetensors alone: torch's
    reader gives each chunk's place, the safetensors library the blob at that place."""
    import safetensors.torch
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = FileSystemReader(str(path)).read_metadata()
    out, blobs = {}, {}
    for fqn, entry in meta.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            out[fqn] = torch.empty(entry.size, dtype=entry.properties.dtype)
    for index, info in meta.storage_data.items():
        data = (path / info.relative_path).read_bytes()
        if index.fqn not in out:  # a bytes entry: torch.save'd
            out[index.fqn] = torch.load(io.BytesIO(data[info.offset:info.offset + info.length]),
                                        weights_only=False)
            continue
        key = (info.relative_path, info.offset)
        if key not in blobs:
            blob = data[info.offset:]
            n = int.from_bytes(blob[:8], "little")
            sharding = json.loads(json.loads(blob[8:8 + n])["__metadata__"]["DCP_SHARDING_INFO"])
            blobs[key] = (safetensors.torch.load(blob), sharding)
        tensors, sharding = blobs[key]
        chunk = tensors[index.fqn]
        assert tuple(sharding[index.fqn]["saved_offsets"]) == tuple(index.offset)
        view = out[index.fqn]
        for dim, (o, n) in enumerate(zip(index.offset, chunk.shape)):
            view = view.narrow(dim, o, n)
        view.copy_(chunk)
    return out


def test_torch_does_not_read_such_a_save_back(tmp_path):
    """Why a merge writes torch.save items: torch's own dcp.load of the source fails."""
    from torch.distributed.checkpoint.api import CheckpointException
    with pytest.raises(CheckpointException) as e:
        torch_state(_save(2), tmp_path)
    assert "UnpicklingError" in repr(e.value.failures), repr(e.value.failures)[:400]


def test_every_chunk_is_found_where_safetensors_reads_it():
    import torch
    src = _save(4)
    meta, want = read_metadata(src), st_state(src)
    assert {i.safetensors for i in meta.items.values() if i.offsets is not None} == {True}
    fds = {}
    try:
        for fqn, t in meta.tensors.items():
            for c in t.chunks:
                item = meta.items[fqn, c.offsets]
                fd = fds.setdefault(item.file, os.open(src / item.file, os.O_RDONLY))
                loc = locate(src, fd, item, t, c.sizes)
                got = torch.frombuffer(bytearray(os.pread(fd, loc.nbytes, loc.offset)),
                                       dtype=want[fqn].dtype) if loc.nbytes else \
                    torch.empty(0, dtype=want[fqn].dtype)
                part = want[fqn]
                for dim, (o, n) in enumerate(zip(c.offsets, c.sizes)):
                    part = part.narrow(dim, o, n)
                assert torch.equal(got.reshape(c.sizes), part), (fqn, c.offsets)
    finally:
        for fd in fds.values():
            os.close(fd)


def test_inspect_reads_it():
    r = run_cli(["inspect", str(_save(2))], {})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "layers.3" in r.stdout and "exp_avg_sq" in r.stdout


def _recipe(tmp_path: Path) -> Path:
    run = build(NAME)
    path = tmp_path / "recipe.yml"
    path.write_text(f"sources: {{s2: {run}/step-2, s4: {run}/step-4}}\n"
                    f"layers: {{even: s2, odd: s4}}\nbase: s4\n")
    return path


def test_a_merge_is_read_by_dcp_load_and_holds_what_the_recipe_names(tmp_path):
    import torch
    r = run_cli(["merge", str(_recipe(tmp_path)), "-o", str(tmp_path / "out")], {}, ranks=2)
    assert r.returncode == 0, r.stdout + r.stderr
    got = torch_state(tmp_path / "out", tmp_path)  # torch's dcp.load machinery
    s2, s4 = st_state(_save(2)), st_state(_save(4))
    assert set(got) == set(s4)
    told_apart = 0
    for key, value in got.items():
        layer = re.search(r"layers\.(\d+)\.", key)
        want, other = (s2, s4) if layer and int(layer.group(1)) % 2 == 0 else (s4, s2)
        if isinstance(value, torch.Tensor):
            assert value.dtype == want[key].dtype and torch.equal(value, want[key]), key
            told_apart += not torch.equal(want[key], other[key])
        else:
            assert value == want[key], key
    assert told_apart > 50
    v = run_cli(["verify", str(tmp_path / "out")], {})
    assert v.returncode == 0, v.stdout + v.stderr


def test_link_mode_is_refused_in_one_line(tmp_path):
    r = run_cli(["merge", str(_recipe(tmp_path)), "-o", str(tmp_path / "out"), "--link"], {})
    assert r.returncode == 2, r.stdout + r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and "safetensors" in line and "--link" in line, line
    assert not (tmp_path / "out").exists()


def test_export_gives_the_weights_safetensors_holds(tmp_path):
    import safetensors.torch
    import torch

    from dev.tinytrain.model import tiny_config
    config = tmp_path / "config"
    tiny_config(spec_for(NAME, build(NAME))).save_pretrained(config)
    r = run_cli(["export", str(_save(4)), "-o", str(tmp_path / "hf"), "--config", str(config)],
                {}, ranks=2)
    assert r.returncode == 0, r.stdout + r.stderr
    got = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        got.update(safetensors.torch.load_file(f))
    want = {k.removeprefix("model."): v for k, v in st_state(_save(4)).items()
            if k.startswith("model.")}
    assert set(got) == set(want)
    for k, v in got.items():
        assert torch.equal(v, want[k]), k


def _damaged(tmp_path: Path, patch) -> tuple[Path, str]:
    """A copy of the step-2 save, one data file's blob header patched in place (same
    length: every offset stays), and that file's name."""
    dst = tmp_path / "damaged"
    shutil.copytree(_save(2), dst)
    meta = read_metadata(dst)
    item = next(i for i in meta.items.values() if i.safetensors and i.offset > 0)
    data = bytearray((dst / item.file).read_bytes())
    n = int.from_bytes(data[item.offset:item.offset + 8], "little")
    head = data[item.offset + 8:item.offset + 8 + n].decode()
    new = patch(head)
    assert len(new) == len(head) and new != head
    data[item.offset + 8:item.offset + 8 + n] = new.encode()
    (dst / item.file).write_bytes(bytes(data))
    return dst, item.file


@pytest.mark.parametrize(("patch", "said"), [
    (lambda h: h.replace('"model.model.norm.weight"', '"model.model.norm.weighs"', 1),
     "not in the blob's header"),
    (lambda h: h.replace('"dtype":"F32"', '"dtype":"F16"', 1), "the metadata says F32"),
    (lambda h: h.replace('"saved_offsets\\": [32, 0]', '"saved_offsets\\": [33, 0]', 1),
     "saved at offsets"),
    (lambda h: "[" + h[1:], "no safetensors blob"),
])
def test_a_damaged_blob_is_one_line_naming_the_file(tmp_path, patch, said):
    dst, name = _damaged(tmp_path, patch)
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(f"sources: {{a: {dst}}}\nlayers: {{rest: a}}\n")
    r = run_cli(["merge", str(recipe), "-o", str(tmp_path / "out")], {})
    assert r.returncode == 2, r.stdout + r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and name in line and said in line, line
    assert not (tmp_path / "out").exists()


def test_a_fuzzed_blob_header_gives_a_chunk_or_one_line(tmp_path):
    """The DCP fuzzer (tests/dcp_fuzzing.py) on a data file's safetensors blob."""
    dst = tmp_path / "fuzzed"
    shutil.copytree(_save(2), dst)
    got = dcp_fuzzing.run_blob(dst, 200, seed=45)
    assert got["located"] + got["refused"] == got["inputs"] * got["chunks"]
    assert got["refused"] > 0


def test_a_truncated_blob_is_refused(tmp_path):
    dst = tmp_path / "cut"
    shutil.copytree(_save(2), dst)
    data = dst / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=re.escape(str(data))):
        meta = read_metadata(dst)
        for fqn, t in meta.tensors.items():
            for c in t.chunks:
                item = meta.items[fqn, c.offsets]
                fd = os.open(dst / item.file, os.O_RDONLY)
                try:
                    locate(dst, fd, item, t, c.sizes)
                finally:
                    os.close(fd)


def test_hf_storage_writer_shards_are_refused_by_name(tmp_path):
    """Per-rank shard-*.safetensors files, no .metadata: torch's HF reader assembles the
    model from them (each size the largest offset + shape it sees); inspect, merge and
    export refuse them in one line naming a shard, exit 2, nothing written."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    run = build("dcp_w2_fsdp2_hf")
    src = run / "step-2"
    reader = HuggingFaceStorageReader(str(src))
    meta = reader.read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype)
             for k, v in meta.state_dict_metadata.items()}
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert state["model.model.embed_tokens.weight"].shape[0] == spec_for(
        "dcp_w2_fsdp2_hf", run).vocab
    from dev.tinytrain.model import tiny_config
    config = tmp_path / "config"
    tiny_config(spec_for(NAME, build(NAME))).save_pretrained(config)
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(f"sources: {{a: {src}, b: {run}/step-4}}\nlayers: {{even: a, odd: b}}\n")
    for args in (["inspect", str(src)], ["merge", str(recipe), "-o", str(tmp_path / "out")],
                 ["export", str(src), "-o", str(tmp_path / "out"), "--config", str(config)]):
        r = run_cli(args, {})
        assert r.returncode == 2, r.stdout + r.stderr
        line = r.stderr.strip()
        assert "\n" not in line and "HuggingFaceStorageWriter" in line and \
            str(src / "shard-0000") in line, line
        assert not (tmp_path / "out").exists()
