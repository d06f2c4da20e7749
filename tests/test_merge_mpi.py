"""Under mpiexec -n 2 and -n 3 (the Makefile runs both): the same output as a serial merge,
file for file and tensor for tensor, so 1, 2 and 3 ranks agree."""
from __future__ import annotations

import json
import shutil
import tempfile
import traceback
from pathlib import Path

import pytest
from merge_check import Ckpt, assert_same, check_merge, parity
from merging import merge_in_process, recipe_env
from safetensors.torch import load_file

from mpitailor.cluster.comm import Comm
from mpitailor.formats.torch.safeload import load


def hf_weights(ckpt_dir: Path) -> dict:
    """All tensors of model.safetensors, or of every shard its index names."""
    index = ckpt_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) \
        if index.exists() else ["model.safetensors"]
    return dict(sorted((k, v) for f in files for k, v in load_file(ckpt_dir / f).items()))


def on_root(comm: Comm, fn) -> None:
    """Run fn on rank 0 only; whatever it raises fails every rank, with rank 0's traceback
    (no rank is left waiting in a collective)."""
    err = None
    if comm.rank == 0:
        try:
            fn()
        except Exception:  # noqa: BLE001 - any failure on root must reach every rank
            err = f"rank 0: {traceback.format_exc()}"
    errors = comm.allgather(err)
    assert errors[0] is None, errors[0]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["w3_bf16_decay_tied_frozen", "w4_fp32_per_layer",
                                  "hf_w3_bf16_weights_tied", "s2_w3_fp32_decay_tied_frozen"])
def test_same_output_for_any_number_of_ranks(ckpt, monkeypatch, name):
    comm = Comm.world()
    root = Path(comm.bcast(tempfile.mkdtemp(prefix="mpitailor-mpi-") if comm.rank == 0
                           else None))
    new, old = ckpt(name, 10), ckpt(name, 5)
    try:
        result = merge_in_process("parity.yml", recipe_env(new, old, root / "mpi"),
                                  monkeypatch, comm=comm)
        # The ranks the merge really used against what mpiexec launched (MPI's own count,
        # not mpitailor's): every one of them wrote a share of the output partitions.
        from mpi4py import MPI  # here: collecting this file must not start MPI
        launched = MPI.COMM_WORLD.Get_size()
        assert result.ranks == len(result.rank_stats) == launched
        parts = [set(st["partitions"]) for st in result.rank_stats]
        assert all(parts), parts
        assert set().union(*parts) == set(range(Ckpt(new).world_size)), parts
        manifest = json.loads((root / "mpi" / "mpitailor_manifest.json").read_text())
        assert manifest["mpi_ranks"] == launched

        def compare():
            merge_in_process("parity.yml", recipe_env(new, old, root / "serial"), monkeypatch)
            check_merge(root / "mpi", parity(new, old), base=new)
            tag = (root / "serial" / "latest").read_text()
            files = sorted(p.name for p in (root / "serial" / tag).iterdir())
            assert files == sorted(p.name for p in (root / "mpi" / tag).iterdir())
            for f in files:
                assert_same(load(root / "serial" / tag / f), load(root / "mpi" / tag / f), f)
            if (root / "serial" / "model.safetensors").exists():  # rebuilt 16-bit weights
                assert_same(hf_weights(root / "serial"), hf_weights(root / "mpi"), "weights")
        on_root(comm, compare)
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
