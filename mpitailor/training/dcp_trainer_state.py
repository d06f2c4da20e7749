"""What a trainer keeps besides the model and optimizer, as entries of its DCP save: each
rank's random generators under `rng.<rank>` (DCP writes each rank's own entry), found again
at resume by the rank of the same number.

A trainer built on DCP (the Accelerate and HF Trainer checkpointers of dcp_accel.py and
dcp_hf.py) saves its small state inside the one DCP checkpoint it writes, not as files beside
it: a composite that `recover` assembles is a DCP checkpoint and nothing else, taking every
entry outside the layers (these) whole from the newest save, so they reach a resume through
it as the weights do. Values are plain Python, numpy and bytes (a generator's state as bytes,
not a tensor: DCP would shard a tensor entry as a weight), what mpitailor's merge copies
after reading them through its allow-list.
"""
from __future__ import annotations

import logging
import random
from pathlib import Path

from mpitailor.training import dependencies

with dependencies(__name__):
    import numpy as np
    import torch

from mpitailor.training import dcp_state
from mpitailor.training.notice import make_visible

log = logging.getLogger(__name__)
RNG = "rng"


def rng_entry(rank: int) -> dict:
    """This rank's generators (python, numpy, torch's CPU one and every CUDA device's), as
    the entry `rng.<rank>` of a save."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_available():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return {RNG: {str(rank): state}}


def rng_to_load(path: Path, rank: int) -> dict:
    """The entry of this rank's generators to load from the checkpoint at path, or {} when
    it holds none (saved by fewer ranks: that rank says its streams start afresh)."""
    names = dcp_state.entry_names(path)
    if any(n.startswith(f"{RNG}.{rank}.") for n in names):
        return rng_entry(rank)  # the template dcp.load fills in place
    make_visible()
    log.warning("%s holds no random state of rank %d (saved by another number of "
                "ranks): its random streams start afresh, the rest resume exactly",
                path, rank)
    return {}


def restore_rng(loaded: dict, rank: int) -> None:
    """Set this rank's generators from what rng_to_load's entry was filled with."""
    state = loaded.get(RNG, {}).get(str(rank))
    if state is None:
        return
    random.setstate(_tuples(state["python"]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(b), dtype=torch.uint8)
                                      for b in state["cuda"]])


def _tuples(value):
    """random.setstate wants tuples where a round trip may give lists."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
