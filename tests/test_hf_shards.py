"""16-bit HF weights do not depend on the number of MPI ranks that wrote them.

The rebuilt base weights keep the base's layout (one file, or its shard files and their
tensor assignment); `--export hf` cuts shards by size as `save_pretrained` does;
1, 2, 3 and 5 ranks write the same bytes, and the manifest records them as they are."""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub.serialization._base import split_state_dict_into_shards_factory
from merging import RECIPES, recipe_env, run_cli
from safetensors.torch import load_file, save_file
from transformers.utils.hub import convert_file_size_to_int

from mpitailor.cluster.comm import Comm
from mpitailor.engine import copyio
from mpitailor.engine.copyio import join_crcs
from mpitailor.formats.manifest import MANIFEST
from mpitailor.formats.zero.layout import ELEMENT
from mpitailor.formats.zero.read import read_meta
from mpitailor.jobs.merge import MergeOptions, plan_merge, run_merge
from mpitailor.planning.hf_layout import (
    INDEX,
    like_base,
    parse_size,
    plan_weights,
    runs,
    size_shards,
)
from mpitailor.planning.program import split, weights_buffers

NAME = "hf_w3_bf16_weights_tied"
RANKS = (1, 2, 3, 5)
VOLATILE = ("created", "mpi_ranks")  # manifest fields that say when and by how many


def hf_split(sizes: dict[str, int], max_bytes: int):
    """huggingface_hub's own split (what save_pretrained uses) of tensors of these sizes."""
    return split_state_dict_into_shards_factory(
        sizes, get_storage_size=lambda n: n, filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_bytes)


def bf16_sizes(tag_dir: Path) -> dict[str, int]:
    meta = read_meta(tag_dir)
    return {name: math.prod(shape) * 2 for name, shape in
            [(s.name, s.shape) for s in meta.layout.slots] + list(meta.frozen_shapes)}


def three_shard_size(sizes: dict[str, int]) -> int:
    total = sum(sizes.values())
    return next(s for s in range(total // 4, total, 512)
                if len(hf_split(sizes, s).filename_to_tensors) == 3)


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def manifest(root: Path) -> dict:
    doc = json.loads((root / MANIFEST).read_text())
    return {k: v for k, v in doc.items() if k not in VOLATILE}


def assert_records_match(root: Path) -> None:
    """Every weights file's manifest record is its size and CRC-32."""
    records = json.loads((root / MANIFEST).read_text())["files"]
    weights = [p for p in root.rglob("model*.safetensors*")]
    assert weights
    for p in weights:
        data = p.read_bytes()
        rec = records[str(p.relative_to(root))]
        assert rec == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}, p


@pytest.fixture(scope="module")
def exports(ckpt, tmp_path_factory) -> tuple[dict[int, Path], int]:
    """The same merge with the export in 3 shards, by 1, 2, 3 and 5 ranks; the shard size."""
    new, old = ckpt(NAME, 10), ckpt(NAME, 5)
    size = three_shard_size(bf16_sizes(new / "global_step10"))
    root = tmp_path_factory.mktemp("ranks")
    outs = {}
    for n in RANKS:
        outs[n] = root / f"n{n}"
        # --export universal too: these runs are also tests/test_rank_independence.py's merge
        # case (the partitions, both exports, the rebuilt weights).
        r = run_cli([str(RECIPES / "parity.yml"), "--export", "hf", "--max-shard-size",
                     str(size), "--export", "universal"], recipe_env(new, old, outs[n]), ranks=n)
        assert r.returncode == 0, r.stderr
    return outs, size


def test_any_number_of_ranks_writes_the_same_bytes(exports):
    outs, _ = exports
    want = files_under(outs[1])
    assert "model.safetensors" in want and "hf/model-00003-of-00003.safetensors" in want
    assert any(f.endswith("optim_states.pt") for f in want)
    assert any(f.endswith("/zero/model.norm.weight/exp_avg.pt") for f in want)
    for n in RANKS[1:]:
        got = files_under(outs[n])
        assert sorted(got) == sorted(want), n
        assert [f for f in want if got[f] != want[f]] == [], n
        assert manifest(outs[n]) == manifest(outs[1]), n
    assert_records_match(outs[5])


