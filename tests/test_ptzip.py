"""The direct torch-file writer (mpitailor/formats/torch/zip_write.py) and the CRC arithmetic under it,
held against torch.save itself, Python's zipfile and torch.load.

The writer is torch-free: it takes objects whose tensors are tensorref.Tensor. Objects made
with torch are handed to it through tests/torch_files.as_refs, and what it writes must be
what torch.save writes for the torch object, byte for byte but for the serialization id."""
from __future__ import annotations

import argparse
import dataclasses
import io
import mmap
import os
import random
import sys
import zipfile
import zlib

import numpy as np
import pytest
import torch
from ckpt_fixtures import VARIANTS, build
from torch.utils.serialization import config as ser_config
from torch_files import as_refs, ref_bytes

from mpitailor.formats.io.crc import crc32_combine, crc32_zeros
from mpitailor.formats.io.filerecord import FileRecord
from mpitailor.formats.torch import opaque, zip_format, zip_write
from mpitailor.formats.torch.safeload import load as safe_load
from mpitailor.formats.torch.tensorref import Tensor

SERIAL_ID = "archive/.data/serialization_id"


# ---- CRC arithmetic ---------------------------------------------------------------------

def test_crc32_combine_matches_zlib_on_random_splits():
    rng = random.Random(7)
    for _ in range(400):
        data = rng.randbytes(rng.randrange(0, 3000))
        cut = rng.choice([0, len(data), rng.randrange(0, len(data) + 1)])  # len2=0 included
        a, b = data[:cut], data[cut:]
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)


def test_crc32_zeros_matches_zlib_and_scales():
    rng = random.Random(8)
    for n in (0, 1, 3, 64, 4095, 65537, (1 << 24) + 7):
        start = rng.getrandbits(32)
        assert crc32_zeros(n) == zlib.crc32(bytes(n))
        assert crc32_zeros(n, start) == zlib.crc32(bytes(n), start)
    # Past what a buffer allows: zeros split anywhere join to the same CRC.
    for big in ((1 << 32) + 5, (1 << 40) + 12345, (1 << 60) - 1):
        tail = rng.randrange(1, 1 << 20)
        whole = crc32_zeros(big + tail)
        assert crc32_combine(crc32_zeros(big), crc32_zeros(tail), tail) == whole
        assert crc32_zeros(tail, crc32_zeros(big)) == whole
        assert crc32_zeros(big, crc32_zeros(tail)) == whole


# ---- objects like DeepSpeed's, written and read back ------------------------------------

def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def optim_like() -> dict:
    """The shape of a ZeRO-3 optim_states file: flat fp32 partitions of odd sizes."""
    g = _gen(1)
    flat = [torch.randn(n, generator=g) for n in (1001, 37, 5)]
    state = {i: {"step": torch.tensor(12.0), "exp_avg": torch.randn(t.numel(), generator=g),
                 "exp_avg_sq": torch.rand(t.numel(), generator=g)} for i, t in enumerate(flat)}
    return {
        "optimizer_state_dict": {
            "zero_stage": 3, "loss_scaler": None, "dynamic_loss_scale": False,
            "overflow": False, "partition_count": [2, 2, 2],
            "optimizer_state_dict": {"state": state, "param_groups": [
                {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                 "params": [0, 1, 2]}]},
            "fp32_flat_groups": flat,
        },
        "ds_config": {"train_batch_size": 8, "zero_optimization": {"stage": 3}},
        "ds_version": "0.16.4",
    }


def mixed() -> dict:
    g = _gen(2)
    base = torch.randn(64, generator=g)
    tagged = torch.randn(6, generator=g)
    tagged.ds_id = 7  # a tensor with attributes (DeepSpeed tags its flat groups so)
    return {
        "bf16": torch.randn(9, generator=g).to(torch.bfloat16),
        "base": base, "view": base[5:17], "rows": base.view(8, 8)[::2],  # one shared storage
        "empty": torch.empty(0), "empty_int": torch.zeros(0, 3, dtype=torch.int64),
        "step": torch.tensor(3), "scalar": torch.tensor(2.5, dtype=torch.float64),
        "nested": [[1, 2.0, "three"], (None, True), {"k": [torch.arange(4)]}],
        "text": "héllo", "n": 10 ** 20, "x": float("inf"),
        "tagged": tagged, "again": tagged, "shape": torch.Size([2, 3]),
    }


OBJECTS = {
    "optim": optim_like,
    "mixed": mixed,
    "tensor": lambda: torch.arange(10, dtype=torch.int16),
    "no_tensors": lambda: {"a": [1, 2.5, "x"], "b": None},
}


def assert_same(got, want) -> None:
    """Equal values, dtypes, shapes and strides (views stay views)."""
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == \
            (want.dtype, want.shape, want.stride(), want.storage_offset())
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert_same(a, b)
    else:
        assert got == want


def torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def masked_serialization_id(data: bytes) -> bytes:
    """The file with its serialization id zeroed (data, descriptor CRC, central CRC): the
    one record ours derives differently from torch's."""
    z = zipfile.ZipFile(io.BytesIO(data))
    info = z.getinfo(SERIAL_ID)
    name_len, extra_len = (int.from_bytes(data[info.header_offset + k:][:2], "little")
                           for k in (26, 28))
    start = info.header_offset + 30 + name_len + extra_len
    cd = data.rindex(b"PK\x01\x02")  # the last central entry: the serialization id's
    assert data[cd + 46:].startswith(SERIAL_ID.encode())
    out = bytearray(data)
    out[start:start + info.file_size + 8] = bytes(info.file_size + 8)
    out[cd + 16:cd + 20] = bytes(4)
    return bytes(out)


def load_every_way(path, monkeypatch) -> list:
    """torch.load plainly, by mmap, and computing storage offsets itself the way torch's
    debug mode checks them (which assumes miniz's exact layout)."""
    out = [torch.load(path, weights_only=True), torch.load(path, weights_only=True, mmap=True)]
    with monkeypatch.context() as m:
        m.setenv("TORCH_SERIALIZATION_DEBUG", "1")
        with ser_config.patch({"load.calculate_storage_offsets": True}):
            out.append(torch.load(path, weights_only=True, mmap=True))
    return out


@pytest.mark.parametrize("which", sorted(OBJECTS))
def test_written_file_is_torch_save_but_for_its_id(which, tmp_path, monkeypatch):
    obj = OBJECTS[which]()
    path = tmp_path / "a.pt"
    record = zip_write.write_torch_file(path, as_refs(obj))
    ours = path.read_bytes()

    whole = FileRecord()
    whole.update(ours)
    assert record == whole.record()  # size and CRC joined from the pieces, not re-read
    for loaded in load_every_way(path, monkeypatch):
        assert_same(loaded, obj)
    if which == "mixed":
        loaded = torch.load(path, weights_only=True, mmap=True)
        assert loaded["view"].untyped_storage().data_ptr() == \
            loaded["base"].untyped_storage().data_ptr()
        assert loaded["tagged"].ds_id == 7 and loaded["again"] is loaded["tagged"]

    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every record's CRC right
        for info in z.infolist():
            extra = int.from_bytes(ours[info.header_offset + 28:][:2], "little")
            data_at = info.header_offset + 30 + len(info.filename) + extra
            assert data_at % 64 == 0, info.filename
        pickled = z.read("archive/data.pkl")

    theirs = torch_saved(obj)
    assert pickled == zipfile.ZipFile(io.BytesIO(theirs)).read("archive/data.pkl")
    assert pickled == zip_write.describe(as_refs(obj)).pickle
    assert masked_serialization_id(ours) == masked_serialization_id(theirs)

    again = tmp_path / "b.pt"
    zip_write.write_torch_file(again, as_refs(OBJECTS[which]()))
    assert again.read_bytes() == ours  # deterministic, serialization id included


# ---- the engine's way: layout first, big data from elsewhere, headers last --------------

def test_layout_first_big_data_later(tmp_path, monkeypatch):
    n = 100_003
    placeholder = Tensor.empty(n)  # no bytes anywhere: stands for a partition-sized tensor
    obj = {"state": {0: {"step": Tensor.scalar(7.0, "fp32"), "exp_avg": placeholder}},
           "ids": [1, 2]}
    tf = zip_write.describe(obj)
    lay = tf.layout()
    (big,) = [i for i, r in tf.storages() if r.storage is placeholder.storage]
    assert tf.records[big].size == 4 * n

    want = torch.randn(n, generator=_gen(3))
    path = tmp_path / "late.pt"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    try:
        os.ftruncate(fd, lay.size)
        crcs: list[int | None] = [None] * len(tf.records)
        for i, (rec, e) in enumerate(zip(tf.records, lay.entries)):
            os.pwrite(fd, lay.local_header(i), e.header_offset)  # no CRC in it
            if i != big:
                data = rec.data if rec.storage is None else rec.storage.read()
                os.pwrite(fd, data, e.data_offset)
                crcs[i] = zlib.crc32(data)
        payload = want.numpy().tobytes()  # "from elsewhere": another process, another file
        os.pwrite(fd, payload, lay.entries[big].data_offset)
        crcs[big] = zlib.crc32(payload)
        for offset, data in lay.pieces(crcs):  # descriptors and the tail, CRCs now known
            os.pwrite(fd, data, offset)
    finally:
        os.close(fd)

    written = path.read_bytes()
    assert len(written) == lay.size and zlib.crc32(written) == lay.file_crc(crcs)
    assert zipfile.ZipFile(path).testzip() is None
    for loaded in load_every_way(path, monkeypatch):
        assert torch.equal(loaded["state"][0]["exp_avg"], want)
        assert loaded["state"][0]["step"].item() == 7.0 and loaded["ids"] == [1, 2]
    # What torch.save writes for the same object with those values, but for the id.
    theirs = torch_saved({"state": {0: {"step": torch.tensor(7.0), "exp_avg": want}},
                          "ids": [1, 2]})
    assert masked_serialization_id(written) == masked_serialization_id(theirs)


