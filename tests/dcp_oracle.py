"""What a DCP checkpoint holds as torch's own reader reads it (`dcp_to_torch_save`): the
oracle of the DCP tests, never mpitailor's reader; and a merge run through the real CLI."""
from __future__ import annotations

import re
from pathlib import Path

from merging import run_cli


def layer_of(entry: str) -> str | None:
    """The layer key of a state-dict entry of the tiny Llama, None outside the layers."""
    if m := re.search(r"layers\.(\d+)\.", entry):
        return f"layers.{m.group(1)}"
    for part, key in (("embed_tokens", "embed"), ("model.norm.", "norm"), ("lm_head", "lm_head")):
        if part in entry:
            return key
    return None


def torch_state(path: Path, tmp: Path, flat: bool = True) -> dict:
    """The checkpoint at path as torch loads it whole: its entries under their flattened keys
    (`model.x.weight`), or (flat=False) as dcp_to_torch_save nests them."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    pt = tmp / f"torch-{abs(hash(str(path)))}.pt"
    dcp_to_torch_save(str(path), str(pt))
    state = torch.load(pt, weights_only=False)
    pt.unlink()
    return _flattened(state) if flat else state


def _flattened(d: dict, pre: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flattened(v, f"{pre}{k}.") if isinstance(v, dict) else {pre + k: v})
    return out


def merged(tmp: Path, recipe: Path, out: str = "out", ranks: int = 1) -> Path:
    """`merge recipe -o tmp/out` on `ranks` ranks, which must succeed."""
    r = run_cli(["merge", str(recipe), "-o", str(tmp / out)], {}, ranks=ranks)
    assert r.returncode == 0, r.stdout + r.stderr
    return tmp / out