def test_max_shard_size_cuts_as_save_pretrained_and_loads(exports, ckpt, tmp_path,
                                                          monkeypatch):
    outs, size = exports
    new, old = ckpt(NAME, 10), ckpt(NAME, 5)
    sharded = outs[2] / "hf"
    index = json.loads((sharded / INDEX).read_text())
    oracle = hf_split(bf16_sizes(new / "global_step10"), size)
    assert index["weight_map"] == oracle.tensor_to_filename
    assert index["metadata"]["total_size"] == oracle.metadata["total_size"]
    assert {p.name for p in sharded.glob("model*.safetensors")} == set(oracle.filename_to_tensors)
    # The reference: one file (the default size), in-process, cast and written 1000 elements
    # at a time, so every parameter is read in several chunks.
    monkeypatch.setattr(copyio, "COPY_CHUNK", 1000 * ELEMENT)
    for k, v in recipe_env(new, old, tmp_path / "one").items():
        monkeypatch.setenv(k, v)
    run_merge(Comm(None), plan_merge(Comm(None), str(RECIPES / "parity.yml")),
              MergeOptions(export=frozenset({"hf"}), export_dtype="bf16"))
    one = tmp_path / "one"
    assert {p.name for p in (one / "hf").glob("model*")} == {"model.safetensors"}
    assert (one / "model.safetensors").read_bytes() == (outs[1] / "model.safetensors").read_bytes()
    want = transformers.AutoModelForCausalLM.from_pretrained(one / "hf", dtype="auto").state_dict()
    got = transformers.AutoModelForCausalLM.from_pretrained(sharded, dtype="auto").state_dict()
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert t.dtype == got[name].dtype == torch.bfloat16 and torch.equal(t, got[name]), name


def test_a_sharded_base_keeps_its_shard_files(exports, ckpt, ckpt_copy, tmp_path):
    outs, _ = exports
    new = ckpt_copy(NAME) / "checkpoint-10"
    tensors = load_file(new / "model.safetensors")
    (new / "model.safetensors").unlink()
    files = [f"model-{i + 1:05d}-of-00003.safetensors" for i in range(3)]
    # Interleaved, which no size rule would give; plus a tied alias the merge does not write.
    weight_map = {n: files[i % 3] for i, n in enumerate(sorted(tensors))}
    for f in files:
        save_file({n: tensors[n] for n, g in weight_map.items() if g == f}, new / f,
                  metadata={"format": "pt"})
    (new / INDEX).write_text(json.dumps({"metadata": {"total_size": 0},
                                         "weight_map": {**weight_map, "lm_head.weight": files[2]}}))
    out = tmp_path / "merged"
    r = run_cli([str(RECIPES / "parity.yml")], recipe_env(new, ckpt(NAME, 5), out), ranks=3)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / INDEX).read_text())["weight_map"] == weight_map
    assert sorted(p.name for p in out.glob("model*")) == sorted([*files, INDEX])
    single = load_file(outs[1] / "model.safetensors")  # the unsharded base's rebuild
    for f in files:
        got = load_file(out / f)
        assert sorted(got) == sorted(n for n, g in weight_map.items() if g == f)
        for n, t in got.items():
            assert t.dtype == torch.bfloat16 and torch.equal(t, single[n]), n
    assert_records_match(out)


def test_max_shard_size_needs_the_hf_export(ckpt, tmp_path):
    env = recipe_env(ckpt("w2_fp32_one", 10), ckpt("w2_fp32_one", 5), tmp_path / "o")
    r = run_cli([str(RECIPES / "parity.yml"), "--max-shard-size", "1MB"], env)
    assert r.returncode == 2 and "--max-shard-size applies to --export hf" in r.stderr
    assert not (tmp_path / "o").exists()
    r = run_cli([str(RECIPES / "parity.yml"), "--export", "hf", "--max-shard-size",
                 "5XB"], env)
    assert r.returncode == 2 and "write a size such as 5GB" in r.stderr


# -- the plan alone: no I/O, no MPI ---------------------------------------------------------

@pytest.mark.parametrize("text", ["5GB", "500MB", "2GiB", "3MiB", "7KiB", "12kB", "5Gb",
                                  "40mb", "1000"])
def test_sizes_parse_as_transformers_reads_them(text):
    assert parse_size(text) == convert_file_size_to_int(int(text) if text.isdigit() else text)


