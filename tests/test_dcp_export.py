"""`export --format hf` of a PyTorch Distributed Checkpoint (issue 43): the model's weights of
real FSDP2 saves as HF safetensors. The oracle is torch's own reader (dcp_to_torch_save) and
safetensors' (load_file): every exported tensor bit-equal to the checkpoint's, named as
save_pretrained names it; transformers loads the export and runs it; the bytes do not depend
on the number of MPI ranks; bad input is one line, exit 2, nothing published."""
from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from ckpt_fixtures import build, spec_for
from merging import run_cli

from mpitailor.formats.dcp import Chunk, TensorEntry, read_metadata
from mpitailor.formats.manifest import MANIFEST
from mpitailor.planning.dcp_hf import count_runs, pieces, runs_of

NAME = "dcp_w2_fsdp2"          # 2 ranks, even chunks
UNEVEN = "dcp_w3_fsdp2_groups"  # 3 ranks, uneven chunks


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """The fixture model's config (a tiny Llama), saved as from_pretrained reads it."""
    from dev.tinytrain.model import tiny_config
    d = tmp_path_factory.mktemp("config")
    tiny_config(spec_for(NAME, build(NAME))).save_pretrained(d)
    return d


def _export(tmp_path: Path, src: Path, config: Path | None, *extra: str, out: str = "out",
            ranks: int = 1):
    args = ["export", str(src), "-o", str(tmp_path / out), *extra]
    return run_cli(args + (["--config", str(config)] if config else []), {}, ranks=ranks)


def _ok(r, tmp_path: Path, out: str = "out") -> Path:
    assert r.returncode == 0, r.stdout + r.stderr
    return tmp_path / out


