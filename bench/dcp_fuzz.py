"""The DCP metadata fuzzer, long (issue 43): random damage to the `.metadata` of a real FSDP2
checkpoint (tests/ckpt_fixtures.py: dcp_w2_fsdp2, step 2), each input read by mpitailor's
torch-free reader; every one must give a checked value or one CheckpointError line.

    python -m bench.dcp_fuzz [--count 20000] [--seed 1] [--json bench/results/dcp_fuzz.json]

Prints the outcomes; writes JSON.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import ckpt_fixtures  # noqa: E402 - tests/ is put on the path just above
import dcp_fuzzing  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "out" / "dcp_fuzz.json")
    args = ap.parse_args()
    source = ckpt_fixtures.build("dcp_w2_fsdp2") / "step-2"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ck"
        shutil.copytree(source, folder)
        t = time.perf_counter()
        got = dcp_fuzzing.run(folder, (source / ".metadata").read_bytes(), args.count,
                              args.seed)
        got.update(seed=args.seed, seconds=round(time.perf_counter() - t, 1),
                   metadata_bytes=(source / ".metadata").stat().st_size,
                   date=time.strftime("%Y-%m-%d"))
    print(f"{got['inputs']} damaged .metadata files: {got['refused']} refused in one line, "
          f"{got['read']} read and checked; worst {got['worst_s']:.3f} s; 0 other outcomes")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(got, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