# ---- zip64: a record over 4 GiB, without writing 4 GiB ----------------------------------

def test_zip64_record_in_a_sparse_file(tmp_path, monkeypatch):
    n = (1 << 30) + 17  # float32: 4 GiB + 68 bytes, never touched (no memory used)
    # Mapped shared from a sparse file, not torch.empty: an anonymous 4 GiB would count
    # against a machine's commit limit under strict overcommit (CI), with other tests'.
    hole = tmp_path / "hole.bin"
    hole.touch()
    os.truncate(hole, 4 * n)
    x = torch.from_file(str(hole), shared=True, size=n, dtype=torch.float32)
    obj = {"a": torch.arange(3.0), "x": x, "b": torch.ones(2)}
    tf = zip_write.describe(as_refs(obj))  # zero-copy: the 4 GiB are never touched
    lay = tf.layout()
    big = next(i for i, r in enumerate(tf.records) if r.size > zip_format.MAX32)
    assert lay.entries[big + 1].header_offset > zip_format.MAX32  # records after it go zip64 too

    path = tmp_path / "big.pt"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    try:
        try:
            os.ftruncate(fd, lay.size)
        except OSError as e:
            pytest.skip(f"{tmp_path}: the filesystem refuses a {lay.size}-byte file ({e})")
        if os.fstat(fd).st_blocks * 512 >= 1 << 30:
            pytest.skip(f"{tmp_path}: the filesystem allocates holes (no sparse files), and "
                        "this test must not write 4 GiB")
        crcs = []
        for i, (rec, e) in enumerate(zip(tf.records, lay.entries)):
            if i == big:
                crcs.append(crc32_zeros(rec.size))  # the hole reads as zeros
                continue
            data = rec.data if rec.storage is None else rec.storage.read()
            os.pwrite(fd, data, e.data_offset)
            crcs.append(zlib.crc32(data))
        for offset, data in lay.pieces(crcs):
            os.pwrite(fd, data, offset)
    finally:
        os.close(fd)

    infos = zipfile.ZipFile(path).infolist()
    assert [(i.filename, i.file_size, i.compress_size, i.header_offset, i.CRC) for i in infos] \
        == [(e.name, e.size, e.size, e.header_offset, c) for e, c in zip(lay.entries, crcs)]

    # torch's own writer, told to skip the data, lays out the same object: same headers.
    oracle = tmp_path / "archive.pt"  # the folder name torch derives from a path: "archive"
    with torch.serialization.skip_data():
        torch.save(obj, oracle)
    with open(path, "rb") as f, open(oracle, "rb") as g:
        assert os.fstat(g.fileno()).st_size == lay.size
        for i, e in enumerate(lay.entries):
            f.seek(e.header_offset)
            g.seek(e.header_offset)
            span = e.data_offset - e.header_offset
            assert f.read(span) == g.read(span) == lay.local_header(i)
    theirs = zipfile.ZipFile(oracle).infolist()
    assert [(i.filename, i.header_offset, i.file_size, i.extra, i.flag_bits) for i in infos] \
        == [(i.filename, i.header_offset, i.file_size, i.extra, i.flag_bits) for i in theirs]

    with monkeypatch.context() as m:
        m.setenv("TORCH_SERIALIZATION_DEBUG", "1")  # offsets torch computes == the real ones
        with ser_config.patch({"load.calculate_storage_offsets": True}):
            # MAP_SHARED: read-only use, and no commit charge (a private writable map has one)
            torch.serialization.set_default_mmap_options(mmap.MAP_SHARED)
            try:
                loaded = torch.load(path, weights_only=True, mmap=True)
            finally:
                torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE)
    x = loaded["x"]
    assert x.shape == (n,)
    assert x[:4].tolist() == [0.0] * 4 and x[-4:].tolist() == [0.0] * 4
    assert torch.equal(loaded["a"], obj["a"]) and torch.equal(loaded["b"], obj["b"])


# ---- stand-ins for untrusted objects ----------------------------------------------------

@dataclasses.dataclass
class RunInfo:  # a training script's own class, as client state holds them
    name: str
    epochs: int


