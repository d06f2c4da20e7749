"""The same inputs give the same output bytes whatever the number of MPI ranks (1, 2, 3, 5):
here a reshard 2 -> 3 (ZeRO-3, and stage 2 whose parameters straddle ranks);
tests/test_hf_shards.py does the same for a merge with the base's
16-bit weights rebuilt and both exports. With 3 and 5 ranks the ranks outnumber or do not
divide the partitions, so partitions are split into byte ranges and several ranks write one
file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from merging import RECIPES, recipe_env, run_cli

RANKS = (1, 2, 3, 5)
TIMING = ("created", "mpi_ranks")  # the only manifest fields that may differ


def tree(root: Path) -> dict[str, bytes]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name == "mpitailor_manifest.json":
                m = json.loads(data)
                for key in TIMING:
                    m.pop(key)
                data = json.dumps(m, sort_keys=True).encode()
            out[str(p.relative_to(root))] = data
    return out


@pytest.mark.parametrize("name", ["w2_bf16_small_subgroups_tied_frozen", "s2_w2_bf16_per_layer"])
def test_reshard_output_bytes_do_not_depend_on_the_rank_count(ckpt, tmp_path, name):
    args = ["--world-size", "3"]
    new, old = ckpt(name, 10), ckpt(name, 5)
    trees = {}
    for ranks in RANKS:
        out = tmp_path / f"n{ranks}"
        r = run_cli([str(RECIPES / "parity.yml"), "--no-progress", *args],
                    recipe_env(new, old, out), ranks=ranks)
        assert r.returncode == 0, r.stderr
        trees[ranks] = tree(out)
    one = trees[1]
    assert any(k.endswith("optim_states.pt") for k in one)
    for ranks in RANKS[1:]:
        assert trees[ranks].keys() == one.keys(), ranks
        differ = [k for k in one if trees[ranks][k] != one[k]]
        assert not differ, f"{ranks} ranks wrote other bytes than 1 rank in {differ}"
