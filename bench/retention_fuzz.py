"""Retention's property, run long: random timelines (full and partial saves, kills, rollbacks,
earlier prunes), damaged at random (saves that cannot be read at prune time, lost or forged
or looping or bad tombstones, incomplete saves), pruned with a random --keep-last; a loss is
a prune that went ahead after which recovery differs from recovery before it.

The generator and the harness are tests/retention_timelines.py's (tests/test_retention_safety.py
runs 3,000 of them in `make test`). Prints a table by damage and outcome; writes
bench/results/retention_fuzz.json.

    python -m bench.retention_fuzz --count 20000
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO / "tests"))

from retention_timelines import DAMAGE, run_case  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=10_000, help="timelines to try")
    ap.add_argument("--seed", type=int, default=0, help="the first timeline's seed")
    ap.add_argument("--json", default="retention_fuzz.json", help="output under bench/results")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    start = time.perf_counter()
    by_damage: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    outcomes: collections.Counter = collections.Counter()
    lost = []
    for seed in range(args.seed, args.seed + args.count):
        case = run_case(seed)
        outcome = "lost" if case.lost else case.outcome
        outcomes[outcome] += 1
        for kind in case.damage or ("none",):
            by_damage[kind][outcome] += 1
        if case.lost:
            lost.append(seed)
    seconds = time.perf_counter() - start
    columns = sorted(outcomes)
    print(f"{'damage':<12}" + "".join(f"{c.removeprefix('refused: '):>20}" for c in columns))
    for kind in (*DAMAGE, "none"):
        print(f"{kind:<12}" + "".join(f"{by_damage[kind][c]:>20}" for c in columns))
    print(f"{'all':<12}" + "".join(f"{outcomes[c]:>20}" for c in columns))
    print(f"{args.count} timelines in {seconds:.1f} s; losses: {len(lost)}"
          + (f" (seeds {lost[:10]})" if lost else ""))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / args.json).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "commit": commit, "count": args.count,
        "first_seed": args.seed, "seconds": round(seconds, 2), "losses": len(lost),
        "lost_seeds": lost[:100], "outcomes": dict(outcomes),
        "by_damage": {k: dict(v) for k, v in by_damage.items()}}, indent=1) + "\n")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
