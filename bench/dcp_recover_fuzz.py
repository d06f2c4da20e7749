"""The DCP recovery fuzzer, long: seeded damage to a real save dir of DCP saves (a 2-rank
FSDP2 run's full save and partial saves, tests/dcp_recover_fuzzing.py), each input
recovered in-process and judged against torch's own reader (tests/dcp_recover_oracle.py).

    python -m bench.dcp_recover_fuzz [--count 5000] [--seed 1] [--json PATH]

Prints outcomes by kind of damage; writes JSON. Exits 1 on any violation.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import dcp_recover_oracle  # noqa: E402 - tests/ is put on the path just above

from dev.tinytrain.launch import launch  # noqa: E402
from dev.tinytrain.spec import TrainSpec  # noqa: E402

OUTCOMES = ("composite", "skipped", "error", "VIOLATION")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path,
                    default=REPO / "bench" / "results" / "dcp_recover_fuzz.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "logs").mkdir()
        launch(TrainSpec(save_dir=str(root / "run"), world_size=2, steps=6, save_at=(2, 4, 6),
                         policy={"name": "parity"}, extra={"flatten_optimizer": True}),
               module="dev.tinytrain.fsdp2_worker", log_dir=root / "logs")
        (root / "fz").mkdir()
        t = time.perf_counter()
        stats = dcp_recover_oracle.run_many(root / "run", root / "fz", args.count, args.seed)
        seconds = round(time.perf_counter() - t, 1)
    print(f"{'kind':<18}" + "".join(f"{o:>11}" for o in OUTCOMES))
    for kind, per in sorted(stats.by_kind.items()):
        print(f"{kind:<18}" + "".join(f"{per.get(o, 0):>11}" for o in OUTCOMES))
    print(f"{stats.inputs} inputs in {seconds} s: " +
          ", ".join(f"{stats.outcomes.get(o, 0)} {o}" for o in OUTCOMES))
    for v in stats.violations[:20]:
        print("violation:", v)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "inputs": stats.inputs, "seed": args.seed, "seconds": seconds,
        "outcomes": stats.outcomes, "by_kind": stats.by_kind,
        "violations": [list(v) for v in stats.violations],
        "date": time.strftime("%Y-%m-%d")}, indent=2))
    print(f"wrote {args.json}")
    return 1 if stats.violations else 0


if __name__ == "__main__":
    sys.exit(main())
