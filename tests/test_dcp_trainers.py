"""The Accelerate and HF Trainer loops with FSDP2 of docs/dcp.md run as written (issue 43,
part 4): on 2 CPU processes each saves layer by layer (Parity: full at step 2, odd layers at
4, even at 6), is killed (kill -9) publishing its step-8 save, and run again on 1 process it
resumes from the composite recover_for_resume assembles with the very losses of the same
script resuming from the composite torch's own DCP reader assembles from the saves.

Cost: three runs of each script, ~12 s each on the 2-core machine (most of it imports)."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from dcp_oracle import layer_of, torch_state
from doc_scripts import run_ranks

from mpitailor.formats.dcp import read_dcp_save_record

PAGE = Path(__file__).resolve().parents[1] / "docs" / "dcp.md"
KILL_AT_8 = {"MPITAILOR_FAILPOINT": "commit/checkpoint-8:0"}  # rank 0, publishing step 8


def dcp_doc_script(marker: str) -> str:
    m = re.search(rf"<!-- {marker} -->\n```python\n(.*?)```\n<!-- /{marker} -->",
                  PAGE.read_text(), re.DOTALL)
    assert m, f"docs/dcp.md lost its {marker}"
    return m.group(1)


def losses_after(log: Path, step: int) -> dict[int, float]:
    """The losses rank 0 printed (`step N loss X`) of the steps after `step`."""
    found = {int(a): float(b) for a, b in re.findall(r"^step (\d+) loss (\S+)$",
                                                      log.read_text(), re.MULTILINE)}
    return {k: v for k, v in found.items() if k > step}


def parity_newest(layer: str | None) -> int:
    return 4 if layer in ("layers.1", "layers.3") else 6


@pytest.mark.parametrize("marker", ["accelerate-fsdp2-example", "hf-fsdp2-example"])
def test_killed_in_a_save_resumes_at_another_size_as_from_torchs_composite(tmp_path, marker):
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "train.py").write_text(dcp_doc_script(marker))
    codes = run_ranks(killed / "train.py", killed, KILL_AT_8)
    assert codes[0] == -9, (killed / "rank0.log").read_text()[-3000:]
    run = killed / "run"
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == \
        ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    full, odd, even = (read_dcp_save_record(run / f"checkpoint-{s}") for s in (2, 4, 6))
    assert full.layers is None
    assert odd.layers == {"embed", "layers.1", "layers.3", "norm", "lm_head"}
    assert even.layers == {"embed", "layers.0", "layers.2", "norm", "lm_head"}
    assert even.lineage.parent == odd.lineage.save_id and odd.lineage.parent == \
        full.lineage.save_id
    saved = {s: torch_state(run / f"checkpoint-{s}", tmp_path) for s in (2, 4, 6)}
    # a partial save holds the chosen layers' weights and optimizer state, and the
    # trainer's own entries whole
    assert not [k for k in saved[4] if layer_of(k) in ("layers.0", "layers.2")]
    assert any(k.startswith("optim.state.") and "layers.1." in k for k in saved[4])
    assert {k for k in saved[4] if layer_of(k) is None} == \
        {k for k in saved[2] if layer_of(k) is None}
    assert any(k.startswith("rng.1.") for k in saved[6])

    # The oracle: torch's reader assembles the composite, entry by entry, into a save dir
    # of its own (a plain dcp.save, the only save there: resumed from as it is).
    import torch
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
    composite = {k: saved[parity_newest(layer_of(k))][k] for k in saved[2]}
    oracle = tmp_path / "oracle"
    shutil.copytree(killed, oracle, ignore=shutil.ignore_patterns("run", "rank*.log"))
    torch.save(composite, tmp_path / "composite.pt")
    torch_save_to_dcp(str(tmp_path / "composite.pt"), str(oracle / "run" / "checkpoint-6"))

    mine = tmp_path / "requeued"
    shutil.copytree(killed, mine, ignore=shutil.ignore_patterns("rank*.log"))
    for where in (mine, oracle):
        codes = run_ranks(where / "train.py", where, ranks=1)
        assert codes == [0], (where / "rank0.log").read_text()[-3000:]
    log = (mine / "rank0.log").read_text()
    assert "recovered from the full save checkpoint-2 and the partial saves checkpoint-4, " \
           "checkpoint-6" in log, log[-3000:]
    got, want = losses_after(mine / "rank0.log", 6), losses_after(oracle / "rank0.log", 6)
    assert sorted(got) == [7, 8] and got == want
    # the resumed run saved on: its first save starts a new timeline, a full one
    assert read_dcp_save_record(mine / "run" / "checkpoint-8").layers is None