@pytest.mark.parametrize("bad", ["", "5XB", "GB", "-3", "1.5GB"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="write a size"):
        parse_size(bad)


@pytest.mark.parametrize("max_bytes", [1, 10, 25, 30, 60, 1000])
def test_size_shards_follow_huggingface_hub(max_bytes):
    # 40 is bigger than most limits: a shard of its own, before the one being filled.
    sizes = dict(zip("abcdefghij", [10, 5, 40, 20, 5, 5, 30, 1, 1, 25]))
    want = hf_split(sizes, max_bytes).filename_to_tensors
    got = size_shards(list(sizes.items()), max_bytes)
    assert [sorted(s) for s in got] == [sorted(v) for v in want.values()]


def test_like_base_keeps_the_assignment_and_places_unlisted_tensors():
    groups = like_base(["a", "b", "x", "c", "d"], {"a": "f2", "b": "f1", "c": "f2",
                                                   "d": "f1", "alias": "f3"})
    assert groups == [("f2", ["a", "c"]), ("f1", ["b", "x", "d"])]


@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 7, 200])
def test_every_byte_has_one_writer_and_shares_are_contiguous(ranks):
    """The copy program's cast buffers of HF files: every data byte of every file written
    by one rank, at 16-bit element boundaries (odd element counts included), each task's
    tensors one contiguous byte range."""
    tensors = [(f"t{i}", shape) for i, shape in
               enumerate([(7, 3), (1,), (64,), (5, 5, 2), (0,), (9,), (31,)])]
    groups = [("f1", ["t0", "t3", "t6"]), ("f2", ["t1", "t5"]), ("f3", ["t2", "t4"])]
    plan = plan_weights(tensors, "bf16", groups, index=True)
    bufs = weights_buffers(plan)
    covered = {f.name: [] for f in plan.files}
    for r, tasks in enumerate(split(bufs, ranks)):
        for t in tasks:
            f = plan.files[bufs[t.buffer].unit]
            assert t.lo % 2 == 0 and t.hi % 2 == 0, (r, t)
            spans = [(p.offset + a * 2, p.offset + b * 2)
                     for p, a, b in runs(f, 2, t.lo // 2, t.hi // 2)]
            assert all(x[1] == y[0] for x, y in zip(spans, spans[1:])), (r, f.name)
            assert (spans[0][0], spans[-1][1]) == (len(f.prefix) + t.lo, len(f.prefix) + t.hi)
            covered[f.name].append((spans[0][0], spans[-1][1]))
    for f in plan.files:
        spans = sorted(covered[f.name])
        assert spans[0][0] == len(f.prefix) and spans[-1][1] == f.size
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))


def test_join_crcs_joins_ranges_in_order_and_stops_at_a_gap():
    data = bytes(range(256)) * 7
    cuts = [0, 5, 300, 301, 1000, len(data)]
    ranges = [(a, b - a, zlib.crc32(data[a:b])) for a, b in zip(cuts, cuts[1:])]
    assert join_crcs(reversed(ranges)) == (zlib.crc32(data), len(data))
    # from a prefix already taken (a header), as an HF file's CRC starts
    assert join_crcs(ranges[2:], zlib.crc32(data[:300]), 300) == (zlib.crc32(data), len(data))
    assert join_crcs([ranges[0], *ranges[2:]])[1] == 5  # bytes 5-300 written by nobody


def test_a_merges_weights_are_read_from_the_sources_not_the_staged_output(ckpt, tmp_path,
                                                                          monkeypatch):
    """The rebuilt 16-bit weights and the safetensors export read the plan's sources, as
    `export` does: the staged merge is never read back, and resharding the merge changes
    none of their bytes."""
    from mpitailor.jobs import merge as merge_job
    new, old = ckpt(NAME, 10), ckpt(NAME, 5)
    read = []

    def read_meta_seen(path, *args, **kwargs):
        read.append(Path(path))
        return read_meta(path, *args, **kwargs)
    monkeypatch.setattr(merge_job, "read_meta", read_meta_seen)
    outs = {}
    for world_size in (None, 2):
        outs[world_size] = tmp_path / f"w{world_size}"
        for k, v in recipe_env(new, old, outs[world_size]).items():
            monkeypatch.setenv(k, v)
        comm = Comm(None)
        run_merge(comm, plan_merge(comm, str(RECIPES / "parity.yml"), world_size=world_size),
                  MergeOptions(export=frozenset({"hf"})))
    assert read and set(read) <= {new, old}, read
    weights = {w: {f: b for f, b in files_under(out).items()
                   if f.startswith("hf/") or f.startswith("model")}
               for w, out in outs.items()}
    assert "model.safetensors" in weights[None] and "hf/model.safetensors" in weights[None]
    assert weights[2] == weights[None]


def test_safetensors_records_that_overlap_are_refused(tmp_path):
    """Helper attack 16: a partial save's layers file whose exp_avg record had the fp32
    record's offsets (the safetensors library refuses it) was read: recover wrote a
    parameter's weights as its exp_avg. The one safetensors header reader refuses it."""
    from mpitailor.errors import CheckpointError
    from mpitailor.formats.safetensors_header import header_prefix, read_tensor_records
    path = tmp_path / "x.safetensors"
    prefix = header_prefix([("a", "F32", [2], 8), ("b", "F32", [2], 8)])
    path.write_bytes(prefix + bytes(16))
    assert {k: v[2:] for k, v in read_tensor_records(path).items()} == {
        "a": (len(prefix), 8), "b": (len(prefix) + 8, 8)}
    header = prefix[8:].replace(b'"data_offsets":[8,16]', b'"data_offsets":[4,12]')
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(CheckpointError, match="'a' and 'b' overlap"):
        read_tensor_records(path)
