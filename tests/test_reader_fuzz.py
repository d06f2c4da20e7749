"""The reader against torch's weights-only loader (issue 40, part 3a): a short seeded sample
of the differential fuzzer (reader_fuzzing.py, reader_oracle.py), a standing guard.

Mutated real DeepSpeed and HF Trainer files, objects torch.save wrote and pickles assembled
opcode by opcode go through `safeload.load` and `torch.load(weights_only=True)`; the test
fails on any finding: mpitailor accepting what torch refuses (but for the stand-ins listed in
reader_oracle.STAND_INS), both accepting different objects, any exception but
CheckpointError, bytes from outside the file's own records, walkers that follow every path
through shared containers, a MemoryError under the fuzzer's address-space bound. The long
run, with reproducers: `python -m bench.reader_fuzz` (bench/README.md).
"""
from __future__ import annotations

import collections

import ckpt_fixtures
import pytest
import reader_compare as compare
import reader_fuzzing as fz
import reader_oracle as oracle

from mpitailor.formats.torch.tensorref import Storage, Tensor

SEED, COUNT = 40, 2000  # ~10 ms an input: the long run is bench/reader_fuzz.py


@pytest.fixture(scope="module")
def seeds():
    fz.plant_marker()
    dirs = [ckpt_fixtures.build(name) for name in fz.SEED_FIXTURES]
    return fz.load_seeds(fz.seed_files(dirs))


def test_real_files_read_as_torch_reads_them(seeds, tmp_path):
    """The unmutated seeds: both read them, to the same objects (the oracle's own check)."""
    assert len(seeds) >= 8
    for s in seeds:
        got = oracle.judge(fz.Input("seed", fz.build_zip(s.records), s.label, s.allow),
                           tmp_path / "seed.pt")
        assert got.verdict == "agree-accept", (s.label, got)


def test_the_checks_see_bytes_from_elsewhere(tmp_path):
    """A storage pointed at another file (the planted marker) is reported (views past their
    storage no longer get built: tensorref.Tensor refuses them itself)."""
    fz.plant_marker()
    own = tmp_path / "own.pt"
    own.write_bytes(bytes(4096))
    marker = Tensor(Storage("u8", 64, path=own, offset=0), 0, (64,), (1,))
    elsewhere = Tensor(Storage("u8", 64, path=fz.MARKER_PATH, offset=0), 0, (64,), (1,))
    assert compare.outside({"a": marker}, own) is None
    assert "another file" in compare.outside({"a": [elsewhere]}, own)


def test_reader_agrees_with_torch(seeds, tmp_path):
    path = tmp_path / "input.pt"
    verdicts, found = collections.Counter(), {}
    with oracle.memory_limited():
        for index in range(COUNT):
            inp = fz.make_input(SEED, index, seeds)
            got = oracle.judge(inp, path)
            verdicts[got.verdict] += 1
            if oracle.finding(got):
                found.setdefault((got.verdict, got.sig), []).append(index)
    assert verdicts["agree-accept"] > COUNT // 10 and verdicts["agree-refuse"] > COUNT // 10
    assert not found, f"{len(found)} kinds of finding in {COUNT} inputs:\n" + "\n".join(
        f"  {v}: {sig} ({len(ix)} inputs; replay: python -m bench.reader_fuzz --seed {SEED} "
        f"--only {ix[0]})" for (v, sig), ix in sorted(found.items()))
