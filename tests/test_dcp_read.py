"""Reading PyTorch Distributed Checkpoints without torch (issue 43, part 1): `.metadata`
through DCP's own classes only, every chunk's bytes located in its data file. The oracle is
torch's own reader (FileSystemReader, torch.load of each item) on checkpoints written by
real FSDP2 runs (tests/ckpt_fixtures.py: DCP_VARIANTS); crafted metadata gets one line."""
from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import dcp_fuzzing
import pytest
from ckpt_fixtures import DCP_VARIANTS, build

from mpitailor.errors import CheckpointError
from mpitailor.formats.dcp import locate, read_metadata
from mpitailor.formats.dtypes import DTYPES

SAVES = [(name, step) for name in DCP_VARIANTS for step in (2, 4)]


def _save(name: str, step: int) -> Path:
    return build(name) / f"step-{step}"


@pytest.mark.parametrize("name,step", SAVES)
def test_metadata_is_what_torchs_reader_reads(name, step):
    from torch.distributed.checkpoint import FileSystemReader
    folder = _save(name, step)
    mine, theirs = read_metadata(folder), FileSystemReader(str(folder)).read_metadata()
    tensors = {k: v for k, v in theirs.state_dict_metadata.items() if hasattr(v, "chunks")}
    assert set(mine.tensors) == set(tensors) and any(".exp_avg_sq" in k for k in tensors)
    assert set(mine.bytes_entries) == set(theirs.state_dict_metadata) - set(tensors)
    for fqn, t in tensors.items():
        m = mine.tensors[fqn]
        assert (DTYPES[m.dtype].torch, m.size) == (str(t.properties.dtype)[6:], tuple(t.size))
        assert [(c.offsets, c.sizes) for c in m.chunks] == [
            (tuple(c.offsets), tuple(c.sizes)) for c in t.chunks]
    assert len(mine.items) == len(theirs.storage_data)
    for index, info in theirs.storage_data.items():
        item = mine.items[index.fqn, None if index.offset is None else tuple(index.offset)]
        assert (item.file, item.offset, item.length) == (
            info.relative_path, info.offset, info.length)
    assert mine.save_id == theirs.storage_meta.save_id and mine.version == theirs.version


@pytest.mark.parametrize("name,step", SAVES)
def test_every_chunk_is_located_where_torch_reads_it(name, step):
    import torch
    folder = _save(name, step)
    meta = read_metadata(folder)
    fds = {f: os.open(folder / f, os.O_RDONLY) for f in meta.files}
    try:
        for fqn, t in meta.tensors.items():
            for c in t.chunks:
                item = meta.items[fqn, c.offsets]
                where = locate(folder, fds[item.file], item, t, c.sizes)
                raw = os.pread(fds[item.file], where.nbytes, where.offset)
                blob = os.pread(fds[item.file], item.length, item.offset)
                want = torch.load(io.BytesIO(blob), weights_only=True)
                got = torch.frombuffer(bytearray(raw) or bytearray(1), dtype=want.dtype)
                assert torch.equal(got[:want.numel()].reshape(want.shape), want), fqn
    finally:
        for fd in fds.values():
            os.close(fd)


def test_the_reader_needs_no_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from pathlib import Path\n"
            "from mpitailor.formats.dcp import locate, read_metadata\n"
            "import os\n"
            f"folder = Path({str(_save('dcp_w3_fsdp2_groups', 4))!r})\n"
            "m = read_metadata(folder)\n"
            "n = 0\n"
            "for fqn, t in m.tensors.items():\n"
            "    for c in t.chunks:\n"
            "        it = m.items[fqn, c.offsets]\n"
            "        fd = os.open(folder / it.file, os.O_RDONLY)\n"
            "        locate(folder, fd, it, t, c.sizes); os.close(fd); n += 1\n"
            "print(n)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and int(r.stdout) > 50, r.stderr


# -- crafted metadata: one line, never a traceback, never code run -------------------------


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(_save("dcp_w2_fsdp2", 2), dst)
    return dst