def _torch_model(src: Path, tmp_path: Path) -> dict:
    """The checkpoint's `model` state dict as torch's own reader gives it."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    pt = tmp_path / "oracle.pt"
    dcp_to_torch_save(str(src), str(pt))
    return torch.load(pt, weights_only=False)["model"]


def _loaded(out: Path) -> dict:
    from safetensors.torch import load_file
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    return got


def check_export(out: Path, want: dict, dtype=None) -> None:
    """What a correct export is: every model tensor, named without `model.`, bit-equal to
    torch's (cast as torch's .to(dtype) casts it), an index naming each tensor's file when
    sharded, the config saying the dtype, a manifest."""
    import torch
    got = _loaded(out)
    assert set(got) == set(want)
    for name, value in want.items():
        value = value.to(dtype) if dtype is not None else value
        bits = {2: torch.int16, 4: torch.int32}[value.element_size()]
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(got[name].view(bits), value.view(bits)), name
    files = sorted(p.name for p in out.glob("*.safetensors"))
    if len(files) > 1:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(want) and set(index["weight_map"].values()) \
            == set(files)
    else:
        assert files == ["model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == str(dtype or next(iter(want.values())).dtype)[6:]
    assert (out / MANIFEST).is_file()


@pytest.mark.parametrize("run,extra,dtype", [
    (NAME, [], None),
    (NAME, ["--max-shard-size", "100KB"], None),   # sharded: 8 files and an index
    (NAME, ["--dtype", "bf16"], "bfloat16"),
    (UNEVEN, ["--dtype", "fp16", "--max-shard-size", "200KB"], "float16")])
def test_every_tensor_is_the_one_torch_reads(tmp_path, config, run, extra, dtype):
    import torch
    src = build(run) / "step-4"
    out = _ok(_export(tmp_path, src, config, *extra), tmp_path)
    check_export(out, _torch_model(src, tmp_path), getattr(torch, dtype) if dtype else None)


def test_transformers_loads_the_export_and_runs_it(tmp_path, config):
    import torch
    from transformers import AutoModelForCausalLM
    src = build(NAME) / "step-4"
    out = _ok(_export(tmp_path, src, config, "--max-shard-size", "300KB"), tmp_path)
    model = AutoModelForCausalLM.from_pretrained(out)
    want = _torch_model(src, tmp_path)
    for name, p in model.state_dict().items():
        assert torch.equal(p, want[name]), name
    spec = spec_for(NAME, build(NAME))
    ids = torch.randint(0, spec.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 16, spec.vocab) and torch.isfinite(logits).all()


@pytest.mark.parametrize("extra", [["--max-shard-size", "100KB"], ["--dtype", "bf16"]])
def test_the_same_bytes_at_one_and_two_ranks(tmp_path, config, extra):
    src = build(NAME) / "step-4"
    one = _ok(_export(tmp_path, src, config, *extra, out="one"), tmp_path, "one")
    r = _export(tmp_path, src, config, *extra, out="two", ranks=2)
    two = _ok(r, tmp_path, "two")
    assert "by 2 rank(s)" in r.stdout, r.stdout
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in two.iterdir())
    for n in names:
        if n != MANIFEST:
            assert (one / n).read_bytes() == (two / n).read_bytes(), n
    files = {k: v for k, v in json.loads((two / MANIFEST).read_text())["files"].items()}
    assert files == json.loads((one / MANIFEST).read_text())["files"]  # sizes and CRCs
    r = run_cli(["verify", str(two)], {})
    assert r.returncode == 0, r.stdout + r.stderr


def _refused(r, tmp_path: Path, *words: str) -> None:
    """Exit 2, one line that says `words`, nothing published and nothing left staged."""
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if "staging" in p.name]


def _copy(src: Path, dest: Path) -> Path:
    dest.mkdir()
    for p in src.iterdir():
        (dest / p.name).write_bytes(p.read_bytes())
    return dest


def test_a_truncated_data_file_is_refused_in_one_line(tmp_path, config):
    src = _copy(build(NAME) / "step-4", tmp_path / "src")
    data = src / "__1_0.distcp"
    os.truncate(data, data.stat().st_size // 2)
    _refused(_export(tmp_path, src, config, ranks=2), tmp_path, str(data), "truncated")


def test_a_chunk_missing_from_the_metadata_is_refused_in_one_line(tmp_path, config):
    """The .metadata loses the storage record of one model chunk (torch's own classes,
    edited and pickled back as DCP pickles them)."""
    src = _copy(build(NAME) / "step-4", tmp_path / "src")
    with open(src / ".metadata", "rb") as f:
        meta = pickle.load(f)
    gone = next(k for k in meta.storage_data if k.fqn.startswith("model.model.layers.1."))
    del meta.storage_data[gone]
    with open(src / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    _refused(_export(tmp_path, src, config), tmp_path, str(src / ".metadata"))


def test_a_checkpoint_without_model_entries_is_refused_in_one_line(tmp_path, config):
    src = _copy(build(NAME) / "step-4", tmp_path / "src")
    with open(src / ".metadata", "rb") as f:
        meta = pickle.load(f)
    for key in [k for k in meta.state_dict_metadata if k.startswith("model.")]:
        del meta.state_dict_metadata[key]
    meta.storage_data = {k: v for k, v in meta.storage_data.items()
                         if not k.fqn.startswith("model.")}
    with open(src / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    _refused(_export(tmp_path, src, config), tmp_path, str(src), "no `model.` entries")


@pytest.mark.parametrize("args,words", [
    ([], ("--config", "no config.json")),
    (["--format", "fp32"], ("--format hf only",))])
def test_what_a_dcp_export_does_not_take_is_refused_in_one_line(tmp_path, config, args,
                                                                words):
    given = None if not args else config
    _refused(_export(tmp_path, build(NAME) / "step-4", given, *args), tmp_path, *words)


GRIDS = [((6, 4), [((0, 0), (3, 4)), ((3, 0), (3, 4))]),                  # FSDP2's dim 0
         ((6, 4), [((0, 0), (6, 1)), ((0, 1), (6, 3))]),                  # dim 1 (TP)
         ((4, 6, 2), [((0, 0, 0), (2, 6, 2)), ((2, 0, 0), (2, 3, 2)),
                      ((2, 3, 0), (2, 3, 2))]),                           # a 2-D grid
         ((5,), [((0,), (2,)), ((2,), (3,))]),
         ((), [((), ())])]                                                 # a scalar


@pytest.mark.parametrize("size,chunks", GRIDS)
def test_any_chunk_grid_gives_the_tensor_back(size, chunks):
    """runs_of/pieces against numpy: each chunk's row-major elements, placed by the runs,
    rebuild the tensor, for every range asked."""
    full = np.arange(math.prod(size)).reshape(size)
    entry = TensorEntry("fp32", size, tuple(Chunk(o, s) for o, s in chunks))
    flat = [full[tuple(slice(a, a + n) for a, n in zip(o, s))].ravel() for o, s in chunks]
    rs = runs_of(entry)
    assert count_runs("t", entry, "here") == len(rs)
    starts = [r.start for r in rs]
    total = math.prod(size)
    for lo in range(total):
        for hi in range(lo + 1, total + 1):
            got = np.concatenate([flat[c][a:a + n] for c, a, n in pieces(rs, starts, lo, hi)])
            assert (got == full.ravel()[lo:hi]).all(), (lo, hi)


def test_the_fixture_is_read_as_torch_chunks_it():
    """The FSDP2 fixture's tensors are cut along dim 0: one run per chunk."""
    meta = read_metadata(build(NAME) / "step-4")
    for fqn, e in meta.tensors.items():
        if fqn.startswith("model."):
            assert len(runs_of(e)) == len(e.chunks), fqn