# As a script's own class pickles (the script runs as __main__): mpitailor carries those alone
# without --safe-globals.
RunInfo.__module__ = "__main__"
setattr(sys.modules["__main__"], "RunInfo", RunInfo)


def client_state_like() -> dict:
    return {"args": argparse.Namespace(lr=0.1, tag="x"), "best": np.float64(0.25),
            "info": RunInfo("run", 3), "w": torch.arange(4.0), "step": 9}


def test_opaque_stand_ins_written_as_torch_writes_them(tmp_path):
    """Client-state objects, loaded as stand-ins and written back, are the very bytes that
    torch.save writes for the real objects."""
    src = tmp_path / "src.pt"
    torch.save(client_state_like(), src)
    obj = safe_load(src, allow=(), opaque_ok=True)
    assert all(isinstance(obj[k], opaque.Opaque) for k in ("args", "best", "info"))

    out = tmp_path / "out.pt"
    zip_write.write_torch_file(out, obj)
    ours = out.read_bytes()
    theirs = torch_saved(client_state_like())
    assert zipfile.ZipFile(out).read("archive/data.pkl") == \
        zipfile.ZipFile(io.BytesIO(theirs)).read("archive/data.pkl")
    assert masked_serialization_id(ours) == masked_serialization_id(theirs)
    back = safe_load(out, allow=(), opaque_ok=True)
    assert all(back[k] == obj[k] for k in ("args", "best", "info", "step"))
    assert ref_bytes(back["w"]) == ref_bytes(obj["w"])
    real = torch.load(out, weights_only=False)  # what a trusting loader builds from it
    want = client_state_like()
    assert real["args"] == want["args"] and real["info"] == want["info"]
    assert real["best"] == want["best"] and torch.equal(real["w"], want["w"])


def test_torch_tensors_are_refused():
    """The writer takes tensorref Tensors; a torch tensor handed to it by mistake must not
    be pickled some other way (torch.storage._load_from_bytes: a file weights-only loaders,
    mpitailor's included, refuse)."""
    with pytest.raises((TypeError, ValueError)):
        zip_write.describe({"x": torch.arange(3.0)})


# ---- every fixture file: loaded and written back, the same pickle and records ------------

def _records(path) -> tuple[bytes, list[tuple[str, int, int]]]:
    """data.pkl, and (name inside the archive folder, size, CRC) of every record but the
    serialization id, in the file's order."""
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        pickled = z.read(next(i for i in infos if i.filename.endswith("/data.pkl")))
    recs = [(i.filename.partition("/")[2], i.file_size, i.CRC) for i in infos]
    return pickled, [r for r in recs if r[0] != ".data/serialization_id"]


def test_every_fixture_file_written_back_is_the_same(tmp_path):
    """Every .pt file of the cached fixtures (real DeepSpeed and mpitailor saves), loaded
    (tensors as references, client state as stand-ins) and written with the torch-free
    writer, has the source's data.pkl bytes and the same records with the same CRCs."""
    from mpitailor.errors import CheckpointError
    files = sorted(p for name in sorted(VARIANTS) for p in build(name).rglob("*.pt"))
    assert len(files) > 100, len(files)
    guard = "mpitailor.training.partial_save.refuse_partial_resume"
    guards = 0
    for i, src in enumerate(files):
        if guard in torch.serialization.get_unsafe_globals_in_checkpoint(str(src)):
            # a partial save's guard: DeepSpeed's loader calls it; mpitailor's refuses calls
            with pytest.raises(CheckpointError, match=f"refused to load: it (calls|pickles) {guard}"):
                safe_load(src, opaque_ok=True)
            guards += 1
            continue
        out = tmp_path / f"{i}.pt"
        zip_write.write_torch_file(out, safe_load(src, allow=("deepspeed", "numpy"),
                                              opaque_ok=True))
        assert _records(out) == _records(src), src
        out.unlink()
    assert 0 < guards < len(files) // 2, guards


def test_containers_nested_past_the_bound_are_refused_in_one_line(tmp_path):
    """A crafted pickle nests lists 100000 deep (the unpickler itself does not recurse, but
    copying and re-pickling would): refused by name at load, not a RecursionError later."""
    from mpitailor.errors import CheckpointError
    n = 100_000
    path = tmp_path / "deep.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02" + b"]" * n + b"a" * (n - 1) + b".")
        z.writestr("archive/version", b"3\n")
    with pytest.raises(CheckpointError, match=r"deep\.pt: containers nested over 200 levels"):
        safe_load(path)
    shallow = tmp_path / "shallow.pt"
    with zipfile.ZipFile(shallow, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02" + b"]" * 150 + b"a" * 149 + b".")
        z.writestr("archive/version", b"3\n")
    assert isinstance(safe_load(shallow), list)