def _rewrite(folder: Path, change) -> None:
    """Rewrite .metadata with torch's own classes, changed by change(metadata)."""
    import torch  # noqa: F401 - the classes DCP pickles
    meta = pickle.loads((folder / ".metadata").read_bytes())
    change(meta)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/mpitailor-dcp-pwned",))


def _first_chunked(meta):
    return next(k for k, v in meta.state_dict_metadata.items()
                if hasattr(v, "chunks") and len(v.chunks) > 1)


def _overlap(meta):
    fqn = _first_chunked(meta)
    chunks = meta.state_dict_metadata[fqn].chunks
    chunks[1].offsets = chunks[0].offsets


def _outside(meta):
    fqn = _first_chunked(meta)
    import torch
    meta.state_dict_metadata[fqn].chunks[0].offsets = torch.Size(
        [10**6] + list(meta.state_dict_metadata[fqn].chunks[0].offsets[1:]))


def _escape(meta):
    info = next(iter(meta.storage_data.values()))
    info.relative_path = "../../etc/passwd"


def _unstored(meta):
    meta.storage_data.pop(next(iter(meta.storage_data)))


def _dtype(meta):
    import torch
    fqn = _first_chunked(meta)
    meta.state_dict_metadata[fqn].properties.dtype = torch.float8_e4m3fn


def _code(meta):
    meta.planner_data = _RunsCode()


def _share_a_record(meta):
    fqns = [k for k, v in meta.state_dict_metadata.items() if hasattr(v, "chunks")]
    meta.state_dict_metadata[fqns[1]] = meta.state_dict_metadata[fqns[0]]


def _long_path(meta):
    meta.storage_meta.checkpoint_id = Path("/".join(["a" * 4000] * 300))


def _negative_offsets(meta):
    fqn = _first_chunked(meta)
    chunk = meta.state_dict_metadata[fqn].chunks[0]
    chunk.offsets = (-4,) + tuple(chunk.offsets[1:])


def _float_sizes(meta):
    fqn = _first_chunked(meta)
    chunk = meta.state_dict_metadata[fqn].chunks[0]
    chunk.sizes = (chunk.sizes[0] + 0.5,) + tuple(chunk.sizes[1:])


def _huge_size(meta):
    fqn = _first_chunked(meta)
    meta.state_dict_metadata[fqn].size = (2 ** 2000,)


@pytest.mark.parametrize("change,says", [
    (_code, "names posix.system, which is not one of DCP's metadata classes"),
    (_overlap, "two chunks overlap"),
    (_outside, "a chunk outside its size"),
    (_escape, "not a file of the checkpoint dir"),
    (_unstored, "stored nowhere"),
    (_dtype, "which mpitailor does not read"),
    # what an hour's attack found (issue 43)
    (_share_a_record, "a record shared among several entries"),
    (_long_path, "longer than any path"),
    (_negative_offsets, "a chunk's offsets is not a size"),
    (_float_sizes, "a chunk's sizes is not a size"),
    (_huge_size, "its size is not a size"),
])
def test_crafted_metadata_is_one_line_naming_the_file(tmp_path, change, says):
    folder = _copy(tmp_path)
    _rewrite(folder, change)
    with pytest.raises(CheckpointError) as e:
        read_metadata(folder)
    assert str(e.value).startswith(f"{folder / '.metadata'}: ") and says in str(e.value)
    assert "\n" not in str(e.value)
    assert not Path("/tmp/mpitailor-dcp-pwned").exists()


def test_transformed_items_are_refused_by_name(tmp_path):
    folder = _copy(tmp_path)

    def compress(meta):
        for info in meta.storage_data.values():
            info.transform_descriptors = ["zstd"]
    _rewrite(folder, compress)
    meta = read_metadata(folder)
    fqn, t = next((k, v) for k, v in meta.tensors.items())
    item = meta.items[fqn, t.chunks[0].offsets]
    fd = os.open(folder / item.file, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError, match="written through stream transforms zstd"):
            locate(folder, fd, item, t, t.chunks[0].sizes)
    finally:
        os.close(fd)