def test_a_rank_killed_after_writing_publishes_nothing(tmp_path, config):
    """Rank 1 dies once its share is written (the failpoint `export`): no output; the next
    run reclaims what the killed one left and publishes."""
    src = build(NAME) / "step-4"
    args = ["export", str(src), "-o", str(tmp_path / "out"), "--config", str(config)]
    r = run_cli(args, {"MPITAILOR_FAILPOINT": "export:1"}, ranks=2)
    assert r.returncode != 0 and not (tmp_path / "out").exists(), r.stdout + r.stderr
    out = _ok(run_cli(args, {}, ranks=2), tmp_path)
    check_export(out, _torch_model(src, tmp_path))


def test_a_save_dir_exports_its_newest_composite_without_writing_it(tmp_path, config):
    """`export SAVE_DIR` of layer-wise saves (dcp_w2_parity: full 2, odd 4, even 6, odd 8):
    the weights of the composite `recover` writes, read where they lie in the saves (no
    composite written), the same bytes at 1 and 2 ranks; a partial save alone is refused."""
    from conftest import tree_digest
    run = build("dcp_w2_parity")
    assert run_cli(["recover", str(run), "-o", str(tmp_path / "composite")], {}).returncode == 0
    want = _ok(_export(tmp_path, tmp_path / "composite", config, out="want"), tmp_path, "want")
    digests = []
    for ranks in (1, 2):
        r = _export(tmp_path, run, config, out=f"got{ranks}", ranks=ranks)
        out = _ok(r, tmp_path, f"got{ranks}")
        assert "from step-6, step-8" in r.stdout, r.stdout
        digests.append({k: v for k, v in tree_digest(out).items() if k != MANIFEST})
        manifest = json.loads((out / MANIFEST).read_text())
        assert {s["global_steps"] for s in manifest["sources"].values()} == {6, 8}
    assert digests[0] == digests[1]
    assert digests[0] == {k: v for k, v in tree_digest(want).items() if k != MANIFEST}
    check_export(want, _torch_model(tmp_path / "composite", tmp_path))
    r = _export(tmp_path, run / "step-8", config, out="partial")
    assert r.returncode == 2 and "a partial save" in r.stderr, r.stderr
    assert f"mpitailor export {run}" in r.stderr and not (tmp_path / "partial").exists()