def test_damaged_metadata_bytes_give_one_line_or_a_checked_value(tmp_path):
    """A short run of the metadata fuzzer (tests/dcp_fuzzing.py; the long one:
    `python -m bench.dcp_fuzz`)."""
    folder = _copy(tmp_path)
    got = dcp_fuzzing.run(folder, (folder / ".metadata").read_bytes(), 300, seed=43)
    assert got["refused"] > 30, got


# -- inspect ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(DCP_VARIANTS))
def test_inspect_tells_the_layers_and_their_optimizer_state(name):
    """Each layer's elements as the model the run trained has them (its own parameters,
    counted here from the model itself), with Adam's state saved for every layer."""
    import json

    from ckpt_fixtures import spec_for
    from merging import run_cli

    from dev.tinytrain.model import build_model
    from mpitailor.planning.layers import LayerClassifier
    spec = spec_for(name, Path("."))
    want: dict[str, int] = {}
    classify = LayerClassifier({})
    for n, p in build_model(spec).named_parameters():
        want[classify(n)] = want.get(classify(n), 0) + p.numel()
    r = run_cli(["inspect", str(_save(name, 4)), "--json"], {})
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["world_size"] == spec.world_size and rep["kind"] == "dcp"
    assert {k: v["elements"] for k, v in rep["layers"].items()} == want
    assert all(v["optimizer_state"] == ["exp_avg", "exp_avg_sq", "step"]
               for v in rep["layers"].values())
    r = run_cli(["inspect", str(_save(name, 4))], {})
    assert r.returncode == 0 and "PyTorch Distributed Checkpoint" in r.stdout, r.stderr


def test_recovering_a_dcp_checkpoint_says_what_it_is(tmp_path):
    from merging import run_cli
    r = run_cli(["recover", str(_save("dcp_w2_fsdp2", 4)), "-o", str(tmp_path / "o")], {})
    assert r.returncode == 2 and "a DCP checkpoint itself, not a save dir" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


def test_plain_dcp_saves_recover_as_full_saves_outside_a_timeline(tmp_path):
    """Saves without mpitailor's record (a plain dcp.save, torchtitan's): each a full save,
    its step from its name; the newest is recovered, whole."""
    from merging import run_cli
    out = tmp_path / "o"
    r = run_cli(["recover", str(_save("dcp_w2_fsdp2", 4).parent), "-o", str(out)], {})
    assert r.returncode == 0 and "from step-4" in r.stdout, r.stdout + r.stderr
    assert read_metadata(out).tensors == read_metadata(_save("dcp_w2_fsdp2", 4)).tensors


# -- the metadata writer ------------------------------------------------------------------


@pytest.mark.parametrize("name,step", SAVES)
def test_written_metadata_is_what_torch_wrote_as_torch_reads_it(name, step, tmp_path):
    """metadata_bytes of what was read: torch's reader gets the very entries, storage
    items, planner data and version torch's own `.metadata` gives; read back by mpitailor,
    the same values."""
    from mpitailor.formats.dcp import metadata_bytes
    folder = _save(name, step)
    meta = read_metadata(folder)
    data = metadata_bytes(meta)
    mine, theirs = pickle.loads(data), pickle.loads((folder / ".metadata").read_bytes())
    assert mine.state_dict_metadata == theirs.state_dict_metadata
    assert mine.storage_data == theirs.storage_data
    assert (mine.planner_data, mine.version) == (theirs.planner_data, theirs.version)
    assert mine.storage_meta.save_id == theirs.storage_meta.save_id
    (tmp_path / ".metadata").write_bytes(data)
    assert read_metadata(tmp_path) == meta


# -- what an hour's attack found (issue 43): each now refused in one line, or read --------


def test_a_python_313_path_is_read(tmp_path, monkeypatch):
    """Python 3.13 pickles a path as pathlib._local.PosixPath (DCP stores the checkpoint's
    path in its metadata): read as any path."""
    import types
    folder = _copy(tmp_path)

    class PosixPath:  # what 3.13's pickle names
        def __reduce__(self):
            return (PosixPath, ("/", "ckpt"))
    PosixPath.__module__, PosixPath.__qualname__ = "pathlib._local", "PosixPath"
    monkeypatch.setitem(sys.modules, "pathlib._local",
                        types.SimpleNamespace(PosixPath=PosixPath))

    def py313(meta):
        meta.storage_meta.checkpoint_id = PosixPath()
    _rewrite(folder, py313)
    assert b"pathlib._local" in (folder / ".metadata").read_bytes()
    assert read_metadata(folder).tensors


def test_an_fsdp_by_tp_grid_of_chunks_is_read_and_an_overlap_in_it_found(tmp_path):
    """torchtitan's FSDP 64 x TP 8 saves a weight as a 64 x 8 grid of chunks."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    folder = _copy(tmp_path)

    def grid(meta, overlap=False):
        chunks = [ChunkStorageMetadata(torch.Size([4 * i, 2 * j]), torch.Size([4, 2]))
                  for i in range(64) for j in range(8)]
        if overlap:  # the second chunk moved onto the first's rows
            chunks[1].offsets = torch.Size([0, 1])
        meta.state_dict_metadata["model.grid"] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([256, 16]), chunks)
        for c in chunks:
            meta.storage_data[MetadataIndex("model.grid", c.offsets)] = _StorageInfo(
                "__0_0.distcp", 0, 0)
    _rewrite(folder, grid)
    assert len(read_metadata(folder).tensors["model.grid"].chunks) == 512
    folder2 = tmp_path / "second"
    shutil.copytree(_save("dcp_w2_fsdp2", 2), folder2)
    _rewrite(folder2, lambda m: grid(m, overlap=True))
    with pytest.raises(CheckpointError, match="two chunks overlap|chunks hold"):
        read_metadata(folder2)


@pytest.mark.parametrize("damage", ["missing", "truncated", "fifo"])
def test_inspect_and_merge_check_the_data_files(tmp_path, damage):
    from merging import run_cli
    folder = _copy(tmp_path)
    data = folder / "__1_0.distcp"
    if damage == "missing":
        data.unlink()
    elif damage == "truncated":
        data.write_bytes(data.read_bytes()[:10])
    else:
        data.unlink()
        os.mkfifo(data)
    r = run_cli(["inspect", str(folder)], {})
    assert r.returncode == 2 and str(data) in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_locate_says_an_item_past_the_end_of_its_file(tmp_path):
    folder = _copy(tmp_path)
    meta = read_metadata(folder)
    fqn, t = next(iter(meta.tensors.items()))
    item = meta.items[fqn, t.chunks[0].offsets]
    path = folder / item.file
    path.write_bytes(path.read_bytes()[:item.offset + item.length - 2])
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError, match="runs past the end of the file"):
            locate(folder, fd, item, t, t.chunks[0].sizes)
    finally:
        os.close(fd)


def test_planner_data_off_its_paths_is_damage_not_dropped(tmp_path):
    """A flipped byte that re-points a pickle memo makes DefaultSavePlanner's map send a key
    to another path: torch's own reader then looks for entries nobody saved. Refused in one
    line (recovery skips such a save, and says it), never silently dropped (found by
    bench/dcp_recover_fuzz.py, seed 734)."""
    import dataclasses
    import pickle

    from mpitailor.errors import CheckpointError
    from mpitailor.formats.dcp import metadata_bytes
    src = _save("dcp_w2_fsdp2", 4)
    meta = read_metadata(src)
    key = next(iter(meta.planner_data))
    bad = dict(meta.planner_data)
    bad[key] = (("optim", "elsewhere"), *bad[key][1:])
    damaged = dataclasses.replace(meta, planner_data=bad)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(metadata_bytes(damaged))
    assert pickle.loads((folder / ".metadata").read_bytes()).planner_data[key] == bad[key]
    with pytest.raises(CheckpointError) as e:
        read_metadata(folder)
    assert "planner data maps" in str(e.value) and "\n" not in str(e.value)
